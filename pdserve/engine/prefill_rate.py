"""How fast an engine computes prompt tokens, for the prefix cache's pull-or-recompute choice."""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOKENS = 16  # a step with fewer prompt tokens says more about its fixed cost than its rate
MAX_STEP_S = 1.0  # a longer step is an outlier (a compile, a stall), not the rate


@dataclass(slots=True)
class PrefillRate:
    """Prompt tokens computed per second, an exponential average over steps; the prior until a
    step with enough prompt tokens is measured.

    A step is measured from when it was scheduled, or when the step before it was seen done if
    that came later (running ahead, a step is scheduled while the one before is still on the
    device), to when the host has its outputs: the time the device spent on it, and never an
    idle wait between requests.
    """

    tokens_per_s: float = 2_000.0
    _last_done: float = 0.0

    def measured(self, prompt_tokens: int, scheduled_at: float, done_at: float) -> None:
        took = done_at - max(scheduled_at, self._last_done)
        self._last_done = done_at
        if prompt_tokens >= MIN_TOKENS and 0 < took < MAX_STEP_S:
            self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * prompt_tokens / took
