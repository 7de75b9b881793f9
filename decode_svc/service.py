"""The decode role: pulls each handed-over request's KV pages and GDN state from its prefill
instance (NIXL READ), checks the lease, then decodes it with every other running request and
streams its tokens.

Request lifecycle:
  1. `decode` RPC (server streaming): validated (`DecodeStart`); the lease's agent is found in
     the registry (never an address a caller gives) and handshaken on first contact (protocol
     version + compatibility hash); a lease held by this very engine is decoded in place;
  2. transfer queue, first come first served: memory reserved through the scheduler (cache
     eviction first, headroom for the running batch): RECEIVING. A request that finds no slot
     or pages waits while the running sequences free them, its lease renewed on the prefill
     instance (`renew`) every admission_timeout_s / 2; it fails only when it has waited
     admission_timeout_s with nothing running here;
  3. READ of the prefill instance's pages/slot into the reserved ones; then `release` on the
     prefill instance with the lease: only if it answers that the lease was still held is the
     state used (anything else: the memory may have been reused; the request fails, never
     decodes from state that is not its own);
  4. running: the first token, sampled by prefill, is fed first; each decode step streams a
     `DecodeEvent`; finished or the stream cancelled -> pages and slot freed.
A failed READ drops the peer (the next request handshakes again: a restarted prefill instance is
a new agent name) and ends the stream with an error. A finished request leaves its state and
pages to the prefix cache (an entry of prompt + output, published in Redis), which a prefill
instance may pull for the conversation's next turn (`pdserve.prefix_sharing`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvtransfer import TransferHandle
from kvtransfer.payload import pool_units
from pdserve.engine.llm_engine import RequestOutput
from pdserve.engine.sequence import Sequence
from pdserve.messages import DecodeEvent, DecodeStart, LeaseRelease, LeaseRenewal
from pdserve.peer_directory import PeerDirectory
from pdserve.peer_reads import PeerReads
from pdserve.prefix_sharing import PrefixSharing
from pdserve.rpc import RpcError
from pdserve.sampling.params import SamplingParams
from pdserve.serving import EngineHost, ServiceRole

logger = logging.getLogger(__name__)
RENEW_RETRY_S = 1.0  # after a renewal that got no answer


@dataclass(slots=True)
class Incoming:
    """A request in the transfer queue: waiting for memory, then its READ, then its lease check."""

    start: DecodeStart
    seq: Sequence
    peer: str
    reading: bool = False  # its READ started (`PeerReads`); then its lease check
    handle: TransferHandle | None = None  # the READ, once done
    arrived: float = field(default_factory=time.monotonic)
    renewed: float = field(default_factory=time.monotonic)  # its lease, last asked to be held longer


class DecodeService(ServiceRole):
    def __init__(self, host: EngineHost) -> None:
        super().__init__(host)
        self.incoming: dict[str, Incoming] = {}  # engine thread; insertion order = arrival order
        self.streams: dict[str, asyncio.Queue] = {}
        self.peers = PeerDirectory(host)
        self.reads = PeerReads(host, self.peers)  # READ, release the lease; a failed peer forgotten
        self.sharing = PrefixSharing.of(host)  # what this decode instance's cache gives to peers

    def load(self) -> dict:
        return {"incoming": len(self.incoming)}

    # ---- RPC handler
    async def decode(self, msg: dict) -> AsyncIterator[dict]:
        start = DecodeStart.from_wire(msg)
        rid = start.request_id
        start.lease.check_pages(self.config.engine.page_size)
        if rid in self.streams:  # a second stream must not take over (or cancel) the first
            raise ValueError(f"request id {rid!r} is already streaming here")
        local = start.lease.agent == self.agent.name
        try:
            peer = None if local else await self.peers.connect(start.lease.agent)
        except (LookupError, RpcError) as e:
            raise RpcError("ABORTED", f"cannot reach the holder of the state of {rid}: {e}") from None
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        finished = False
        try:
            await self.thread.call(self._admit, start, peer)
            while not finished:
                event = await queue.get()
                if "error" in event:  # ABORTED: the state never arrived (the router may retry)
                    raise RpcError(event.get("code", "INTERNAL"), event["error"])
                finished = event["finished"]
                yield event
        finally:
            self.streams.pop(rid, None)
            if not finished:
                self.thread.post(self._cancel, rid)

    # ---- on the engine thread
    def _admit(self, start: DecodeStart, peer: str | None) -> None:
        rid = start.request_id
        if peer is None:  # handed over by this engine: decoded in place, nothing moves
            made = self.engine.resume_held(rid, start.lease.lease_id)
            if made is None:
                raise RpcError("ABORTED", f"the lease of {rid} is no longer held here")
            self._post(rid, DecodeEvent(transfer={"bytes": 0, "seconds": 0.0}).to_wire())
            self.host.deliver(made)  # the tokens it decoded before this stream came
            return
        seq = self.engine.make_sequence(start.prompt_token_ids, SamplingParams(**start.params), rid)
        if start.lease.num_tokens != seq.num_prompt_tokens:
            raise ValueError(
                f"the lease holds {start.lease.num_tokens} tokens, the prompt has {seq.num_prompt_tokens}"
            )
        self.incoming[rid] = Incoming(start, seq, peer)

    def tick(self) -> bool:
        now, blocked = time.monotonic(), False
        for rid, inc in list(self.incoming.items()):
            if inc.reading:
                continue
            if blocked or not self._pull(rid, inc):
                # first come, first served: later requests wait behind one that does not fit, their
                # states held on the prefill instances meanwhile (the running free memory)
                if not blocked and now - inc.arrived > self.config.admission_timeout_s and not self._busy:
                    where = f"{rid} on {self.config.instance_id}"
                    self._fail(rid, f"no sequence slot or KV pages free for {where}", "RESOURCE_EXHAUSTED")
                elif now - inc.renewed > self.config.admission_timeout_s / 2:
                    self._renew(rid, inc, now)
                blocked = True
        self.reads.tick()
        return bool(self.incoming)

    @property
    def _busy(self) -> bool:
        """Is anything here that will free a sequence slot and pages (running or arriving)?"""
        return bool(self.engine.scheduler.running or self.engine.scheduler.receiving)

    def _renew(self, rid: str, inc: Incoming, now: float) -> None:
        inc.renewed = now
        renewal = LeaseRenewal(rid, inc.start.lease.lease_id).to_wire()
        self.reads.let_go(
            inc.start.lease.agent, "renew", renewal, then=functools.partial(self._renewed, rid, inc)
        )

    def _pull(self, rid: str, inc: Incoming) -> bool:
        """Reserve memory and start the READ; False if the memory is not there yet."""
        lease = inc.start.lease
        if not self.engine.reserve_transfer(inc.seq, len(lease.kv_pages)):
            return False
        inc.reading = True
        self.reads.start(
            rid,
            lease.agent,
            inc.peer,
            pool_units(lease.kv_pages, lease.state_slot),
            pool_units(inc.seq.block_table, inc.seq.state_slot),
            on_done=lambda handle: self._confirm(rid, inc, handle),
            on_failed=lambda why: self._fail(rid, f"state transfer of {rid} from {lease.agent}: {why}"),
        )
        return True

    def _renewed(self, rid: str, inc: Incoming, answer: dict | None, why: str) -> None:
        """The holder's answer: a lease it no longer holds ends the request (ABORTED: the router
        prefills it again). No answer (a slow or older holder) ends nothing: the lease may still
        run, and the READ's release check says whether the state was the request's own."""
        if self.incoming.get(rid) is not inc or inc.reading:
            return
        if answer is None:
            logger.warning("could not renew the lease of %s (%s); trying again", rid, why)
            inc.renewed -= self.config.admission_timeout_s / 2 - RENEW_RETRY_S  # again in RENEW_RETRY_S
        elif answer.get("held") is not True:
            self._fail(rid, f"the state of {rid} is no longer held: its lease expired")

    def _confirm(self, rid: str, inc: Incoming, handle: TransferHandle) -> None:
        """After the READ: release the lease on the prefill instance; use the state only if the
        lease was still held (the memory read was the request's own)."""
        inc.handle = handle
        lease = inc.start.lease

        def confirmed(answer: dict | None, why: str) -> None:
            if answer is None:
                self._start(rid, inc, False, f"its holder could not confirm the lease: {why}")
            else:
                self._start(rid, inc, answer.get("intact") is True, "its lease had expired or was released")

        release = LeaseRelease(rid, lease.lease_id, pulled=True).to_wire()
        self.reads.let_go(lease.agent, "release", release, then=confirmed)

    def _start(self, rid: str, inc: Incoming, intact: bool, why: str) -> None:
        if self.incoming.get(rid) is not inc:  # cancelled meanwhile
            return
        if not intact:
            self._fail(rid, f"the state of {rid} was not used: {why}")
            return
        del self.incoming[rid]
        self.engine.start_received(inc.seq, inc.start.first_token, inc.start.first_logprobs)
        transfer = {"bytes": inc.handle.nbytes, "seconds": inc.handle.seconds}
        self._post(rid, DecodeEvent(transfer=transfer).to_wire())

    def _fail(self, rid: str, message: str, code: str = "ABORTED") -> None:
        """End a request whose state did not arrive (ABORTED) or found no memory."""
        self.incoming.pop(rid, None)
        self.engine.abort(rid)
        self._post(rid, {"error": message, "code": code})

    def _cancel(self, rid: str) -> None:
        self.incoming.pop(rid, None)
        self.reads.cancel(rid)  # a READ in flight (one confirming its lease ends unused)
        self.engine.abort(rid)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.request_id not in self.streams or out.lease_id is not None:
                continue  # not ours (yet): a first token of the prefill role of this engine
            event = DecodeEvent(
                token_ids=out.new_token_ids,
                text_delta=out.text_delta,
                logprobs=out.logprobs[-1:] if out.logprobs else None,
                finished=out.finished,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            ).to_wire()
            if out.finished:  # once its entry is in Redis: the next turn, sent at once, finds it
                version = self.host.prefix_snapshot()[0]
                asyncio.run_coroutine_threadsafe(
                    self._post_published(out.request_id, event, version), self._loop
                )
            else:
                self._post(out.request_id, event)

    def on_error(self, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            self._post(rid, {"error": message})

    async def _post_published(self, rid: str, event: dict, version: int) -> None:
        await self.host.prefix_published(version)
        queue = self.streams.get(rid)
        if queue is not None:
            queue.put_nowait(event)

    def _post(self, rid: str, event: dict) -> None:
        queue = self.streams.get(rid)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, event)
