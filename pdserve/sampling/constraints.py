"""What may be sampled next, before any penalty or filter: grammars, allowed tokens, logit bias.

Applied by the sampler to its fp32 copy of a step's logits [B, V], in this order (vLLM's):
  1. structured outputs: the rows whose grammar is active get one batched bitmask
     (pdserve.sampling.grammar); the other rows are not touched
  2. allowed_token_ids: every other token of the row -> -inf
  3. logit_bias: the bias added to each listed token's logit (OpenAI's; ids beyond the
     logits' width are left out: the router and the engine refuse them first)
Each stage costs nothing when no row of the batch uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pdserve.sampling.sampler import SamplingState


def apply_grammar_masks(logits: Tensor, requests: Sequence[SamplingState]) -> None:
    """Stage 1, in place: each constrained row first catches up on the tokens it got."""
    rows, grammars = [], []
    for i, state in enumerate(requests):
        grammar = state.output_grammar()
        if grammar is None:
            continue
        grammar.advance(state.output_token_ids)
        if grammar.active:
            rows.append(i)
            grammars.append(grammar)
    if rows:
        from pdserve.sampling.grammar import apply_grammars

        apply_grammars(logits, rows, grammars)


def apply_allowed_token_ids(logits: Tensor, requests: Sequence[SamplingState]) -> None:
    """Stage 2, in place."""
    rows = [i for i, state in enumerate(requests) if state.params.allowed_token_ids is not None]
    if not rows:
        return
    vocab_size = logits.shape[1]
    pairs = [
        (j, t)
        for j, i in enumerate(rows)
        for t in requests[i].params.allowed_token_ids or ()
        if t < vocab_size
    ]
    keep = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=logits.device)
    if pairs:
        keep[torch.tensor(pairs, dtype=torch.long, device=logits.device).unbind(1)] = True
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def apply_logit_bias(logits: Tensor, requests: Sequence[SamplingState]) -> None:
    """Stage 3, in place."""
    vocab_size = logits.shape[1]
    rows, ids, values = [], [], []
    for i, state in enumerate(requests):
        for token, bias in (state.params.logit_bias or {}).items():
            if token < vocab_size:
                rows.append(i)
                ids.append(token)
                values.append(bias)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device))
        logits.index_put_(
            index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True
        )


def apply_constraints(logits: Tensor, requests: Sequence[SamplingState]) -> Tensor:
    """Stages 1-3 on `logits` (the sampler's own copy, changed in place and returned)."""
    apply_grammar_masks(logits, requests)
    apply_allowed_token_ids(logits, requests)
    apply_logit_bias(logits, requests)
    return logits
