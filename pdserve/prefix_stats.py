"""What the prefix cache did, counted: hits by where the state came from, misses by why.

Sources: "gpu" (an entry in this instance's pools), "host" (restored from the host tier),
"peer" (pulled from another instance for this request). Reasons for a miss (nothing reused):
"no_entry" (no cached prefix shares a block with the prompt), "evicted" (one did, and was
evicted), "diverged" (the prompt shares cached blocks but no checkpoint at or before where it
diverges), "too_short" (what could be reused is too short to pay for itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

HIT_SOURCES = ("gpu", "host", "peer")
MISS_REASONS = ("no_entry", "evicted", "diverged", "too_short")
PULL_OUTCOMES = ("done", "failed", "refused")


@dataclass(slots=True)
class PrefixStats:
    hit_requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HIT_SOURCES, 0))
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HIT_SOURCES, 0))
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    saved: int = 0  # checkpoints taken (copied or adopted)
    evicted: int = 0  # entries taken off the device to make room (dropped, or moved to the host tier)
    demoted: int = 0  # of those, the ones moved to the host tier (a device-to-host copy each)
    # pulls of entries from peers (pdserve.prefix_sharing): done, failed, or not started because
    # recomputing was cheaper; bytes read
    pulls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PULL_OUTCOMES, 0))
    pull_bytes: int = 0

    def hit(self, source: str, tokens: int) -> None:
        self.hit_requests[source] += 1
        self.hit_tokens[source] += tokens

    def miss(self, reason: str) -> None:
        self.misses[reason] += 1

    def report(self) -> dict:
        """The counters as a JSON-able dict (published with an instance's load)."""
        return {
            "hit_requests": dict(self.hit_requests),
            "hit_tokens": dict(self.hit_tokens),
            "misses": dict(self.misses),
            "saved": self.saved,
            "evicted": self.evicted,
            "demoted": self.demoted,
            "pulls": dict(self.pulls),
            "pull_bytes": self.pull_bytes,
        }
