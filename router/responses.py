"""Building OpenAI answers: responses, stream chunks, usage (the logprobs formats are
router.logprob_formats').

A `ResponseFormat` (ChatFormat or CompletionFormat, in router.response_formats) is made per HTTP
request; the app feeds it `Choice`s, one per backend generation, which accumulate the `TokenEvent`s.
A completions choice with `echo` starts with the prompt's text and, with `logprobs`, the prompt
tokens' logprobs (the first with null logprob), as vLLM returns them; streamed, both go in the
choice's first chunk. Prompt logprobs asked for (`prompt_logprobs`) are also returned in vLLM's
form: per choice for completions, at the top for chat. A chat request with output parsing
(router.chat_output: reasoning, tool calls) gives each choice a parser: streamed, each event's text
goes through it into `reasoning_content` / `content` / `tool_calls` deltas; not streamed, the whole
text does, into the message; after tool calls a "stop" finishes as "tool_calls".
`sse` frames one event of a stream; `ClosingStreamingResponse` sends a stream and releases what it
holds however the stream ends.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.tokenizer import Tokenizer
from router.backend import TokenEvent
from router.chat_output import ChatOutputParser
from router.logprob_formats import vllm_prompt_logprobs


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <compact JSON, or the text as it is>`."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: also when the client left before the
    stream's generator started (its `finally` would never run then)."""

    def __init__(self, content: AsyncIterator[str], on_close: tuple[Callable[[], None], ...]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for close in self.on_close:
                close()


@dataclass(slots=True)
class Choice:
    """What one choice produced so far."""

    index: int
    prompt_tokens: int
    prefix: str = ""  # text put before the output (completions with echo: the prompt)
    echo: bool = False  # completions: the prompt (text, and with logprobs its tokens') comes first
    deltas: list[str] = field(default_factory=list)  # joined once, at the end: no O(length) a token
    num_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)
    has_logprobs: bool = False  # the request asked for logprobs (max_tokens 0 yields no entry)
    prompt_logprobs: list[dict] | None = None  # TokenEvent.prompt_logprobs, when asked for
    started: bool = False  # a chunk of this choice went out (streaming)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cached_tokens: int = 0
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    parser: ChatOutputParser | None = None  # chat with reasoning or tool-call parsing

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    def add(self, event: TokenEvent) -> None:
        self.deltas.append(event.text_delta)
        self.num_tokens += len(event.token_ids)
        self.logprobs.extend(event.logprobs or ())
        self.has_logprobs |= event.logprobs is not None
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.finish_reason = event.finish_reason
        self.stop_reason = event.stop_reason
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)


def usage(choices: list[Choice], n: int) -> dict:
    """OpenAI usage: each prompt counted once (not once per choice), every choice's output."""
    prompts = [choices[p : p + n] for p in range(0, len(choices), n)]
    prompt_tokens = sum(group[0].prompt_tokens for group in prompts)
    completion_tokens = sum(c.num_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(max(c.cached_tokens for c in g) for g in prompts)},
    }


class ResponseFormat:
    """The envelope both APIs share; subclasses say how a choice and its logprobs look."""

    id_prefix = ""
    object_name = ""
    chunk_object = ""

    def __init__(self, model: str, tokenizer: Tokenizer, n: int, include_usage: bool = False) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.n = n
        self.include_usage = include_usage
        self.continuous_usage = False  # set by the handler: stream_options.continuous_usage_stats

    def new_choice(self, index: int, prompt_tokens: int, prefix: str = "") -> Choice:
        return Choice(index=index, prompt_tokens=prompt_tokens, prefix=prefix)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choices: list[dict]) -> dict:
        body = self._envelope(self.chunk_object, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def with_running_usage(self, chunk: dict, choices: list[Choice]) -> dict:
        """`chunk` with vLLM's continuous usage when asked for: its choice's prompt and output
        tokens so far (each choice counted alone, its prompt with it)."""
        if self.continuous_usage and len(chunk["choices"]) == 1:
            choice = choices[chunk["choices"][0]["index"]]
            total = choice.prompt_tokens + choice.num_tokens
            chunk["usage"] = {
                "prompt_tokens": choice.prompt_tokens,
                "completion_tokens": choice.num_tokens,
                "total_tokens": total,
            }
        return chunk

    def usage_chunk(self, choices: list[Choice]) -> dict:
        return {**self.chunk([]), "usage": usage(choices, self.n)}

    def response(self, choices: list[Choice]) -> dict:
        body = self._envelope(self.object_name, [self.final_choice(c) for c in choices])
        self.add_prompt_logprobs(body, choices)
        return {**body, "usage": usage(choices, self.n)}

    def one_choice_chunk(
        self,
        index: int,
        payload: dict,
        logprobs: dict | None = None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        choice = {"index": index, **payload, "logprobs": logprobs, "finish_reason": finish_reason}
        return self.chunk([{**choice, "stop_reason": stop_reason}])

    def event_chunk(self, choice: Choice, event: TokenEvent) -> dict | None:
        """The chunk of one event (after `choice.add(event)`); None when it has nothing to say
        (text held back for a stop string or an incomplete character, no logprobs)."""
        first = not choice.started
        if not (event.text_delta or event.logprobs or event.finished or (first and choice.echo)):
            return None
        choice.started = True
        entries = event.logprobs
        delta = self.delta(event)
        if first and choice.echo:  # vLLM's first echo chunk: the prompt's text, then the output's
            delta = {"text": choice.prefix + event.text_delta}
            if choice.has_logprobs:
                entries = [*(choice.prompt_logprobs or ()), *entries]
        logprobs = None if entries is None else self.logprobs(choice, entries)
        chunk = self.one_choice_chunk(choice.index, delta, logprobs, event.finish_reason, event.stop_reason)
        if event.prompt_logprobs is not None:
            self.add_prompt_logprobs(chunk, [choice])
        return chunk

    def final_choice(self, choice: Choice) -> dict:
        entries = choice.logprobs
        if choice.echo:
            entries = [*(choice.prompt_logprobs or ()), *entries]
        logprobs = self.logprobs(choice, entries) if choice.has_logprobs else None
        return {
            "index": choice.index,
            **self.message(choice),
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def add_prompt_logprobs(self, body: dict, choices: list[Choice]) -> None:
        """Put the choices' prompt logprobs (vLLM's form) into a response or chunk `body`."""
        for choice, out in zip(choices, body["choices"], strict=True):
            if choice.prompt_logprobs is not None:
                out["prompt_logprobs"] = vllm_prompt_logprobs(self.token_text, choice.prompt_logprobs)

    # ---- what differs between the two APIs
    def head_chunks(self, choices: list[Choice]) -> list[dict]:
        """Chunks sent before any token event."""
        return []

    def delta(self, event: TokenEvent) -> dict:
        raise NotImplementedError

    def message(self, choice: Choice) -> dict:
        raise NotImplementedError

    def logprobs(self, choice: Choice, entries: list[dict]) -> dict:
        raise NotImplementedError
