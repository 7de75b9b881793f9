"""Shared building blocks: zero-centred RMSNorm (with the residual add), gated RMSNorm, the rotary
tables. Each forward is one op of `pdserve.ops` (one kernel on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from pdserve import ops


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: `norm(x) * (1 + w)`, computed in fp32.

    With a residual, the sublayer output `x` ([T, D], or [T, P, D] parts summed first) is added to
    the residual stream before the norm: returns (normed, new residual), as in vLLM's fused norm.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain weight, not zero-centred) followed by a SiLU gate: `w * norm(x) * silu(z)`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [T, H, D] -> [T, H * D]."""
        return ops.gated_rms_norm(x, gate, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables (fp32, [max_positions, rotary_dim], rotate-half layout) of the rotary embedding
    on the first `rotary_dim` channels of each head; `pdserve.ops.qk_norm_rope_store` applies them.

    Text-only inputs give the three multimodal position streams the same value, so the
    interleaved M-RoPE of Qwen3.5 reduces to ordinary RoPE.
    """

    def __init__(self, rotary_dim: int, base: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.rotary_dim = rotary_dim
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)
