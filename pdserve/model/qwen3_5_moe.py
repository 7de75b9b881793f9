"""The Qwen3.5/3.6-MoE hybrid model: GDN and gated-attention layers, each followed by a sparse MoE."""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model.attention import GatedAttention
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.gdn import GatedDeltaNet
from pdserve.model.layers import RMSNorm, RotaryEmbedding
from pdserve.model.moe import SparseMoe


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg, rotary)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoe(cfg)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: this layer's input_layernorm output; residual: the stream it normed. Returns the MoE's
        weighted expert rows [T, P, H] and the stream before them: the next norm adds the two."""
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, batch)
        else:
            h = self.self_attn(h, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3MoeHybrid(nn.Module):
    """Parameter names follow the checkpoint (`model.layers.N....`, `lm_head.weight`) except where
    projections are fused; `pdserve.weights` maps checkpoint names onto these."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, max_positions)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, t, self.rotary) for t in cfg.layer_types)
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def bind_pools(self, kv: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Give every layer its slice of the memory pools (see docs/architecture.md)."""
        attn_i = gdn_i = 0
        for layer in self.model.layers:
            if layer.layer_type == "linear_attention":
                layer.linear_attn.bind_state(conv[gdn_i], recurrent[gdn_i])
                gdn_i += 1
            else:
                layer.self_attn.bind_kv(kv[attn_i])
                attn_i += 1

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]. Each layer's residual add is folded into
        the norm after it (the last layer's into the final norm)."""
        layers = self.forward_layers(batch)
        while True:
            try:
                next(layers)
            except StopIteration as done:
                return done.value

    def forward_layers(self, batch: ForwardBatch) -> Generator[None, None, torch.Tensor]:
        """`forward` a decoder layer at a time: yields after launching each, returns the hidden
        states (what a pass interleaved with other work between its layers runs)."""
        layers = self.model.layers
        residual = self.model.embed_tokens(batch.input_ids)
        h = layers[0].input_layernorm(residual)
        for i, layer in enumerate(layers):
            parts, residual = layer(h, residual, batch)
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, residual = next_norm(parts, residual)
            yield
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
