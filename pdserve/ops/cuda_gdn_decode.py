"""A Gated DeltaNet layer's decode token in two Triton launches: the conv step (`cuda_conv`), then
gates + delta-rule step + gated norm in one (`pdserve.ops.gdn_decode.gdn_decode_step`'s semantics).

Unfused, a GDN layer's decode token is four launches between its two GEMMs (`causal_conv1d_step`,
`gdn_gates`, `gdn_recurrent_step`, `gated_rms_norm`): at 4 sequences each is 2-7 us of mostly
launch and memory latency (docs/benchmarks.md, session 13). After the conv, one program here takes
a (sequence, value head): its gates, its [Dk, Dv] fp32 state tile updated in place (whole, or in
V_SPLIT blocks of value columns in turn: the read-outs parked in the output row, then normed by
the row's rms), and its gated-normed output row, through the unfused kernels' own jit helpers
(`gdn_decay`, `l2_normed_qk`, `delta_rule_step`, `gated_norm_values`) and rounded where they round
(beta to the activation dtype, the step's output before the norm): whole-tile, the two paths agree
to the bit under the interpreter.
The conv stays a launch of its own. Fused into one program a (sequence, key head) (220e29d) it was
slower (64-512 programs for 4-32 sequences, H200) and wrong: a 128-lane tensor over 8 warps is held
by two threads each, and one replica shifted a channel's conv history before the other had read it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.cuda_conv import causal_conv1d_step
from pdserve.ops.cuda_gdn import _L2NORM_EPS, delta_rule_step, l2_normed_qk
from pdserve.ops.cuda_layers import gdn_decay
from pdserve.ops.cuda_norms import gated_norm_scaled, gated_norm_values
from pdserve.ops.gdn_decode import GdnTensors

# the program's shape: its state tile in V_SPLIT blocks of value columns in turn, NUM_WARPS warps.
# The whole tile on 8 warps is what session 14 measured; `bench_step --variants gsplit=,gwarps=`
# times the others
V_SPLIT = 1
NUM_WARPS = 8


@triton.jit
def _step_block(v_row, s_row, offs_k, mask_k, offs_v, q, k, decay, beta, DV: tl.constexpr, dtype):
    """Value columns offs_v of a value head (its v at v_row, its state tile at s_row): that block
    of the tile stepped in place; -> (its read-out rounded to `dtype` as gdn_recurrent_step stores
    it, the columns' mask)."""
    mask_v = offs_v < DV
    v = tl.load(v_row + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    s_ptrs = s_row + offs_k[:, None] * DV + offs_v[None, :]
    o = delta_rule_step(s_ptrs, mask_k[:, None] & mask_v[None, :], q, k, v, decay, beta)
    return o.to(dtype), mask_v


@triton.jit
def _gates_step_norm_kernel(
    m_ptr, z_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slot_ptr, norm_w_ptr, out_ptr,
    stride_mb, stride_zb, stride_zh, stride_ab, stride_bb, stride_ss, stride_sh,
    key_dim, scale, l2_eps, norm_eps,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, V_SPLIT: tl.constexpr,
):  # fmt: skip
    """One (sequence, value head) of the conv output m = q | k | v; its state tile V_SPLIT blocks
    of BV value columns one after another (1: the whole tile at once)."""
    seq = tl.program_id(0) // HV
    hv = tl.program_id(0) % HV
    hk = hv // GROUP
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < DK
    m_row = m_ptr + seq * stride_mb
    q = tl.load(m_row + hk * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(m_row + key_dim + hk * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    q, k = l2_normed_qk(q, k, scale, l2_eps)
    a = tl.load(a_ptr + seq * stride_ab + hv).to(tl.float32) + tl.load(dt_bias_ptr + hv).to(tl.float32)
    decay = tl.exp(gdn_decay(a, tl.load(a_log_ptr + hv).to(tl.float32)))
    b = tl.load(b_ptr + seq * stride_bb + hv)
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)  # rounded as gdn_gates stores it
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    s_row = state_ptr + slot * stride_ss + hv * stride_sh
    out_row = out_ptr + (seq * HV + hv) * DV
    z_row = z_ptr + seq * stride_zb + hv * stride_zh
    v_row = m_row + 2 * key_dim + hv * DV
    dtype = z_ptr.dtype.element_ty
    if V_SPLIT == 1:
        offs_v = tl.arange(0, BV)
        o, mask_v = _step_block(v_row, s_row, offs_k, mask_k, offs_v, q, k, decay, beta, DV, dtype)
        norm_w = tl.load(norm_w_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        z = tl.load(z_row + offs_v, mask=mask_v, other=0.0)
        tl.store(out_row + offs_v, gated_norm_values(o, z, norm_w, DV, norm_eps).to(dtype), mask=mask_v)
    else:  # each block's read-out parked in the output row, then normed by the whole row's rms
        sum_sq = tl.zeros([BV], tl.float32)
        for j in tl.static_range(V_SPLIT):
            offs_v = j * BV + tl.arange(0, BV)
            o, mask_v = _step_block(v_row, s_row, offs_k, mask_k, offs_v, q, k, decay, beta, DV, dtype)
            sum_sq += o.to(tl.float32) * o.to(tl.float32)
            tl.store(out_row + offs_v, o, mask=mask_v)
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / DV + norm_eps)
        tl.debug_barrier()  # every block's read-out is in the row before any thread norms it
        for j in tl.static_range(V_SPLIT):
            offs_v = j * BV + tl.arange(0, BV)
            mask_v = offs_v < DV
            o = tl.load(out_row + offs_v, mask=mask_v, other=0.0)
            norm_w = tl.load(norm_w_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
            z = tl.load(z_row + offs_v, mask=mask_v, other=0.0)
            tl.store(out_row + offs_v, gated_norm_scaled(o, z, norm_w, rstd).to(dtype), mask=mask_v)


def gdn_decode_step(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    layer: GdnTensors,
    slot_ids: torch.Tensor,
    v_split: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Shapes checked by `pdserve.ops.gdn_decode.gdn_decode_step`; -> [B, Hv * Dv] in z's dtype.
    `v_split` (a power of two), `num_warps`: the kernel's shape, V_SPLIT and NUM_WARPS by default."""
    v_split, num_warps = v_split or V_SPLIT, num_warps or NUM_WARPS
    conv_weight, conv_pool, A_log, dt_bias, recurrent_pool, norm_weight, norm_eps = layer
    batch = mixed_qkv.shape[0]
    num_v_heads, head_k_dim, head_v_dim = recurrent_pool.shape[1:]
    key_dim = (mixed_qkv.shape[1] - num_v_heads * head_v_dim) // 2
    num_k_heads = key_dim // head_k_dim
    if recurrent_pool.stride(3) != 1 or recurrent_pool.stride(2) != head_v_dim:
        raise ValueError("gdn_decode_step: each slot's [Hv, Dk, Dv] state must be contiguous")
    a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (a, b))
    if z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty(batch, num_v_heads * head_v_dim, dtype=z.dtype, device=z.device)
    if batch == 0:
        return out
    m = causal_conv1d_step(mixed_qkv, conv_weight, conv_pool, slot_ids)
    _gates_step_norm_kernel[(batch * num_v_heads,)](
        m, z, a, b, A_log, dt_bias, recurrent_pool, slot_ids, norm_weight, out,
        m.stride(0), z.stride(0), z.stride(1), a.stride(0), b.stride(0),
        recurrent_pool.stride(0), recurrent_pool.stride(1),
        key_dim, head_k_dim**-0.5, _L2NORM_EPS, norm_eps,
        HV=num_v_heads, GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        BK=triton.next_power_of_2(head_k_dim), BV=triton.next_power_of_2(head_v_dim) // v_split,
        V_SPLIT=v_split, num_warps=num_warps,
    )  # fmt: skip
    return out
