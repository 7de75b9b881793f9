"""Continuous batching over the KV page pool and the GDN state pool.

Each step:
  1. every running sequence gets its next tokens (decode: 1; a chunked prefill: the rest of its
     prompt, up to the token budget), growing its block table; when pages run out the newest
     running sequence is preempted (its memory freed, recomputed later);
  2. waiting sequences are admitted in order while the budget, `max_num_seqs`, state slots and
     pages allow: several prompts share one packed pass, a long prompt is chunked. With a
     prefix cache, an admitted prompt starts after its longest cached prefix, and a chunk stops
     at the prompt's checkpoint boundary so its GDN state can be saved there; cache entries are
     evicted before anything running is preempted.
A sequence samples a token only in the step that brings it to its last token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.engine.prefix_cache import CacheEntry, PrefixCache
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.memory import GdnStatePool, KvPagePool


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(
        self,
        kv_pool: KvPagePool,
        state_pool: GdnStatePool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.prefix_cache = prefix_cache
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose memory is already filled (a decode instance after a transfer)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            if not self._grow(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
                continue
            batch.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.state_pool.num_free == 0:
                break
            cached = (
                self.prefix_cache.lookup(seq) if self.prefix_cache and seq.num_computed_tokens == 0 else None
            )
            start = cached.num_tokens if cached else seq.num_computed_tokens
            self._plan_checkpoint(seq, start)
            n = self._chunk(seq, start, budget)
            held = len(cached.pages) if cached else len(seq.block_table)
            if not self._make_room(self.kv_pool.pages_for(start + n) - held, keep=cached):
                break
            self.waiting.popleft()
            seq.state_slot = self.state_pool.allocate()
            if cached:
                self.prefix_cache.restore(cached, seq)
            self._grow(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """How many tokens `seq` computes this step, from token `start`."""
        n = min(seq.num_tokens - start, budget)
        if seq.checkpoint_at is not None and start < seq.checkpoint_at:
            n = min(n, seq.checkpoint_at - start)
        return n

    def _plan_checkpoint(self, seq: Sequence, start: int) -> None:
        seq.checkpoint_at = None
        if self.prefix_cache is not None:
            boundary = self.prefix_cache.checkpoint_boundary(seq.num_prompt_tokens)
            seq.checkpoint_at = boundary if boundary > start else None

    def _make_room(self, pages: int, keep: CacheEntry | None = None) -> bool:
        """True once `pages` pages are free, evicting prefix-cache entries (but `keep`) if need be."""
        cache = self.prefix_cache
        while pages > self.kv_pool.num_free and cache is not None and cache.evict_one(keep):
            pass
        return pages <= self.kv_pool.num_free

    def reached_checkpoint(self, seq: Sequence) -> None:
        """Called after each pass: save the prefix checkpoint of a sequence that just reached it."""
        if seq.checkpoint_at is not None and seq.num_computed_tokens == seq.checkpoint_at:
            self.prefix_cache.save(seq)
            seq.checkpoint_at = None

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Give `seq` pages for `n` more tokens; False when the pool cannot."""
        need = self.kv_pool.pages_for(seq.num_computed_tokens + n) - len(seq.block_table)
        if not self._make_room(need):
            return False
        if need > 0:
            seq.block_table.extend(self.kv_pool.allocate(need))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s memory and queue it first; it recomputes its tokens when readmitted."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if not seq.hold_memory:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.kv_pool.free(seq.block_table)
        seq.block_table = []
        if seq.state_slot is not None:
            self.state_pool.free(seq.state_slot)
            seq.state_slot = None

    def release_held(self, seq: Sequence) -> None:
        """Return the memory of a finished sequence that held it for a transfer."""
        seq.hold_memory = False
        self._release(seq)
