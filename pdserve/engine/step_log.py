"""A timeline of engine steps, one JSON line a step, for finding where a request's time goes
(`PDSERVE_STEP_LOG=/path/steps.jsonl` in an engine process's environment; off by default).

Each line: `t` (perf_counter at the step's start, s), `s` (its wall time, s), and what the pass it
launched ran: `decode` rows, prefill `chunks` and their `tokens`, checkpoint `saves`, and the
scheduler's `running` / `waiting` counts after it; with a background pass in flight, `bg_ms`: the
host time the step spent starting, launching and ending it, and of that, where not zero,
`bg_start_ms` (its batch built), `bg_end_ms` (its chunk committed) and `bg_layers` (layers
launched); with the prefix cache, `hits` (requests
that started from a cached prefix since the line before, by source: "gpu", "host", "peer") and
`evicted` (entries taken off the device) and `to_host` (of those, moved to the host tier), where
not zero: the host tier's copies run on the compute stream, so a pass that restored or demoted
entries waited on them. On a GPU, the CUDA caching allocator's events since the line before, where
not zero: `device_allocs` / `device_frees` (cudaMalloc / cudaFree calls; a cudaFree waits for the
device), `alloc_retries` (allocations that failed, freed the cache and tried again) and
`allocator_syncs` (times it synchronized every stream): host time that waits for the GPU. Where
the garbage collector paused the process since the line before (`pdserve.heap.GC_PAUSES`, once the
start-up heap is frozen): `gc_ms`, the pauses' total, and `gc_full`, how many were full collections.
A step that launched nothing writes no line.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import TextIO

import torch

from pdserve.engine.background_pass import BackgroundHostTime
from pdserve.engine.scheduler import ScheduledSeq, Scheduler
from pdserve.heap import GC_PAUSES, GcPauses
from pdserve.prefix_stats import PrefixStats

ENV = "PDSERVE_STEP_LOG"
logger = logging.getLogger(__name__)
ALLOCATOR_EVENTS = {  # the step log's name: torch.cuda.memory_stats()'s
    "device_allocs": "num_device_alloc",
    "device_frees": "num_device_free",
    "alloc_retries": "num_alloc_retries",
    "allocator_syncs": "num_sync_all_streams",
}


def allocator_events() -> dict[str, int]:
    """The CUDA caching allocator's event counters on the current device ({} where CUDA is not in use)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    stats = torch.cuda.memory_stats_as_nested_dict()  # these counters sit at its top; no flattening
    return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_EVENTS.items()}


class StepLog:
    def __init__(
        self,
        path: str | None = None,
        allocator: Callable[[], dict[str, int]] = allocator_events,
        gc_pauses: GcPauses = GC_PAUSES,
    ) -> None:
        path = path if path is not None else os.environ.get(ENV)
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._last: list[ScheduledSeq] | None = None
        self._seen = PrefixStats()  # the cache's counters at the line before
        self._allocator = allocator
        self._allocator_seen: dict[str, int] = allocator() if self._file is not None else {}
        self._gc = gc_pauses
        self._gc_seen = (sum(gc_pauses.seconds), gc_pauses.count[2])

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def record(
        self,
        start: float,
        took: float,
        last_pass: list[ScheduledSeq],
        scheduler: Scheduler,
        background: BackgroundHostTime | None = None,
        cache_stats: PrefixStats | None = None,
    ) -> None:
        """One line for the step that began at `start`, when it launched a pass (`last_pass` is new)."""
        if self._file is None or not last_pass or last_pass is self._last:
            return
        self._last = last_pass
        chunks = [s.num_new_tokens for s in last_pass if s.num_new_tokens > 1]
        line = {
            "t": round(start, 6),
            "s": round(took, 6),
            "decode": len(last_pass) - len(chunks),
            "chunks": len(chunks),
            "tokens": sum(chunks),
            "saves": sum(len(s.saves) for s in last_pass),
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
        }
        if background is not None and background.total:
            line["bg_ms"] = round(1000 * background.total, 3)
            parts = {"bg_start_ms": background.start, "bg_end_ms": background.end}
            line.update({k: round(1000 * v, 3) for k, v in parts.items() if v})
            if background.layers:
                line["bg_layers"] = background.layers
        if cache_stats is not None:
            line.update(self._cache_delta(cache_stats))
        line.update(self._allocator_delta())
        line.update(self._gc_delta())
        try:
            self._file.write(json.dumps(line) + "\n")
        except OSError as e:  # a full disk must not stop the engine: the log stops instead
            logger.warning("step log stopped: %s", e)
            self.close()

    def _cache_delta(self, stats: PrefixStats) -> dict:
        """`hits` by source and `evicted` since the last call, the zero ones left out."""
        hits = {k: n - self._seen.hit_requests.get(k, 0) for k, n in stats.hit_requests.items()}
        evicted, demoted = stats.evicted - self._seen.evicted, stats.demoted - self._seen.demoted
        self._seen = PrefixStats(
            hit_requests=dict(stats.hit_requests), evicted=stats.evicted, demoted=stats.demoted
        )
        delta: dict = (
            {"hits": {k: n for k, n in hits.items() if n > 0}} if any(n > 0 for n in hits.values()) else {}
        )
        if evicted > 0:
            delta["evicted"] = evicted
        if demoted > 0:
            delta["to_host"] = demoted
        return delta

    def _allocator_delta(self) -> dict[str, int]:
        """The allocator's events since the last call, the ones that did not happen left out."""
        counts, seen = self._allocator(), self._allocator_seen
        self._allocator_seen = counts
        return {k: n - seen.get(k, 0) for k, n in counts.items() if n > seen.get(k, 0)}

    def _gc_delta(self) -> dict:
        """The garbage collector's pauses since the last call (`gc_ms`, all generations) and of
        those the full collections (`gc_full`), where there were any."""
        seconds, full = sum(self._gc.seconds), self._gc.count[2]
        (seen_s, seen_full), self._gc_seen = self._gc_seen, (seconds, full)
        delta: dict = {"gc_ms": round(1000 * (seconds - seen_s), 3)} if seconds > seen_s else {}
        if full > seen_full:
            delta["gc_full"] = full - seen_full
        return delta

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
