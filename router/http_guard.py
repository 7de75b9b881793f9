"""uvicorn's HTTP/1.1 protocol with two limits it lacks: a connection must send a whole request
(headers and body) within `request_timeout_s` of opening (or of its last answer), and the router
keeps at most `max_connections` open, closing any beyond at once.

Without them a connection flood took the router down (robustness audit): 20,000 connections
that sent half a request line and waited were kept forever, the process ran out of file
descriptors, /health and every request timed out, and asyncio logged a failed accept() in a
loop (100 MB of log a minute). Timing only the headers would not do: a request with complete
headers and a Content-Length whose body never comes held its connection as long (review). Now
a request that does not arrive whole goes after the timeout, and the descriptors never run out:
a connection past the cap is closed as it is accepted. Once a request is in, its answer is not
timed here (it may stream for minutes), and a pipelined request read with the last answer is in.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT_S = 30.0  # a request's headers and body (at most --max-request-bytes) in this long
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
    """H11Protocol with the request timeout and the connection cap (class attributes: uvicorn
    makes the protocol from the class, `uvicorn.Config(http=guarded_protocol(...))`)."""

    request_timeout_s: float = REQUEST_TIMEOUT_S
    max_connections: int = 10_000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._request_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            transport.close()  # frees the descriptor now: the flood cannot use them all
            return
        self._time_the_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._request_in():
            self._stop_timing()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may read a pipelined request in already
        if not self.transport.is_closing() and not self._request_in():
            self._time_the_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_request_timer", None) is not None:
            self._stop_timing()
        super().connection_lost(exc)

    def _request_in(self) -> bool:
        """Has the client sent its whole request (h11: their side DONE, or closing after it)?"""
        return self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)

    def _time_the_request(self) -> None:
        self._stop_timing()
        self._request_timer = self.loop.call_later(self.request_timeout_s, self._request_late)

    def _stop_timing(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _request_late(self) -> None:
        self._request_timer = None
        if not self._request_in() and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(**limits: Any) -> type[GuardedH11Protocol]:
    """GuardedH11Protocol with `request_timeout_s` and `max_connections` set."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), limits)
