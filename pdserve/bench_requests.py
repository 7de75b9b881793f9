"""One timed streaming request of `pdserve bench-serve`, against /v1/completions or
/v1/chat/completions, and the random prompts and arrival times it sends.

A request is timed from just before it is sent: TTFT to the first chunk that carries text
(chat: content, reasoning or a tool call; the role-only first chunk does not count), the gap
between consecutive text chunks (ITL), end-to-end to the last text chunk. Token counts are the
server's (`stream_options.include_usage`; from a server that sends none, a token a text chunk),
so TPOT = (e2e - TTFT) / (output tokens - 1). A request that fails (HTTP status, an error event
in the stream, no text, a timeout, a broken connection) is a `RequestFailure` with one line
saying why, never an exception.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# single tokens (with their leading space) in Qwen's and most BPE vocabularies: a chat prompt of n
# of them is about n tokens, plus the chat template's few
WORDS = (
    "the of and to in is it that for on with as was at by be this are from or have an they which one "
    "you were all there would their we been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like "
    "our over man even most made after also did many before must through back years where much your way"
).split()


@dataclass(slots=True)
class RequestTiming:
    ttft: float  # seconds
    itl: list[float]  # seconds between consecutive text chunks
    e2e: float
    prompt_tokens: int  # the server's usage; 0 when it sent none
    output_tokens: int

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT, AIPerf's ITL)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(slots=True)
class RequestFailure:
    error: str  # one line


def random_prompt(rng: random.Random, length: int, endpoint: str) -> list[int] | str:
    """Completions: `length` random token ids (1,000..99,999, ids every large vocabulary has);
    chat, which takes text: `length` random one-token words."""
    if endpoint == CHAT:
        return " ".join(rng.choice(WORDS) for _ in range(length))
    return [rng.randrange(1000, 100_000) for _ in range(length)]


def arrival_times(rng: random.Random, count: int, request_rate: float) -> list[float]:
    """Seconds after the start at which each request is sent: all at once for an infinite rate,
    else a Poisson process of `request_rate` requests a second (exponential gaps, vLLM's
    `--request-rate` with burstiness 1)."""
    if request_rate == float("inf"):
        return [0.0] * count
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


def request_body(
    endpoint: str, model: str, prompt: list[int] | str, output_len: int, running_usage: bool = False
) -> dict:
    """A streaming request's body; `running_usage`: every chunk carries the tokens so far
    (vLLM's continuous_usage_stats), so a chunk's tokens are known."""
    options = {"include_usage": True} | ({"continuous_usage_stats": True} if running_usage else {})
    body = {
        "model": model,
        "max_tokens": output_len,
        "ignore_eos": True,  # every request generates output_len tokens
        "temperature": 0,
        "stream": True,
        "stream_options": options,
    }
    if endpoint == CHAT:
        return body | {"messages": [{"role": "user", "content": prompt}]}
    return body | {"prompt": prompt}


def carries_text(chunk: dict) -> bool:
    """A completions chunk with text, or a chat chunk with content, reasoning or a tool call."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if delta is None:
            if choice.get("text"):
                return True
        elif delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


async def timed_request(
    client: httpx.AsyncClient,
    base_url: str,
    endpoint: str,
    model: str,
    prompt: list[int] | str,
    output_len: int,
    arrivals: list[float] | None = None,
    encoded: bytes | None = None,
    tokens_so_far: list[int] | None = None,
) -> RequestTiming | RequestFailure:
    """Send one streaming request and time it; whatever goes wrong is a RequestFailure.
    `arrivals`, when given, gets each text chunk's arrival time as it comes (a caller watching
    the stream live). `encoded`: the body already as JSON bytes (`request_body` of the same
    arguments), for a prompt too long to encode on the event loop while other streams are read.
    `tokens_so_far`, when given, gets the output tokens counted by each text chunk's running usage
    (asked for; the chunk's count in text chunks where the server sends none)."""
    running = tokens_so_far is not None
    if encoded is None:
        sent: dict = {"json": request_body(endpoint, model, prompt, output_len, running)}
    else:
        sent = {"content": encoded, "headers": {"Content-Type": "application/json"}}
    start = time.perf_counter()
    arrivals = [] if arrivals is None else arrivals
    usage: dict = {}
    try:
        async with client.stream("POST", base_url.rstrip("/") + endpoint, **sent) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestFailure(f"HTTP {response.status_code}: {one_line(text)}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestFailure(f"error event: {one_line(str(chunk['error'].get('message')))}")
                usage = chunk.get("usage") or usage
                if carries_text(chunk):
                    arrivals.append(time.perf_counter())
                    if tokens_so_far is not None:
                        counted = (chunk.get("usage") or {}).get("completion_tokens")
                        tokens_so_far.append(counted or len(arrivals))
    except (httpx.HTTPError, ValueError) as e:  # timeouts, broken connections, bad JSON
        return RequestFailure(f"{type(e).__name__}: {one_line(str(e))}")
    if not arrivals:
        return RequestFailure("the stream carried no text")
    itl = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    output_tokens = usage.get("completion_tokens") or len(arrivals)  # no usage: a token a chunk
    return RequestTiming(
        arrivals[0] - start, itl, arrivals[-1] - start, usage.get("prompt_tokens", 0), output_tokens
    )


def one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
