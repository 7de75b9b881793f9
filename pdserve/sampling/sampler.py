"""Batched sampling of one next token for each of B requests.

One step, on the logits' device, with per-request knobs gathered into [B] tensors once
(`SamplingTensors.from_requests`) so that no stage loops over requests:

  1. constraints (pdserve.sampling.constraints): grammar bitmasks of the structured rows,
     allowed_token_ids, logit_bias
  2. penalties: repetition (prompt + output tokens, vLLM/HF), presence and frequency
     (output tokens only, OpenAI's formula); then min_tokens masks eos and stop_token_ids
  3. logprobs come from the RAW logits (before steps 1-2), as vLLM returns them by default
  4. greedy rows (temperature 0) take the argmax of the constrained, penalised logits
  5. the other rows: temperature -> min-p -> top-k -> top-p -> a draw from the probabilities;
     min-p before top-k/top-p as vLLM orders them: with probabilities [.4, .3, .2, .1], min_p
     .3 and top_p .75 keep tokens 0 and 1 only. On a GPU the draw is the exponential race
     (argmax of probs / q with q ~ Exp(1)), as vLLM's; on a CPU, where an exponential for each
     of the 248k vocabulary entries cost more than the model's step (117 ms for 16 rows, half
     of a served tiny model's engine time), the inverse CDF: one uniform a row, searched in the
     float64 cumulative sum. Both draw exactly from the probabilities.

The only per-request loop is the draw for seeded rows: each uses its own `torch.Generator`,
kept by the caller in its `SamplingState` across steps, so a seeded request samples the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from pdserve.pinned import to_device
from pdserve.sampling.constraints import apply_constraints
from pdserve.sampling.filters import apply_min_p, apply_penalties, apply_top_k_top_p
from pdserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    from pdserve.sampling.grammar import RequestGrammar

__all__ = ["Sampler", "SamplerOutput", "SamplingState", "SamplingTensors", "apply_min_p", "apply_penalties",
           "apply_top_k_top_p", "make_generator", "replay_draws"]  # fmt: skip


def replay_draws(state: SamplingState, vocab_size: int, num_tokens: int, device: torch.device | str) -> None:
    """Advance a seeded request's generator past the draws of `num_tokens` tokens sampled
    elsewhere (a prefill instance), so it continues the random stream one process would have."""
    if state.generator is None or state.params.greedy:
        return
    for _ in range(num_tokens):
        if torch.device(device).type == "cpu":
            torch.rand(1, dtype=torch.float64, generator=state.generator)  # as _draw_inverse_cdf
        else:
            torch.empty(vocab_size, dtype=torch.float32, device=device).exponential_(
                generator=state.generator
            )


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`: one per seeded request, created once."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs to know about one request at one step.

    `output_token_ids` is the caller's list and grows as the request runs; `generator` is
    set (on the logits' device) exactly when `params.seed` is, and must live as long as the
    request does. A structured request's grammar matcher is made on its first step.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    generator: torch.Generator | None = None
    _prompt_ids: Tensor | None = field(default=None, init=False, repr=False)  # made once, on the device
    _grammar: RequestGrammar | None = field(default=None, init=False, repr=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        eos_token_ids: Sequence[int] = (),
        device: torch.device | str = "cpu",
    ) -> SamplingState:
        generator = None if params.seed is None else make_generator(params.seed, device)
        return cls(params, prompt_token_ids, [], tuple(eos_token_ids), generator)

    def prompt_ids_on(self, device: torch.device) -> Tensor:
        """The prompt as an int64 tensor on `device`, copied there once per request."""
        if self._prompt_ids is None or self._prompt_ids.device != device:
            self._prompt_ids = to_device(self.prompt_token_ids, torch.long, device)
        return self._prompt_ids

    def output_grammar(self) -> RequestGrammar | None:
        """The matcher of a structured request (made on first use), else None."""
        if self._grammar is None and self.params.structured_outputs is not None:
            from pdserve.sampling.grammar import RequestGrammar

            self._grammar = RequestGrammar(self.params, self.prompt_token_ids, self.eos_token_ids)
        return self._grammar

    def min_tokens_blocked_ids(self) -> list[int]:
        """Token ids that may not be sampled yet: stop tokens while min_tokens is unmet."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return []
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return [*eos, *self.params.stop_token_ids]


def _token_histograms(
    requests: Sequence[SamplingState], vocab_size: int, device: torch.device, with_prompt: bool
) -> tuple[Tensor, Tensor | None]:
    """[R, V] fp32 counts of each output token of the R penalised `requests`, and (if asked) an
    [R, V] bool mask of their prompt tokens.

    The output lists grow every step, so they go over as one flat array of row * V + token
    (numpy reads the lists several times faster than torch.tensor reads nested ones); prompts
    are copied to the device once per request and padded with the id V, an extra column. A
    penalised request never holds a PENDING token: a step with one does not run ahead
    (pdserve.engine.run_ahead), so every token counted here is known."""
    outputs = [r.output_token_ids for r in requests]
    lengths = [len(o) for o in outputs]
    tokens = np.fromiter(itertools.chain.from_iterable(outputs), dtype=np.int64, count=sum(lengths))
    flat = np.repeat(np.arange(len(outputs), dtype=np.int64) * vocab_size, lengths) + tokens
    counts = torch.zeros(len(requests) * vocab_size, device=device)
    flat_index = torch.from_numpy(flat).to(device)
    counts = counts.index_add_(0, flat_index, torch.ones_like(flat_index, dtype=counts.dtype))
    counts = counts.view(len(requests), vocab_size)
    if not with_prompt:
        return counts, None
    prompts = [r.prompt_ids_on(device) for r in requests]
    prompts = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True, padding_value=vocab_size)
    prompt_mask = torch.zeros(len(requests), vocab_size + 1, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, prompts, True)
    return counts, prompt_mask[:, :vocab_size]


def _blocked_tokens(
    requests: Sequence[SamplingState], vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """(rows, token ids) of the stop tokens that min_tokens forbids this step, or None."""
    pairs = [(i, t) for i, r in enumerate(requests) for t in r.min_tokens_blocked_ids()]
    if not pairs:
        return None
    if any(t >= vocab_size for _, t in pairs):
        raise ValueError(f"an eos or stop token id is outside the vocabulary of {vocab_size}")
    return to_device(pairs, torch.long, device).unbind(1)


@dataclass(slots=True)
class SamplingTensors:
    """Per-row knobs of one step as [B] tensors; a knob no row uses is None (its stage is skipped)."""

    temperature: Tensor  # [B] fp32; 1.0 on greedy rows so that dividing is harmless
    greedy: Tensor  # [B] bool
    all_greedy: bool
    top_k: Tensor | None  # [B] int64 in [1, V]; V where off
    max_top_k: int  # the largest k of the sampled rows (V when one of them has top-k off)
    top_p: Tensor | None  # [B] fp32; 1.0 where off
    min_p: Tensor | None  # [B] fp32; 0.0 where off
    # penalties: only the R rows that ask for one (a batch of 32 with one penalised request
    # counts one row's tokens, not 32 x V)
    penalty_rows: Tensor | None  # [R] int64: the rows with a penalty
    penalties: Tensor | None  # [R, 3] fp32: repetition, presence, frequency
    output_counts: Tensor | None  # [R, V] fp32: occurrences of each token in the output
    prompt_mask: Tensor | None  # [R, V] bool: tokens present in the prompt
    blocked: tuple[Tensor, Tensor] | None  # (rows, token ids) masked to -inf for min_tokens
    seeded: list[tuple[int, torch.Generator]]  # non-greedy rows with their own generator
    max_num_logprobs: int | None  # largest `logprobs` asked for; None when no row asks

    @classmethod
    def from_requests(
        cls, requests: Sequence[SamplingState], vocab_size: int, device: torch.device
    ) -> SamplingTensors:
        ps = [r.params for r in requests]

        def column(values: list, dtype: torch.dtype) -> Tensor:
            return to_device(values, dtype, device)

        def k_of(p: SamplingParams) -> int:
            return vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)

        # Greedy rows get neutral filter knobs: what the random path draws for them is discarded.
        max_top_k = max((k_of(p) for p in ps if not p.greedy), default=vocab_size)
        top_k = [max_top_k if p.greedy else k_of(p) for p in ps]
        top_p = [1.0 if p.greedy else p.top_p for p in ps]
        min_p = [0.0 if p.greedy else p.min_p for p in ps]
        penalties = [(p.repetition_penalty, p.presence_penalty, p.frequency_penalty) for p in ps]
        rows = [i for i, pen in enumerate(penalties) if pen != (1.0, 0.0, 0.0)]
        counts = prompt_mask = None
        if rows:
            with_prompt = any(ps[i].repetition_penalty != 1.0 for i in rows)
            penalised = [requests[i] for i in rows]
            counts, prompt_mask = _token_histograms(penalised, vocab_size, device, with_prompt)
        asked = [p.logprobs for p in ps if p.logprobs is not None]
        return cls(
            temperature=column([1.0 if p.greedy else p.temperature for p in ps], torch.float32),
            greedy=column([p.greedy for p in ps], torch.bool),
            all_greedy=all(p.greedy for p in ps),
            top_k=column(top_k, torch.long) if min(top_k, default=vocab_size) < vocab_size else None,
            max_top_k=max_top_k,
            # a top_p below fp32's smallest normal would round to 0 and keep nothing: keep the top token
            top_p=column(top_p, torch.float32).clamp_(min=torch.finfo(torch.float32).tiny)
            if min(top_p, default=1.0) < 1.0
            else None,
            min_p=column(min_p, torch.float32) if max(min_p, default=0.0) > 0.0 else None,
            penalty_rows=column(rows, torch.long) if rows else None,
            penalties=column([penalties[i] for i in rows], torch.float32) if rows else None,
            output_counts=counts,
            prompt_mask=prompt_mask,
            blocked=_blocked_tokens(requests, vocab_size, device),
            seeded=[
                (i, r.generator)
                for i, r in enumerate(requests)
                if r.generator is not None and not r.params.greedy
            ],
            max_num_logprobs=max(asked) if asked else None,
        )


@dataclass(slots=True)
class SamplerOutput:
    """One step's result. The logprob fields are None unless some request asked for logprobs."""

    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None = None  # [B] fp32: raw log-probability of the chosen token
    top_token_ids: Tensor | None = None  # [B, max_n] int64, most likely first
    top_logprobs: Tensor | None = None  # [B, max_n] fp32, descending


class Sampler:
    """Picks one next token per row of a [B, V] logits tensor (fp32 or bf16, any device)."""

    def sample(self, logits: Tensor, requests: Sequence[SamplingState]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [B, V] with B = {len(requests)} requests, got {tuple(logits.shape)}"
            )
        t = SamplingTensors.from_requests(requests, logits.shape[1], logits.device)
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = None if t.max_num_logprobs is None else logits.log_softmax(dim=-1)
        logits = apply_penalties(apply_constraints(logits, requests), t)
        if t.blocked is not None:
            logits[t.blocked] = float("-inf")
        token_ids = logits.argmax(dim=-1)
        if not t.all_greedy:
            token_ids = torch.where(t.greedy, token_ids, self._sample_random(logits, t))
        if raw_logprobs is None or t.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        top_logprobs, top_token_ids = raw_logprobs.topk(t.max_num_logprobs, dim=-1)
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return SamplerOutput(token_ids, chosen, top_token_ids, top_logprobs)

    @staticmethod
    def _sample_random(logits: Tensor, t: SamplingTensors) -> Tensor:
        logits = apply_min_p(logits / t.temperature.unsqueeze(1), t.min_p)
        probs = apply_top_k_top_p(logits, t.top_k, t.top_p, t.max_top_k).softmax(dim=-1)
        if probs.device.type == "cpu":
            return _draw_inverse_cdf(probs, t.seeded)
        q = torch.empty_like(probs)
        if len(t.seeded) < q.shape[0]:
            q.exponential_()
        for row, generator in t.seeded:
            q[row].exponential_(generator=generator)
        # An exact 0 draw would make 0/0 = NaN, which argmax takes for the largest value.
        return probs.div_(q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def _draw_inverse_cdf(probs: Tensor, seeded: list[tuple[int, torch.Generator]]) -> Tensor:
    """A token of each row drawn from `probs` [B, V] by its inverse CDF: the first token whose
    cumulative probability exceeds u * total, u ~ U[0, 1) (a seeded row's from its generator).
    A token of probability 0 is never drawn (the sum does not grow there)."""
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64)
    for row, generator in seeded:
        u[row] = torch.rand(1, dtype=torch.float64, generator=generator)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return drawn.clamp_(max=probs.shape[1] - 1).squeeze(1)
