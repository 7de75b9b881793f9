"""CPU reference of the per-layer ops (`pdserve.ops.layer_ops`): plain torch, written to be read.

These are the formulas of transformers' Qwen3.5-MoE modules (zero-centred RMSNorm, gated RMSNorm,
rotate-half partial rotary, softmax top-k router), with the intermediate roundings the unfused
model made. Shapes are checked by the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.ops.reference import store_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    added = parts if parts.dim() == 2 else parts.float().sum(dim=1).to(residual.dtype)
    residual = residual + added
    return rms_norm(residual, weight, eps), residual


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(gate.float())).to(dtype).reshape(x.shape[0], -1)


def _rotate_half_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos, sin [T, 1, R]: rotary on the first R channels, rotate-half layout."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


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
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_layer.shape[3], kv_layer.shape[4]
    q_size, kv_size = num_heads * 2 * head_dim, num_kv_heads * head_dim
    q_gate, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, gate = q_gate.view(num_tokens, num_heads, 2 * head_dim).chunk(2, dim=-1)
    q = rms_norm(q.reshape(-1, head_dim), q_weight, eps).view(num_tokens, num_heads, head_dim)
    k = rms_norm(k.reshape(-1, head_dim), k_weight, eps).view(num_tokens, num_kv_heads, head_dim)
    cos = cos_cache[positions].to(qkv.dtype)[:, None, :]
    sin = sin_cache[positions].to(qkv.dtype)[:, None, :]
    q, k = _rotate_half_partial(q, cos, sin), _rotate_half_partial(k, cos, sin)
    store_kv(k, v.view(num_tokens, num_kv_heads, head_dim), kv_layer, slot_mapping)
    return q.contiguous(), gate


def output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    num_tokens = o.shape[0]
    return o.reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def route_topk(logits: torch.Tensor, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits[:, :num_experts], dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)
    if logits.shape[1] == num_experts + 1:  # the shared expert, gated by its own sigmoid
        shared_id = torch.full_like(ids[:, :1], num_experts)
        weights = torch.cat([weights, torch.sigmoid(logits[:, num_experts:])], dim=1)
        ids = torch.cat([ids, shared_id], dim=1)
    return weights, ids
