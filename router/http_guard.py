"""uvicorn's HTTP/1.1 protocol with two limits it lacks: a connection must send a request's
headers within `header_timeout_s` of opening (or of its last response), and the router keeps
at most `max_connections` open, closing any beyond at once.

Without them a connection flood took the router down (robustness audit): 20,000 connections
that sent half a request line and waited were kept forever, the process ran out of file
descriptors, /health and every request timed out, and asyncio logged a failed accept() in a
loop (100 MB of log a minute). Now the half-open ones go after the header timeout, and the
descriptors never run out: a connection past the cap is closed as it is accepted. A request
whose headers have arrived is not timed here (its body is bounded by the request gate, its
answer may stream for minutes).
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 20.0  # nginx's client_header_timeout is 60 s; a client sends its headers at once
FD_MARGIN = 1024  # descriptors left for Redis, gRPC channels, files and the flood's own accepts


def connection_cap() -> int:
    """Raise the descriptor limit to its hard limit (as vLLM does) and return the connections
    the router may keep open under it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return max(64, soft - FD_MARGIN)


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with the header timeout and the connection cap (class attributes: uvicorn
    makes the protocol from the class, `uvicorn.Config(http=guarded_protocol(...))`)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    max_connections: int = 10_000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            transport.close()  # frees the descriptor now: the flood cannot use them all
            return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._timed_cycle:
            self._header_timer.cancel()  # a new request's headers are in: it is not timed here
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._timed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is self._timed_cycle and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(**limits: Any) -> type[GuardedH11Protocol]:
    """GuardedH11Protocol with `header_timeout_s` and `max_connections` set."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), limits)
