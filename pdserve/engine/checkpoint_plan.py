"""Where a prompt saves prefix-cache checkpoints while it is prefilled (docs/prefix-cache.md).

Planned positions, each with the kind of entry it makes. A prefill chunk does not stop at
them: the pass that crosses one saves the state there on its way (`PlannedSave`,
`pdserve.model.mid_pass_saves`); one that ends there copies its slot after the pass:
  - "resume": where the generation prompt starts that a chat's next turn does not repeat
    (`pdserve.engine.resume_points`): that turn reuses everything before it;
  - "branch": how far the prompt runs along what the cache already holds without finding a
    checkpoint (a sibling of a cached prompt, or the same prompt again): the next prompt that
    shares it finds one (Marconi's branch points);
  - "end": the prompt's exact end, for a request that decodes here (a request handed over
    keeps its slot until the decode side has read it; the slot itself then becomes the entry),
    unless a resume point is within `NEAR_TOKENS` of it (a prompt extending this one reuses
    that and recomputes the few tokens between: a slot saved).
Unplanned, and free of an extra pass: where a chunk ends because the step's token budget does
("chunk", `Scheduler.reached_checkpoint`). No position is forced on a block boundary: a split
there would cost every prompt a pass for a sibling that may never come.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.prefix_cache import NEAR_TOKENS, Lookup, PrefixCache
from pdserve.engine.sequence import Sequence


@dataclass(slots=True, frozen=True)
class PlannedSave:
    """A checkpoint reserved for the state after `position` tokens, which the pass crossing that
    position fills; the entry is made after the pass (`PrefixCache.commit_save`)."""

    position: int
    checkpoint: int
    kind: str


def plan_checkpoints(
    cache: PrefixCache, seq: Sequence, start: int, lookup: Lookup | None
) -> list[tuple[int, str]]:
    """(position, kind) after `start`, in order; one kind per position (the later rule wins)."""
    n = seq.num_prompt_tokens
    resume = cache.resume_point(seq.prompt_token_ids)
    wanted = {resume: "resume"}
    if lookup is not None and 0 < lookup.shared_tokens < n:
        wanted[lookup.shared_tokens] = "branch"
    if not seq.handoff and not (resume and n - resume <= NEAR_TOKENS):
        wanted[n] = "end"
    return sorted((pos, kind) for pos, kind in wanted.items() if pos > start)
