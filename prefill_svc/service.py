"""The prefill role: packs each burst of prompts into shared passes, samples each first token,
and holds the request's KV pages + GDN state slot under a lease until a decode instance pulls them.

Request lifecycle (one prompt of a burst):
  1. `prefill` RPC (server streaming): the burst is validated (`PrefillBurst`); each request is
     queued on the engine thread, or refused alone (a bad prompt, a full queue);
  2. packed prefill with the other prompts of the burst (chunked under the token budget);
  3. first token sampled -> its `PrefillResult` is streamed at once, whatever the rest of the
     burst is doing (a burst never waits on itself), with the prompt's logprobs when asked for:
     either the request ended there (eos, a stop, max_tokens 1, or 0: the prompt scored and no
     token) and its memory is freed, or it is HELD under a new `Lease`;
  4. held until the decode instance, after its NIXL READ, calls `release` with the lease
     (answer: was the lease still held, i.e. was the memory it read the request's own?), or the
     router releases it, or the lease expires after `handoff_timeout_s` (a decode instance
     still waiting for memory for it calls `renew` to hold it longer).
A stream cancelled before all its results went out aborts the requests still queued or running:
their memory is freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from pdserve.engine.llm_engine import RequestOutput
from pdserve.engine.sequence import Sequence
from pdserve.messages import (
    Abort,
    GenerateItem,
    Lease,
    LeaseRelease,
    LeaseRenewal,
    PrefillBurst,
    PrefillResult,
)
from pdserve.prefix_sharing import PrefixSharing
from pdserve.sampling.params import SamplingParams
from pdserve.serving import EngineHost, ServiceRole

logger = logging.getLogger(__name__)


class PrefillService(ServiceRole):
    def __init__(self, host: EngineHost) -> None:
        super().__init__(host)
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its burst's result queue
        self._seqs: dict[str, Sequence] = {}  # engine thread: queued or prefilling here
        self.sharing = PrefixSharing.of(host)  # pulls of cached prefixes that peers hold

    # ---- RPC handlers
    async def prefill(self, msg: dict) -> AsyncIterator[dict]:
        """A `PrefillBurst` in; a `PrefillResult` per request out, in the order they finish."""
        received = time.monotonic()  # its queue time counts from here: the engine thread may be mid-step
        burst = PrefillBurst.from_wire(msg)
        queue: asyncio.Queue[PrefillResult] = asyncio.Queue()
        mine = [r.request_id for r in burst.requests if r.request_id not in self._streams]
        for rid in mine:
            self._streams[rid] = queue
        pending = set(mine)
        try:
            refused = await self.thread.call(
                self._admit, [r for r in burst.requests if r.request_id in pending], received
            )
            for r in burst.requests:
                if r.request_id not in pending:
                    refused.append(_refusal(r.request_id, f"request id {r.request_id!r} is already in use"))
            for result in refused:
                pending.discard(result.request_id)
                yield result.to_wire()
            while pending:
                result = await queue.get()
                pending.discard(result.request_id)
                yield result.to_wire()
        finally:
            for rid in mine:
                self._streams.pop(rid, None)
            if pending:  # the router went away (client gone, router died): stop their work
                self.thread.post(self._abort, sorted(pending), False)

    async def endpoint(self, msg: dict) -> dict:
        return dict(self.agent.endpoint())

    async def release(self, msg: dict) -> dict:
        """`LeaseRelease`: free a held request's memory; `intact` says whether its lease was still
        held (False: it expired or was released first, so a READ of it must not be used)."""
        req = LeaseRelease.from_wire(msg)
        intact = await self.thread.call(self.engine.scheduler.release_lease, req.request_id, req.lease_id)
        return {"intact": intact}

    async def renew(self, msg: dict) -> dict:
        """`LeaseRenewal`: hold a request's state longer; `held` False if its lease is gone."""
        req = LeaseRenewal.from_wire(msg)
        held = await self.thread.call(self.engine.scheduler.renew_lease, req.request_id, req.lease_id)
        return {"held": held}

    async def abort(self, msg: dict) -> dict:
        """`Abort`: stop requests queued, prefilling or held here; frees their memory at once."""
        return {"aborted": await self.thread.call(self._abort, Abort.from_wire(msg).request_ids, True)}

    # ---- on the engine thread
    def _admit(self, requests: list[GenerateItem], received: float) -> list[PrefillResult]:
        """Queue each request on the engine (`received`: when its burst reached this instance)."""
        refused = []
        for r in requests:
            rid = r.request_id
            if rid in self._seqs or rid in self.engine.scheduler.held:
                refused.append(_refusal(rid, f"request id {rid!r} is already in use"))
                continue
            if len(self.engine.scheduler.waiting) >= self.config.max_queued_requests:
                message = f"{self.config.instance_id} has {self.config.max_queued_requests} requests queued"
                refused.append(PrefillResult(rid, error=message, error_code="queue_full"))
                continue
            try:
                params = SamplingParams(**r.params)
                seq = self.engine.make_sequence(r.prompt_token_ids, params, rid)
            except (ValueError, TypeError) as e:
                refused.append(_refusal(rid, str(e)))
                continue
            seq.handoff = True
            seq.arrival_time = received
            self._seqs[rid] = seq
            self.engine.enqueue(seq)
            if r.prefix_source is not None:  # a peer caches more of it: pull that if it pays
                self.sharing.start(seq, r.prefix_source)
        return refused

    def _abort(self, request_ids: list[str], tell_stream: bool) -> int:
        aborted = 0
        for rid in request_ids:
            queued = self._seqs.pop(rid, None) is not None
            if self.engine.abort(rid):
                aborted += 1
            if queued and tell_stream:
                self._post([PrefillResult(rid, error=f"request {rid} was aborted", error_code="aborted")])
        return aborted

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        results, now = [], time.monotonic()
        for out in outputs:
            seq = self._seqs.pop(out.request_id, None)
            if seq is None:  # not ours: decoding here (an engine holding both roles)
                continue
            lease = None
            if out.lease_id is not None:  # the prompt's pages (decoding in place, the step
                # launched ahead may have given it the next token's page already)
                prompt_pages = self.engine.runner.kv_pool.pages_for(seq.num_prompt_tokens)
                lease = Lease(
                    out.request_id,
                    out.lease_id,
                    self.agent.name,
                    seq.block_table[:prompt_pages],
                    seq.state_slot,
                    seq.num_prompt_tokens,
                )
            results.append(
                PrefillResult(
                    request_id=out.request_id,
                    token_id=out.new_token_ids[0] if out.new_token_ids else None,  # None: max_tokens 0
                    text_delta=out.text_delta,
                    # copied here, on the engine thread: a request decoding on in this engine
                    # appends to its own list while the result waits to be sent
                    logprobs=None if out.logprobs is None else list(out.logprobs),
                    prompt_logprobs=out.prompt_logprobs,
                    finished=out.finished,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=out.num_cached_tokens,
                    lease=lease,
                    **_timings(seq, now),
                )
            )
        finished = [r for r in results if r.finished]
        if finished:  # once their entries are in Redis: a next turn sent at once finds them
            version = self.host.prefix_snapshot()[0]
            asyncio.run_coroutine_threadsafe(self._post_published(finished, version), self._loop)
        if len(finished) < len(results):
            self._post([r for r in results if not r.finished])

    async def _post_published(self, results: list[PrefillResult], version: int) -> None:
        await self.host.prefix_published(version)
        self._deliver(results)

    def on_error(self, request_ids: list[str], message: str) -> None:
        failed = [rid for rid in request_ids if self._seqs.pop(rid, None) is not None]
        self._post([PrefillResult(rid, error=message, error_code="failed") for rid in failed])

    def _post(self, results: list[PrefillResult]) -> None:
        self._loop.call_soon_threadsafe(self._deliver, results)

    def _deliver(self, results: list[PrefillResult]) -> None:
        for result in results:
            queue = self._streams.get(result.request_id)
            if queue is not None:
                queue.put_nowait(result)
            elif result.lease is not None:  # nobody listens any more: do not pin its memory
                self.thread.post(
                    self.engine.scheduler.release_lease, result.request_id, result.lease.lease_id
                )

    def tick(self) -> bool:
        for rid in self.engine.scheduler.expire_leases(time.monotonic()):
            logger.warning(
                "request %s was never pulled; freed its state after %.0f s",
                rid,
                self.config.handoff_timeout_s,
            )
        # NIXL completes a decode instance's READ only as this side's worker progresses (no
        # progress thread on CPU): pump it often while anything is held for a transfer
        self.agent.take_done_notifications()
        return bool(self.engine.scheduler.held or self.engine.scheduler.decoding)


def _timings(seq: Sequence, now: float) -> dict[str, float]:
    """`seq`'s queue time (arrival here to first scheduled) and prefill time (to its first token)."""
    scheduled = seq.arrival_time if seq.scheduled_time is None else seq.scheduled_time
    return {"queue_s": scheduled - seq.arrival_time, "prefill_s": now - scheduled}


def _refusal(request_id: str, message: str) -> PrefillResult:
    return PrefillResult(request_id, error=message, error_code="invalid")
