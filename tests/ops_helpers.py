"""Shared by the CPU ops tests (test_ops_gdn.py, test_ops.py, test_ops_shape_checks.py): the small
head, channel and pool sizes, the tolerance, and builders of packed inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DK, DV, HK, POOL_SLOTS = 16, 8, 2, 12
CHANNELS, WIDTH = 12, 4
TOL = dict(atol=2e-5, rtol=1e-5)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def some_slots(n: int) -> torch.Tensor:
    """n distinct slots out of POOL_SLOTS, shuffled, so never 0..n-1."""
    return torch.randperm(POOL_SLOTS)[:n].flip(0).contiguous()


def other_slots(slots: torch.Tensor) -> torch.Tensor:
    return torch.ones(POOL_SLOTS, dtype=torch.bool).index_fill(0, slots, False)


def gdn_inputs(num_tokens: int, hv: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return dict(
        q=torch.randn(num_tokens, HK, DK, dtype=dtype),
        k=torch.randn(num_tokens, HK, DK, dtype=dtype),
        v=torch.randn(num_tokens, hv, DV, dtype=dtype),
        g=-F.softplus(torch.randn(num_tokens, hv)) * torch.rand(hv) * 2,
        beta=torch.rand(num_tokens, hv).to(dtype),
    )
