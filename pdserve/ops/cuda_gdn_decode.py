"""A Gated DeltaNet layer's decode token in one Triton launch: conv step + gates + delta-rule step +
gated norm (`pdserve.ops.gdn_decode.gdn_decode_step`'s semantics).

Unfused, a GDN layer's decode token is four launches between its two GEMMs (`causal_conv1d_step`,
`gdn_gates`, `gdn_recurrent_step`, `gated_rms_norm`): at 4 sequences each is 2-7 us of mostly
launch and memory latency (docs/benchmarks.md, session 13). One program here takes a sequence and
a key head: it convolves that head's q and k channels and the v channels of its GROUP value heads
(so each channel's history is read and shifted by exactly one program), then for each value head
updates the [Dk, Dv] fp32 state tile in place and writes the gated-normed output row. Values are
rounded where the unfused kernels round (conv output and beta to the activation dtype, the step's
output before the norm), so the two paths agree to the last bf16 bit up to reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.cuda_gdn import _L2NORM_EPS
from pdserve.ops.gdn_decode import GdnTensors


@triton.jit
def _conv_silu(x_row, w_ptr, hist_row, channels, mask, stride_wc, HIST: tl.constexpr):
    """silu(w . [history, x]) of `channels` (fp32, rounded to x's dtype); the history shifted by x."""
    x = tl.load(x_row + channels, mask=mask, other=0.0)
    hist = hist_row + channels * HIST
    w_row = w_ptr + channels * stride_wc
    acc = x.to(tl.float32) * tl.load(w_row + HIST, mask=mask, other=0.0).to(tl.float32)
    prev = tl.load(hist, mask=mask, other=0.0)
    for j in tl.static_range(HIST):
        acc += prev.to(tl.float32) * tl.load(w_row + j, mask=mask, other=0.0).to(tl.float32)
        if j + 1 < HIST:
            nxt = tl.load(hist + j + 1, mask=mask, other=0.0)
            tl.store(hist + j, nxt, mask=mask)
            prev = nxt
    tl.store(hist + HIST - 1, x.to(hist_row.dtype.element_ty), mask=mask)
    return (acc * tl.sigmoid(acc)).to(x.dtype).to(tl.float32)


@triton.jit
def _gdn_decode_kernel(
    x_ptr, z_ptr, a_ptr, b_ptr, conv_w_ptr, conv_pool_ptr, a_log_ptr, dt_bias_ptr,
    state_ptr, slot_ptr, norm_w_ptr, out_ptr,
    stride_xb, stride_zb, stride_zh, stride_ab, stride_bb, stride_wc, stride_cs, stride_ss, stride_sh,
    key_dim, scale, l2_eps, norm_eps,
    HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HIST: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One (sequence, key head): its q/k conv, then each of its GROUP value heads in turn."""
    seq = tl.program_id(0) // HK
    hk = tl.program_id(0) % HK
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    x_row = x_ptr + seq * stride_xb
    hist_row = conv_pool_ptr + slot * stride_cs
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < DK
    offs_v = tl.arange(0, BV)
    mask_v = offs_v < DV
    q = _conv_silu(x_row, conv_w_ptr, hist_row, hk * DK + offs_k, mask_k, stride_wc, HIST)
    k = _conv_silu(x_row, conv_w_ptr, hist_row, key_dim + hk * DK + offs_k, mask_k, stride_wc, HIST)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + l2_eps) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + l2_eps)
    norm_w = tl.load(norm_w_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    for j in tl.static_range(GROUP):
        hv = hk * GROUP + j
        v_channels = 2 * key_dim + hv * DV + offs_v
        v = _conv_silu(x_row, conv_w_ptr, hist_row, v_channels, mask_v, stride_wc, HIST)
        # gates: g = -exp(A_log) * softplus(a + dt_bias) (torch's softplus: linear above 20); beta
        # = sigmoid(b), rounded to b's dtype
        a = tl.load(a_ptr + seq * stride_ab + hv).to(tl.float32) + tl.load(dt_bias_ptr + hv).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        g = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus
        b = tl.load(b_ptr + seq * stride_bb + hv)
        beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
        # the delta rule on the [DK, DV] fp32 state tile, in place
        s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
        s_mask = mask_k[:, None] & mask_v[None, :]
        state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32) * tl.exp(g)
        written = beta * (v - tl.sum(state * k[:, None], axis=0))
        state = state + k[:, None] * written[None, :]
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)
        # gated RMSNorm over the head: round(w * round(o / rms(o))) * silu(z)
        o = o.to(z_ptr.dtype.element_ty).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(o * o, axis=0) / DV + norm_eps)
        normed = (o * rstd).to(z_ptr.dtype.element_ty).to(tl.float32)
        scaled = (norm_w * normed).to(z_ptr.dtype.element_ty).to(tl.float32)
        z = tl.load(z_ptr + seq * stride_zb + hv * stride_zh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        out = (scaled * (z * tl.sigmoid(z))).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (seq * HK * GROUP + hv) * DV + offs_v, out, mask=mask_v)


def gdn_decode_step(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    layer: GdnTensors,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """Shapes checked by `pdserve.ops.gdn_decode.gdn_decode_step`; -> [B, Hv * Dv] in z's dtype."""
    conv_weight, conv_pool, A_log, dt_bias, recurrent_pool, norm_weight, norm_eps = layer
    batch = mixed_qkv.shape[0]
    num_v_heads, head_k_dim, head_v_dim = recurrent_pool.shape[1:]
    key_dim = (mixed_qkv.shape[1] - num_v_heads * head_v_dim) // 2
    num_k_heads = key_dim // head_k_dim
    if conv_pool.stride(2) != 1 or conv_pool.stride(1) != conv_pool.shape[2]:
        raise ValueError("gdn_decode_step: each slot's [C, W-1] history must be contiguous")
    if recurrent_pool.stride(3) != 1 or recurrent_pool.stride(2) != head_v_dim:
        raise ValueError("gdn_decode_step: each slot's [Hv, Dk, Dv] state must be contiguous")
    mixed_qkv, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (mixed_qkv, a, b))
    if z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty(batch, num_v_heads * head_v_dim, dtype=z.dtype, device=z.device)
    if batch == 0:
        return out
    _gdn_decode_kernel[(batch * num_k_heads,)](
        mixed_qkv, z, a, b, conv_weight, conv_pool, A_log, dt_bias, recurrent_pool, slot_ids,
        norm_weight, out,
        mixed_qkv.stride(0), z.stride(0), z.stride(1), a.stride(0), b.stride(0), conv_weight.stride(0),
        conv_pool.stride(0), recurrent_pool.stride(0), recurrent_pool.stride(1),
        key_dim, head_k_dim**-0.5, _L2NORM_EPS, norm_eps,
        HK=num_k_heads, GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        HIST=conv_pool.shape[2], BK=triton.next_power_of_2(head_k_dim),
        BV=triton.next_power_of_2(head_v_dim), num_warps=8,
    )  # fmt: skip
    return out
