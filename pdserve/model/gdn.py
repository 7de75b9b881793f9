"""Gated DeltaNet: the linear-attention token mixer of three of every four layers."""

from __future__ import annotations

import torch
from torch import nn

from pdserve import ops
from pdserve.config import ModelConfig
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.layers import GatedRMSNorm
from pdserve.ops.gdn_decode import GdnTensors, gdn_decode_step
from pdserve.ops.linear import linear, linear_to_norm


class GatedDeltaNet(nn.Module):
    """in_proj -> causal conv1d (SiLU) -> gated delta rule -> gated RMSNorm -> out_proj.

    `in_proj` fuses the checkpoint's `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a`
    (in that order) into one GEMM. The conv and recurrent states live in the GDN state pool,
    indexed by each sequence's state slot.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.key_dim = cfg.gdn_key_dim
        self.value_dim = cfg.gdn_value_dim
        self.conv_dim = cfg.gdn_conv_dim
        self.split = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        self.in_proj = nn.Parameter(torch.empty(sum(self.split), cfg.hidden_size))
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, cfg.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Parameter(torch.empty(cfg.hidden_size, self.value_dim))
        self.conv_pool: torch.Tensor | None = None  # [S, conv_dim, kernel - 1]
        self.recurrent_pool: torch.Tensor | None = None  # [S, Hv, Dk, Dv]

    def bind_state(self, conv_pool: torch.Tensor, recurrent_pool: torch.Tensor) -> None:
        self.conv_pool, self.recurrent_pool = conv_pool, recurrent_pool

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        mixed_qkv, z, b, a = linear(x, self.in_proj).split(self.split, dim=-1)
        z = z.view(T, self.num_v_heads, self.head_v_dim)
        if batch.is_decode:  # conv, gates, step and norm: one launch on CUDA
            tensors = GdnTensors(self.conv1d_weight, self.conv_pool, self.A_log, self.dt_bias,
                                 self.recurrent_pool, self.norm.weight, self.norm.eps)  # fmt: skip
            o = gdn_decode_step(mixed_qkv, z, a, b, tensors, batch.state_slots)
            return linear_to_norm(o, self.out_proj)
        conv = ops.causal_conv1d_prefill if batch.saves is None else batch.saves.conv
        mixed_qkv = conv(mixed_qkv, self.conv1d_weight, batch.cu_seqlens, self.conv_pool, batch.state_slots)
        q, k, v = mixed_qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        g, beta = ops.gdn_gates(a, b, self.A_log, self.dt_bias)
        if batch.saves is not None:
            o = batch.saves.scan(q, k, v, g, beta, self.recurrent_pool)
        else:
            o = ops.gdn_chunk_prefill(
                q, k, v, g, beta, batch.cu_seqlens, self.recurrent_pool, batch.state_slots,
                chunks=batch.gdn_chunks,
            )  # fmt: skip
        o = self.norm(o, z)
        return linear_to_norm(o, self.out_proj)
