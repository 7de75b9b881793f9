"""The per-layer ops on CUDA (`pdserve.ops.layer_ops`), one Triton launch each and sync-free, so a
decode step that uses them captures in a CUDA graph.

| op | kernel |
|---|---|
| `rms_norm`, `add_rms_norm`, `gated_rms_norm` | `pdserve.ops.cuda_norms` |
| `qk_norm_rope_store` | one program per (token, head): norm, rotary; K and V written to their page slot |
| `output_gate` | elementwise over [T, H, D] |
| `gdn_gates` | elementwise over [T, Hv] |
| `route_topk` | `pdserve.ops.cuda_route`: softmax, k rounds of argmax, renormalise, one program per token |
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.cuda_norms import add_rms_norm, gated_rms_norm, rms_norm
from pdserve.ops.cuda_route import route_topk

__all__ = [
    "add_rms_norm",
    "gated_rms_norm",
    "gdn_gates",
    "output_gate",
    "qk_norm_rope_store",
    "rms_norm",
    "route_topk",
]


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, kv_ptr,
    stride_qkv, stride_q, stride_slot, stride_kv_half, stride_cos, eps,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
):  # fmt: skip
    """Program (t, head): head < H is query head `head`, else KV head `head - H`. x / rms(x) * (1 + w),
    then the first ROT channels rotate by the token's position (rotate-half: channel i < ROT/2 pairs
    with i + ROT/2). Queries go to q; keys, with their values, to the token's page slot."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_query = head < H
    kv_head = tl.maximum(head - H, 0)
    offs = tl.arange(0, D)
    half: tl.constexpr = ROT // 2
    in_rot = offs < ROT
    partner = tl.where(offs < half, offs + half, offs - half)
    row = qkv_ptr + t * stride_qkv
    if is_query:
        src = row + head * (2 * D)
        w_ptr = qw_ptr
    else:
        src = row + H * 2 * D + kv_head * D
        w_ptr = kw_ptr
    x = tl.load(src + offs).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs).to(tl.float32)
    x = x * rstd * (1.0 + w)
    xp = tl.load(src + partner, mask=in_rot, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
    xp = xp * rstd * (1.0 + wp)
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=in_rot, other=1.0)
    sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=in_rot, other=0.0)
    y = x * cos + tl.where(offs < half, -xp, xp) * sin
    if is_query:
        tl.store(q_ptr + t * stride_q + head * D + offs, y.to(q_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + t)
        dst = kv_ptr + slot * stride_slot + kv_head * D + offs
        tl.store(dst, y.to(kv_ptr.dtype.element_ty))
        v = tl.load(row + H * 2 * D + HKV * D + kv_head * D + offs)
        tl.store(dst + stride_kv_half, v.to(kv_ptr.dtype.element_ty))


def qk_norm_rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, H*2D + 2*Hkv*D]; kv_layer [2, P, page, Hkv, D] contiguous -> (q [T, H, D], gate view)."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_layer.shape[3], kv_layer.shape[4]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    gate = qkv[:, : num_heads * 2 * head_dim].view(num_tokens, num_heads, 2 * head_dim)[..., head_dim:]
    if num_tokens == 0:
        return q, gate
    if cos_cache.stride(1) != 1 or sin_cache.stride() != cos_cache.stride():
        cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    _qk_norm_rope_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, q_weight, k_weight, cos_cache, sin_cache, positions, slot_mapping, q, kv_layer,
        qkv.stride(0), q.stride(0), num_kv_heads * head_dim, kv_layer.stride(0), cos_cache.stride(0), eps,
        H=num_heads, HKV=num_kv_heads, D=head_dim, ROT=cos_cache.shape[1],
        num_warps=max(1, min(4, head_dim // 64)),
    )  # fmt: skip
    return q, gate


@triton.jit
def _output_gate_kernel(
    o_ptr, gate_ptr, out_ptr, stride_ot, stride_oh, stride_gt, stride_gh, H, D: tl.constexpr
):
    """Program (t, h): out[t, h*D:(h+1)*D] = o[t, h] * sigmoid(gate[t, h])."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, D)
    o = tl.load(o_ptr + t * stride_ot + h * stride_oh + offs).to(tl.float32)
    g = tl.load(gate_ptr + t * stride_gt + h * stride_gh + offs).to(tl.float32)
    tl.store(out_ptr + (t * H + h) * D + offs, (o * tl.sigmoid(g)).to(out_ptr.dtype.element_ty))


def output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o, gate [T, H, D] (last dim contiguous; D a power of two) -> [T, H * D] in o's dtype."""
    o, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (o, gate))
    num_tokens, num_heads, head_dim = o.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=o.dtype, device=o.device)
    if num_tokens == 0:
        return out
    _output_gate_kernel[(num_tokens, num_heads)](
        o, gate, out, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1), num_heads, D=head_dim,
        num_warps=max(1, min(4, head_dim // 128)),
    )  # fmt: skip
    return out


@triton.jit
def gdn_decay(x, a_log):
    """g = -exp(A_log) * softplus(x), x = a + dt_bias, all fp32 (torch's softplus: linear above 20)."""
    return -tl.exp(a_log) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit(do_not_specialize=["T"])  # one build for every pass size
def _gdn_gates_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr,
    stride_at, stride_bt, T, HV, BT: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    """A [BT tokens, BH heads] tile: g = -exp(A_log) * softplus(a + dt_bias) (torch's softplus:
    linear above 20), beta = sigmoid(b)."""
    offs_t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    offs_h = tl.arange(0, BH)
    mask_h = offs_h < HV
    mask = (offs_t < T)[:, None] & mask_h[None, :]
    a = tl.load(a_ptr + offs_t[:, None] * stride_at + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    g = gdn_decay(a + dt_bias[None, :], a_log[None, :])
    tl.store(g_ptr + offs_t[:, None] * HV + offs_h[None, :], g, mask=mask)
    b = tl.load(b_ptr + offs_t[:, None] * stride_bt + offs_h[None, :], mask=mask, other=0.0)
    beta = tl.sigmoid(b.to(tl.float32))
    tl.store(beta_ptr + offs_t[:, None] * HV + offs_h[None, :], beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] (last dim contiguous) -> (g fp32 [T, Hv], beta [T, Hv] in b's dtype)."""
    a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (a, b))
    num_tokens, num_heads = a.shape
    g = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(num_tokens, num_heads, dtype=b.dtype, device=b.device)
    if num_tokens == 0:
        return g, beta
    block_h = triton.next_power_of_2(num_heads)
    block_t = max(1, min(64, 2048 // block_h))
    _gdn_gates_kernel[(triton.cdiv(num_tokens, block_t),)](
        a, b, A_log, dt_bias, g, beta, a.stride(0), b.stride(0), num_tokens, num_heads,
        BT=block_t, BH=block_h, num_warps=4,
    )  # fmt: skip
    return g, beta
