"""Sparse MoE block: softmax top-k router over routed experts plus a gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import ops
from pdserve.config import ModelConfig
from pdserve.ops import linear
from pdserve.ops.moe import fused_moe, routed_moe


class SparseMoe(nn.Module):
    """Experts are stacked: `w13` [E, 2I, H] (gate then up), `w2` [E, H, I].

    The parameters keep the checkpoint's split (the names `pdserve.weights` fills) but live inside
    stacks, so one launch does the work of several: the router `gate` [E, H] and the shared expert's
    gate `shared_expert_gate` [1, H] are the first rows of `router` [E + 1 rounded up to 16, H] (one
    GEMM; the zero rows past E + 1 keep its output rows 16-byte aligned for cuBLAS); when the shared
    expert is as wide as a routed one (Qwen3.6: both 512), its weights are expert E of `experts_w13`
    [E + 1, 2I, H] and `experts_w2` [E + 1, H, I], and it runs as a (k+1)-th pair of every token,
    weighted by its sigmoid gate, in the same grouped GEMMs. The stacks are buffers aliased by the
    parameters: move the model with `.to()` before filling it, never after.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        E, H, I, S = (
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        )
        self.num_experts = E
        self.register_buffer("router", torch.zeros(-(-(E + 1) // 16) * 16, H), persistent=False)
        self.gate = nn.Parameter(self.router[:E])
        self.shared_folded = S == I
        if self.shared_folded:
            self.register_buffer("experts_w13", torch.empty(E + 1, 2 * I, H), persistent=False)
            self.register_buffer("experts_w2", torch.empty(E + 1, H, I), persistent=False)
            self.w13 = nn.Parameter(self.experts_w13[:E])
            self.w2 = nn.Parameter(self.experts_w2[:E])
            self.shared_gate_up = nn.Parameter(self.experts_w13[E])
            self.shared_down = nn.Parameter(self.experts_w2[E])
        else:
            self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))
            self.w2 = nn.Parameter(torch.empty(E, H, I))
            self.shared_gate_up = nn.Parameter(torch.empty(2 * S, H))
            self.shared_down = nn.Parameter(torch.empty(H, S))
        self.shared_expert_gate = nn.Parameter(self.router[E : E + 1])  # last, in the checkpoint's order

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts of each token and their renormalised softmax weights, then (when folded)
        the shared expert, id E, with its sigmoid gate: [T, K(+1)] each."""
        logits = F.linear(x, self.router)[:, : self.num_experts + int(self.shared_folded)]
        return ops.route_topk(logits, self.num_experts, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the weighted expert rows of each token, [T, P, H], for the next
        `add_rms_norm` to sum: the routed experts' and the shared expert's."""
        if self.gate.data_ptr() != self.router.data_ptr():
            raise RuntimeError("SparseMoe: parameters no longer alias their stacks (moved after init?)")
        if self.shared_folded:
            logits = linear.router_logits(x, self.router)[..., : self.num_experts + 1]
            w13, w2 = self.experts_w13, self.experts_w2
            return routed_moe(x, logits, w13, w2, self.num_experts, self.top_k, reduce=False)
        weights, ids = self.route(x)
        routed = fused_moe(x, self.w13, self.w2, weights, ids, reduce=False)
        gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
        shared = F.linear(F.silu(gate) * up, self.shared_down)
        shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        return torch.cat([routed, shared[:, None]], dim=1)
