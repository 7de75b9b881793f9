"""A Gated DeltaNet layer's decode token between its two GEMMs, as one op: conv step, gates,
delta-rule step and gated norm. On CUDA, up to FUSED_MAX_BATCH sequences, two launches
(`pdserve.ops.cuda_gdn_decode`); above that, elsewhere, and as its reference, the four ops composed
(`gdn_decode_step_unfused`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve import ops
from pdserve.ops.shapes import Shapes

# The fused kernel's program holds a whole [Dk, Dv] state tile (8 warps). bench_step, H200 (the GDN
# mixer's kernels a step, 30 layers): c=4 0.36 -> 0.27 ms, c=32 1.24 -> 1.73 ms (the unfused step's
# half tiles keep twice the programs in flight); c=16: 9.66 ms a whole step, 9.54 before (another
# machine).
# Between 4 and 16 it was not measured: 8 is the guess.
FUSED_MAX_BATCH = 8


class GdnTensors(NamedTuple):
    """A GDN layer's weights and state pools, as its decode mixer reads them."""

    conv_weight: torch.Tensor  # [C, W]
    conv_pool: torch.Tensor  # [S, C, W-1], updated in place
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    recurrent_pool: torch.Tensor  # [S, Hv, Dk, Dv] fp32, updated in place
    norm_weight: torch.Tensor  # [Dv]
    norm_eps: float


def gdn_decode_step(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    layer: GdnTensors,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """One decode token per sequence through a GDN layer's mixer, after `in_proj`, before `out_proj`.

    mixed_qkv: [B, C] pre-conv q | k | v (C = 2 Hk Dk + Hv Dv); z: [B, Hv, Dv] the norm's gate;
    a, b: [B, Hv]; `layer`'s pools are read at slot_ids (int64 [B]) and updated in place.
    Returns the gated-normed output [B, Hv * Dv] in z's dtype.
    """
    conv_weight, conv_pool, A_log, dt_bias, recurrent_pool, norm_weight, _ = layer
    shapes = Shapes("gdn_decode_step")
    shapes("mixed_qkv", mixed_qkv, "B C")
    shapes("z", z, "B Hv Dv")
    shapes("a", a, "B Hv")
    shapes("b", b, "B Hv")
    shapes("conv_weight", conv_weight, "C W")
    shapes.fix("W-1", shapes.sizes["W"] - 1)
    shapes("conv_pool", conv_pool, "S C W-1")
    shapes("A_log", A_log, "Hv")
    shapes("dt_bias", dt_bias, "Hv")
    shapes("recurrent_pool", recurrent_pool, "S Hv Dk Dv")
    shapes("slot_ids", slot_ids, "B", torch.int64)
    shapes("norm_weight", norm_weight, "Dv")
    sizes = shapes.sizes
    qk_channels, dk = sizes["C"] - sizes["Hv"] * sizes["Dv"], sizes["Dk"]  # q and k: 2 Hk Dk
    if qk_channels <= 0 or qk_channels % (2 * dk) or sizes["Hv"] % (qk_channels // (2 * dk)):
        raise ValueError(
            f"gdn_decode_step: {sizes['C']} channels do not split into q | k of Dk={sizes['Dk']} heads "
            f"and v of {sizes['Hv']} x {sizes['Dv']}, with the value heads a multiple of the key heads"
        )
    if {z.dtype, a.dtype, b.dtype} != {mixed_qkv.dtype} or recurrent_pool.dtype != torch.float32:
        raise ValueError(
            f"gdn_decode_step: mixed_qkv, z, a, b in one dtype (got {mixed_qkv.dtype}, {z.dtype}, "
            f"{a.dtype}, {b.dtype}) and an fp32 recurrent_pool (got {recurrent_pool.dtype})"
        )
    if mixed_qkv.is_cuda and sizes["B"] <= FUSED_MAX_BATCH:
        from pdserve.ops import cuda_gdn_decode

        return cuda_gdn_decode.gdn_decode_step(mixed_qkv, z, a, b, layer, slot_ids)
    return gdn_decode_step_unfused(mixed_qkv, z, a, b, layer, slot_ids)


def gdn_decode_step_unfused(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    layer: GdnTensors,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """The same as four ops on the tensors' device: the CPU path, and the fused kernel's reference."""
    conv_weight, conv_pool, A_log, dt_bias, recurrent_pool, norm_weight, norm_eps = layer
    num_v_heads, head_k_dim, head_v_dim = recurrent_pool.shape[1:]
    key_dim = (mixed_qkv.shape[1] - num_v_heads * head_v_dim) // 2
    batch = mixed_qkv.shape[0]
    mixed_qkv = ops.causal_conv1d_step(mixed_qkv, conv_weight, conv_pool, slot_ids)
    q, k, v = mixed_qkv.split([key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    g, beta = ops.gdn_gates(a, b, A_log, dt_bias)
    o = ops.gdn_recurrent_step(
        q.reshape(batch, -1, head_k_dim),
        k.reshape(batch, -1, head_k_dim),
        v.reshape(batch, num_v_heads, head_v_dim),
        g,
        beta,
        recurrent_pool,
        slot_ids,
    )
    return ops.gated_rms_norm(o, z, norm_weight, norm_eps)
