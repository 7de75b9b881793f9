"""Draining the router on SIGTERM/SIGINT: answer what is open, refuse what is new, then stop.

  1. the signal: new requests get 503 + Retry-After (the instance is going away; a load
     balancer retries elsewhere), `/health` says "draining" with 503;
  2. open requests go on for up to `--shutdown-timeout` seconds;
  3. then each one still open ends with an error (an SSE error event and `[DONE]` for a stream,
     a 503 for a plain request) instead of being cut off mid-stream, and the server stops.
A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

import uvicorn

from router.errors import BackendError
from router.fanout import Fanout

log = logging.getLogger("pdserve.router")
SHUTDOWN_MESSAGE = "the server is shutting down; retry the request"


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self._open: weakref.WeakSet[Fanout] = weakref.WeakSet()

    def track(self, fanout: Fanout) -> None:
        self._open.add(fanout)

    def open_requests(self) -> int:
        return sum(not f.closed for f in self._open)

    async def run(self, timeout_s: float) -> None:
        """Steps 2-3: wait for open requests, then end the rest with an error."""
        self.draining = True
        log.warning("draining: %d requests open, up to %.0f s", self.open_requests(), timeout_s)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.open_requests() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        left = [f for f in self._open if not f.closed]
        if left:
            log.warning("shutdown timeout: ending %d open requests with an error", len(left))
        for fanout in left:
            fanout.fail(BackendError(SHUTDOWN_MESSAGE, 503))
        for _ in range(40):  # let those error events reach their clients
            if not self.open_requests():
                break
            await asyncio.sleep(0.05)


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains (`Drain.run`) before the server stops."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self._draining: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: object) -> None:
        if self._draining is not None or self._loop is None:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            await self.drain.run(self.timeout_s)
            self.should_exit = True

        self._draining = asyncio.ensure_future(drain_then_exit())
