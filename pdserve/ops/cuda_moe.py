"""Routed-expert MoE on CUDA, sync-free: the (token, k) pairs are laid out by expert on the device and
run as grouped GEMMs, either a Triton kernel (fused SiLU-gate, any float dtype) or torch's
`_grouped_mm` (CUTLASS, bf16 on sm90). Semantics are those of `pdserve.ops.moe.fused_moe`.

The Triton path lays the pairs out by counting (`pdserve.ops.cuda_route.align_pairs`: one launch up to
8,192 pairs, two above; `pairs_by_sort` is the same layout by a device sort, its reference; or
`cuda_route_align.route_align` with the routing, see ROUTE_ALIGN_UP_TO); each GEMM program reads its
block's expert off the block's first pair.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.ops.cuda_route import align_pairs, padded_rows, route_topk
from pdserve.ops.cuda_route_align import ROUTE_ALIGN_TOKENS, route_align

PREFILL_TIERS = 0  # the large tile's TIERS (`bench_moe_tiles --tiers` times 0-2: no gain, session 31)


@triton.jit(do_not_specialize=["num_blocks"])  # one build a tile config, whatever the pass size
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, pair_ptr, ids_ptr, weight_ptr,
    N, K, stride_am, stride_we, stride_wn, stride_cm, top_k, num_blocks,
    GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TIERS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One block of BLOCK_M padded rows (all one expert's: the expert of its first pair; a block whose
    first row is padding is unused) x BLOCK_N output columns.

    GATE_UP: rows gather x[pair // top_k]; out = silu(x W_gate^T) * (x W_up^T), stored by padded row.
    else: rows read the intermediate by padded row; out = weight[pair] * (h W_down^T), stored by pair.

    TIERS t: a block whose rows past BLOCK_M / 2 are all padding (an expert's last block, its pairs
    first) runs a tile of BLOCK_M / 2 rows, and with t = 2 one past BLOCK_M / 4 a tile of BLOCK_M / 4:
    the padding rows of an expert's last block cost no MMA work (at 8,192 tokens a pass, ~256 rows
    an expert, about half the experts spill a few rows into a third block of 128).

    Launch order (a 1-D grid): GROUP_M 0 runs every row block of one column block before the next
    column block; GROUP_M g runs g row blocks across all column blocks before the next g, so their
    rows (and their experts' weights) are read from memory once and then from L2.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    if GROUP_M == 0:
        pid_m = pid % num_blocks
        pid_n = pid // num_blocks
    else:
        first_m = pid // (GROUP_M * num_n) * GROUP_M
        in_group = tl.minimum(num_blocks - first_m, GROUP_M)
        pid_m = first_m + pid % (GROUP_M * num_n) % in_group
        pid_n = pid % (GROUP_M * num_n) // in_group
    first = tl.load(pair_ptr + pid_m * BLOCK_M)
    if first < 0:
        return
    args = (a_ptr, w_ptr, c_ptr, pair_ptr, weight_ptr, tl.load(ids_ptr + first).to(tl.int64), pid_m * BLOCK_M,
            pid_n, N, K, stride_am, stride_we, stride_wn, stride_cm, top_k)  # fmt: skip
    if TIERS == 0:
        _moe_tile(*args, GATE_UP, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    elif TIERS == 1:
        if tl.load(pair_ptr + pid_m * BLOCK_M + BLOCK_M // 2) < 0:
            _moe_tile(*args, GATE_UP, BLOCK_M // 2, BLOCK_N, BLOCK_K, IEEE)
        else:
            _moe_tile(*args, GATE_UP, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    else:
        if tl.load(pair_ptr + pid_m * BLOCK_M + BLOCK_M // 4) < 0:
            _moe_tile(*args, GATE_UP, BLOCK_M // 4, BLOCK_N, BLOCK_K, IEEE)
        elif tl.load(pair_ptr + pid_m * BLOCK_M + BLOCK_M // 2) < 0:
            _moe_tile(*args, GATE_UP, BLOCK_M // 2, BLOCK_N, BLOCK_K, IEEE)
        else:
            _moe_tile(*args, GATE_UP, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)


@triton.jit
def _moe_tile(
    a_ptr, w_ptr, c_ptr, pair_ptr, weight_ptr, expert, first_row, pid_n,
    N, K, stride_am, stride_we, stride_wn, stride_cm, top_k,
    GATE_UP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """`_moe_gemm_kernel`'s work on the ROWS padded rows from `first_row`, all `expert`'s."""
    offs_p = first_row + tl.arange(0, ROWS)
    pairs = tl.load(pair_ptr + offs_p)
    valid = pairs >= 0
    if GATE_UP:
        a_rows = tl.where(valid, pairs // top_k, 0)
    else:
        a_rows = offs_p.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    if GATE_UP:  # gate columns n.., then up columns N+n..: one [BLOCK_K, 2 BLOCK_N] operand, one wide dot
        j = tl.arange(0, 2 * BLOCK_N)
        col = pid_n * BLOCK_N + j % BLOCK_N
        w_rows = col + j // BLOCK_N * N
        acc = tl.zeros([ROWS, 2 * BLOCK_N], tl.float32)
    else:
        col = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = col
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + w_rows[None, :] * stride_wn + offs_k[:, None]
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & (col < N)[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if GATE_UP:
        gate, up = acc.reshape(ROWS, 2, BLOCK_N).permute(0, 2, 1).split()
        # round gate and up to the activation dtype first, as the unfused F.linear calls do
        gate = gate.to(c_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(c_ptr.dtype.element_ty).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        c_rows = offs_p.to(tl.int64)
    else:
        out = acc * tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
        c_rows = tl.where(valid, pairs, 0)
    tl.store(c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :], out.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & mask_n[None, :])  # fmt: skip


def _block_config(num_pairs: int, num_experts: int) -> dict[str, int]:
    """Tile sizes: small row blocks when experts get a few rows each (decode), large ones in prefill
    (TIERS: `_moe_gemm_kernel`'s smaller tiles for an expert's last, mostly padding block)."""
    if num_pairs <= 4 * num_experts:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=0, TIERS=0, num_warps=4, num_stages=3)
    if num_pairs >= 128 * num_experts:  # compute-bound: 4,096 tokens -11%, 16,384 -19% (H200);
        # grouped launch order: 8,192 tokens 1.65 -> 1.36 ms, 16,384 2.87 -> 2.49 ms (H100)
        tile = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=16, TIERS=PREFILL_TIERS)
        return dict(tile, num_warps=8, num_stages=3)
    # grouped launch order: 1,024 tokens 892 -> 859 us, 2,048 836 -> 736 us (H100)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=16, TIERS=0, num_warps=4, num_stages=3)


def pairs_by_sort(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> torch.Tensor:
    """topk_ids [T, K] -> pair index of each padded row, -1 for padding [padded_rows(T*K, E, block_m)]:
    expert e's pairs fill ceil(count_e / block_m) blocks in pair order. By a stable device sort in
    torch: the reference of `align_pairs` (which the kernels use: ~20 launches and ~1 ms of host time
    a layer fewer at 8,192 tokens)."""
    flat = topk_ids.flatten()
    num_pairs = flat.shape[0]
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.argsort(flat, stable=True)
    padded = (counts + block_m - 1) // block_m * block_m
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    position = (padded.cumsum(0) - padded)[sorted_experts] + rank
    num_rows = padded_rows(num_pairs, num_experts, block_m)
    pair_of_row = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    return pair_of_row.scatter_(0, position, order)


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    reduce: bool = True,
    cfg: dict[str, int] | None = None,
    cfg_down: dict[str, int] | None = None,
    pair_of_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights, topk_ids [T, K] -> [T, H] in x's dtype
    (reduce=False: the weighted rows of each pair, [T, K, H]). `cfg`, `cfg_down`: tile sizes of the
    gate/up and the down GEMM other than `_block_config`'s (pdserve.ops.bench_moe_tiles sweeps them;
    cfg_down defaults to cfg and must keep its BLOCK_M: both GEMMs read one row layout). `pair_of_row`:
    the ids' row layout for cfg's BLOCK_M when the caller has it (`route_align`)."""
    num_tokens, hidden = x.shape
    num_experts, top_k = w2.shape[0], topk_ids.shape[1]
    cfg = cfg or _block_config(num_tokens * top_k, num_experts)
    cfg_down = cfg_down or cfg
    block_m = cfg["BLOCK_M"]
    if cfg_down["BLOCK_M"] != block_m:
        raise ValueError(f"fused_moe_triton: cfg_down BLOCK_M {cfg_down['BLOCK_M']} != cfg's {block_m}")
    if pair_of_row is None:
        pair_of_row = align_pairs(topk_ids, num_experts, block_m)
    elif pair_of_row.shape != (padded_rows(topk_ids.numel(), num_experts, block_m),):
        shape = tuple(pair_of_row.shape)
        raise ValueError(f"fused_moe_triton: pair_of_row {shape} is not a layout for BLOCK_M {block_m}")
    x, w13, w2, ids = x.contiguous(), w13.contiguous(), w2.contiguous(), topk_ids.contiguous()
    weights = topk_weights.contiguous().flatten()
    hidden_act = moe_gemm(x, w13, pair_of_row, ids, weights, cfg, gate_up=True)
    per_pair = moe_gemm(hidden_act, w2, pair_of_row, ids, weights, cfg_down, gate_up=False)
    per_pair = per_pair.view(num_tokens, top_k, hidden)
    return per_pair.sum(dim=1, dtype=torch.float32).to(x.dtype) if reduce else per_pair


def moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    pair_of_row: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    cfg: dict[str, int],
    gate_up: bool,
) -> torch.Tensor:
    """One of `fused_moe_triton`'s two GEMMs (contiguous operands; ids [T, K], weights flat [T * K]):
    gate_up, a = x [T, H] and w = w13 -> the SiLU-gated intermediate by padded row [R, I]; else
    a = that intermediate and w = w2 -> each pair's weighted row [T * K, H]."""
    num_blocks = pair_of_row.shape[0] // cfg["BLOCK_M"]
    n = w.shape[1] // 2 if gate_up else w.shape[1]
    rows = pair_of_row.shape[0] if gate_up else ids.numel()
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    _moe_gemm_kernel[(num_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)](
        a, w, out, pair_of_row, ids, weights,
        n, w.shape[2], a.stride(0), w.stride(0), w.stride(1), out.stride(0), ids.shape[1], num_blocks,
        GATE_UP=gate_up, IEEE=a.dtype == torch.float32, **{"GROUP_M": 0, "TIERS": 0, **cfg},
    )  # fmt: skip
    return out


def fused_moe_grouped_mm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    reduce: bool = True,
) -> torch.Tensor:
    """The same through `torch._grouped_mm` (bf16, sm90): rows sorted by expert, groups by offsets."""
    num_tokens, hidden = x.shape
    num_experts, top_k = w2.shape[0], topk_ids.shape[1]
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    rows = x.index_select(0, order // top_k)
    gate, up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    down = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)
    down = down * topk_weights.flatten()[order, None]
    per_pair = torch.empty_like(down).index_copy_(0, order, down).view(num_tokens, top_k, hidden)
    return per_pair.sum(dim=1, dtype=torch.float32).to(x.dtype) if reduce else per_pair


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    reduce: bool = True,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, K]; topk_ids int64 [T, K] -> [T, H]
    (reduce=False: [T, K, H])."""
    if x.shape[0] == 0:
        shape = x.shape if reduce else (0, topk_ids.shape[1], x.shape[1])
        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, reduce)


# `route_align` serves steps of up to this many tokens (at most ROUTE_ALIGN_TOKENS). 0 until it has
# run and been timed on the H200 (written in session 14 without a device): then ROUTE_ALIGN_TOKENS.
ROUTE_ALIGN_UP_TO = 0
assert ROUTE_ALIGN_UP_TO <= ROUTE_ALIGN_TOKENS


def routed_experts(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    num_experts: int,
    top_k: int,
    reduce: bool = True,
) -> torch.Tensor:
    """Route (`route_topk`; logits [T, E + 1]: the shared expert folded in as expert E; or their
    partial sums [T, S, E + 1]) and run the experts (`fused_moe`); steps of up to ROUTE_ALIGN_UP_TO
    tokens route and align in one launch."""
    num_tokens = x.shape[0]
    if 0 < num_tokens <= ROUTE_ALIGN_UP_TO:
        out_k = top_k + int(router_logits.shape[-1] == num_experts + 1)
        cfg = _block_config(num_tokens * out_k, w13.shape[0])
        weights, ids, rows = route_align(router_logits, num_experts, top_k, cfg["BLOCK_M"], x.dtype)
        return fused_moe_triton(x, w13, w2, weights, ids, reduce, cfg=cfg, pair_of_row=rows)
    weights, ids = route_topk(router_logits, num_experts, top_k, x.dtype)
    return fused_moe(x, w13, w2, weights, ids, reduce)
