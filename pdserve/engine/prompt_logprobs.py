"""Prompt logprobs: each prompt token's log-probability given the tokens before it (vLLM's
`prompt_logprobs`), computed inside the prefill passes.

A sequence whose params ask (`prompt_logprobs` = n) keeps `seq.prompt_logprobs`, a list with one
entry per prompt token: None for the first (nothing predicts it), then
`{"token_id", "logprob", "rank", "top_logprobs": {id: logprob}}` with the n most likely tokens.
Chunked prefill spreads a prompt over several passes: each pass scores the positions of its chunk
whose next token is a prompt token (the last prompt position predicts the first output token,
which the sampler covers) and appends them. The logits of those rows are computed from the hidden
states of the pass in slices (a long chunk's `[rows, vocab]` fp32 logits would not fit at once),
log-softmaxed in fp32; only the sequences that ask pay for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence

ROWS_PER_SLICE = 256  # logits of this many rows at once: 256 x 248K fp32 = 250 MB on the full model


@dataclass(slots=True)
class PromptRows:
    """Rows `[offset, offset + count)` of a packed pass: positions `first ...` of `seq`'s prompt,
    each scored against the prompt token after it."""

    seq: Sequence
    offset: int
    first: int
    count: int

    def targets(self) -> list[int]:
        return self.seq.prompt_token_ids[self.first + 1 : self.first + 1 + self.count]


def plan_prompt_rows(scheduled: list[ScheduledSeq]) -> list[PromptRows]:
    """The rows of this pass that some sequence's prompt logprobs need (none: an empty list)."""
    rows, offset = [], 0
    for s in scheduled:
        seq = s.seq
        if seq.prompt_logprobs is not None:
            start = seq.num_computed_tokens
            scored = len(seq.prompt_logprobs) - 1  # positions done (a preempted sequence recomputes)
            end = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
            if end > scored:
                if start > scored:
                    raise RuntimeError(
                        f"request {seq.request_id}: prompt logprobs need position {scored}, but the "
                        f"pass starts at {start} (a prefix-cache hit must be skipped for such requests)"
                    )
                rows.append(PromptRows(seq, offset + scored - start, scored, end - scored))
        offset += s.num_new_tokens
    return rows


@torch.inference_mode()
def score_prompt_rows(
    hidden: torch.Tensor, rows: list[PromptRows], compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Append the entries of `rows` (from this pass's `hidden` [T, H]) to their sequences."""
    device = hidden.device
    index = torch.cat([torch.arange(r.offset, r.offset + r.count, device=device) for r in rows])
    targets = torch.tensor([t for r in rows for t in r.targets()], dtype=torch.int64, device=device)
    n = max(r.seq.params.prompt_logprobs for r in rows)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for lo in range(0, index.numel(), ROWS_PER_SLICE):
        logprobs = compute_logits(hidden[index[lo : lo + ROWS_PER_SLICE]]).float().log_softmax(dim=-1)
        own = logprobs.gather(1, targets[lo : lo + ROWS_PER_SLICE, None])
        chosen.append(own.squeeze(1))
        ranks.append((logprobs > own).sum(dim=1) + 1)  # vLLM's rank: 1 + tokens more likely
        values, ids = logprobs.topk(n, dim=-1)
        top_values.append(values)
        top_ids.append(ids)
    # one host synchronisation for the whole pass
    chosen_l, ranks_l = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
    values_l, ids_l = torch.cat(top_values).tolist(), torch.cat(top_ids).tolist()
    i = 0
    for r in rows:
        k = r.seq.params.prompt_logprobs
        for token in r.targets():
            r.seq.prompt_logprobs.append(
                {
                    "token_id": token,
                    "logprob": chosen_l[i],
                    "rank": ranks_l[i],
                    "top_logprobs": dict(zip(ids_l[i][:k], values_l[i][:k], strict=True)),
                }
            )
            i += 1
