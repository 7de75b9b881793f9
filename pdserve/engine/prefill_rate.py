"""How fast an engine computes prompt tokens, for the prefix cache's pull-or-recompute choice."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefillRate:
    """Prompt tokens computed per second, measured over back-to-back steps (a step's time runs
    from one `schedule` to the next), an exponential average; `prior` until measured."""

    tokens_per_s: float = 2_000.0
    _started: float | None = None
    _tokens: int = 0

    def step_started(self, now: float) -> None:
        if self._started is not None and self._tokens >= 16 and 0 < now - self._started < 1.0:
            self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * self._tokens / (now - self._started)
        self._started, self._tokens = now, 0

    def scheduled(self, tokens: int) -> None:
        self._tokens = tokens
