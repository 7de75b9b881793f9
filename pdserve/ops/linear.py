"""The model's dense projections: `F.linear`, or on CUDA for decode-sized inputs (up to
`SKINNY_UP_TO` tokens; the MoE router's up to `ROUTER_UP_TO`) `pdserve.ops.cuda_skinny.skinny_linear`.

`linear` returns the product itself (in_proj, qkv: their outputs feed other ops). `linear_to_norm`
is for a projection whose output only goes to the next `add_rms_norm` (out_proj, o_proj): there it
may return `SKINNY_SPLITS` fp32 partial sums [T, S, N], which the norm adds and rounds once, as it
adds the MoE's rows, so no reduce launch runs. SKINNY_UP_TO is 0 (cuBLAS everywhere) until the H200
has timed the kernel in a step (`python -m pdserve.ops.bench_step --skinny-up-to 32`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SKINNY_UP_TO = 0  # tokens: 0 until measured (session 14 wrote it without a device)
SKINNY_SPLITS = 4
# The MoE router's logits as split-K partials (`router_logits`) up to this many tokens: 0 until
# `bench_step --variants plain: router:router=32 --rounds 7` shows a gain beyond the run-order
# drift (session 34, H100: ~1% of a step, inside it)
ROUTER_UP_TO = 0
ROUTER_SPLITS, ROUTER_BLOCK_N = 4, 16


def _skinny(x: torch.Tensor) -> bool:
    return x.is_cuda and 0 < x.shape[0] <= SKINNY_UP_TO


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N] in x's dtype."""
    if _skinny(x):
        from pdserve.ops.cuda_skinny import skinny_linear

        return skinny_linear(x.contiguous(), weight, 1)
    return F.linear(x, weight)


def linear_to_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for the next `add_rms_norm` to add: [T, N] in x's dtype, or fp32 partial sums
    [T, SKINNY_SPLITS, N]."""
    if _skinny(x):
        from pdserve.ops.cuda_skinny import skinny_linear

        return skinny_linear(x.contiguous(), weight, SKINNY_SPLITS)
    return F.linear(x, weight)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for `route_topk`, which adds split-K partials itself: [T, N] in x's dtype, or on
    CUDA up to ROUTER_UP_TO tokens fp32 partial sums [T, ROUTER_SPLITS, N]. cuBLAS gives the router's
    [272, 2048] weight (1.1 MB) 5 programs at decode sizes: 5.3 us a layer for a 0.4 us read (H100
    trace, c=4); split by 16 columns and 4 K-slices it is 68."""
    if x.is_cuda and 0 < x.shape[0] <= ROUTER_UP_TO:
        from pdserve.ops.cuda_skinny import skinny_linear

        return skinny_linear(x.contiguous(), weight, ROUTER_SPLITS, block_n=ROUTER_BLOCK_N)
    return F.linear(x, weight)
