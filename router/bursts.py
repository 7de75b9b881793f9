"""Bursts of requests to prefill instances: the first token of each request.

A request joins the burst of the prefill instance that caches its prompt's longest prefix
(Redis prefix keys, `router.prefix_route`), or the burst for any instance; when a decode
instance caches a longer prefix still (it generated the conversation's previous turn), the
request names it (`GenerateItem.prefix_source`) and the prefill instance may pull it. So it does
when the burst goes elsewhere because the prefill instance holding the prefix is too busy
(`InstanceSet.pick`'s slack): the one taking it may pull from the busy one. A burst
goes out as one `prefill` stream when it is full (`max_requests`, or `max_tokens` of work: the
tokens past each prompt's cached prefix) or `window_s` after its first request. Each
request's `PrefillResult` settles its future as soon as it arrives. A prefill instance that
fails before a request's first token has that request sent once more, to another instance. A
request whose client leaves is taken out of a burst not yet sent, or aborted on the instance
that has it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field

import msgpack

from pdserve.messages import Abort, GenerateItem, LeaseRelease, PrefillBurst, PrefillResult
from pdserve.registry import InstanceInfo
from pdserve.rpc import RpcError
from router.backend import GenerateRequest
from router.disagg_metrics import DisaggMetrics
from router.errors import BackendError
from router.instances import InstanceSet, NoInstanceError
from router.prefix_route import Holder, prefix_holders

log = logging.getLogger("pdserve.router")
# a prefill instance failing with these is set aside; other codes are the request's own fault
INSTANCE_FAILURES = {"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "UNAUTHENTICATED"}


class Background:
    """Cleanup calls (release, abort) run apart from the request: they must not wait on (or
    die with) the request's task."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@dataclass(slots=True)
class Pending:
    """A request waiting for its first token: its wire form and the future of its result."""

    req: GenerateRequest
    item: GenerateItem
    future: asyncio.Future
    sent_to: InstanceInfo | None = None  # the prefill instance its burst went to
    tries: int = 0
    holder: dict | None = None  # the prefill holder of its prefix, as a prefix_source (if it is busy)
    new_tokens: int = 0  # its work: prompt tokens past its instance's cached prefix (0: one instance)
    created: float = field(default_factory=time.monotonic)  # when it asked for its first token


@dataclass(slots=True)
class Burst:
    """Requests gathered for one prefill instance, sent together when full or when the timer fires."""

    items: list[Pending] = field(default_factory=list)
    tokens: int = 0
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class BurstConfig:
    window_s: float = 0.005
    max_tokens: int = 16384
    max_requests: int = 256


class PrefillBursts:
    def __init__(
        self, instances: InstanceSet, metrics: DisaggMetrics, config: BurstConfig, background: Background
    ) -> None:
        self.instances = instances
        self.metrics = metrics
        self.config = config
        self.background = background
        self._bursts: dict[str | None, Burst] = {}  # by preferred prefill instance (None: any)

    async def first_token(
        self, req: GenerateRequest, exclude: frozenset = frozenset()
    ) -> tuple[PrefillResult, InstanceInfo]:
        item = GenerateItem(req.request_id, req.prompt_token_ids, asdict(req.params))
        try:
            msgpack.packb(item.to_wire())  # a field the wire cannot carry is this request's fault
        except (TypeError, ValueError, OverflowError) as e:
            raise BackendError(f"request cannot be encoded: {e}", 400) from e
        pending = Pending(req, item, asyncio.get_running_loop().create_future())
        target = None
        if exclude:  # a retry goes alone, around the instance that failed it
            self.background.spawn(self._send_burst([pending], None, frozenset(exclude)))
        else:
            target, item.prefix_source, pending.holder, pending.new_tokens = await self._prefix_choice(req)
            self._join(pending, target)
        try:
            return await pending.future
        except asyncio.CancelledError:  # the client left before its first token
            self._abandon(pending, target)
            raise

    def _join(self, pending: Pending, target: str | None) -> None:
        burst = self._bursts.setdefault(target, Burst())
        burst.items.append(pending)
        burst.tokens += pending.new_tokens
        if burst.tokens >= self.config.max_tokens or len(burst.items) >= self.config.max_requests:
            self._flush(target)
        elif burst.timer is None:
            burst.timer = asyncio.get_running_loop().call_later(self.config.window_s, self._flush, target)

    def _abandon(self, pending: Pending, target: str | None) -> None:
        burst = self._bursts.get(target)
        if burst is not None and pending in burst.items:  # not sent yet: just leave the burst
            burst.items.remove(pending)
            burst.tokens -= pending.new_tokens
            return
        future = pending.future
        if future.done() and not future.cancelled() and future.exception() is None:
            result, instance = future.result()  # answered as the client left: free its lease
            if result.lease is not None:
                self.background.spawn(self.release(instance, result))
        elif pending.sent_to is not None:
            self.background.spawn(self._abort(pending.sent_to, pending.req.request_id))

    async def _prefix_choice(self, req: GenerateRequest) -> tuple[str | None, dict | None, dict | None, int]:
        """The live prefill instance holding the longest cached prefix of the prompt (None: route
        by load); the decode instance holding a longer one, as a `prefix_source` (or None); that
        prefill holder's entry as a `prefix_source`, for when it is too busy to take it; and how
        many tokens the prompt adds to its burst's work: those past that holder's prefix (all
        without one; none with one live instance, whose bursts are filled by their window)."""
        prefill, decode = self.instances.live["prefill"], self.instances.live["decode"]
        live, n = set(prefill) | set(decode), len(req.prompt_token_ids)
        if len(live) < 2:  # one instance (one GPU: both roles under one id): nothing to choose or
            # pull, so no lookup (~1 ms of the event loop for a 4.5K-token prompt, 32 at once in a
            # chat turn); its bursts only batch the wire to one engine that packs its own passes
            return None, None, None, 0
        info = next(
            (i.extra for i in [*prefill.values(), *decode.values()] if i.extra.get("prefix_block_size")), None
        )
        if info is None or n < 2:
            return None, None, None, n
        try:
            holders = await prefix_holders(
                self.instances.registry,
                req.prompt_token_ids,
                info["prefix_block_size"],
                info["prefix_salt"],
                live,
            )
        except Exception as e:  # Redis briefly away: route by load alone
            log.warning("prefix lookup failed: %s", e)
            return None, None, None, n
        best_prefill = next((h for h in holders if h.instance_id in prefill), None)
        target = best_prefill.instance_id if best_prefill else None
        holder = None if best_prefill is None else _source(prefill[target], best_prefill)
        work = n - (0 if best_prefill is None else best_prefill.num_tokens)
        best = holders[0] if holders else None
        if best is None or best.instance_id not in decode:
            return target, None, holder, work
        if best_prefill is not None and best.num_tokens <= best_prefill.num_tokens:
            return target, None, holder, work
        source = _source(decode[best.instance_id], best)
        if source is not None:
            self.metrics.prefix_pull_hints.inc()
        return target, source, holder, work

    def _flush(self, target: str | None) -> None:
        burst = self._bursts.pop(target, None)
        if burst is None:
            return
        if burst.timer is not None:
            burst.timer.cancel()
        if burst.items:
            self.background.spawn(self._send_burst(burst.items, target))

    async def _send_burst(
        self, batch: list[Pending], target: str | None, exclude: frozenset = frozenset()
    ) -> None:
        try:  # around `exclude` if another instance is live (set-aside ones are skipped anyway)
            try:
                instance = self.instances.pick("prefill", exclude=set(exclude), prefer=target)
            except NoInstanceError:
                instance = self.instances.pick("prefill", prefer=target)
        except NoInstanceError as e:
            return _fail(batch, BackendError(str(e), 503))
        if target is not None and instance.instance_id == target:
            self.metrics.prefix_routed.inc(len(batch))
        elif target is not None:  # the holder is too busy (or away): the one taking them may pull
            for p in batch:
                if p.item.prefix_source is None and p.holder is not None:
                    p.item.prefix_source = p.holder
                    self.metrics.prefix_pull_hints.inc()
        self.metrics.batch_size.observe(len(batch))
        waiting = {p.req.request_id: p for p in batch}
        sent = time.monotonic()
        for p in batch:
            p.sent_to, p.tries = instance, p.tries + 1
        burst = PrefillBurst([p.item for p in batch]).to_wire()
        self.instances.in_flight[instance.instance_id] += len(batch)
        error = BackendError(f"prefill instance {instance.instance_id} ended the stream early", 503)
        try:
            async for wire in self.instances.client(instance).stream("prefill", burst, timeout=600.0):
                result = PrefillResult.from_wire(wire)
                pending = waiting.pop(result.request_id, None)
                if pending is not None:
                    self.instances.in_flight[instance.instance_id] -= 1
                    if result.error is None:
                        self.metrics.first_token(sent - pending.created, result.queue_s, result.prefill_s)
                    _settle(pending, result, instance)
        except RpcError as e:
            if e.code not in INSTANCE_FAILURES:  # the burst itself was refused: not the instance's fault
                return _fail(
                    list(waiting.values()), BackendError(f"prefill refused the request: {e.message}", 400)
                )
            self.instances.set_aside(instance)
            error = BackendError(f"prefill instance {instance.instance_id} failed: {e.message}", 503)
        finally:
            self.instances.in_flight[instance.instance_id] -= len(waiting)
        retry = [p for p in waiting.values() if not p.future.done() and p.tries < 2]
        _fail([p for p in waiting.values() if p not in retry], error)
        if retry:  # no first token of theirs went out: once more, on another instance
            log.warning("retrying %d requests of %s elsewhere: %s", len(retry), instance.instance_id, error)
            await self._send_burst(retry, None, exclude | {instance.instance_id})

    async def release(self, prefill: InstanceInfo, first: PrefillResult) -> None:
        message = LeaseRelease(first.request_id, first.lease.lease_id).to_wire()
        try:
            await self.instances.client(prefill).unary("release", message, timeout=5.0)
        except RpcError as e:
            log.warning("could not release %s on %s: %s", first.request_id, prefill.instance_id, e)

    async def _abort(self, prefill: InstanceInfo, request_id: str) -> None:
        try:
            await self.instances.client(prefill).unary("abort", Abort([request_id]).to_wire(), timeout=5.0)
        except RpcError as e:
            log.warning("could not abort %s on %s: %s", request_id, prefill.instance_id, e)


def _source(instance: InstanceInfo, holder: Holder) -> dict | None:
    """`holder`'s entry as a `GenerateItem.prefix_source` (None: the instance has no NIXL agent)."""
    agent = instance.extra.get("agent")
    return {"agent": agent, "key": holder.key, "num_tokens": holder.num_tokens} if agent else None


def _settle(pending: Pending, result: PrefillResult, instance: InstanceInfo) -> None:
    if pending.future.done():  # the client left: _abandon aborts it there (a lease included)
        return
    if result.error is None:
        pending.future.set_result((result, instance))
    elif result.error_code == "queue_full":
        pending.future.set_exception(BackendError(result.error, 503))
    elif result.error_code == "invalid":
        pending.future.set_exception(BackendError(result.error, 400))
    else:
        pending.future.set_exception(BackendError(result.error, 503))


def _fail(batch: list[Pending], error: BackendError) -> None:
    for p in batch:
        if not p.future.done():
            p.future.set_exception(error)
