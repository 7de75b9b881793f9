"""What the router asks of whatever generates tokens: the `Backend` interface and its messages.

The router hands a backend a `GenerateRequest` (already tokenized and validated, n=1: the
router fans out n choices itself) and reads `TokenEvent`s until one has `finished=True`.
A backend raises `BackendError(message, status)` when it cannot go on; the router turns it
into a JSON error (nothing streamed yet) or an SSE error event (mid-stream). When the router
stops iterating early (client gone), the backend aborts the request and frees its memory.

The router never imports the engine (nor torch): the backend it serves with is the
disaggregated one (`router.disagg`); the tests' `LocalBackend` (tests/local_backend.py) puts an
`LLMEngine` of their own process behind this interface.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from router.errors import BackendError

if TYPE_CHECKING:
    from pdserve.sampling.params import SamplingParams


__all__ = ["Backend", "BackendError", "GenerateRequest", "TokenEvent", "prompt_entries"]


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
    `prompt_logprobs` (the first event, when `params.prompt_logprobs` asked): one entry per prompt
    token, shaped like `logprobs` items plus "rank"; the first token's has its "token_id" only
    (nothing predicts it). `token_ids` is empty when `params.max_tokens` is 0 (the prompt scored).
    `stop_reason` (the finished event): the stop string or stop token id that ended the request,
    None for end-of-sequence and for "length" (vLLM's `stop_reason`).
    """

    token_ids: list[int]
    text_delta: str
    logprobs: list[dict] | None
    finished: bool
    finish_reason: str | None
    cached_tokens: int = 0
    prompt_logprobs: list[dict] | None = None
    stop_reason: int | str | None = None


def prompt_entries(prompt_token_ids: list[int], engine_entries: list | None) -> list[dict] | None:
    """`TokenEvent.prompt_logprobs` from the engine's (whose first entry is None, as vLLM's)."""
    if engine_entries is None:
        return None
    return [{"token_id": prompt_token_ids[0]}, *engine_entries[1:]]


class Backend(Protocol):
    """What the router needs. `generate` is an async generator (`async def ... yield`): the router
    closes it (`aclose`) when it stops early, and the backend then aborts the request."""

    def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]: ...

    async def health(self) -> dict: ...

    def max_model_len(self) -> int: ...
