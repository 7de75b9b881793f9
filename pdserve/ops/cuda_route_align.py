"""A decode step's MoE routing in one Triton program: softmax top-k of every token, then the row
layout of the routed-expert GEMMs (`pdserve.ops.cuda_route.route_topk` + `align_pairs` fused).

Separately they are two launches a layer, each 2.5-4.5 us at 4-32 tokens, mostly launch and memory
latency (bench_step, H200: 0.13 + 0.10 ms of a c=4 step). Up to `ROUTE_ALIGN_TOKENS` tokens fit one
program: it routes them as one [ROUTE_ALIGN_TOKENS, E] tile (the same tile at every batch size up to
there: a graph padded to 8 rows routes like 5 rows eagerly; `route_topk`'s one-row tile may round a
weight differently), writes weights and ids, and aligns the ids it wrote after a barrier.
Used by `cuda_moe.routed_experts` up to its ROUTE_ALIGN_UP_TO tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.cuda_route import align_all, padded_rows, split_logits, store_routes, topk_tile

ROUTE_ALIGN_TOKENS = 32  # decode steps up to this size route and align in one program


@triton.jit(do_not_specialize=["num_tokens", "num_rows"])
def _route_align_kernel(
    logits_ptr, weights_ptr, ids_ptr, pair_of_row_ptr, scratch_ptr,
    stride_lt, stride_ls, num_tokens, num_rows, E, num_aligned,
    TOP_K: tl.constexpr, OUT_K: tl.constexpr, HAS_SHARED: tl.constexpr, E_PAD: tl.constexpr,
    K_PAD: tl.constexpr, T_PAD: tl.constexpr, BLOCK_M: tl.constexpr, P_PAD: tl.constexpr,
    A_PAD: tl.constexpr, FILL: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """All tokens' routes (shared expert id E), then `align_all` over E (+1) experts."""
    rows = tl.arange(0, T_PAD)
    row_ok = rows < num_tokens
    w, ids = topk_tile(
        logits_ptr, rows, row_ok, stride_lt, stride_ls, weights_ptr, E, E,
        TOP_K, HAS_SHARED, E_PAD, K_PAD, SPLITS,
    )  # fmt: skip
    store_routes(weights_ptr, ids_ptr, rows, row_ok, w, ids, OUT_K, K_PAD)
    tl.debug_barrier()  # the ids are visible to every thread before the alignment reads them
    align_all(
        ids_ptr, pair_of_row_ptr, scratch_ptr, num_tokens * OUT_K, num_rows, num_aligned,
        BLOCK_M, P_PAD, A_PAD, FILL,
    )  # fmt: skip


def route_align(
    logits: torch.Tensor, num_experts: int, top_k: int, block_m: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] or [T, E + 1] (T <= ROUTE_ALIGN_TOKENS), or their partial sums [T, S, E (+ 1)]
    -> (weights [T, K'], ids int64 [T, K'], pair_of_row): `route_topk` (logits and `dtype` as there),
    then `align_pairs(ids, E (+1), block_m)`."""
    num_tokens = logits.shape[0]
    if num_tokens > ROUTE_ALIGN_TOKENS:
        raise ValueError(f"route_align: {num_tokens} tokens, at most {ROUTE_ALIGN_TOKENS} fit one program")
    logits, splits, dtype = split_logits(logits, dtype)
    has_shared = logits.shape[-1] == num_experts + 1
    out_k, num_aligned = top_k + int(has_shared), num_experts + int(has_shared)
    device = logits.device
    weights = torch.empty(num_tokens, out_k, dtype=dtype, device=device)
    ids = torch.empty(num_tokens, out_k, dtype=torch.int64, device=device)
    num_rows = padded_rows(num_tokens * out_k, num_aligned, block_m)
    pair_of_row = torch.empty(num_rows, dtype=torch.int64, device=device)
    a_pad = triton.next_power_of_2(num_aligned + 1)
    scratch = torch.empty(a_pad, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids, pair_of_row.fill_(-1)
    _route_align_kernel[(1,)](
        logits, weights, ids, pair_of_row, scratch, logits.stride(0), logits.stride(1) if splits > 1 else 0,
        num_tokens, num_rows, num_experts, num_aligned, TOP_K=top_k, OUT_K=out_k, HAS_SHARED=has_shared,
        E_PAD=triton.next_power_of_2(num_experts), K_PAD=triton.next_power_of_2(out_k),
        T_PAD=ROUTE_ALIGN_TOKENS, BLOCK_M=block_m,
        P_PAD=max(16, triton.next_power_of_2(ROUTE_ALIGN_TOKENS * out_k)), A_PAD=a_pad, FILL=1024,
        SPLITS=splits, num_warps=8,
    )  # fmt: skip
    return weights, ids, pair_of_row
