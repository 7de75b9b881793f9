"""`LocalBackend`: an `LLMEngine` in this process behind the router's `Backend` interface.

The tests serve a tiny engine through the router app with it (tests/router_server.py). It lives
with the tests: the router imports neither the engine nor torch.

Lifecycle of a request:

  generate() -> EngineThread.call(engine.add_request) (a bad request: BackendError 400)
  engine thread loop (pdserve.engine.engine_thread): engine.step() -> each RequestOutput
    becomes a TokenEvent, put on the request's asyncio queue with loop.call_soon_threadsafe
  generate() yields the events; on a finished event the engine has already freed the request;
  if the consumer goes away first, generate()'s `finally` calls engine.abort on that thread.
Only the engine thread touches the engine (it is not thread-safe); `health()` reads counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from router.backend import BackendError, GenerateRequest, TokenEvent, prompt_entries
from router.metrics import RouterMetrics

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)  # seconds

__all__ = ["LocalBackend"]


class LocalBackend:
    """Runs `engine` on an `EngineThread` and serves its requests to the router's event loop."""

    def __init__(self, engine: LLMEngine, metrics: RouterMetrics | None = None) -> None:
        if engine.tokenizer is None:
            raise ValueError("LocalBackend needs an engine with a tokenizer (text deltas, stop strings)")
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._step_seconds = None
        if metrics is not None:
            self._step_seconds = metrics.histogram(
                "local_engine_step_seconds", "One LLMEngine.step() of the local backend.", STEP_BUCKETS
            )
        self._thread = EngineThread(engine, self._on_outputs, self._on_error, on_step=self._observe_step)
        self._thread.start()
        self._stopped = False

    # ---- the Backend interface (event-loop side)
    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        if self._stopped:
            raise BackendError("the local engine is stopped", 503)
        events: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = (asyncio.get_running_loop(), events)
        finished = False
        try:
            try:
                await self._thread.call(
                    self.engine.add_request, req.prompt_token_ids, req.params, req.request_id
                )
            except ValueError as e:
                finished = True
                raise BackendError(str(e), 400) from e
            while not finished:
                item = await events.get()
                if isinstance(item, BackendError):
                    finished = True  # the engine thread already dropped the request
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(req.request_id, None)
            if not finished and not self._stopped:
                await self._thread.call(self.engine.abort, req.request_id)

    async def health(self) -> dict:
        if self._stopped:
            raise BackendError("the local engine is stopped", 503)
        scheduler, runner = self.engine.scheduler, self.engine.runner
        return {
            "backend": "local",
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "free_kv_pages": runner.kv_pool.num_free,
            "free_state_slots": runner.state_pool.num_free,
        }

    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running end with a 503 BackendError."""
        if not self._stopped:
            self._stopped = True
            self._thread.stop(timeout)
            self._on_error(list(self._queues), "the local engine is stopped", status=503)

    # ---- called on the engine thread
    def _observe_step(self, seconds: float) -> None:
        if self._step_seconds is not None:
            self._step_seconds.observe(seconds)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            n = len(out.new_token_ids)
            first = n == len(out.token_ids)  # the request's first output: its prompt logprobs go with it
            event = TokenEvent(
                token_ids=list(out.new_token_ids),
                text_delta=out.text_delta,
                logprobs=None if out.logprobs is None else out.logprobs[len(out.logprobs) - n :],
                finished=out.finished,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                prompt_logprobs=prompt_entries(out.prompt_token_ids, out.prompt_logprobs) if first else None,
            )
            self._send(out.request_id, event)

    def _on_error(self, request_ids: list[str], message: str, status: int = 500) -> None:
        for request_id in request_ids:
            self._send(request_id, BackendError(message, status))

    def _send(self, request_id: str, item: TokenEvent | BackendError) -> None:
        target = self._queues.get(request_id)
        if target is None:  # aborted while this step ran
            return
        loop, events = target
        try:
            loop.call_soon_threadsafe(events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._queues.pop(request_id, None)
