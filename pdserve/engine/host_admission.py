"""Which evicted entries are worth a copy to the host tier, learnt from what came back.

Moving an entry to the host tier copies its KV pages and its checkpoint out (~140 MiB for a
4K-token entry at the full shape, in the engine's stream ahead of the next passes). It pays when
the entry is restored from there, and is wasted when the entry leaves the host tier unused. Some
kinds of entry are never reused in a workload: a chat template that re-renders earlier answers
(Qwen3.6's drops their reasoning) makes every generation's entry (`decode`) a branch no later
prompt follows, and a 32-conversation run on the H200 moved ~65 of them a turn through the host
tier (simulated on the CPU, session 16).

`HostAdmission` keeps, per kind, whether each of the last `WINDOW` entries moved to the host tier
was restored before it left. While none of a full window was, only one entry in `PROBE` of that
kind is moved there (the others are dropped), so a change in the workload is still seen; one
restore and every entry of the kind is moved again. A probe is not among the first the host tier
evicts (`CacheEntry.probe`), so it lives long enough to show a change.
"""

from __future__ import annotations

from collections import deque

WINDOW = 32  # the outcomes remembered per kind
PROBE = 8  # while a kind's window holds no restore: one entry in this many still goes to the host


class HostAdmission:
    def __init__(self) -> None:
        self._outcomes: dict[str, deque[bool]] = {}
        self._skipped: dict[str, int] = {}

    def throttled(self, kind: str) -> bool:
        """Whether none of the last full window of `kind`'s entries moved to the host was restored."""
        outcomes = self._outcomes.get(kind)
        return outcomes is not None and len(outcomes) == WINDOW and not any(outcomes)

    def admits(self, kind: str) -> bool:
        """Whether an evicted entry of `kind` should be moved to the host tier now."""
        if not self.throttled(kind):
            return True
        skipped = self._skipped.get(kind, 0) + 1
        self._skipped[kind] = skipped % PROBE
        return skipped % PROBE == 0

    def left(self, kind: str, restored: bool) -> None:
        """An entry of `kind` moved to the host tier leaves it (`restored`: after a restore from
        there), or is restored from it for the first time (`restored` True)."""
        self._outcomes.setdefault(kind, deque(maxlen=WINDOW)).append(restored)
