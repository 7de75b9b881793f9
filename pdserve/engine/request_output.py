"""What the engine reports of a request after each step (`LLMEngine.step`'s outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step; `new_token_ids`/`text_delta` are what this step added.

    `token_ids` and `logprobs` are the request's own lists (not copied every step: that would
    cost O(length) per token), complete once `finished`; `text` is set once `finished` only
    (joining it every step would cost as much).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None  # params.prompt_logprobs: None, then a token each
    lease_id: str | None = None  # handed over: the state stays in the pools under this lease
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


def output_of(
    seq: Sequence, new_tokens: list[int], text_delta: str, lease_id: str | None = None
) -> RequestOutput:
    """`seq`'s output after a step that added `new_tokens` (and `text_delta`)."""
    finished = seq.status is SequenceStatus.FINISHED
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=seq.output_token_ids,
        text=seq.stop_checker.text if finished else "",
        finished=finished,
        lease_id=lease_id,
        num_cached_tokens=seq.num_cached_tokens,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        new_token_ids=new_tokens,
        text_delta=text_delta,
        logprobs=seq.logprobs if seq.params.logprobs is not None else None,
        prompt_logprobs=seq.prompt_logprobs,
    )
