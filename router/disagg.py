"""`DisaggBackend`: the router's path through prefill and decode instances.

Request lifecycle:
  1. first token: the request joins a burst to a prefill instance (`router.bursts`), which
     streams back its `PrefillResult` as soon as it is prefilled (the TTFT) with, unless it
     ended there, a `Lease` on its KV pages and GDN state slot;
  2. a decode instance (least loaded) gets a `decode` stream: it READs the state through NIXL,
     checks the lease with its holder, then streams tokens; the router forwards them;
  3. a decode instance that could not get the state (ABORTED: its holder died, the lease
     expired) has the request prefilled once more, and decoding goes on only if that gives the
     same first token (greedy and seeded requests do);
  4. a client that leaves aborts its request where it is: taken out of a burst not yet sent,
     aborted on the prefill instance (queued, prefilling or held), or its lease released.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import asdict

from pdserve.messages import DecodeEvent, DecodeStart, PrefillResult
from pdserve.rpc import RpcError
from router.backend import GenerateRequest, TokenEvent, prompt_entries
from router.bursts import Background, BurstConfig, PrefillBursts
from router.disagg_metrics import DisaggMetrics
from router.errors import BackendError
from router.instances import InstanceSet, NoInstanceError
from router.metrics import RouterMetrics

__all__ = ["BurstConfig", "DisaggBackend"]
log = logging.getLogger("pdserve.router")


class StateLost(Exception):
    """A decode instance could not get a request's prefilled state (no token of it decoded)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class DisaggBackend:
    def __init__(
        self,
        instances: InstanceSet,
        metrics: RouterMetrics,
        max_model_len: int,
        burst: BurstConfig | None = None,
    ) -> None:
        self.instances = instances
        self._max_model_len = max_model_len
        self.metrics = DisaggMetrics(metrics)
        self.background = Background()
        self.bursts = PrefillBursts(instances, self.metrics, burst or BurstConfig(), self.background)

    def max_model_len(self) -> int:
        """The longest request every live instance takes (each publishes its own, which the
        memory plan may have lowered to what its KV pool holds), never above the router's own
        limit; the router's limit alone while no instance has registered."""
        published = [
            info.extra["max_model_len"]
            for role in self.instances.live.values()
            for info in role.values()
            if isinstance(info.extra.get("max_model_len"), int)
        ]
        return min([self._max_model_len, *published])

    async def health(self) -> dict:
        counts = self.instances.counts()
        return {"status": "ok" if counts["prefill"] and counts["decode"] else "degraded", **counts}

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        first, prefill = await self.bursts.first_token(req)
        self.metrics.cached_tokens.inc(first.num_cached_tokens)
        yield TokenEvent(
            [] if first.token_id is None else [first.token_id],  # None: max_tokens 0, the prompt only
            first.text_delta,
            first.logprobs,
            first.finished,
            first.finish_reason,
            cached_tokens=first.num_cached_tokens,
            prompt_logprobs=prompt_entries(req.prompt_token_ids, first.prompt_logprobs),
            stop_reason=first.stop_reason,
        )
        if first.finished:  # max_tokens 0 or 1, a stop: no lease was made, no decode stream opens
            return
        for attempt in range(2):
            pulled, lost = False, None
            try:
                async for event in self._decode(req, first):
                    pulled = True
                    if event is not None:
                        yield event
                return
            except StateLost as e:
                lost = e
            finally:
                if not pulled:  # decode never took the state over: free it on the prefill instance
                    self.background.spawn(self.bursts.release(prefill, first))
            if pulled or attempt:
                raise BackendError(lost.message, 503)
            # the state never reached decode (its holder died, say): prefill once more, around
            # that instance if another is live; the first token must come out the same again
            log.warning("%s; prefilling %s again", lost.message, req.request_id)
            again, prefill = await self.bursts.first_token(req, exclude=frozenset({prefill.instance_id}))
            if again.finished or again.token_id != first.token_id:
                self.background.spawn(self.bursts.release(prefill, again))
                raise BackendError(lost.message, 503)
            first = again

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
                    event.token_ids,
                    event.text_delta,
                    event.logprobs,
                    event.finished,
                    event.finish_reason,
                    stop_reason=event.stop_reason,
                )
                if event.finished:
                    return
        except RpcError as e:
            if e.code == "ABORTED":  # the state did not arrive; the instance is fine
                raise StateLost(f"decode instance {instance.instance_id}: {e.message}") from None
            if e.code == "UNAVAILABLE":
                self.instances.set_aside(instance)
            raise BackendError(f"decode instance {instance.instance_id} failed: {e.message}", 503) from e
        finally:
            self.instances.in_flight[instance.instance_id] -= 1
        raise BackendError(f"decode instance {instance.instance_id} ended the stream early", 503)
