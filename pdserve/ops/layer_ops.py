"""The small per-layer ops of the hybrid model, each one kernel on CUDA: norms (with the residual add),
q/k norm + partial rotary + KV store, the attention output gate, the GDN gates, the MoE router.

Each checks shapes (metadata only, no host sync), raising `ValueError` on a mismatch, then runs
`pdserve.ops.reference_layers` (plain torch, written to be read: the contract) on the CPU or
`pdserve.ops.cuda_layers` (Triton) on a CUDA device. Activations are bf16 or fp32 and every op
computes in fp32 inside; where the unfused model rounded an intermediate that is stored (the
residual stream, a summed sublayer output), the kernels round it the same way.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pdserve.ops import reference_layers
from pdserve.ops.shapes import Shapes


def _implementation(x: torch.Tensor) -> ModuleType:
    if x.is_cuda:
        from pdserve.ops import cuda_layers

        return cuda_layers
    return reference_layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: `x / rms(x) * (1 + weight)`. x: [T, D] -> [T, D] in x's dtype."""
    shapes = Shapes("rms_norm")
    shapes("x", x, "T D")
    shapes("weight", weight, "D")
    return _implementation(x).rms_norm(x, weight, eps)


def add_rms_norm(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sublayer's output added to the residual stream, then the next zero-centred RMSNorm.

    parts: [T, D] (one output, in residual's dtype) or [T, P, D] (P outputs summed in fp32 and rounded
    to residual's dtype: the MoE's weighted expert rows, a projection's split-K partials); residual:
    [T, D].
    Returns (normed [T, D], the new residual [T, D] = residual + sum(parts), in residual's dtype).
    """
    shapes = Shapes("add_rms_norm")
    shapes("parts", parts, "T D" if parts.dim() == 2 else "T P D")
    shapes("residual", residual, "T D")
    shapes("weight", weight, "D")
    return _implementation(residual).add_rms_norm(parts, residual, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: `weight * (x / rms(x)) * silu(gate)` per head (plain weight, not centred).

    x, gate: [T, H, D] (gate may be a strided view); weight: [D]. Returns [T, H * D] in x's dtype.
    """
    shapes = Shapes("gated_rms_norm")
    shapes("x", x, "T H D")
    shapes("gate", gate, "T H D")
    shapes("weight", weight, "D")
    return _implementation(x).gated_rms_norm(x, gate, weight, eps)


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
    """The gated attention's input step: q/k RMSNorm, rotary on the first R channels, K/V stored.

    qkv: [T, H*2D + 2*Hkv*D], the fused projection: per query head D query then D gate channels,
    then K, then V. q_weight, k_weight: [D] (zero-centred). cos_cache, sin_cache: fp32 [positions, R]
    (rotate-half layout); positions: int64 [T]. kv_layer: [2, P, page_size, Hkv, D];
    slot_mapping: int64 [T]: the normed, rotated K and the V of token t go to flat slot
    slot_mapping[t]. Returns (q [T, H, D] contiguous, gate [T, H, D]: a view of qkv).
    """
    shapes = Shapes("qk_norm_rope_store")
    shapes("kv_layer", kv_layer, "2 P page_size Hkv D")
    head_dim, num_kv_heads = shapes.sizes["D"], shapes.sizes["Hkv"]
    shapes.fix("W", num_heads * 2 * head_dim + 2 * num_kv_heads * head_dim)
    shapes("qkv", qkv, "T W")
    shapes("q_weight", q_weight, "D")
    shapes("k_weight", k_weight, "D")
    shapes("cos_cache", cos_cache, "L R", torch.float32)
    shapes("sin_cache", sin_cache, "L R", torch.float32)
    shapes("positions", positions, "T", torch.int64)
    shapes("slot_mapping", slot_mapping, "T", torch.int64)
    rotary_dim = shapes.sizes["R"]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"qk_norm_rope_store: rotary dim {rotary_dim} must be even and <= D={head_dim}")
    if qkv.stride(1) != 1 or not kv_layer.is_contiguous():
        raise ValueError("qk_norm_rope_store: qkv rows and kv_layer must be contiguous")
    return _implementation(qkv).qk_norm_rope_store(
        qkv, num_heads, q_weight, k_weight, eps, cos_cache, sin_cache, positions, kv_layer, slot_mapping
    )


def output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gated attention's output gate: `o * sigmoid(gate)`. o, gate: [T, H, D] (gate may be a
    strided view) -> [T, H * D] in o's dtype."""
    shapes = Shapes("output_gate")
    shapes("o", o, "T H D")
    shapes("gate", gate, "T H D")
    return _implementation(o).output_gate(o, gate)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GDN's per-head decay and write strength from its projections.

    a, b: [T, Hv] (may be strided views); A_log, dt_bias: [Hv]. Returns
    (g = -exp(A_log) * softplus(a + dt_bias): fp32 [T, Hv], beta = sigmoid(b): [T, Hv] in b's dtype).
    """
    shapes = Shapes("gdn_gates")
    shapes("a", a, "T Hv")
    shapes("b", b, "T Hv")
    shapes("A_log", A_log, "Hv")
    shapes("dt_bias", dt_bias, "Hv")
    return _implementation(a).gdn_gates(a, b, A_log, dt_bias)


def route_topk(logits: torch.Tensor, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router: softmax over the E routed experts' logits (fp32), top-k, renormalised.

    logits: [T, E] or [T, E + 1], where the extra column is the shared expert's gate logit: then a
    (k+1)-th pair is appended, expert id E with weight sigmoid(logit). Returns (weights [T, K'] in
    logits' dtype, ids int64 [T, K']), K' = top_k (+ 1), the routed pairs by falling weight.
    """
    shapes = Shapes("route_topk")
    shapes("logits", logits, "T E")
    if logits.shape[1] not in (num_experts, num_experts + 1) or not 0 < top_k <= num_experts:
        raise ValueError(
            f"route_topk: logits [T, {logits.shape[1]}] for {num_experts} experts (+1 shared) "
            f"and top_k={top_k}"
        )
    return _implementation(logits).route_topk(logits, num_experts, top_k)
