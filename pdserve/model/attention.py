"""Gated full attention: every fourth layer; its K/V live in the paged KV pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import ops
from pdserve.config import ModelConfig
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.layers import RMSNorm, RotaryEmbedding


class GatedAttention(nn.Module):
    """q/k/v projection (q carries an output gate), q/k RMSNorm, partial RoPE, GQA, sigmoid gate.

    `qkv_proj` fuses the checkpoint's `q_proj` ([H * 2D]: per head, D query channels then
    D gate channels), `k_proj` and `v_proj`.
    """

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.split = [
            self.num_heads * self.head_dim * 2,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        self.qkv_proj = nn.Parameter(torch.empty(sum(self.split), cfg.hidden_size))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, self.num_heads * self.head_dim))
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self.kv_layer: torch.Tensor | None = None  # [2, num_pages, page_size, Hkv, D]

    def bind_kv(self, kv_layer: torch.Tensor) -> None:
        self.kv_layer = kv_layer

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        q_gate, k, v = F.linear(x, self.qkv_proj).split(self.split, dim=-1)
        q, gate = q_gate.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(batch.positions, q, k)
        ops.store_kv(k, v, self.kv_layer, batch.slot_mapping)
        o = ops.paged_attention(
            q.contiguous(), self.kv_layer, batch.cu_seqlens, batch.seq_lens, batch.block_tables, self.scale
        )
        o = o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return F.linear(o, self.o_proj)
