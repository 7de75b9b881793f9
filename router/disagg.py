"""`DisaggBackend`: the router's path through prefill and decode instances.

Request lifecycle:
  1. burst: requests arriving within `burst_window_s` of each other (up to a token budget)
     go to one prefill instance as one `prefill` stream, which packs them into shared passes;
     a request whose prompt prefix a prefill instance has cached (Redis prefix keys) joins that
     instance's burst, unless it is much busier than the least loaded one;
  2. each request's `PrefillResult` arrives as soon as it is prefilled (the TTFT) with, unless it
     ended there, a `Lease` on its KV pages and GDN state slot; a refusal for a full queue is a
     503 with Retry-After; a prefill instance that fails before a request's first token has
     that request sent once more, to another instance;
  3. a decode instance (least loaded) gets a `decode` stream: it READs the state through NIXL,
     checks the lease with its holder, then streams tokens; the router forwards them;
  4. a client that leaves aborts its request where it is: taken out of a burst not yet sent,
     aborted on the prefill instance (queued or prefilling), or its lease released.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import asdict, dataclass, field

import msgpack

from pdserve.messages import (
    Abort,
    DecodeEvent,
    DecodeStart,
    GenerateItem,
    LeaseRelease,
    PrefillBurst,
    PrefillResult,
)
from pdserve.prefix_keys import prefix_block_keys
from pdserve.registry import InstanceInfo
from pdserve.rpc import RpcError
from router.backend import GenerateRequest, TokenEvent
from router.disagg_metrics import DisaggMetrics
from router.errors import BackendError
from router.instances import InstanceSet, NoInstanceError
from router.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")
# a prefill instance failing with these is set aside; other codes are the request's own fault
INSTANCE_FAILURES = {"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "UNAUTHENTICATED"}


@dataclass(slots=True)
class Pending:
    """A request waiting for its first token: its wire form and the future of its result."""

    req: GenerateRequest
    item: GenerateItem
    future: asyncio.Future
    sent_to: InstanceInfo | None = None  # the prefill instance its burst went to
    tries: int = 0


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


class DisaggBackend:
    def __init__(
        self,
        instances: InstanceSet,
        metrics: RouterMetrics,
        max_model_len: int,
        burst: BurstConfig | None = None,
    ) -> None:
        self.instances = instances
        self.burst = burst or BurstConfig()
        self._max_model_len = max_model_len
        self._bursts: dict[str | None, Burst] = {}  # by preferred prefill instance (None: any)
        self.metrics = DisaggMetrics(metrics)
        self._background: set[asyncio.Task] = set()  # cleanup calls (release, abort) in flight

    def max_model_len(self) -> int:
        return self._max_model_len

    async def health(self) -> dict:
        counts = self.instances.counts()
        return {"status": "ok" if counts["prefill"] and counts["decode"] else "degraded", **counts}

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        first, prefill = await self._prefill(req)
        self.metrics.cached_tokens.inc(first.num_cached_tokens)
        yield TokenEvent(
            [first.token_id],
            first.text_delta,
            first.logprobs,
            first.finished,
            first.finish_reason,
            cached_tokens=first.num_cached_tokens,
        )
        if first.finished:
            return
        pulled = False
        try:
            async for event in self._decode(req, first):
                pulled = True
                if event is not None:
                    yield event
        finally:
            if not pulled:  # decode never took the state over: free it on the prefill instance
                self._spawn(self._release(prefill, first))

    # ---- 1-2: bursts to a prefill instance (the one caching the prompt's prefix, if any)
    async def _prefill(self, req: GenerateRequest) -> tuple[PrefillResult, InstanceInfo]:
        item = GenerateItem(req.request_id, req.prompt_token_ids, asdict(req.params))
        try:
            msgpack.packb(item.to_wire())  # a field the wire cannot carry is this request's fault
        except (TypeError, ValueError, OverflowError) as e:
            raise BackendError(f"request cannot be encoded: {e}", 400) from e
        pending = Pending(req, item, asyncio.get_running_loop().create_future())
        target = await self._prefix_owner(req)
        self._join(pending, target)
        try:
            return await pending.future
        except asyncio.CancelledError:  # the client left before its first token
            self._abandon(pending, target)
            raise

    def _join(self, pending: Pending, target: str | None) -> None:
        burst = self._bursts.setdefault(target, Burst())
        burst.items.append(pending)
        burst.tokens += len(pending.item.prompt_token_ids)
        if burst.tokens >= self.burst.max_tokens or len(burst.items) >= self.burst.max_requests:
            self._flush(target)
        elif burst.timer is None:
            burst.timer = asyncio.get_running_loop().call_later(self.burst.window_s, self._flush, target)

    def _abandon(self, pending: Pending, target: str | None) -> None:
        burst = self._bursts.get(target)
        if burst is not None and pending in burst.items:  # not sent yet: just leave the burst
            burst.items.remove(pending)
            burst.tokens -= len(pending.item.prompt_token_ids)
            return
        future = pending.future
        if future.done() and not future.cancelled() and future.exception() is None:
            result, instance = future.result()  # answered as the client left: free its lease
            if result.lease is not None:
                self._spawn(self._release(instance, result))
        elif pending.sent_to is not None:
            self._spawn(self._abort(pending.sent_to, pending.req.request_id))

    async def _prefix_owner(self, req: GenerateRequest) -> str | None:
        """The live prefill instance holding the longest cached prefix of the prompt."""
        live = self.instances.live["prefill"]
        info = next((i.extra for i in live.values() if i.extra.get("prefix_block_size")), None)
        if info is None:
            return None
        keys = prefix_block_keys(req.prompt_token_ids[:-1], info["prefix_block_size"], info["prefix_salt"])
        if not keys:
            return None
        try:
            owners = await self.instances.registry.prefix_owners([k.hex() for k in keys])
        except Exception as e:  # Redis briefly away: route by load alone
            log.warning("prefix lookup failed: %s", e)
            return None
        for key in reversed(keys):
            owner = owners.get(key.hex())
            if owner in live:
                return owner
        return None

    def _flush(self, target: str | None) -> None:
        burst = self._bursts.pop(target, None)
        if burst is None:
            return
        if burst.timer is not None:
            burst.timer.cancel()
        if burst.items:
            self._spawn(self._send_burst(burst.items, target))

    async def _send_burst(
        self, batch: list[Pending], target: str | None, exclude: frozenset = frozenset()
    ) -> None:
        try:
            instance = self.instances.pick("prefill", exclude=set(exclude), prefer=target)
        except NoInstanceError as e:
            return _fail(batch, BackendError(str(e), 503))
        if target is not None and instance.instance_id == target:
            self.metrics.prefix_routed.inc(len(batch))
        self.metrics.batch_size.observe(len(batch))
        waiting = {p.req.request_id: p for p in batch}
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

    # ---- 3: a decode stream
    async def _decode(
        self, req: GenerateRequest, first: PrefillResult
    ) -> AsyncGenerator[TokenEvent | None, None]:
        try:
            instance = self.instances.pick("decode")
        except NoInstanceError as e:
            raise BackendError(str(e), 503) from e
        message = DecodeStart(
            req.request_id,
            req.prompt_token_ids,
            asdict(req.params),
            first.token_id,
            first.lease,
            first.logprobs,
        ).to_wire()
        self.instances.in_flight[instance.instance_id] += 1
        self.metrics.decoded.labels(instance.instance_id).inc()
        try:
            async for wire in self.instances.client(instance).stream("decode", message):
                event = DecodeEvent.from_wire(wire)
                if event.transfer is not None:
                    self.metrics.transfer(event.transfer)
                    yield None
                    continue
                yield TokenEvent(
                    event.token_ids, event.text_delta, event.logprobs, event.finished, event.finish_reason
                )
                if event.finished:
                    return
        except RpcError as e:
            if e.code == "UNAVAILABLE":
                self.instances.set_aside(instance)
            raise BackendError(f"decode instance {instance.instance_id} failed: {e.message}", 503) from e
        finally:
            self.instances.in_flight[instance.instance_id] -= 1
        raise BackendError(f"decode instance {instance.instance_id} ended the stream early", 503)

    # ---- 4: giving up on a request
    async def _release(self, prefill: InstanceInfo, first: PrefillResult) -> None:
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

    def _spawn(self, coro: Coroutine) -> None:
        """Run cleanup in the background: it must not wait on (or die with) the request's task."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _settle(pending: Pending, result: PrefillResult, instance: InstanceInfo) -> None:
    if pending.future.done():  # the client left: its lease is released by _abandon or here
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
