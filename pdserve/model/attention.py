"""Gated full attention: every fourth layer; its K/V live in the paged KV pool."""

from __future__ import annotations

import torch
from torch import nn

from pdserve import ops
from pdserve.config import ModelConfig
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.layers import RMSNorm, RotaryEmbedding
from pdserve.ops.linear import linear, linear_to_norm
from pdserve.ops.long_attention import long_chunk_attention


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
        qkv_rows = (self.num_heads * 2 + self.num_kv_heads * 2) * self.head_dim
        self.qkv_proj = nn.Parameter(torch.empty(qkv_rows, cfg.hidden_size))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, self.num_heads * self.head_dim))
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self.kv_layer: torch.Tensor | None = None  # [2, num_pages, page_size, Hkv, D]

    def bind_kv(self, kv_layer: torch.Tensor) -> None:
        self.kv_layer = kv_layer

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, gate = ops.qk_norm_rope_store(
            linear(x, self.qkv_proj),
            self.num_heads,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            self.rotary.cos_cache,
            self.rotary.sin_cache,
            batch.positions,
            self.kv_layer,
            batch.slot_mapping,
        )
        if batch.long_context is not None:  # a long prompt's chunk: in parts
            o = long_chunk_attention(q, self.kv_layer, batch.block_tables[0], batch.long_context, self.scale)
        else:
            o = ops.paged_attention(
                q,
                self.kv_layer,
                batch.cu_seqlens,
                batch.seq_lens,
                batch.block_tables,
                self.scale,
                max_q_len=batch.max_query_len,
                programs=batch.attention_programs,
            )
        return linear_to_norm(ops.output_gate(o, gate), self.o_proj)
