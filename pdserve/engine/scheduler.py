"""Continuous batching over the KV page pool and the GDN state pool.

Each step:
  1. every running sequence gets its next tokens, decoding ones first (1 each), then chunked
     prefills (the rest of the prompt, up to the token budget, or past it by a short tail),
     growing its block table; when pages run out the running sequence cheapest to recompute is
     preempted (its memory freed, recomputed later);
  2. waiting sequences are admitted in order while the budget, `max_num_seqs`, state slots and
     pages allow: several prompts share one packed pass, a long prompt is chunked. With a
     prefix cache, an admitted prompt starts after its longest cached prefix, and the pass
     crossing one of its checkpoint positions (`pdserve.engine.checkpoint_plan`) saves its GDN
     state there, into a checkpoint reserved when it is scheduled; a request that ends
     (finished, released, aborted) with its whole prompt in its state leaves its slot and
     pages to the cache as an entry (no copy); cache entries are evicted before anything
     running is preempted, for pages and for state slots (a checkpoint is a state slot).
     Sequences in `fetching` (their prefix pulled from a peer) wait, and later ones pass them,
     as do those waiting one pass for a checkpoint of the prefix they share with a prompt in
     it (`pdserve.engine.burst_sharing`).
A sequence samples a token only in the step that brings it to its last token. Hand-over
states (disaggregated serving: HELD with a lease on the prefill side, RECEIVING on the decode
side) are `pdserve.engine.handover_states.HandoverStates`, a base of `Scheduler`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.burst_sharing import waits_for_sibling
from pdserve.engine.checkpoint_plan import PlannedSave, plan_checkpoints
from pdserve.engine.handover_states import DecodingLease, HandoverStates, HeldLease
from pdserve.engine.prefix_cache import CacheEntry, Lookup, PrefixCache
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.memory import GdnStatePool, KvPagePool

TAIL_SHARE = 16  # a pass may take a short prompt's tail of up to 1/16 of the budget past it


def longest_chunk(budget: int) -> int:
    """The most new tokens one sequence computes in a pass at a token budget (a tail past it)."""
    return budget + budget // TAIL_SHARE


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    saves: list[PlannedSave] = field(default_factory=list)  # checkpoints taken inside this pass

    @property
    def samples(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler(HandoverStates):
    def __init__(
        self,
        kv_pool: KvPagePool,
        state_pool: GdnStatePool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_cache: PrefixCache | None = None,
        lease_ttl_s: float = 60.0,
    ) -> None:
        self.prefix_cache = prefix_cache
        self.lease_ttl_s = lease_ttl_s
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, HeldLease] = {}
        self.decoding: dict[str, DecodingLease] = {}
        self.receiving: dict[str, Sequence] = {}
        # waiting sequences whose cached prefix is being pulled from a peer: not admitted yet
        self.fetching: dict[str, Sequence] = {}
        self._plans: dict[Sequence, list[tuple[int, str]]] = {}  # checkpoints still to save

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _num_active(self) -> int:
        return len(self.running) + len(self.receiving)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        # decoding sequences first (a token each), then chunks of prompts still prefilling: a long
        # prompt never holds the decode batch back (one in a background pass sits out, no victim)
        order = sorted(
            (s for s in self.running if not s.in_background),
            key=lambda s: s.num_tokens - s.num_computed_tokens > 1,
        )
        # a prompt too long to end in this step yields to waiting prompts that end in it: a short
        # request arriving during a 262K-token prefill starts at once, the long one takes the rest
        long = []
        if self.waiting:  # what the decoding rows leave: one token each
            room = budget - sum(s.num_tokens - s.num_computed_tokens == 1 for s in order)
            rests = {s: s.num_tokens - s.num_computed_tokens for s in order}
            long = [s for s in order if rests[s] > room and not self._takes_tail(rests[s], room)]
        budget = self._schedule_running([s for s in order if s not in long], budget, batch)
        budget = self._admit_waiting(budget, batch, whole_only=bool(long))
        self._schedule_running(long, budget, batch)
        return batch

    def _schedule_running(self, order: list[Sequence], budget: int, batch: list[ScheduledSeq]) -> int:
        """Each of `order` its next tokens (preempting the cheapest to recompute of those not yet
        given theirs when pages run out; `order` is the caller's to give up); the budget left."""
        i = 0
        while i < len(order) and budget > 0:
            seq = order[i]
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            if not self._grow(seq, n):
                # the cheapest to recompute among those not yet in this batch
                victim = min(order[i:], key=lambda s: (s.num_computed_tokens, -order.index(s)))
                self.preempt(victim)
                order.remove(victim)
                if victim is seq:
                    break
                continue
            batch.append(self._with_saves(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, budget: int, batch: list[ScheduledSeq], whole_only: bool) -> int:
        """Admit waiting sequences in order while the budget, slots and pages allow (`whole_only`:
        only while each one's prompt ends in this step); the budget left."""
        for seq in list(self.waiting):  # in order, past those whose prefix is still being fetched
            if budget <= 0 or self._num_active() >= self.max_num_seqs:
                break
            if seq.request_id in self.fetching:
                continue
            lookup = self._lookup(seq)
            cached = lookup.entry if lookup else None
            if (
                lookup is not None
                and not seq.waited_for_sibling
                and not seq.output_token_ids  # preempted: its turn, as before
                and waits_for_sibling(self.prefix_cache, seq, cached.num_tokens if cached else 0, batch)
            ):
                seq.waited_for_sibling = True  # once: it never waits again
                continue  # a prompt in this pass leaves a checkpoint of what they share
            start = cached.num_tokens if cached else seq.num_computed_tokens
            rest = seq.num_tokens - start
            if whole_only and rest > budget and not self._takes_tail(rest, budget):
                break
            if not self._free_slot(keep=cached):
                break
            self._plan_checkpoints(seq, start, lookup)
            n = self._chunk(seq, start, budget)
            held = self.prefix_cache.pages_to_share(cached) if cached else len(seq.block_table)
            if not self._make_room(self.kv_pool.pages_for(start + n) - held, keep=cached):
                break
            self.waiting.remove(seq)
            seq.state_slot = self.state_pool.allocate()
            if cached:
                self.prefix_cache.restore(cached, seq)
            elif lookup is not None:
                self.prefix_cache.stats.miss(lookup.reason)
            self._grow(seq, n)
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            self.running.append(seq)
            batch.append(self._with_saves(seq, start, n))
            budget -= n
        return budget

    def _lookup(self, seq: Sequence) -> Lookup | None:
        """What the prefix cache holds of a prompt about to start from scratch (None: no cache,
        or a request that must compute every position)."""
        if self.prefix_cache is None or seq.num_computed_tokens or getattr(seq, "skip_prefix_cache", False):
            return None
        return self.prefix_cache.lookup(seq)

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """How many tokens `seq` computes this step, from token `start` (planned checkpoints do
        not cut a chunk: the pass saves them on its way, `_with_saves`), the tail past the budget
        too when it is short (`_takes_tail`)."""
        rest = seq.num_tokens - start
        return rest if self._takes_tail(rest, budget) else min(rest, budget)

    def _takes_tail(self, rest: int, budget: int) -> bool:
        """Whether a prompt's last `rest` tokens go in this step though only `budget` are left:
        when the tail past it is at most 1/16 of the budget (TAIL_SHARE). A tail left for
        later costs a pass of its own, and a pass of a few hundred tokens costs nearly what one
        of thousands does (it reads every expert's weights, ~15 ms on the H200): a c=32 wave of
        1,034-token chat prompts took five passes, the fifth for 365 tokens in 54-62 ms with
        every stream waiting; an 8,202-token prompt took a pass and then one of 10 tokens."""
        return budget < rest <= budget + self.max_num_batched_tokens // TAIL_SHARE

    def _with_saves(self, seq: Sequence, start: int, n: int) -> ScheduledSeq:
        """`seq`'s chunk of `n` tokens from `start`, with a checkpoint reserved for each planned
        position strictly inside it (one the cache declines is skipped, as a copy would be)."""
        item = ScheduledSeq(seq, n)
        plan = self._plans.get(seq)
        while plan and plan[0][0] < start + n:  # every position left lies past `start`
            position, kind = plan.pop(0)
            checkpoint = self.prefix_cache.reserve_save(seq, position, kind)
            if checkpoint is not None:
                item.saves.append(PlannedSave(position, checkpoint, kind))
        return item

    def _plan_checkpoints(self, seq: Sequence, start: int, lookup: Lookup | None) -> None:
        plan = [] if self.prefix_cache is None else plan_checkpoints(self.prefix_cache, seq, start, lookup)
        self._plans[seq] = plan

    def make_room(self, pages: int) -> bool:
        """True once `pages` pages and a state slot are free (evicting cache entries if need be)."""
        return self._make_room(pages) and self._free_slot()

    def _free_slot(self, keep: CacheEntry | None = None) -> bool:
        """True once a state slot is free, evicting a checkpoint entry (but `keep`) if need be."""
        cache = self.prefix_cache
        while self.state_pool.num_free == 0 and cache is not None and cache.checkpoints.num_used:
            if not cache.evict_one(keep, to_host=True):
                break
        return self.state_pool.num_free > 0

    def _make_room(self, pages: int, keep: CacheEntry | None = None) -> bool:
        """True once `pages` pages are free, evicting prefix-cache entries (but `keep`) if need be."""
        cache = self.prefix_cache
        while pages > self.kv_pool.num_free and cache is not None and cache.evict_one(keep, to_host=True):
            pass
        return pages <= self.kv_pool.num_free

    def reached_checkpoint(self, item: ScheduledSeq) -> None:
        """Called after each pass: make the entries of the checkpoints the pass took inside the
        chunk, and save the checkpoint of a sequence that just reached a planned position, or
        whose prefill chunk the token budget ended before its prompt's end."""
        seq, cache = item.seq, self.prefix_cache
        n = seq.num_computed_tokens
        if cache is None:
            return
        for save in item.saves:
            cache.commit_save(seq, save.position, save.checkpoint, save.kind)
        plan = self._plans.get(seq)
        if plan and plan[0][0] == n:  # the chunk ended on a planned position: copy the slot
            _, kind = plan.pop(0)
            cache.save(seq, kind)
        elif 0 < n < seq.num_prompt_tokens:
            cache.save(seq, "chunk")

    def abandon(self, scheduled: list[ScheduledSeq]) -> None:
        """A pass that failed before it ran: free the checkpoints reserved inside its chunks."""
        for item in scheduled:
            for save in item.saves:
                self.prefix_cache.checkpoints.free(save.checkpoint)
            item.saves.clear()

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
        self._release(seq, keep_entry=False)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """End `seq` wherever it is and free its memory (the prefix cache may keep it: a request
        whose whole prompt is in its state leaves an entry of every token it computed)."""
        clean = seq.status in (SequenceStatus.RUNNING, SequenceStatus.HELD)
        self.fetching.pop(seq.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.receiving.pop(seq.request_id, None)
        held = self.held.get(seq.request_id)
        if held is not None and held.seq is seq:
            del self.held[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        self._release(seq, keep_entry=clean)

    def _release(self, seq: Sequence, keep_entry: bool) -> None:
        self._plans.pop(seq, None)
        cache = self.prefix_cache
        if keep_entry and cache is not None and seq.state_slot is not None:
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                cache.adopt(seq, "decode" if seq.num_computed_tokens > seq.num_prompt_tokens else "end")
        self.kv_pool.free(seq.block_table)
        seq.block_table = []
        if seq.state_slot is not None:
            self.state_pool.free(seq.state_slot)
            seq.state_slot = None
