"""Publishing the entries of this instance's prefix cache in Redis (`{ns}:prefix:{key}` -> this
instance, read by the router's prefix route), so that a conversation's next turn finds the
instance holding its previous turn.

Two kinds of writes, each one pipelined round-trip:
  - new keys, as soon as the step that made them is over: the engine thread wakes the
    publisher (`EngineHost.on_prefix_keys`, a call_soon_threadsafe: it never waits on Redis),
    which writes the keys it has not written yet. Wake-ups that come while a write is on its
    way are folded into the next one, so a burst of steps costs a write or two, and a step
    that changed nothing (or only dropped entries) costs none. `published(version)` waits
    (at most `PUBLISHED_WAIT_S`) until a snapshot's keys are written: the decode role sends a
    request's last token after that, so the conversation's next turn, sent the moment the
    answer is in, finds the answer's entry;
  - every key, once every FULL_WRITE_BEATS heartbeats, with a TTL of three such periods: an
    evicted entry (or a dead instance) drops out by itself, and the keys come back after a
    Redis restart. Not every beat: a full write is ~20-45 us of the event loop's Python a key,
    and a 262K-token prompt alone leaves 4,096 keys (~0.1-0.2 s a write, the engine thread
    waiting for the GIL meanwhile); the registry writes them in slices, the loop free between.
With Redis away, a failed write is logged once and retried at the next beat only (no retry
per step); when it answers again every key is written at once. The engine thread never notices.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.registry import InstanceRegistry
from pdserve.serving import EngineHost

log = logging.getLogger("pdserve.serving")
PUBLISHED_WAIT_S = 0.05  # the longest a last token waits for its entry's write (a slow Redis)
FULL_WRITE_BEATS = 5  # every key is written again this often (in heartbeats), TTL 3 times that


class PrefixPublisher:
    """Built on the host's event loop; `run()` is a task there until cancelled."""

    def __init__(
        self, registry: InstanceRegistry, host: EngineHost, instance_id: str, interval_s: float
    ) -> None:
        self.registry = registry
        self.host = host
        self.instance_id = instance_id
        self.interval_s = interval_s
        self._published: set[str] = set()  # written since the last full write
        self._written = -1  # the snapshot version whose keys are all in Redis
        self._failing = False
        self._changed = asyncio.Event()
        self._progress = asyncio.Event()  # set (and replaced) after each write
        self._loop = asyncio.get_running_loop()
        host.publisher = self

    def notify(self) -> None:
        """New keys may be there (any thread; returns at once)."""
        try:
            self._loop.call_soon_threadsafe(self._changed.set)
        except RuntimeError:  # the loop is closed: the service is stopping
            pass

    async def published(self, version: int, timeout_s: float = PUBLISHED_WAIT_S) -> None:
        """Until the keys of snapshot `version` are written; at once while Redis fails."""
        deadline = self._loop.time() + timeout_s
        while self._written < version and not self._failing:
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(self._progress.wait(), remaining)
            except TimeoutError:
                return

    async def run(self) -> None:
        """Publish until cancelled; then the host no longer waits on this publisher (a request
        finishing while the service drains is not held back for a write that cannot come)."""
        try:
            await self._publish_forever()
        finally:
            if self.host.publisher is self:
                self.host.publisher = None

    async def _publish_forever(self) -> None:
        next_full = time.monotonic()
        while True:
            self._changed.clear()  # before reading the keys: a change after it wakes us again
            now = time.monotonic()
            full = now >= next_full
            version, keys = self.host.prefix_snapshot()
            if not full:
                keys = [key for key in keys if key not in self._published]
            try:
                if keys:
                    ttl_s = 3 * FULL_WRITE_BEATS * self.interval_s
                    await self.registry.set_prefix_owners(keys, self.instance_id, ttl_s=ttl_s)
                self._published = set(keys) if full else self._published | set(keys)
                self._written = version
                if self._failing:
                    log.warning("prefix keys: Redis answers again")
                self._failing = False
            except Exception as e:  # Redis away (or anything else): retry at the next beat
                if not self._failing:
                    log.warning("prefix keys: cannot publish (%s); retrying every %.1fs", e, self.interval_s)
                self._failing, full = True, True
            self._progress.set()
            self._progress = asyncio.Event()
            if full:  # while Redis fails: again at the next beat
                next_full = now + self.interval_s * (1 if self._failing else FULL_WRITE_BEATS)
            await self._wait(next_full - time.monotonic(), beat_only=self._failing)

    async def _wait(self, timeout_s: float, beat_only: bool) -> None:
        """Until the next beat, or a change first (unless Redis is failing)."""
        if timeout_s <= 0:
            return
        if beat_only:
            await asyncio.sleep(timeout_s)
            return
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass
