"""What every op of `pdserve.ops` shares: the implementation for a tensor's device, and the checks
of a packed pass's sequence boundaries and checkpoints (the GDN scans' and the conv's)."""

from __future__ import annotations

from types import ModuleType

import torch

from pdserve.ops import reference
from pdserve.ops.shapes import Shapes


def implementation(x: torch.Tensor) -> ModuleType:
    """The module that runs an op on `x`'s device: the Triton / flash-linear-attention kernels of
    `pdserve.ops.cuda` on CUDA (imported on first use, so CPU machines need neither), the plain
    torch reference elsewhere. The ops' checks stay shared by both."""
    if x.is_cuda:
        from pdserve.ops import cuda

        return cuda
    return reference


def check_pass(
    shapes: Shapes,
    cu_seqlens: torch.Tensor,
    save_at: torch.Tensor | None = None,
    save_to: torch.Tensor | None = None,
) -> None:
    """A packed pass's sequence boundaries (int32 [N+1]) and, when given, the checkpoint each
    sequence saves on the way: after save_at (int32 [N]) tokens, to save_to (int64 [N])."""
    shapes.fix("N+1", shapes.sizes["N"] + 1)
    shapes("cu_seqlens", cu_seqlens, "N+1", torch.int32)
    if (save_at is None) != (save_to is None):
        raise ValueError(f"{shapes.op}: save_at and save_to go together")
    if save_at is not None and save_to is not None:
        shapes("save_at", save_at, "N", torch.int32)
        shapes("save_to", save_to, "N", torch.int64)
