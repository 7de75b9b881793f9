"""Gated DeltaNet prefill of short sequences on CUDA: the recurrence a token at a time, one Triton
launch for the whole pass (`pdserve.ops.gdn_recurrent_prefill`'s shapes and semantics), with the
checkpoints a pass takes written on the way. The step itself is `cuda_gdn`'s (shared with decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.cuda_gdn import (
    _L2NORM_EPS,
    _last_dim_contiguous,
    delta_rule_update,
    head_tile,
    l2_normed_qk,
)


@triton.jit
def _gdn_segments_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, cu_ptr, o_ptr, save_at_ptr, save_to_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_betat,
    stride_ss, stride_sh, stride_ot, stride_oh, scale, eps,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, SAVES: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """One (sequence, value head, block of BV value columns): the [DK, BV] state tile is read
    once, stepped through the sequence's tokens in registers (the step of `_gdn_step_kernel`,
    each token's read-out stored as it goes) and written back once; with SAVES, also written to
    the sequence's checkpoint slot after its first save_at tokens. PREFETCH: each token's inputs
    are loaded one step ahead, so their memory latency overlaps the step before (the loop is a
    chain of dependent steps, each otherwise waiting for its loads)."""
    n, hv, hk, offs_k, offs_v, mask_k, mask_v = head_tile(HV, GROUP, DK, DV, BK, BV)
    start = tl.load(cu_ptr + n).to(tl.int64)
    end = tl.load(cu_ptr + n + 1).to(tl.int64)
    # an empty sequence (a padded graph's) moves no state (a tensor compare: the interpreter
    # takes no scalar bool in a mask)
    s_mask = (mask_k & (tl.zeros([BK], tl.int64) + end > start))[:, None] & mask_v[None, :]
    slot = tl.load(slot_ptr + n).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    save_end = start - 1  # the token after which the state is saved (none: before the start)
    ck_ptrs = s_ptrs
    if SAVES:
        save_end = start + tl.load(save_at_ptr + n).to(tl.int64) - 1
        ck_slot = tl.load(save_to_ptr + n).to(tl.int64)
        ck_ptrs = state_ptr + ck_slot * stride_ss + hv * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
    # PREFETCH: the next token's inputs, loaded a step ahead (the last token's again past the end:
    # a valid row, never used; token 0 for an empty sequence)
    nq, nk, nv, ng, nbeta = _token_inputs(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tl.maximum(tl.minimum(start, end - 1), 0), hk, hv,
        offs_k, offs_v, mask_k, mask_v, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_gt, stride_betat,
    )  # fmt: skip
    for t in range(start, end):
        if PREFETCH:
            q, k, v, g, beta = nq, nk, nv, ng, nbeta
            nq, nk, nv, ng, nbeta = _token_inputs(
                q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tl.minimum(t + 1, end - 1), hk, hv,
                offs_k, offs_v, mask_k, mask_v, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_vt, stride_vh, stride_gt, stride_betat,
            )  # fmt: skip
        else:
            q, k, v, g, beta = _token_inputs(
                q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, hk, hv,
                offs_k, offs_v, mask_k, mask_v, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_vt, stride_vh, stride_gt, stride_betat,
            )  # fmt: skip
        q, k = l2_normed_qk(q.to(tl.float32), k.to(tl.float32), scale, eps)
        decay = tl.exp(g.to(tl.float32))
        state, out = delta_rule_update(state, q, k, v.to(tl.float32), decay, beta.to(tl.float32))
        tl.store(o_ptr + t * stride_ot + hv * stride_oh + offs_v, out.to(o_ptr.dtype.element_ty), mask=mask_v)
        if SAVES:
            if t == save_end:
                tl.store(ck_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)


@triton.jit
def _token_inputs(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, hk, hv, offs_k, offs_v, mask_k, mask_v,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_betat,
):  # fmt: skip
    """Token t's q, k [BK] (key head hk), v [BV] (value head hv's block), g and beta, as stored."""
    q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + offs_k, mask=mask_k, other=0.0)
    k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + offs_k, mask=mask_k, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + offs_v, mask=mask_v, other=0.0)
    return q, k, v, tl.load(g_ptr + t * stride_gt + hv), tl.load(beta_ptr + t * stride_betat + hv)


# load each token's inputs a step ahead in the recurrent prefill: 11-19% less GPU time (H100,
# `python -m pdserve.ops.bench_gdn_prefill --prefetch`, 1-8 sequences of 16-512 tokens)
RECURRENT_PREFETCH = True


def gdn_recurrent_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    recurrent_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    block_v: int = 32,
    num_warps: int = 4,
    save_at: torch.Tensor | None = None,
    save_to: torch.Tensor | None = None,
    prefetch: bool | None = None,
) -> torch.Tensor:
    """`gdn_chunk_prefill`'s shapes (q, k raw), a token at a time: one launch, no host read of
    cu_seqlens, N x Hv x Dv/block_v programs each looping over its sequence's tokens. Its GPU time
    grows with the longest sequence; fla's chunked scan costs ~1 ms of host time a call
    (measured in the served conversations, session 16), so this is for short sequences.
    `save_at`, `save_to`: `pdserve.ops.gdn_recurrent_prefill`'s checkpoints on the way;
    `prefetch`: load each token's inputs a step ahead (None: `RECURRENT_PREFETCH`)."""
    num_k_heads, head_k_dim = k.shape[1], k.shape[2]
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    if recurrent_pool.stride(3) != 1 or recurrent_pool.stride(2) != head_v_dim:
        raise ValueError("gdn_recurrent_prefill: each slot's [Hv, Dk, Dv] state must be contiguous")
    q, k, v, g, beta = (_last_dim_contiguous(x) for x in (q, k, v, g, beta))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if slot_ids.numel() == 0 or v.shape[0] == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(head_v_dim))
    grid = (slot_ids.numel() * num_v_heads, triton.cdiv(head_v_dim, block_v))
    saves = save_at is not None and save_to is not None
    _gdn_segments_kernel[grid](
        q, k, v, g, beta, recurrent_pool, slot_ids, cu_seqlens, out,
        save_at if saves else slot_ids, save_to if saves else slot_ids,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), recurrent_pool.stride(0), recurrent_pool.stride(1),
        out.stride(0), out.stride(1), head_k_dim**-0.5, _L2NORM_EPS,
        HV=num_v_heads, GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        BK=triton.next_power_of_2(head_k_dim), BV=block_v, SAVES=saves,
        PREFETCH=RECURRENT_PREFETCH if prefetch is None else prefetch, num_warps=num_warps,
    )  # fmt: skip
    return out
