"""The stats line a service logs every 10 s while it serves, as vLLM's engines do:

    prefill-0: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 3.1 tokens/s,
    Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

(one line). Throughputs are over the interval since the last line; running, waiting and KV-cache
use are the instance's load at the moment (`load_report`); the prefix-cache hit
rate (engines with the prefix cache only) is cached prompt tokens over prompt tokens of the last
1,000 requests prefilled here. A role that hands requests over adds `Held` (prefill: states
waiting to be pulled) and `Receiving` (decode: states being pulled) when they are not zero.

A prompt counts on the instance that prefilled it, all its tokens (cached ones too, as vLLM's
prompt throughput), when the request's first token comes out there; a decode instance, which
starts from a first token sampled elsewhere, counts only the tokens it generates. An idle service
logs one line of zeros after its last activity, then nothing until the next request.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

STATS_INTERVAL_S = 10.0  # vLLM's
RECENT_REQUESTS = 1000  # the prefix-cache hit rate's window (vLLM's)


def load_report(engine: LLMEngine) -> dict:
    """An instance's load as the registry publishes it (read on the engine thread)."""
    s, runner = engine.scheduler, engine.runner
    return {
        "running": len(s.running),
        "waiting": len(s.waiting),
        "held": len(s.held),
        "receiving": len(s.receiving),
        "free_kv_pages": runner.kv_pool.num_free,
        "free_state_slots": runner.state_pool.num_free,
        "kv_pages": runner.kv_pool.num_pages - runner.reserved,
        "state_slots": runner.state_pool.num_slots - runner.reserved,
        "prefix_cache_pages": engine.prefix_cache.num_pages if engine.prefix_cache else 0,
    }


class Output(Protocol):  # the fields of pdserve.engine.llm_engine.RequestOutput read here
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    num_cached_tokens: int


def prefilled_here(output: Output) -> bool:
    """The output carries the request's first token(s), so its prompt was prefilled here (a
    request received from a prefill instance already has its first token when it starts)."""
    return 0 < len(output.new_token_ids) == len(output.token_ids)


class ServingStats:
    """Token counts from the engine thread's outputs, turned into one line per interval."""

    def __init__(self, name: str, interval_s: float = STATS_INTERVAL_S, prefix_cache: bool = False) -> None:
        self.name = name
        self.interval_s = interval_s
        self.prefix_cache = prefix_cache
        self.prompt_tokens = 0  # since the last line
        self.generation_tokens = 0
        self.recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=RECENT_REQUESTS)
        self.last_line_at = time.monotonic()
        self.was_active = False  # the last line had tokens or requests

    def observe(self, outputs: Iterable[Output]) -> None:
        """Count one engine step's outputs (on the engine thread)."""
        for output in outputs:
            self.generation_tokens += len(output.new_token_ids)
            if prefilled_here(output):
                self.prompt_tokens += len(output.prompt_token_ids)
                self.recent.append((len(output.prompt_token_ids), output.num_cached_tokens))

    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens of the recent requests (0 before any)."""
        prompt = sum(tokens for tokens, _ in self.recent)
        return sum(cached for _, cached in self.recent) / prompt if prompt else 0.0

    def line(self, load: dict, now: float | None = None) -> str | None:
        """The stats line once `interval_s` has passed since the last one (then counting starts
        over), or None: too early, or idle now and at the last line too."""
        now = time.monotonic() if now is None else now
        seconds = now - self.last_line_at
        if self.interval_s <= 0 or seconds < self.interval_s:
            return None
        active = bool(self.prompt_tokens or self.generation_tokens)
        active = active or any(load.get(key, 0) for key in ("running", "waiting", "held", "receiving"))
        quiet = not active and not self.was_active
        text = None if quiet else self._format(load, seconds)
        self.prompt_tokens = self.generation_tokens = 0
        self.last_line_at, self.was_active = now, active
        return text

    def _format(self, load: dict, seconds: float) -> str:
        parts = [
            f"Avg prompt throughput: {self.prompt_tokens / seconds:.1f} tokens/s",
            f"Avg generation throughput: {self.generation_tokens / seconds:.1f} tokens/s",
            f"Running: {load.get('running', 0)} reqs",
            f"Waiting: {load.get('waiting', 0)} reqs",
        ]
        parts += [f"{key.title()}: {load[key]} reqs" for key in ("held", "receiving") if load.get(key)]
        pages, free = load.get("kv_pages"), load.get("free_kv_pages")
        if pages and free is not None:
            parts.append(f"KV cache usage: {100 * (1 - free / pages):.1f}%")
        if self.prefix_cache:
            parts.append(f"Prefix cache hit rate: {100 * self.hit_rate():.1f}%")
        return f"{self.name}: " + ", ".join(parts)
