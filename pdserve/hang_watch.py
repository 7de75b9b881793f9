"""`pdserve up`'s watch on its services' heartbeats: a service that runs but does not beat is hung.

A service refreshes its instance key in Redis every HEARTBEAT_S (1 s) with a TTL of 3 beats
(pdserve.service_process); routers drop an instance whose key expired (router/instances.py).
The supervisor reads the keys' remaining TTL (one pipelined PTTL per poll), which dates each
service's last beat, and calls a service hung when

    it has beaten since it (re)started, and not for `timeout_s`   (--heartbeat-timeout, 10 s)
    it has not beaten since it (re)started, for `start_grace_s`   (--startup-timeout: loading the
                                                                   weights and warming up come
                                                                   before the first beat)

The supervisor then kills it and restarts it as a dead one (`Child.kill_hung`). A SIGSTOPped
process, a deadlocked event loop, a service that cannot reach Redis: all stop beating, and so does
a service whose engine thread has been held in one step for `--engine-stuck-timeout` (60 s) while
its event loop runs (`EngineThread.stuck`). While Redis does not answer the supervisor, nobody is
judged, and for `timeout_s` after it answers again (the services' beats come back within one).
"""

from __future__ import annotations

import math

import redis

from pdserve.registry import HEARTBEAT_S, HEARTBEAT_TTL_BEATS, ROLES, instance_key
from pdserve.supervisor import Child, say

TTL_S = HEARTBEAT_S * HEARTBEAT_TTL_BEATS  # the TTL a beat sets on the instance key


class HeartbeatWatch:
    """The last heartbeat of each supervised service (by pid: a restarted one starts afresh)."""

    def __init__(
        self,
        redis_url: str,
        password: str | None,
        timeout_s: float,
        start_grace_s: float,
        ttl_s: float = TTL_S,
    ) -> None:
        if timeout_s <= 0 or start_grace_s <= 0:
            raise ValueError("timeout_s and start_grace_s must be positive")
        self.timeout_s, self.start_grace_s, self.ttl_s = timeout_s, start_grace_s, ttl_s
        self._redis = redis.Redis.from_url(
            redis_url, password=password, socket_connect_timeout=1.0, socket_timeout=1.0
        )
        self._beat_at: dict[int, float] = {}  # pid -> its last beat seen (monotonic)
        self._blind = False  # Redis did not answer the last read
        self._judge_after = -math.inf  # no verdict before (Redis answered again at - timeout)

    def _last_beats(self, children: list[Child], now: float) -> dict[str, float] | None:
        """Each service's last beat (by name) as its keys date it, or None when Redis fails."""
        keys = [(child.name, instance_key(role, child.name)) for child in children for role in ROLES]
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                for _name, key in keys:
                    pipe.pttl(key)
                ttls = pipe.execute()
        except (redis.RedisError, OSError) as e:
            if not self._blind:
                say(f"cannot read the services' heartbeats from Redis ({e}): none is judged hung meanwhile")
            self._blind = True
            return None
        if self._blind:
            say("Redis answers again: heartbeats are watched again")
            self._blind, self._judge_after = False, now + self.timeout_s
        beats: dict[str, float] = {}
        for (name, _key), ttl_ms in zip(keys, ttls, strict=True):
            if ttl_ms is None or ttl_ms < 0:  # -2: no key (expired, or not yet registered)
                continue
            beat = now - max(0.0, self.ttl_s - ttl_ms / 1000)
            beats[name] = max(beats.get(name, beat), beat)
        return beats

    def hung(self, children: list[Child], now: float) -> list[tuple[Child, str]]:
        """The running `children` found hung, each with what shows it (`now`: time.monotonic())."""
        running = [c for c in children if c.restart_at is None and c.proc.poll() is None]
        self._beat_at = {pid: t for pid, t in self._beat_at.items() if pid in {c.pid for c in running}}
        beats = self._last_beats(running, now) if running else {}
        if beats is None or now < self._judge_after:
            return []
        found = []
        for child in running:
            beat = beats.get(child.name)
            if beat is not None and beat > child.started_at:  # not the key of its last incarnation
                self._beat_at[child.pid] = max(self._beat_at.get(child.pid, beat), beat)
            last = self._beat_at.get(child.pid)
            if last is None and now - child.started_at > self.start_grace_s:
                why = f"no heartbeat in the {now - child.started_at:.1f}s since it started"
                found.append((child, f"{why} (--startup-timeout {self.start_grace_s:g})"))
            elif last is not None and now - last > self.timeout_s:
                why = f"no heartbeat for {now - last:.1f}s"
                found.append((child, f"{why} (--heartbeat-timeout {self.timeout_s:g})"))
        return found

    def close(self) -> None:
        self._redis.close()
