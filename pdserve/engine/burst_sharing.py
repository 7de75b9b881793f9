"""Prompts of one burst that share a long prefix: compute it once, not once each.

A burst of requests with one system prompt (an agent's, a conversation benchmark's first turn)
reaches the scheduler before any of them is cached, so each would compute the shared prefix in
the same pass. Instead, a waiting prompt that shares at least MIN_SHARED_TOKENS more with a
prompt prefilling in this pass than the cache holds for it waits one pass, once, and that pass
leaves a "branch" checkpoint reserved inside the sibling's chunk where the two part: next step
its lookup restores it and it computes only its own tail. SGLang's scheduler does the like
("in-batch prefix caching"). The wait costs the prompt one pass; it is taken only where it saves
at least MIN_SHARED_TOKENS of compute, and never by a preempted sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.checkpoint_plan import PlannedSave
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from pdserve.engine.scheduler import ScheduledSeq

MIN_SHARED_TOKENS = 256


def waits_for_sibling(cache: PrefixCache, seq: Sequence, have: int, batch: list[ScheduledSeq]) -> bool:
    """True when `seq` (the cache holds its first `have` tokens) should wait for a checkpoint that
    a prompt prefilling in `batch` leaves this pass (reserved here)."""
    block = cache.block_size
    mine = cache.seq_block_keys(seq, seq.num_prompt_tokens - 1)
    if len(mine) * block - have < MIN_SHARED_TOKENS:
        return False
    for item in batch:
        sibling, n = item.seq, item.num_new_tokens
        start = sibling.num_computed_tokens
        end = min(start + n, sibling.num_prompt_tokens)
        if n <= 1 or sibling is seq or end - have <= MIN_SHARED_TOKENS:
            continue  # a decode row, or too little of a prompt in this pass
        theirs = cache.seq_block_keys(sibling, end - 1)  # blocks that end inside the chunk
        point = _common_prefix(mine, theirs) * block
        if point <= start or point - have < MIN_SHARED_TOKENS:
            continue
        if any(save.position == point for save in item.saves) or _reserve(cache, item, point):
            return True
    return False


def _reserve(cache: PrefixCache, item: ScheduledSeq, point: int) -> bool:
    """A "branch" checkpoint inside `item`'s chunk at `point`; False when the cache declines."""
    checkpoint = cache.reserve_save(item.seq, point, "branch")
    if checkpoint is None:
        return False
    item.saves.append(PlannedSave(point, checkpoint, "branch"))
    item.saves.sort(key=lambda save: save.position)
    return True


def _common_prefix(a: list[bytes], b: list[bytes]) -> int:
    """How many leading block keys `a` and `b` share. Keys are chained (each hashes the one before
    it), so a match at block i means every block before matches: a bisection."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; a[high] != b[high] or past the end
    while low < high:
        mid = (low + high + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            low = mid
        else:
            high = mid - 1
    return low
