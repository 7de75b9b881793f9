"""The metrics of the disaggregated path: burst sizes, state transfers, prefix-cache routing."""

from __future__ import annotations

from router.metrics import TTFT_BUCKETS, RouterMetrics

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
BYTES_BUCKETS = tuple(2**k for k in range(10, 34, 2))
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class DisaggMetrics:
    def __init__(self, metrics: RouterMetrics) -> None:
        self.batch_size = metrics.histogram("prefill_batch_size", "Requests per prefill burst", BATCH_BUCKETS)
        self.xfer_bytes = metrics.histogram("transfer_bytes", "State bytes moved per request", BYTES_BUCKETS)
        self.xfer_seconds = metrics.histogram(
            "transfer_seconds", "State transfer time per request", SECONDS_BUCKETS
        )
        self.cached_tokens = metrics.counter(
            "prefix_cache_hit_tokens", "Prompt tokens served from a prefill instance's prefix cache"
        )
        self.prefix_routed = metrics.counter(
            "prefix_routed_requests", "Requests sent to the prefill instance caching their prefix"
        )
        self.prefix_pull_hints = metrics.counter(
            "prefix_pull_hints",
            "Requests sent naming a peer that holds a longer cached prefix to pull (a decode "
            "instance, or the busy prefill instance the request went around)",
        )
        # where a request's first token waits (the router's TTFT is their sum plus the wire):
        # in the router for its burst, queued on the prefill instance, then its prefill passes
        self.burst_wait = metrics.histogram(
            "prefill_burst_wait_seconds", "Arrival at the router to its burst going out", TTFT_BUCKETS
        )
        self.queue_time = metrics.histogram(
            "request_queue_time_seconds",
            "Arrival on the prefill instance to the first step that scheduled it",
            TTFT_BUCKETS,
        )
        self.prefill_time = metrics.histogram(
            "request_prefill_time_seconds", "First scheduled to its first token", TTFT_BUCKETS
        )
        self.decoded = metrics.counter(
            "decode_requests", "Requests sent to each decode instance", ["instance"]
        )

    def first_token(self, burst_wait_s: float, queue_s: float, prefill_s: float) -> None:
        """Where one request's first token waited (`PrefillResult.queue_s`, `.prefill_s`)."""
        self.burst_wait.observe(burst_wait_s)
        self.queue_time.observe(queue_s)
        self.prefill_time.observe(prefill_s)

    def transfer(self, figures: dict) -> None:
        """One request's state transfer (`{"bytes", "seconds"}`; 0 bytes when decoded in place)."""
        self.xfer_bytes.observe(figures["bytes"])
        self.xfer_seconds.observe(figures["seconds"])
