"""Shape checks shared by the op interfaces (`pdserve.ops`, `pdserve.ops.layer_ops`): metadata only,
no host sync, a specific `ValueError` on each mismatch."""

from __future__ import annotations

import torch


class Shapes:
    """Checks tensors against named dims ("T Hk Dk"); a name is fixed by the first tensor that has it
    (or by `fix`), and a digit string is a literal size."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.sizes: dict[str, int] = {}

    def __call__(self, name: str, x: torch.Tensor, dims: str, dtype: torch.dtype | None = None) -> None:
        names = dims.split()
        if x.dim() != len(names):
            raise ValueError(f"{self.op}: {name} must be [{', '.join(names)}], got shape {list(x.shape)}")
        for dim, size in zip(names, x.shape, strict=True):
            expected = int(dim) if dim.isdigit() else self.sizes.setdefault(dim, size)
            if size != expected:
                raise ValueError(
                    f"{self.op}: {name} has {dim}={size} but {dim}={expected} elsewhere "
                    f"(shape {list(x.shape)}, expected [{', '.join(names)}])"
                )
        if dtype is not None and x.dtype != dtype:
            raise ValueError(f"{self.op}: {name} must be {dtype}, got {x.dtype}")

    def fix(self, dim: str, size: int) -> None:
        self.sizes[dim] = size

    def multiple(self, dim: str, of: str) -> None:
        size, of_size = self.sizes[dim], self.sizes[of]
        if size % of_size:
            raise ValueError(f"{self.op}: {dim}={size} must be a multiple of {of}={of_size}")
