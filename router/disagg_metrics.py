"""The metrics of the disaggregated path: burst sizes, state transfers, prefix-cache routing."""

from __future__ import annotations

from router.metrics import RouterMetrics

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
        self.decoded = metrics.counter(
            "decode_requests", "Requests sent to each decode instance", ["instance"]
        )

    def transfer(self, figures: dict) -> None:
        """One request's state transfer (`{"bytes", "seconds"}`; 0 bytes when decoded in place)."""
        self.xfer_bytes.observe(figures["bytes"])
        self.xfer_seconds.observe(figures["seconds"])
