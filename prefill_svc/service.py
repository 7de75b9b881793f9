"""The prefill service: packs each burst of prompts into shared passes, samples each first
token, and holds the request's KV pages + GDN state slot until a decode instance pulls them.

Request lifecycle (one prompt of a burst):
  1. `prefill` RPC: validated and queued on the engine thread (a bad prompt fails alone,
     the rest of the burst goes on);
  2. packed prefill with the other prompts of the burst (chunked under the token budget);
  3. first token sampled -> the request either ends here (eos, a stop, max_tokens=1) and its
     memory is freed, or it is handed over: the RPC answers with its `RequestPayload`;
  4. held until the decode instance's NIXL READ completes (its notification names the
     request) or the router releases it; after `handoff_timeout_s` it is freed anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass

from kvtransfer import RequestPayload
from pdserve.engine.llm_engine import RequestOutput
from pdserve.engine.sequence import Sequence
from pdserve.sampling.params import SamplingParams
from pdserve.serving import EngineService, ServiceConfig, prefix_cache_info

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillConfig(ServiceConfig):
    """The one config object of a prefill process."""

    handoff_timeout_s: float = 60.0


@dataclass(slots=True)
class HeldRequest:
    seq: Sequence
    deadline: float


class PrefillService(EngineService):
    def __init__(self, config: PrefillConfig) -> None:
        self.held: dict[str, HeldRequest] = {}
        self._futures: dict[str, asyncio.Future] = {}
        self._seqs: dict[str, Sequence] = {}
        self._prefix_keys: list[str] = []  # snapshot of the cache's keys, replaced by the engine thread
        self._prefix_version = -1
        super().__init__(config)

    # ---- RPC handlers
    async def prefill(self, msg: dict) -> dict:
        """{"requests": [{request_id, prompt_token_ids, params}]} -> {"results": [...]}, in order."""
        requests = msg.get("requests")
        if not isinstance(requests, list) or not requests or not all(isinstance(r, dict) for r in requests):
            raise ValueError("prefill wants a non-empty list of requests")
        ids = [r.get("request_id") for r in requests]
        if not all(isinstance(i, str) and i for i in ids) or len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique non-empty strings")
        futures = {rid: self._loop.create_future() for rid in ids}
        self._futures.update(futures)
        try:
            errors = await self.thread.call(self._admit, requests)
        except BaseException:
            for rid in ids:
                self._futures.pop(rid, None)
            raise
        results = []
        for r in requests:
            rid = r["request_id"]
            if rid in errors:
                self._futures.pop(rid, None)
                results.append({"request_id": rid, "error": errors[rid]})
            else:
                results.append(await futures[rid])
        return {"results": results}

    async def endpoint(self, msg: dict) -> dict:
        return dict(self.agent.endpoint())

    async def release(self, msg: dict) -> dict:
        """The router gave up on a handed-over request (decode failed or the client left)."""
        return {"released": await self.thread.call(self._release, msg["request_id"])}

    def load(self) -> dict:
        return {**super().load(), "held": len(self.held)}

    def extra(self) -> dict:
        return prefix_cache_info(self.engine)

    def prefix_keys(self) -> list[str]:
        return self._prefix_keys

    # ---- on the engine thread
    def _admit(self, requests: list[dict]) -> dict[str, str]:
        errors = {}
        for r in requests:
            rid = r["request_id"]
            if rid in self.held or rid in self._seqs:
                errors[rid] = f"request id {rid!r} is already in use"
                continue
            try:
                params = SamplingParams(**r.get("params", {}))
                seq = self.engine.make_sequence(r.get("prompt_token_ids"), params, rid)
            except (ValueError, TypeError) as e:
                errors[rid] = str(e)
                continue
            seq.prefill_only = True
            self._seqs[rid] = seq
            self.engine.enqueue(seq)
        return errors

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        results = []
        for out in outputs:
            seq = self._seqs.pop(out.request_id)
            result = {
                "request_id": out.request_id,
                "token_id": out.new_token_ids[0],
                "text_delta": out.text_delta,
                "logprobs": out.logprobs,
                "finished": not out.handed_over,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
                "num_prompt_tokens": seq.num_prompt_tokens,
                "num_cached_tokens": out.num_cached_tokens,
                "payload": None,
            }
            if out.handed_over:
                payload = RequestPayload(
                    out.request_id,
                    list(seq.block_table),
                    seq.state_slot,
                    seq.num_prompt_tokens,
                    self.agent.name,
                )
                result["payload"] = asdict(payload)
                self.held[out.request_id] = HeldRequest(seq, time.monotonic() + self.config.handoff_timeout_s)
            results.append(result)
        self._loop.call_soon_threadsafe(self._deliver, results)

    def _on_error(self, request_ids: list[str], message: str) -> None:
        results = [{"request_id": rid, "error": message} for rid in request_ids]
        for rid in request_ids:
            self._seqs.pop(rid, None)
        self._loop.call_soon_threadsafe(self._deliver, results)

    def _deliver(self, results: list[dict]) -> None:
        for result in results:
            future = self._futures.pop(result["request_id"], None)
            if future is not None and not future.done():
                future.set_result(result)

    def _release(self, request_id: str) -> bool:
        held = self.held.pop(request_id, None)
        if held is None:
            return False
        self.engine.scheduler.release_held(held.seq)
        return True

    def _tick(self) -> bool:
        cache = self.engine.prefix_cache
        if cache is not None and cache.version != self._prefix_version:  # rebuilt only on a change
            self._prefix_keys = [key.hex() for key in cache.entries]
            self._prefix_version = cache.version
        for rid in self.agent.take_done_notifications():
            self._release(rid)
        now = time.monotonic()
        for rid in [rid for rid, h in self.held.items() if h.deadline < now]:
            logger.warning(
                "request %s was never pulled; freeing its state after %.0f s",
                rid,
                self.config.handoff_timeout_s,
            )
            self._release(rid)
        # NIXL completes a decode instance's READ only as this side progresses: poll often
        # while any request is held for a transfer
        return bool(self.held)
