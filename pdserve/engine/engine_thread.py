"""An `LLMEngine` on its own thread, driven from asyncio services.

Loop, each turn:
  1. run the calls queued by `call()` (admissions, aborts, releases: they touch the pools,
     so only this thread touches the engine and the transfer agent);
  2. `tick()`: the service's own polling (transfer states, done notifications, expiries);
  3. `engine.step()` when there is work, and hand its outputs to `on_outputs`;
  4. when nothing ran, sleep until woken by a new call, or `idle_s` when the tick asked to be
     called again soon (a transfer to poll), or 50 ms.
A failing step fails the requests it held (reported through `on_error`), never the thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.step_log import StepLog
from pdserve.ops import compile_watch

logger = logging.getLogger(__name__)
SLOW_STEP_S = 1.0  # a step this long is logged: no healthy step takes it


def describe_pass(scheduled: list[ScheduledSeq]) -> str:
    """One line on what a pass ran: its shape, for logs."""
    chunks = [s.num_new_tokens for s in scheduled if s.num_new_tokens > 1]
    saves = sum(len(s.saves) for s in scheduled)
    return (
        f"{len(scheduled) - len(chunks)} decoding, {len(chunks)} prefill chunks of "
        f"{sum(chunks)} tokens (longest {max(chunks, default=0)}), {saves} checkpoints inside"
    )


class EngineThread:
    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_error: Callable[[list[str], str], None],
        tick: Callable[[], bool] | None = None,
        idle_s: float = 0.002,
        on_step: Callable[[float], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_outputs = on_outputs
        self.on_error = on_error
        self.tick = tick or (lambda: False)
        self.idle_s = idle_s
        self.on_step = on_step or (lambda seconds: None)
        self._calls: queue.SimpleQueue[
            tuple[Callable, tuple, Callable[[Any, BaseException | None], None]]
        ] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.step_log = StepLog()  # PDSERVE_STEP_LOG: a line a step (off by default)
        self._turn_started: float | None = None  # monotonic start of the turn under way

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.step_log.close()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the engine thread between steps; its exception is raised here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            def set_result() -> None:
                if future.cancelled():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            loop.call_soon_threadsafe(set_result)

        self._calls.put((fn, args, settle))
        self._wake.set()
        return await future

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the engine thread between steps, without waiting for it (from any
        thread: cleanup paths that must not await); its exception is logged."""

        def settle(result: Any, error: BaseException | None) -> None:
            if error is not None:
                logger.error("engine call %s failed: %r", getattr(fn, "__name__", fn), error)

        self._calls.put((fn, args, settle))
        self._wake.set()

    def busy_s(self) -> float:
        """Seconds the thread has spent in its current turn (calls, tick, step); 0 while it waits.
        A turn that never ends (a hung step, a deadlocked call) grows without bound."""
        started = self._turn_started
        return 0.0 if started is None else time.monotonic() - started

    def stuck(self, limit_s: float) -> str | None:
        """Why the service should stop its heartbeat: the current turn has run more than `limit_s`
        (0: never), else None."""
        busy = self.busy_s()
        if limit_s and busy > limit_s:
            return f"the engine thread has been in one turn (step or call) for {busy:.0f} s, over {limit_s:g}"
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._turn_started = time.monotonic()
            self._run_calls()
            busy = self._safe_tick()
            if self.engine.has_unfinished() and self._safe_step():
                continue
            # nothing ran: idle, or waiting requests that cannot be admitted yet (memory held
            # for transfers) - poll again soon when the tick wants it, never spin
            self._turn_started = None
            self._wake.wait(self.idle_s if busy else 0.05)
            self._wake.clear()
        self._turn_started = None

    def _run_calls(self) -> None:
        while True:
            try:
                fn, args, settle = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                settle(None, e)
            else:
                settle(result, None)

    def _safe_tick(self) -> bool:
        try:
            return bool(self.tick())
        except Exception:
            logger.exception("engine tick failed")
            return False

    def _safe_step(self) -> bool:
        """One engine step; False when it had nothing it could run."""
        start = time.perf_counter()
        try:
            ran = bool(self.engine.scheduler.running)
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing its requests")
            failed = list(self.engine.requests)
            for request_id in failed:
                self.engine.abort(request_id)
            self.on_error(failed, f"engine step failed: {type(e).__name__}: {e}")
            return True
        took = time.perf_counter() - start
        self.on_step(took)
        if self.step_log.enabled:
            engine = self.engine
            cache = engine.prefix_cache
            stats = cache.stats if cache is not None else None
            self.step_log.record(
                start, took, engine.last_pass, engine.scheduler, engine.background.host, stats
            )
        compiled = compile_watch.take()  # Triton kernels built in this step (with the watch on)
        if took > SLOW_STEP_S or compiled:
            s = self.engine.scheduler
            why = (
                f"{len(compiled)} Triton kernels compiled in it: {compile_watch.describe(compiled)}"
                if compiled
                else "no Triton compile seen: host work in the step, or an unwatched compile"
            )
            logger.warning(
                "an engine step took %.2f s (last pass: %s; %d running, %d waiting after it); %s",
                took,
                describe_pass(self.engine.last_pass),
                len(s.running),
                len(s.waiting),
                why,
            )
        if outputs:
            self.on_outputs(outputs)
        return ran or bool(self.engine.scheduler.running) or bool(outputs)
