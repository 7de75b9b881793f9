"""MoE routing on CUDA without a sort: the router's softmax + top-k + renormalise in one Triton
program per token, and the alignment of (token, k) pairs into per-expert row blocks by counting.

`route_topk` has the semantics of `pdserve.ops.layer_ops.route_topk`. `align_pairs` produces the
same row layout as `pdserve.ops.cuda_moe.pairs_by_sort` (each expert's pairs in pair order, padded
to whole blocks) without a device sort: up to `MAX_ALIGN_PAIRS` pairs in one launch (a histogram of
the experts, prefix sums of the padded counts, and one `tl.sort` of (expert, pair) keys to rank each
pair inside its expert); more (prefill passes) in two, over chunks of `align_chunk` pairs: each
chunk's histogram, then each chunk ranks its own pairs after the chunks before it.

Their size arguments are not specialised: Triton builds a kernel again for an int argument that
is (or stops being) a multiple of 16, and a served pass of 7,238 tokens (16 chunks) waited 7.5 s
for a `_chunk_scatter_kernel` build the warm-up's pass sizes had not met (H200, session 14).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ALIGN_PAIRS = 512  # one program sorts every pair: decode steps (H100: 2,448 pairs 89 us, chunked 13-47)
ALIGN_CHUNK: int | None = None  # pairs a program takes above that; None: `align_chunk`'s choice


def align_chunk(num_pairs: int) -> int:
    """Pairs a program aligns in a pass of num_pairs: small chunks spread a small pass over more
    programs (H100, 4,096 x 9 pairs: 20 us at 512, 34 at 2,048); from 65,536 pairs, 2,048 (H200,
    32,768 x 9 pairs: 67-83 us vs 105 at 4,096: each program reads every chunk's counts)."""
    return ALIGN_CHUNK or (512 if num_pairs <= 65_536 else 2048)


@triton.jit
def summed_logits(ptrs, mask, stride_ls, round_ptr, SPLITS: tl.constexpr):
    """The logits at `ptrs` in fp32; with SPLITS > 1 they are fp32 split-K partial sums `stride_ls`
    apart, added and rounded to round_ptr's dtype as the product in that dtype would be."""
    acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if SPLITS > 1:
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(ptrs + s * stride_ls, mask=mask, other=0.0)
        acc = acc.to(round_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
    return acc


@triton.jit
def topk_tile(
    logits_ptr, rows, row_ok, stride_lt, stride_ls, round_ptr, E, SHARED_ID,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    """Each of `rows` (the ones with row_ok): probs = softmax(logits[:E]); TOP_K rounds of argmax
    (lowest id first on ties), the chosen weights renormalised; with HAS_SHARED a last pair
    (SHARED_ID, sigmoid(logits[E])). -> (weights fp32, ids int32), [R, K_PAD] each. The logits are
    `summed_logits` (SPLITS partial sums, `stride_ls` apart)."""
    offs = tl.arange(0, E_PAD)
    mask = row_ok[:, None] & (offs < E)[None, :]
    ptrs = logits_ptr + rows[:, None] * stride_lt + offs[None, :]
    logits = tl.where(mask, summed_logits(ptrs, mask, stride_ls, round_ptr, SPLITS), float("-inf"))
    logits = tl.where(row_ok[:, None], logits, 0.0)  # rows past the tokens: finite, never stored
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]
    offs_k = tl.arange(0, K_PAD)[None, :]
    chosen_w = tl.zeros([rows.shape[0], K_PAD], tl.float32)
    chosen_id = tl.zeros([rows.shape[0], K_PAD], tl.int32)
    remaining = tl.where((offs < E)[None, :], probs, -1.0)
    for k in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)[:, None]
        best_id = tl.min(tl.where(remaining == best, offs[None, :], E_PAD), axis=1)[:, None]
        chosen_w = tl.where(offs_k == k, best, chosen_w)
        chosen_id = tl.where(offs_k == k, best_id, chosen_id)
        remaining = tl.where(offs[None, :] == best_id, -1.0, remaining)
    chosen_w = chosen_w / tl.sum(chosen_w, axis=1)[:, None]
    if HAS_SHARED:
        gate_ptrs = logits_ptr + rows * stride_lt + E
        gate = tl.sigmoid(summed_logits(gate_ptrs, row_ok, stride_ls, round_ptr, SPLITS))
        chosen_w = tl.where(offs_k == TOP_K, gate[:, None], chosen_w)
        chosen_id = tl.where(offs_k == TOP_K, SHARED_ID, chosen_id)
    return chosen_w, chosen_id


@triton.jit
def store_routes(
    weights_ptr, ids_ptr, rows, row_ok, chosen_w, chosen_id, OUT_K: tl.constexpr, K_PAD: tl.constexpr
):
    """The first OUT_K pairs of each row with row_ok into weights / ids [T, OUT_K] (ids as int64)."""
    offs_k = tl.arange(0, K_PAD)[None, :]
    dst = rows.to(tl.int64)[:, None] * OUT_K + offs_k
    out = row_ok[:, None] & (offs_k < OUT_K)
    tl.store(weights_ptr + dst, chosen_w.to(weights_ptr.dtype.element_ty), mask=out)
    tl.store(ids_ptr + dst, chosen_id.to(tl.int64), mask=out)


@triton.jit
def _route_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_lt, stride_ls, E, SHARED_ID,
    TOP_K: tl.constexpr, OUT_K: tl.constexpr, HAS_SHARED: tl.constexpr,
    E_PAD: tl.constexpr, K_PAD: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Token t's routes (`topk_tile` of one row)."""
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    row_ok = rows >= 0
    w, ids = topk_tile(
        logits_ptr, rows, row_ok, stride_lt, stride_ls, weights_ptr, E, SHARED_ID,
        TOP_K, HAS_SHARED, E_PAD, K_PAD, SPLITS,
    )  # fmt: skip
    store_routes(weights_ptr, ids_ptr, rows, row_ok, w, ids, OUT_K, K_PAD)


def route_topk(
    logits: torch.Tensor, num_experts: int, top_k: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] or [T, E + 1] (last dim contiguous), or their fp32 split-K partial sums
    [T, S, E (+ 1)] (`pdserve.ops.linear.router_logits`), added here and rounded to `dtype`, the
    product's -> (weights [T, K'] in dtype (default logits'), ids int64 [T, K'])."""
    logits, splits, dtype = split_logits(logits, dtype)
    num_tokens = logits.shape[0]
    has_shared = logits.shape[-1] == num_experts + 1
    out_k = top_k + int(has_shared)
    weights = torch.empty(num_tokens, out_k, dtype=dtype, device=logits.device)
    ids = torch.empty(num_tokens, out_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(num_experts)
    _route_topk_kernel[(num_tokens,)](
        logits, weights, ids, logits.stride(0), logits.stride(1) if splits > 1 else 0, num_experts,
        num_experts, TOP_K=top_k, OUT_K=out_k, HAS_SHARED=has_shared, E_PAD=e_pad,
        K_PAD=triton.next_power_of_2(out_k), SPLITS=splits, num_warps=max(1, min(4, e_pad // 128)),
    )  # fmt: skip
    return weights, ids


def split_logits(logits: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.Tensor, int, torch.dtype]:
    """(logits with a contiguous last dim, how many partial sums they are, the weights' dtype)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if logits.dim() == 3 and dtype is None:
        raise ValueError("route_topk: partial sums [T, S, E] need the product's dtype")
    return logits, logits.shape[1] if logits.dim() == 3 else 1, dtype or logits.dtype


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])  # one build for every pass size
def _align_pairs_kernel(
    ids_ptr, pair_of_row_ptr, scratch_ptr, num_pairs, num_rows, E,
    BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    """One program: `align_all`."""
    align_all(ids_ptr, pair_of_row_ptr, scratch_ptr, num_pairs, num_rows, E, BLOCK_M, P_PAD, E_PAD, FILL)


@triton.jit
def align_all(
    ids_ptr, pair_of_row_ptr, scratch_ptr, num_pairs, num_rows, E,
    BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    """Expert e's pairs take rows padded_start[e] + rank, rank = the pair's place among e's pairs in
    pair order, padded_start = exclusive prefix sum of counts rounded up to BLOCK_M; every other
    row is -1. One program does it all (scratch: E_PAD int32)."""
    offs = tl.arange(0, P_PAD)
    valid = offs < num_pairs
    experts = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    experts = tl.where(valid, experts, E)  # padding lanes sort last, into a bin past the experts
    offs_e = tl.arange(0, E_PAD)
    counts = tl.where(offs_e < E, tl.histogram(experts, E_PAD), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    # row of the i-th pair in (expert, pair) order = i + (padded_start - start) of its expert
    shift = (tl.cumsum(padded, axis=0) - padded) - (tl.cumsum(counts, axis=0) - counts)
    tl.store(scratch_ptr + offs_e, shift)
    for start in range(0, num_rows, FILL):
        rows = start + tl.arange(0, FILL)
        tl.store(pair_of_row_ptr + rows, tl.full([FILL], -1, tl.int64), mask=rows < num_rows)
    tl.debug_barrier()  # the shifts and the -1 fill are visible to every thread before the scatter
    keys = tl.sort(experts * P_PAD + offs)
    sorted_experts = keys // P_PAD
    in_expert = sorted_experts < E
    rows = offs + tl.load(scratch_ptr + sorted_experts, mask=in_expert, other=0)
    tl.store(pair_of_row_ptr + rows, (keys % P_PAD).to(tl.int64), mask=in_expert)


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])  # one build for every pass size
def _chunk_counts_kernel(
    ids_ptr, counts_ptr, pair_of_row_ptr, num_pairs, num_rows, E,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    """Chunk c: how many of its pairs each expert has (counts[c, :]); and its share of the -1 fill."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < num_pairs
    experts = tl.where(valid, tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32), E)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.histogram(experts, E_PAD))
    share = tl.cdiv(num_rows, tl.num_programs(0))
    end = tl.minimum(num_rows, (c + 1) * share)
    for start in range(c * share, end, FILL):
        rows = start + tl.arange(0, FILL)
        tl.store(pair_of_row_ptr + rows, tl.full([FILL], -1, tl.int64), mask=rows < end)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks"])  # one build for every pass size
def _chunk_scatter_kernel(
    ids_ptr, counts_ptr, pair_of_row_ptr, scratch_ptr, num_pairs, num_chunks, E,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Chunk c: expert e's pairs of this chunk follow e's pairs of the chunks before it, from e's
    padded start (from every chunk's counts); ranked inside the chunk by one `tl.sort`."""
    c = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], tl.int32)
    before = tl.zeros([E_PAD], tl.int32)
    for first in range(0, num_chunks, ROWS):
        chunk = first + tl.arange(0, ROWS)
        counts = tl.load(
            counts_ptr + chunk[:, None] * E_PAD + offs_e[None, :], mask=chunk[:, None] < num_chunks, other=0
        )
        total += tl.sum(counts, axis=0)
        before += tl.sum(tl.where(chunk[:, None] < c, counts, 0), axis=0)
    total = tl.where(offs_e < E, total, 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    offs = tl.arange(0, CHUNK)
    valid = c * CHUNK + offs < num_pairs
    experts = tl.where(valid, tl.load(ids_ptr + c * CHUNK + offs, mask=valid, other=0).to(tl.int32), E)
    mine = tl.where(offs_e < E, tl.histogram(experts, E_PAD), 0)
    # row of the i-th pair in this chunk's (expert, pair) order = i + shift[its expert]
    shift = (tl.cumsum(padded, axis=0) - padded) + before - (tl.cumsum(mine, axis=0) - mine)
    tl.store(scratch_ptr + c * E_PAD + offs_e, shift)
    tl.debug_barrier()  # the shifts are visible to every thread before the scatter
    keys = tl.sort(experts * CHUNK + offs)
    sorted_experts = keys // CHUNK
    in_expert = sorted_experts < E
    rows = offs + tl.load(scratch_ptr + c * E_PAD + sorted_experts, mask=in_expert, other=0)
    tl.store(pair_of_row_ptr + rows, (c * CHUNK + keys % CHUNK).to(tl.int64), mask=in_expert)


def padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows that hold any routing of `num_pairs` pairs, each expert's padded to whole blocks: at most
    one partial block per expert that has a pair, so ceil(P / block_m) + min(E, P) blocks. The bound
    sets the MoE GEMMs' grids: a decode step of 4 tokens (36 pairs) launches 39 row blocks, not 260."""
    return (triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)) * block_m


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> torch.Tensor:
    """topk_ids [T, K] -> the pair index of each padded row, -1 for padding: int64
    [padded_rows(T*K, num_experts, block_m)]. Sizes depend only on the shapes: no sync."""
    flat = topk_ids.flatten()
    num_pairs = flat.shape[0]
    num_rows = padded_rows(num_pairs, num_experts, block_m)
    pair_of_row = torch.empty(num_rows, dtype=torch.int64, device=flat.device)
    e_pad = triton.next_power_of_2(num_experts + 1)
    if num_pairs > MAX_ALIGN_PAIRS:
        chunk = align_chunk(num_pairs)
        chunks = triton.cdiv(num_pairs, chunk)
        counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=flat.device)
        scratch = torch.empty(chunks, e_pad, dtype=torch.int32, device=flat.device)
        _chunk_counts_kernel[(chunks,)](
            flat, counts, pair_of_row, num_pairs, num_rows, num_experts,
            CHUNK=chunk, E_PAD=e_pad, FILL=1024, num_warps=8,
        )  # fmt: skip
        _chunk_scatter_kernel[(chunks,)](
            flat, counts, pair_of_row, scratch, num_pairs, chunks, num_experts,
            BLOCK_M=block_m, CHUNK=chunk, E_PAD=e_pad, ROWS=16, num_warps=8,
        )  # fmt: skip
        return pair_of_row
    scratch = torch.empty(e_pad, dtype=torch.int32, device=flat.device)
    p_pad = max(16, triton.next_power_of_2(num_pairs))
    _align_pairs_kernel[(1,)](
        flat, pair_of_row, scratch, num_pairs, num_rows, num_experts,
        BLOCK_M=block_m, P_PAD=p_pad, E_PAD=e_pad, FILL=1024, num_warps=4 if p_pad <= 1024 else 8,
    )  # fmt: skip
    return pair_of_row
