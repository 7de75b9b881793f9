"""Where a prompt saves prefix-cache checkpoints while it is prefilled (docs/prefix-cache.md).

Positions, each with the kind of entry it makes:
  - "boundary": the prompt's last block boundary (moved back a block inside its last tokens);
  - "branch": the longest block boundary the prompt shares with cached entries that have no
    checkpoint there (Marconi's branch point: the next prompt sharing it will find one);
  - "resume": where the generation prompt starts that the next turn does not repeat;
  - "end": the prompt's exact end, for a request that decodes here (a request handed over
    keeps its slot until the decode side has read it; the slot itself then becomes the entry).
A prefill chunk stops at each position so the state can be copied there (`Scheduler._chunk`).
"""

from __future__ import annotations

from pdserve.engine.prefix_cache import Lookup, PrefixCache
from pdserve.engine.sequence import Sequence


def plan_checkpoints(
    cache: PrefixCache, seq: Sequence, start: int, lookup: Lookup | None
) -> list[tuple[int, str]]:
    """(position, kind) after `start`, in order; one kind per position (the later rule wins)."""
    n = seq.num_prompt_tokens
    wanted = {cache.checkpoint_boundary(n): "boundary"}
    if lookup is not None and 0 < lookup.shared_tokens < n:
        wanted[lookup.shared_tokens] = "branch"
    wanted[cache.resume_point(seq.prompt_token_ids)] = "resume"
    if not seq.handoff:
        wanted[n] = "end"
    return sorted((pos, kind) for pos, kind in wanted.items() if pos > start)
