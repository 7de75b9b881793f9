"""Admission at the router: how many generations may wait for their first token, and how long.

A generation (one choice of one request: `n` x prompts of them) is *queued* from the moment the
router hands it to the backend until its first event (a token, or an error).

  --max-queued-requests N  a request whose generations would take the queue past N is refused
                           at once: 503 with Retry-After (code "queue_full"). A request always
                           gets into an empty queue, so one larger than N still runs, alone.
  --queue-timeout S        a request with a generation still queued S seconds after it arrived
                           ends with 503 + Retry-After (code "queue_timeout"): the status when
                           nothing was sent yet, else (a stream already under way, another choice
                           started) an SSE error event then `data: [DONE]`. Its generations are
                           cancelled: closing a backend generator aborts its work.
0 turns either off. `AdmissionConfig` also carries the request gate's settings (router.gate):
the API keys and the body limit.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from router.errors import RETRY_AFTER_S, OpenAIError
from router.fanout import Fanout, Item
from router.gate import ApiKey
from router.metrics import RouterMetrics


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Who gets into the router, and for how long a request may wait for its first token."""

    api_keys: tuple[ApiKey, ...] = ()  # none: /v1/ is open
    max_request_bytes: int = 32 << 20  # a larger body is refused (413)
    max_queued_requests: int = 1024  # generations without a first token; 0: no cap
    queue_timeout_s: float = 60.0  # longest wait for a first token; 0: none

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1 or self.max_queued_requests < 0 or not self.queue_timeout_s >= 0:
            raise ValueError(
                "max_request_bytes must be >= 1, max_queued_requests and queue_timeout_s >= 0, got "
                f"{self.max_request_bytes}, {self.max_queued_requests}, {self.queue_timeout_s}"
            )
        if len({k.key for k in self.api_keys}) < len(self.api_keys):
            raise ValueError("an API key is given twice")


class QueueTimeout(OpenAIError):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"no first token within the queue timeout ({timeout_s:g} s): the server is overloaded",
            503,
            code="queue_timeout",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class Admission:
    """The queue count and its two limits, shared by every request of one app."""

    def __init__(self, config: AdmissionConfig, metrics: RouterMetrics) -> None:
        self.max_queued = config.max_queued_requests or None
        self.timeout_s = config.queue_timeout_s or None
        self.metrics = metrics
        self.queued = 0

    def admit(self, num_generations: int, arrival: float) -> Ticket:
        """A request's place in the queue, or OpenAIError(503) when it would overfill it."""
        if self.max_queued is not None and self.queued and self.queued + num_generations > self.max_queued:
            self.metrics.reject("queue_full")
            raise OpenAIError(
                f"the server is busy: {self.queued} generations are waiting for a first token "
                f"(at most {self.max_queued}); retry later",
                503,
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.queued += num_generations
        deadline = None if self.timeout_s is None else arrival + self.timeout_s
        return Ticket(self, num_generations, deadline)


class Ticket:
    """One request's generations in the queue. `next(fanout)` is `fanout.next()` that takes each
    choice out of the queue at its first event and raises QueueTimeout past the deadline while
    one is still queued; `close()` (idempotent) takes out whatever is left."""

    def __init__(self, admission: Admission, num_generations: int, deadline: float | None) -> None:
        self.admission = admission
        self.queued = set(range(num_generations))
        self.deadline = deadline

    async def next(self, fanout: Fanout) -> Item:
        if not self.queued or self.deadline is None:
            item = await fanout.next()
        else:
            try:
                item = await asyncio.wait_for(fanout.next(), self.deadline - time.monotonic())
            except TimeoutError:
                self.admission.metrics.reject("queue_timeout")
                raise QueueTimeout(self.admission.timeout_s) from None
        if item[0] in self.queued:
            self.queued.discard(item[0])
            self.admission.queued -= 1
        return item

    def close(self) -> None:
        self.admission.queued -= len(self.queued)
        self.queued.clear()
