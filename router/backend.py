"""What the router asks of whatever generates tokens: the `Backend` interface and its messages.

The router hands a backend a `GenerateRequest` (already tokenized and validated, n=1: the
router fans out n choices itself) and reads `TokenEvent`s until one has `finished=True`.
A backend raises `BackendError(message, status)` when it cannot go on; the router turns it
into a JSON error (nothing streamed yet) or an SSE error event (mid-stream). When the router
stops iterating early (client gone), the backend aborts the request and frees its memory.

`LocalBackend` (an `LLMEngine` in this process, for tests and benchmarks) lives in
`router.local_backend`, which imports the engine; this module imports neither it nor torch, so
`router.server` (the disaggregated router) runs without them. `from router.backend import
LocalBackend` still works: the name is imported on first use.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from router.errors import BackendError

if TYPE_CHECKING:
    from pdserve.sampling.params import SamplingParams
    from router.local_backend import LocalBackend


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


def __getattr__(name: str) -> Any:
    """`LocalBackend`, imported from `router.local_backend` (and so the engine) on first use."""
    if name == "LocalBackend":
        from router.local_backend import LocalBackend

        return LocalBackend
    raise AttributeError(f"module 'router.backend' has no attribute {name!r}")
