"""Gated DeltaNet on CUDA: chunked prefill through flash-linear-attention, decode through a Triton
kernel that updates the fp32 states in place in the pool.

Shapes and semantics are those of `pdserve.ops.gdn_chunk_prefill` / `gdn_recurrent_step`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.cuda_norms import l2_normalize
from pdserve.ops.per_pass import PerPass

_L2NORM_EPS = 1e-6
_FLA_CHUNK_SIZES = (16, 32, 64)


def _fla_chunk_rule():
    """fla's `chunk_gated_delta_rule`, imported on first use so CPU machines never need fla."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as err:
        raise ImportError(
            "pdserve's CUDA GDN prefill needs flash-linear-attention: pip install fla-core==0.6.0"
        ) from err
    return chunk_gated_delta_rule


def gdn_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    recurrent_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    chunk_size: int,
    chunks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; cu_seqlens int32 [N+1];
    recurrent_pool [S, Hv, Dk, Dv]; slot_ids int64 [N] -> o [T, Hv, Dv] in v's dtype.

    fla handles Hv = group x Hk natively (value head h reads key head h // group, as here). q and
    k are l2-normalised here (`l2_normalize`: fla's in-kernel option's arithmetic, without the
    autotuner that compiled under traffic). The N initial states are gathered from the pool (one
    copy of N x 2 MiB at the real shape) and the final states scattered back. `chunks` is fla's
    chunk index, made on the host by the caller; without it fla reads cu_seqlens on the host (a
    device sync), caching the result by tensor identity: `_as_long` hands every layer of a pass
    the same int64 tensor for the same cu_seqlens, so that read happens once a pass.
    """
    rule = _fla_chunk_rule()
    fla_chunk = chunk_size if chunk_size in _FLA_CHUNK_SIZES else 64
    dtype = v.dtype
    # fla wants one dtype for q/k/v and a fp32 log-decay; contiguous [1, T, H, D] views.
    q, k = (l2_normalize(x, dtype, _L2NORM_EPS)[None] for x in (q, k))
    v = v.contiguous()[None]
    initial = recurrent_pool.index_select(0, slot_ids).float()
    out, final = rule(
        q,
        k,
        v,
        g.float().contiguous()[None],
        beta.to(dtype).contiguous()[None],
        scale=q.shape[-1] ** -0.5,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=_as_long(cu_seqlens),
        chunk_indices=chunks if fla_chunk == chunk_size else None,
        chunk_size=fla_chunk,
    )
    recurrent_pool.index_copy_(0, slot_ids, final.to(recurrent_pool.dtype))
    return out[0]


# The int64 copy of a pass's cu_seqlens, made once for all the layers of the pass: fla reads it on
# the host (a device sync) and caches that by identity, the last 4 calls (FLA_TENSOR_CACHE_SIZE).
_as_long = PerPass(lambda cu_seqlens: cu_seqlens.long(), keep=4)


@triton.jit
def _gdn_step_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slot_ptr,
    o_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_gb,
    stride_betab,
    stride_ss,
    stride_sh,
    stride_ob,
    stride_oh,
    scale,
    eps,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """One (sequence, value head, block of BV value columns): the whole [DK, BV] state tile is read
    once, decayed, delta-updated, read out by q and written back where it was."""
    b, hv, hk, offs_k, offs_v, mask_k, mask_v = head_tile(HV, GROUP, DK, DV, BK, BV)

    q = tl.load(q_ptr + b * stride_qb + hk * stride_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + hk * stride_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    q, k = l2_normed_qk(q, k, scale, eps)
    v = tl.load(v_ptr + b * stride_vb + hv * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + b * stride_gb + hv).to(tl.float32))
    beta = tl.load(beta_ptr + b * stride_betab + hv).to(tl.float32)

    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
    out = delta_rule_step(s_ptrs, mask_k[:, None] & mask_v[None, :], q, k, v, decay, beta)
    tl.store(o_ptr + b * stride_ob + hv * stride_oh + offs_v, out.to(o_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def head_tile(HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """A program of the (row x value head, block of BV value columns) grid: its row, value head,
    key head, key offsets [BK], value offsets [BV] and their masks."""
    hv = tl.program_id(0) % HV
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    return tl.program_id(0) // HV, hv, hv // GROUP, offs_k, offs_v, offs_k < DK, offs_v < DV


@triton.jit
def l2_normed_qk(q, k, scale, eps):
    """q and k [DK] fp32, each over its l2 norm (q then times scale), as fla's use_qk_l2norm_in_kernel."""
    return q * (tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale), k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)


@triton.jit
def delta_rule_step(s_ptrs, s_mask, q, k, v, decay, beta):
    """The [DK, BV] state tile at s_ptrs decayed, delta-updated by (k, v) and written back; -> q's
    read-out [BV] (fp32). q, k [DK] l2-normed (q scaled); v [BV]; decay, beta scalars."""
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    state, out = delta_rule_update(state, q, k, v, decay, beta)
    tl.store(s_ptrs, state.to(s_ptrs.dtype.element_ty), mask=s_mask)
    return out


@triton.jit
def delta_rule_update(state, q, k, v, decay, beta):
    """The fp32 [DK, BV] `state` decayed and delta-updated by (k, v); -> (new state, q's read-out
    [BV]). q, k [DK] l2-normed (q scaled); v [BV]; decay, beta scalars."""
    state = state * decay
    written = beta * (v - tl.sum(state * k[:, None], axis=0))
    state = state + k[:, None] * written[None, :]
    return state, tl.sum(state * q[:, None], axis=0)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gdn_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    block_v: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """q, k [B, Hk, Dk] raw; v [B, Hv, Dv]; g, beta [B, Hv]; recurrent_pool [S, Hv, Dk, Dv] (each
    slot's [Hv, Dk, Dv] contiguous); slot_ids int64 [B] -> o [B, Hv, Dv] in v's dtype.

    Sync-free, one launch: B x Hv x Dv/block_v programs, each moving a [Dk, block_v] state tile.
    """
    batch, num_k_heads, head_k_dim = k.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    if recurrent_pool.stride(3) != 1 or recurrent_pool.stride(2) != head_v_dim:
        raise ValueError("gdn_recurrent_step: each slot's [Hv, Dk, Dv] state must be contiguous")
    q, k, v, g, beta = (_last_dim_contiguous(x) for x in (q, k, v, g, beta))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if batch == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(head_v_dim))
    grid = (batch * num_v_heads, triton.cdiv(head_v_dim, block_v))
    _gdn_step_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        recurrent_pool,
        slot_ids,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        recurrent_pool.stride(0),
        recurrent_pool.stride(1),
        out.stride(0),
        out.stride(1),
        head_k_dim**-0.5,
        _L2NORM_EPS,
        HV=num_v_heads,
        GROUP=num_v_heads // num_k_heads,
        DK=head_k_dim,
        DV=head_v_dim,
        BK=triton.next_power_of_2(head_k_dim),
        BV=block_v,
        num_warps=num_warps,
    )
    return out
