"""The prefix cache in the router's /metrics, from what every instance publishes with its load
(`load["prefix_cache"]`, `pdserve.prefix_stats`): hits by where the state came from,
misses by why, pulls from peers by outcome, evictions by where the entry went, summed over the live
instances.

Instances publish running totals; the router turns each instance's increase since its last view
into counter increments (a total that went down is a restarted instance: counted from zero).
"""

from __future__ import annotations

from pdserve.prefix_stats import HIT_SOURCES, MISS_REASONS, PULL_OUTCOMES
from router.metrics import RouterMetrics


class PrefixCacheMetrics:
    def __init__(self, metrics: RouterMetrics) -> None:
        self.hit_tokens = metrics.counter(
            "prefix_cache_hit_tokens_by_source",
            "Prompt tokens reused from a prefix cache: gpu (an instance's own pools), host (its "
            "host tier), peer (pulled from another instance for the request)",
            ["source"],
        )
        self.hit_requests = metrics.counter(
            "prefix_cache_hit_requests", "Requests that reused a cached prefix, by source", ["source"]
        )
        self.misses = metrics.counter(
            "prefix_cache_misses",
            "Requests that reused nothing: no_entry, evicted, diverged (shared cached tokens but no "
            "checkpoint there), too_short (not worth a checkpoint, or a pull that would not pay)",
            ["reason"],
        )
        self.pulls = metrics.counter(
            "prefix_cache_pulls", "Cached prefixes pulled from a peer: done, failed, refused", ["outcome"]
        )
        self.pull_bytes = metrics.counter("prefix_cache_pull_bytes", "Bytes of cached prefixes pulled")
        self.evictions = metrics.counter(
            "prefix_cache_evictions",
            "Cache entries taken off an instance's GPU to make room: to host (moved to its host tier, "
            "a device-to-host copy) or dropped",
            ["to"],
        )
        self._seen: dict[str, dict] = {}

    def observe(self, instance_id: str, report: dict | None) -> None:
        """Count what `instance_id` did since its last report (its `load["prefix_cache"]`)."""
        if not isinstance(report, dict):
            return
        last = self._seen.get(instance_id, {})
        for counter, field, labels in (
            (self.hit_tokens, "hit_tokens", HIT_SOURCES),
            (self.hit_requests, "hit_requests", HIT_SOURCES),
            (self.misses, "misses", MISS_REASONS),
            (self.pulls, "pulls", PULL_OUTCOMES),
        ):
            now, before = report.get(field) or {}, last.get(field) or {}
            for label in labels:
                _inc(counter.labels(label), now.get(label, 0), before.get(label, 0))
        _inc(self.pull_bytes, report.get("pull_bytes", 0), last.get("pull_bytes", 0))
        for to, now, before in (
            ("host", report.get("demoted", 0), last.get("demoted", 0)),
            ("dropped", _dropped(report), _dropped(last)),
        ):
            _inc(self.evictions.labels(to), now, before)
        self._seen[instance_id] = report


def _dropped(report: dict) -> object:
    """Evicted entries that were not moved to the host tier (None when the report has no count)."""
    evicted, demoted = report.get("evicted", 0), report.get("demoted", 0)
    return evicted - demoted if isinstance(evicted, int) and isinstance(demoted, int) else None


def _inc(counter: object, now: object, before: object) -> None:
    if not isinstance(now, int) or not isinstance(before, int):
        return
    delta = now - before if now >= before else now  # went down: the instance restarted
    if delta > 0:
        counter.inc(delta)
