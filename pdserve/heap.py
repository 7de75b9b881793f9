"""The Python heap of a serving process, kept out of the garbage collector's way.

CPython's oldest-generation collection walks every tracked object the process holds. A serving
process holds a great many that live as long as it does (the model's modules, torch's and
FastAPI's, the tokenizer, pydantic's schemas): one full collection took 76 ms in a router and
75-100 ms in an engine process on the 2-core CPU box, with the engine thread or the event loop
stopped meanwhile, so every stream's next token waits. `freeze_startup_heap` is called once, when
a process is ready to serve: what is alive then moves to the permanent generation, and later
collections walk only what was made since (vLLM does the same after its engine starts). From
then on `GC_PAUSES` counts the pauses that remain (the step log writes them, `gc_ms`).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("pdserve.heap")


def freeze_startup_heap() -> int:
    """Collect what start-up left, then freeze everything alive: the number of objects frozen.
    Objects frozen are never collected; call this once, when the process is ready to serve."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    watch_gc_pauses()
    log.info(
        "froze %d start-up objects out of garbage collection (%.0f ms)",
        frozen,
        1e3 * (time.perf_counter() - start),
    )
    return frozen


class GcPauses:
    """The collector's pauses in this process, from `gc.callbacks`: a running count and total of
    the collections of each generation (the step log writes what happened since its last line),
    and a warning for any one pause of `warn_s` or more, naming its generation. After the start-up
    heap is frozen a full collection walks what was made since: a 262K-token prompt's id lists
    (every item visited) and each request's objects; a pause holds the GIL, so no stream's token
    leaves the process meanwhile."""

    def __init__(self, warn_s: float = 0.02) -> None:
        self.warn_s = warn_s
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._began = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        generation = info.get("generation", 2)
        self.count[generation] += 1
        self.seconds[generation] += took
        if took >= self.warn_s:
            log.warning("a generation-%d garbage collection took %.0f ms", generation, 1e3 * took)


GC_PAUSES = GcPauses()


def watch_gc_pauses() -> GcPauses:
    """Count this process's collection pauses in `GC_PAUSES` (once; later calls change nothing)."""
    if GC_PAUSES not in gc.callbacks:
        gc.callbacks.append(GC_PAUSES)
    return GC_PAUSES
