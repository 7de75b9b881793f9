"""The request gate: pure ASGI middleware in front of every route (no BaseHTTPMiddleware: it
would get in the way of streaming and of noticing client disconnects), answering in the OpenAI
shape before the app sees the request:

  413  a body declared (Content-Length) larger than `max_bytes`, or, without a Content-Length
       (a chunked body), as soon as more than `max_bytes` arrived: counted while the app reads,
       so the app never holds more than `max_bytes` plus one chunk of it
  401  a `/v1/` route without a valid API key: `Authorization: Bearer <key>`, the scheme in any
       case (RFC 9110); every configured key is compared, in constant time
  429  a POST to `/v1/` by a key already at its `max_concurrency` requests in flight (a request
       is in flight until its answer, a whole stream included, is sent), with `Retry-After`

It also stamps each HTTP request's arrival (`request.state.arrived`, `arrival_of`): the router's
TTFT, preprocess and latency histograms start there, so the body's reading and validation and any
wait for the event loop (a burst of chat turns queues there) are the router's time too.

With no API key configured every route is open. `/health` and `/metrics` always are (for probes
and scrapers, as vLLM's `--api-key`).

API keys come from `--api-key` (repeatable), `--api-key-file` and `$PDSERVE_API_KEY`. A key file
has one key a line, optionally followed by its concurrency limit (`KEY 8`); blank lines and lines
starting with `#` are skipped.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import error_response
from router.metrics import RouterMetrics

ARRIVED = "arrived"  # request.state's: time.monotonic() when the request's headers reached the gate


def arrival_of(request: Request) -> float:
    """When `request` reached the router (the gate's stamp; now, for an app without the gate): its
    body's reading, parsing and validation, and any wait for the event loop, count as the router's."""
    return getattr(request.state, ARRIVED, None) or time.monotonic()


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key clients send as a Bearer token, with the number of requests it may have in flight."""

    key: str
    max_concurrency: int | None = None  # None: no limit

    def __post_init__(self) -> None:
        if not self.key or any(c.isspace() for c in self.key):
            raise ValueError("an API key must be non-empty, without whitespace")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"an API key's max_concurrency must be >= 1, got {self.max_concurrency}")


def parse_api_keys(lines: Iterable[str], source: str) -> list[ApiKey]:
    """`KEY` or `KEY max_concurrency` a line; blank lines and `#` comments skipped."""
    keys = []
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2 or (len(fields) == 2 and not fields[1].isdigit()):
            raise ValueError(f"{source}:{number}: expected `KEY` or `KEY max_concurrency`")
        keys.append(ApiKey(fields[0], int(fields[1]) if len(fields) == 2 else None))
    return keys


def read_api_key_file(path: str | Path) -> list[ApiKey]:
    return parse_api_keys(Path(path).read_text().splitlines(), str(path))


class RequestGate:
    """Body size, API keys and per-key concurrency (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        api_keys: Sequence[ApiKey] = (),
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.keys = [(key.key.encode(), key) for key in api_keys]
        self.metrics = metrics
        self.in_flight: dict[str, int] = {}  # key -> its requests in flight (limited keys only)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})[ARRIVED] = time.monotonic()  # the headers are in: arrival
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(scope, receive, send, self._too_large(), 413)
        key = None
        if self.keys and scope["path"].startswith("/v1/"):
            key = self._key_of(headers.get(b"authorization", b""))
            if key is None:
                response = error_response("invalid or missing API key", 401, code="invalid_api_key")
                return await response(scope, receive, send)
        if key is None or key.max_concurrency is None or scope["method"] != "POST":
            return await self.app(scope, self._counted(receive), send)
        if self.in_flight.get(key.key, 0) >= key.max_concurrency:
            if self.metrics is not None:
                self.metrics.reject("key_concurrency")
            message = f"this API key already has {key.max_concurrency} requests in flight (its limit)"
            return await self._refuse(scope, receive, send, message, 429, "rate_limit_exceeded")
        self.in_flight[key.key] = self.in_flight.get(key.key, 0) + 1
        try:
            await self.app(scope, self._counted(receive), send)
        finally:
            self.in_flight[key.key] -= 1
            if not self.in_flight[key.key]:
                del self.in_flight[key.key]

    def _key_of(self, authorization: bytes) -> ApiKey | None:
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token, found = token.lstrip(b" "), None
        for secret, key in self.keys:  # all of them: the time taken does not say which one matched
            if hmac.compare_digest(token, secret):
                found = key
        return found

    def _too_large(self) -> str:
        return f"request body larger than {self.max_bytes} bytes"

    def _counted(self, receive: Receive) -> Receive:
        """`receive`, raising a 413 (to the app's error handlers) once the body passes max_bytes."""
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._too_large())
            return message

        return counted

    @staticmethod
    async def _refuse(
        scope: Scope, receive: Receive, send: Send, message: str, status: int, code: str | None = None
    ) -> None:
        await error_response(message, status, code=code)(scope, receive, send)
