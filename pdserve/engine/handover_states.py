"""The hand-over states of disaggregated serving, as methods of `Scheduler` (this is its base).

- prefill side: a `handoff` sequence that sampled its first token becomes HELD: it leaves the
  batch but keeps its pages and slot under a lease (`hold`), until the decode side has READ them
  (`release_lease`), the router gives up, or the lease expires (`expire_leases`; a decode side
  still waiting for memory renews it: `renew_lease`);
- one instance holding both roles: the sequence stays in the batch and decodes on at once under
  a `DecodingLease` (`lease_decoding`); its outputs wait in the lease until the router's decode
  stream claims it (`claim`), so the second token never waits for the round trip through the
  router (a HELD sequence of such an engine is decoded in place by `resume_held`);
- decode side: `reserve` gives a transferred sequence its pages and slot (evicting cache entries
  first, keeping one page of headroom per running sequence), it is RECEIVING while the READ
  runs, then `start_received` makes it RUNNING.

These methods move sequences between the scheduler's batch (`running`) and its `held` and
`receiving` maps, and use its helpers (`finish`, `_num_active`, `_free_slot`, `_make_room`).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.memory import GdnStatePool, KvPagePool


@dataclass(slots=True)
class HeldLease:
    """A HELD sequence's memory, leased to whoever READs it: valid until released or expired."""

    seq: Sequence
    lease_id: str
    expires: float


@dataclass(slots=True)
class DecodingLease(HeldLease):
    """A sequence decoding on after its first token under a lease that the router's decode
    stream claims, with the outputs made before it did (RequestOutputs)."""

    outputs: list[Any] = field(default_factory=list)


class HandoverStates:
    # the scheduler's state these methods read and change (set by `Scheduler.__init__`)
    running: list[Sequence]
    held: dict[str, HeldLease]
    decoding: dict[str, DecodingLease]
    receiving: dict[str, Sequence]
    prefix_cache: PrefixCache | None
    kv_pool: KvPagePool
    state_pool: GdnStatePool
    max_num_seqs: int
    lease_ttl_s: float

    # ---- prefill side: HELD sequences and their leases
    def hold(self, seq: Sequence) -> HeldLease:
        """Take a running sequence out of the batch, keeping its memory under a new lease."""
        self.running.remove(seq)
        seq.status = SequenceStatus.HELD
        lease = HeldLease(seq, secrets.token_hex(16), time.monotonic() + self.lease_ttl_s)
        self.held[seq.request_id] = lease
        return lease

    def lease_decoding(self, seq: Sequence) -> DecodingLease:
        """Keep a sequence that sampled its first token in the batch, under a new lease (its
        prompt-end checkpoint was taken when its last chunk was launched: `save_prompt_end`)."""
        seq.handoff = False
        lease = DecodingLease(seq, secrets.token_hex(16), time.monotonic() + self.lease_ttl_s)
        self.decoding[seq.request_id] = lease
        return lease

    def claim(self, request_id: str, lease_id: str) -> DecodingLease | None:
        """The decode stream takes a decoding sequence over: its lease, with the outputs made
        so far (the sequence may have finished meanwhile); None if the lease is gone."""
        lease = self.decoding.get(request_id)
        if lease is None or lease.lease_id != lease_id:
            return None
        return self.decoding.pop(request_id)

    def release_lease(self, request_id: str, lease_id: str | None = None) -> bool:
        """Free a HELD sequence's memory (stop a decoding one); True if the lease (any, when
        `lease_id` is None) was still held, i.e. its memory was the request's own until now."""
        decoding = self.decoding.get(request_id)
        if decoding is not None and lease_id in (None, decoding.lease_id):
            del self.decoding[request_id]
            if not decoding.seq.is_finished:
                self.finish(decoding.seq)
            return True
        lease = self.held.get(request_id)
        if lease is None or (lease_id is not None and lease.lease_id != lease_id):
            return False
        self.finish(lease.seq)
        return True

    def renew_lease(self, request_id: str, lease_id: str) -> bool:
        """Hold a HELD sequence's memory another `lease_ttl_s` from now; False if that lease is gone."""
        lease = self.held.get(request_id)
        if lease is None or lease.lease_id != lease_id:
            return False
        lease.expires = time.monotonic() + self.lease_ttl_s
        return True

    def expire_leases(self, now: float) -> list[str]:
        """Free the memory of leases past their time; the ids of the requests they held."""
        expired = [rid for rid, lease in self.held.items() if lease.expires < now]
        for rid in expired:
            self.finish(self.held[rid].seq)
        unclaimed = [rid for rid, lease in self.decoding.items() if lease.expires < now]
        for rid in unclaimed:
            self.release_lease(rid)
        return expired + unclaimed

    def resume_held(self, request_id: str, lease_id: str) -> Sequence | None:
        """Decode a HELD sequence here, in place (one instance holding both roles): its memory
        moves to the batch without a copy. None if the lease is not held."""
        lease = self.held.get(request_id)
        if lease is None or lease.lease_id != lease_id:
            return None
        del self.held[request_id]
        self.save_prompt_end(lease.seq)
        lease.seq.status = SequenceStatus.RUNNING
        lease.seq.handoff = False
        self.running.append(lease.seq)
        return lease.seq

    def save_prompt_end(self, seq: Sequence) -> None:
        """Checkpoint a handed-over prompt's final state before decoding here moves it on: a copy
        queued on the current stream, so right after the pass that ended the prompt (the next
        step, launched before the host sees the first token, moves the state on)."""
        cache = self.prefix_cache
        if cache is not None and cache.wants_end_checkpoint(seq):
            cache.save(seq, "end")

    # ---- decode side: memory for a transferred sequence
    def reserve(self, seq: Sequence, num_pages: int) -> bool:
        """Give `seq` `num_pages` pages and a slot for an incoming transfer (RECEIVING), keeping a
        page of headroom per running sequence; False (nothing taken) when they do not fit."""
        if self._num_active() >= self.max_num_seqs or not self._free_slot():
            return False
        if not self._make_room(num_pages + len(self.running)):
            return False
        seq.block_table = self.kv_pool.allocate(num_pages)
        seq.state_slot = self.state_pool.allocate()
        seq.status = SequenceStatus.RECEIVING
        self.receiving[seq.request_id] = seq
        return True

    def start_received(self, seq: Sequence) -> None:
        """A RECEIVING sequence's state has arrived: it joins the batch."""
        del self.receiving[seq.request_id]
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
