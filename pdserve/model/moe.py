"""Sparse MoE block: softmax top-k router over routed experts plus a gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.ops.moe import fused_moe


class SparseMoe(nn.Module):
    """Experts are stacked: `w13` [E, 2I, H] (gate then up), `w2` [E, H, I]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        E, H, I, S = (
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        )
        self.gate = nn.Parameter(torch.empty(E, H))
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        self.shared_gate_up = nn.Parameter(torch.empty(2 * S, H))
        self.shared_down = nn.Parameter(torch.empty(H, S))
        self.shared_expert_gate = nn.Parameter(torch.empty(1, H))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts of each token and their renormalised softmax weights."""
        logits = F.linear(x, self.gate)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        routed = fused_moe(x, self.w13, self.w2, weights, ids)
        gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
        shared = F.linear(F.silu(gate) * up, self.shared_down)
        shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        return routed + shared
