"""`DisaggBackend`: the router's path through prefill and decode instances.

Request lifecycle:
  1. burst: requests arriving within `burst_window_s` of each other (up to a token budget)
     go to one prefill instance as one `prefill` RPC, which packs them into shared passes; a
     request whose prompt prefix a prefill instance has cached (Redis prefix keys) joins that
     instance's burst, unless it is much busier than the least loaded one;
  2. the prefill answer carries each first token (the TTFT) and, unless the request ended
     there, a `RequestPayload` naming its KV pages and GDN state slot;
  3. a decode instance (least loaded) gets a `decode` stream: it READs the state through
     NIXL, then streams tokens; the router forwards them as they come;
  4. a failed instance is set aside and the request gets a clear error; a request whose
     decode never pulled its state has its prefill copy released.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass, field

from pdserve.engine.prefix_cache import prefix_block_keys
from pdserve.rpc import RpcError
from router.backend import GenerateRequest, TokenEvent
from router.errors import BackendError
from router.instances import InstanceSet, NoInstanceError
from router.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
BYTES_BUCKETS = tuple(2**k for k in range(10, 34, 2))
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class Burst:
    """Requests gathered for one prefill instance, sent together when full or when the timer fires."""

    items: list[tuple[GenerateRequest, asyncio.Future]] = field(default_factory=list)
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
        self._batch_size = metrics.histogram(
            "prefill_batch_size", "Requests per prefill burst", BATCH_BUCKETS
        )
        self._xfer_bytes = metrics.histogram("transfer_bytes", "State bytes moved per request", BYTES_BUCKETS)
        self._xfer_seconds = metrics.histogram(
            "transfer_seconds", "State transfer time per request", SECONDS_BUCKETS
        )
        self._cached_tokens = metrics.counter(
            "prefix_cache_hit_tokens", "Prompt tokens served from a prefill instance's prefix cache"
        )
        self._prefix_routed = metrics.counter(
            "prefix_routed_requests", "Requests sent to the prefill instance caching their prefix"
        )
        self._decoded = metrics.counter(
            "decode_requests", "Requests sent to each decode instance", ["instance"]
        )

    def max_model_len(self) -> int:
        return self._max_model_len

    async def health(self) -> dict:
        counts = self.instances.counts()
        return {"status": "ok" if counts["prefill"] and counts["decode"] else "degraded", **counts}

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        first, prefill = await self._prefill(req)
        self._cached_tokens.inc(first.get("num_cached_tokens", 0))
        yield TokenEvent(
            [first["token_id"]],
            first["text_delta"],
            first["logprobs"],
            first["finished"],
            first["finish_reason"],
            cached_tokens=first.get("num_cached_tokens", 0),
        )
        if first["finished"]:
            return
        pulled = False
        try:
            async for event in self._decode(req, first, prefill):
                pulled = True
                if event is not None:
                    yield event
        finally:
            if not pulled:
                await self._release(prefill, req.request_id)

    # ---- 1-2: bursts to a prefill instance (the one caching the prompt's prefix, if any)
    async def _prefill(self, req: GenerateRequest) -> tuple[dict, object]:
        target = await self._prefix_owner(req)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        burst = self._bursts.setdefault(target, Burst())
        burst.items.append((req, future))
        burst.tokens += len(req.prompt_token_ids)
        if burst.tokens >= self.burst.max_tokens or len(burst.items) >= self.burst.max_requests:
            self._flush(target)
        elif burst.timer is None:
            burst.timer = loop.call_later(self.burst.window_s, self._flush, target)
        return await future

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
        asyncio.create_task(self._send_burst(burst.items, target))

    async def _send_burst(
        self, batch: list[tuple[GenerateRequest, asyncio.Future]], target: str | None
    ) -> None:
        try:
            instance = self.instances.pick("prefill", prefer=target)
        except NoInstanceError as e:
            return _fail(batch, BackendError(str(e), 503))
        if target is not None and instance.instance_id == target:
            self._prefix_routed.inc(len(batch))
        self._batch_size.observe(len(batch))
        message = {
            "requests": [
                {
                    "request_id": r.request_id,
                    "prompt_token_ids": r.prompt_token_ids,
                    "params": asdict(r.params),
                }
                for r, _ in batch
            ]
        }
        self.instances.in_flight[instance.instance_id] += len(batch)
        try:
            answer = await self.instances.client(instance).unary("prefill", message, timeout=600.0)
        except RpcError as e:
            self.instances.set_aside(instance)
            return _fail(batch, BackendError(f"prefill instance {instance.instance_id} failed: {e}", 503))
        finally:
            self.instances.in_flight[instance.instance_id] -= len(batch)
        for (_, future), result in zip(batch, answer["results"], strict=True):
            if future.done():
                continue
            if "error" in result:
                future.set_exception(BackendError(result["error"], 400))
            else:
                future.set_result((result, instance))

    # ---- 3: a decode stream
    async def _decode(
        self, req: GenerateRequest, first: dict, prefill
    ) -> AsyncGenerator[TokenEvent | None, None]:
        try:
            instance = self.instances.pick("decode")
        except NoInstanceError as e:
            raise BackendError(str(e), 503) from e
        message = {
            "request_id": req.request_id,
            "prompt_token_ids": req.prompt_token_ids,
            "params": asdict(req.params),
            "first_token": first["token_id"],
            "first_logprobs": first["logprobs"],
            "payload": first["payload"],
            "prefill_address": prefill.address,
        }
        self.instances.in_flight[instance.instance_id] += 1
        self._decoded.labels(instance.instance_id).inc()
        try:
            async for event in self.instances.client(instance).stream("decode", message):
                if "transfer" in event:
                    self._xfer_bytes.observe(event["transfer"]["bytes"])
                    self._xfer_seconds.observe(event["transfer"]["seconds"])
                    yield None
                    continue
                yield TokenEvent(
                    event["token_ids"],
                    event["text_delta"],
                    event["logprobs"],
                    event["finished"],
                    event["finish_reason"],
                )
                if event["finished"]:
                    return
        except RpcError as e:
            if e.code == "UNAVAILABLE":
                self.instances.set_aside(instance)
            raise BackendError(f"decode instance {instance.instance_id} failed: {e.message}", 503) from e
        finally:
            self.instances.in_flight[instance.instance_id] -= 1
        raise BackendError(f"decode instance {instance.instance_id} ended the stream early", 503)

    async def _release(self, prefill, request_id: str) -> None:
        try:
            await self.instances.client(prefill).unary("release", {"request_id": request_id}, timeout=5.0)
        except RpcError as e:
            log.warning("could not release %s on %s: %s", request_id, prefill.instance_id, e)


def _fail(batch: list[tuple[GenerateRequest, asyncio.Future]], error: BackendError) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(error)
