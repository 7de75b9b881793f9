"""Which entries are worth their memory, learnt per kind from what was reused.

Two places ask. The host tier: moving an entry there copies its KV pages and its checkpoint out
(~140 MiB for a 4K-token entry at the full shape, in the engine's stream ahead of the next
passes); it pays when the entry is restored from there, and is wasted when it leaves the host tier
unused. The device: a new checkpoint in a full pool evicts an entry (and copies it to the host
tier); that pays when the new one is reused. Some kinds of entry are never reused in a workload:
a chat template that re-renders earlier answers (Qwen3.6's drops their reasoning) makes every
generation's entry (`decode`) a branch no later prompt follows. In 32 conversations with 40
device checkpoints (an 80 GB H100) those entries pushed each turn's resume points to the host
tier: 24 of 32 hits a turn came back from there and 29 entries a turn were copied out (the tiny
model, the served turn structure, session 23); with 128 (the H200's default), 64 copies in turn 3.

`ReuseAdmission` keeps, per kind, whether each of the last `WINDOW` entries was reused (restored
from the host tier; hit before it left the device). While none of a full window was, only one
entry in `PROBE` of that kind is admitted (the others are dropped, or not saved over entries of
other kinds), so a change in the workload is still seen; one reuse and every entry of the kind is
admitted again. A probe is not among the first the host tier evicts (`CacheEntry.probe`), so it
lives long enough to show a change.
"""

from __future__ import annotations

from collections import deque

WINDOW = 32  # the outcomes remembered per kind
PROBE = 8  # while a kind's window holds no restore: one entry in this many still goes to the host


class ReuseAdmission:
    def __init__(self) -> None:
        self._outcomes: dict[str, deque[bool]] = {}
        self._skipped: dict[str, int] = {}

    def throttled(self, kind: str) -> bool:
        """Whether none of the last full window of `kind`'s entries was reused."""
        outcomes = self._outcomes.get(kind)
        return outcomes is not None and len(outcomes) == WINDOW and not any(outcomes)

    def admits(self, kind: str) -> bool:
        """Whether an entry of `kind` should be admitted now (moved to the host tier, or saved
        over entries of other kinds)."""
        if not self.throttled(kind):
            return True
        skipped = self._skipped.get(kind, 0) + 1
        self._skipped[kind] = skipped % PROBE
        return skipped % PROBE == 0

    def left(self, kind: str, restored: bool) -> None:
        """An entry of `kind` leaves (`restored`: it was reused), or is reused for the first time
        (`restored` True)."""
        self._outcomes.setdefault(kind, deque(maxlen=WINDOW)).append(restored)
