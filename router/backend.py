"""What the router asks of whatever generates tokens, and `LocalBackend`: an `LLMEngine` in this process.

The router hands a backend a `GenerateRequest` (already tokenized and validated, n=1: the
router fans out n choices itself) and reads `TokenEvent`s until one has `finished=True`.
A backend raises `BackendError(message, status)` when it cannot go on; the router turns it
into a JSON error (nothing streamed yet) or an SSE error event (mid-stream). When the router
stops iterating early (client gone), the backend aborts the request and frees its memory.

`LocalBackend` lifecycle of a request:
  generate() -> ("add", req) on the inbox -> engine thread: engine.add_request
  engine thread loop: drain inbox -> engine.step() -> each RequestOutput becomes a TokenEvent,
    put on the request's asyncio queue with loop.call_soon_threadsafe
  generate() yields the events; on a finished event the engine has already freed the request;
  if the consumer goes away first, generate()'s `finally` sends ("abort", id) -> engine.abort.
Only the engine thread touches the engine (it is not thread-safe); `health()` reads counters.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.sampling.params import SamplingParams
from router.errors import BackendError
from router.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)  # seconds

__all__ = ["Backend", "BackendError", "GenerateRequest", "LocalBackend", "TokenEvent"]


@dataclass(slots=True)
class GenerateRequest:
    """One generation the router hands a backend: tokenized, validated, `params.n == 1`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class TokenEvent:
    """One step of one request: the tokens it added and their text.

    `logprobs` has one entry per token (when the request asked for logprobs), shaped like
    `RequestOutput.logprobs` items: {"token_id", "logprob", "top_logprobs": {id: logprob}}.
    `cached_tokens`: prompt tokens served from a prefix cache (any event may carry it).
    """

    token_ids: list[int]
    text_delta: str
    logprobs: list[dict] | None
    finished: bool
    finish_reason: str | None
    cached_tokens: int = 0


class Backend(Protocol):
    """What the router needs. `generate` is an async generator (`async def ... yield`): the router
    closes it (`aclose`) when it stops early, and the backend then aborts the request."""

    def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]: ...

    async def health(self) -> dict: ...

    def max_model_len(self) -> int: ...


@dataclass(slots=True)
class _Route:
    """Where the engine thread sends a request's events: a queue owned by an event loop."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue

    def send(self, item: TokenEvent | BackendError) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
            return True
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False


class LocalBackend:
    """Runs `engine` in a background thread and serves its requests to the router's event loop."""

    def __init__(self, engine: LLMEngine, metrics: RouterMetrics | None = None) -> None:
        if engine.tokenizer is None:
            raise ValueError("LocalBackend needs an engine with a tokenizer (text deltas, stop strings)")
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, object, _Route | None]] = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}  # engine thread only
        self._step_seconds = None
        if metrics is not None:
            self._step_seconds = metrics.histogram(
                "local_engine_step_seconds", "One LLMEngine.step() of the local backend.", STEP_BUCKETS
            )
        self._thread = threading.Thread(target=self._run, name="pdserve-local-engine", daemon=True)
        self._thread.start()

    # ---- the Backend interface (event-loop side)
    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        if not self._thread.is_alive():
            raise BackendError("the local engine is stopped", 503)
        route = _Route(asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("add", req, route))
        finished = False
        try:
            while not finished:
                item = await route.events.get()
                if isinstance(item, BackendError):
                    finished = True  # the engine thread already dropped the request
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._inbox.put(("abort", req.request_id, None))

    async def health(self) -> dict:
        if not self._thread.is_alive():
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
        if self._thread.is_alive():
            self._inbox.put(("stop", None, None))
            self._thread.join(timeout)

    # ---- the engine thread
    def _run(self) -> None:
        while self._drain(block=not self.engine.has_unfinished()):
            if not self.engine.has_unfinished():
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # a broken step must not leave clients waiting forever
                log.exception("engine step failed")
                self._fail_all(BackendError(f"engine step failed: {type(e).__name__}: {e}", 500))
                continue
            if self._step_seconds is not None:
                self._step_seconds.observe(time.perf_counter() - start)
            for out in outputs:
                self._deliver(out)
            if not outputs:
                time.sleep(0.001)  # nothing sampled (chunked prefill, or waiting for memory)
        self._fail_all(BackendError("the local engine is stopped", 503))

    def _drain(self, block: bool) -> bool:
        """Apply every queued command (waiting for one if `block`); False on "stop"."""
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, payload, route = command
            if kind == "stop":
                return False
            if kind == "add":
                self._add(payload, route)
            elif kind == "abort":
                self.engine.abort(payload)
                self._routes.pop(payload, None)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, req: GenerateRequest, route: _Route) -> None:
        try:
            self.engine.add_request(req.prompt_token_ids, req.params, req.request_id)
        except ValueError as e:
            route.send(BackendError(str(e), 400))
            return
        self._routes[req.request_id] = route

    def _deliver(self, out: RequestOutput) -> None:
        route = self._routes.get(out.request_id)
        if route is None:  # aborted while this step ran
            return
        if out.finished:
            del self._routes[out.request_id]
        n = len(out.new_token_ids)
        event = TokenEvent(
            token_ids=list(out.new_token_ids),
            text_delta=out.text_delta,
            logprobs=None if out.logprobs is None else out.logprobs[len(out.logprobs) - n :],
            finished=out.finished,
            finish_reason=out.finish_reason,
        )
        if not route.send(event) and not out.finished:
            self.engine.abort(out.request_id)
            del self._routes[out.request_id]

    def _fail_all(self, error: BackendError) -> None:
        for request_id, route in list(self._routes.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine may be what broke; the client still gets its error
                log.exception("aborting %s failed", request_id)
            route.send(error)
        self._routes.clear()
