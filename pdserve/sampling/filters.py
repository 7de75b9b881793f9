"""The logit filters of a sampling step, on [B, V] fp32 logits with per-row knobs (pdserve.sampling.sampler
gathers the knobs into `SamplingTensors`): penalties, min-p, top-k and top-p."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pdserve.sampling.sampler import SamplingTensors


def apply_penalties(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Penalised fp32 `logits` [B, V] (only `t.penalty_rows` change). Repetition divides the
    positive logits of tokens seen in the prompt or output and multiplies the negative ones; then
    logit -= frequency * count + presence * seen over the output tokens (OpenAI's formula)."""
    if t.penalties is None or t.output_counts is None or t.penalty_rows is None:
        return logits
    rows = logits.index_select(0, t.penalty_rows)
    repetition, presence, frequency = (p.unsqueeze(1) for p in t.penalties.unbind(1))
    seen_in_output = t.output_counts > 0
    if t.prompt_mask is not None:
        penalised = torch.where(rows > 0, rows / repetition, rows * repetition)
        rows = torch.where(t.prompt_mask | seen_in_output, penalised, rows)
    rows = rows - frequency * t.output_counts - presence * seen_in_output
    return logits.index_copy(0, t.penalty_rows, rows)


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, max_top_k: int | None = None
) -> Tensor:
    """Masks to -inf the logits below each row's k-th largest value (ties with it stay), then
    those outside its top-p nucleus: a token stays while the tokens strictly more likely than it
    hold less than p of the probability (renormalised over what top-k kept).

    Both filters are thresholds on values, so the result depends neither on how a sort orders
    ties nor on the other rows. `max_top_k` (the largest k, when every row has one) lets the
    thresholds come from torch.topk instead of sorting whole rows.
    """
    if top_k is None and top_p is None:
        return logits
    if max_top_k is not None and max_top_k < logits.shape[1]:
        values = logits.topk(max_top_k, dim=-1).values  # descending
    else:
        values = logits.sort(dim=-1, descending=True).values
    if top_k is None:
        threshold = torch.full_like(values[:, :1], float("-inf"))
    else:
        threshold = values.gather(1, top_k.unsqueeze(1) - 1)
    if top_p is not None:
        row_max = values[:, :1]
        total = torch.where(logits >= threshold, (logits - row_max).exp(), 0.0).sum(dim=-1, keepdim=True)
        probs = torch.where(values >= threshold, (values - row_max).exp(), 0.0) / total
        mass_before = torch.cat([torch.zeros_like(probs[:, :1]), probs[:, :-1].cumsum(dim=-1)], dim=1)
        p = top_p.unsqueeze(1)
        kept = (mass_before < p) | (p >= 1.0)  # a prefix of the sorted values, never empty
        threshold = torch.maximum(threshold, values.gather(1, kept.sum(dim=-1, keepdim=True) - 1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_min_p(logits: Tensor, min_p: Tensor | None) -> Tensor:
    """Masks tokens whose probability is below min_p times the row's largest probability;
    in logit space: logit < max_logit + log(min_p)."""
    if min_p is None:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))
