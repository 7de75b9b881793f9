"""The live prefill and decode instances, as the registry in Redis reports them.

Refreshed in the background; an instance whose heartbeat expires drops out. An instance the
router could not reach is set aside locally until the registry shows a fresh heartbeat.
Choice: least load (registry load + this router's requests in flight there).
Each refresh also closes the gRPC clients of addresses no longer registered (a service restarted
on a new port, expired, removed) once their calls in flight have ended (pdserve/instance_clients.py),
and forgets what it counted for instances that left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from pdserve.instance_clients import SERVICES, InstanceClient, InstanceClients, client_key
from pdserve.registry import InstanceInfo, InstanceRegistry
from router.metrics import RouterMetrics
from router.prefix_metrics import PrefixCacheMetrics

log = logging.getLogger("pdserve.router")
SET_ASIDE_S = 5.0
REREGISTER_S = 3.0  # after a Redis restart, instances re-register within a heartbeat TTL
PREFER_SLACK = 16  # requests a prefix-cache owner may be busier than the least loaded instance


class NoInstanceError(RuntimeError):
    pass


class InstanceSet:
    def __init__(self, registry: InstanceRegistry, metrics: RouterMetrics, refresh_s: float = 0.5) -> None:
        self.registry = registry
        self.refresh_s = refresh_s
        self.live: dict[str, dict[str, InstanceInfo]] = {"prefill": {}, "decode": {}}
        self.in_flight: dict[str, int] = defaultdict(int)
        self._set_aside: dict[str, float] = {}
        self._run_id: str | None = None  # the Redis server's: a new one means Redis restarted
        self._restarted_at: float | None = None
        self.clients = InstanceClients(SERVICES)
        self._task: asyncio.Task | None = None
        self._load = metrics.gauge(
            "instance_load", "Requests running + waiting per instance", ["role", "instance"]
        )
        self._count = metrics.gauge("instances_live", "Live instances per role", ["role"])
        self.prefix_metrics = PrefixCacheMetrics(metrics)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.clients.close()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception as e:  # Redis briefly unreachable: keep the last view
                log.warning("instance refresh failed: %s", e)

    async def refresh(self) -> None:
        run_id = await self.registry.server_id()
        if self._run_id is not None and run_id != self._run_id:
            log.warning(
                "Redis restarted: keeping the instances for %.0f s while they re-register", REREGISTER_S
            )
            self._restarted_at = time.monotonic()
        self._run_id = run_id
        reregistering = (
            self._restarted_at is not None and time.monotonic() - self._restarted_at < REREGISTER_S
        )
        seen = {role: {i.instance_id: i for i in await self.registry.instances(role)} for role in self.live}
        if reregistering:  # an instance not back yet has not left: it re-registers within a heartbeat
            seen = {role: {**self.live[role], **found} for role, found in seen.items()}
        for role, found in seen.items():
            for gone in set(self.live[role]) - set(found):
                log.warning("%s instance %s left the registry", role, gone)
                self._load.remove(role, gone)
            self.live[role] = found
            self._count.labels(role).set(len(found))
            for i in found.values():
                self._load.labels(role, i.instance_id).set(
                    i.load.get("running", 0) + i.load.get("waiting", 0)
                )
                self.prefix_metrics.observe(i.instance_id, i.load.get("prefix_cache"))
        self.clients.keep({client_key(i.role, i.address) for found in seen.values() for i in found.values()})
        self._forget_gone({i for found in seen.values() for i in found})

    def _forget_gone(self, registered: set[str]) -> None:
        """Drop the counts of instances that left: nothing in flight there, set-aside time over."""
        for instance_id in [k for k, n in self.in_flight.items() if n == 0 and k not in registered]:
            del self.in_flight[instance_id]
        now = time.monotonic()
        for instance_id in [k for k, until in self._set_aside.items() if until < now]:
            del self._set_aside[instance_id]

    def pick(self, role: str, exclude: set[str] = frozenset(), prefer: str | None = None) -> InstanceInfo:
        """The least loaded live instance; `prefer` (it caches the prompt's prefix) wins unless
        its load exceeds the least loaded one's by more than PREFER_SLACK requests."""
        now = time.monotonic()
        candidates = [
            i
            for i in self.live[role].values()
            if i.instance_id not in exclude and self._set_aside.get(i.instance_id, 0.0) < now
        ]
        if not candidates:
            raise NoInstanceError(f"no live {role} instance")

        def load(i: InstanceInfo) -> float:
            return self.in_flight[i.instance_id] + i.load.get("running", 0) + i.load.get("waiting", 0)

        best = min(candidates, key=load)
        preferred = next((i for i in candidates if i.instance_id == prefer), None)
        if preferred is not None and load(preferred) <= load(best) + PREFER_SLACK:
            return preferred
        return best

    def set_aside(self, instance: InstanceInfo) -> None:
        """The instance failed us: skip it for a while (the registry will drop it if it is dead)."""
        log.warning("%s instance %s failed; setting it aside", instance.role, instance.instance_id)
        self._set_aside[instance.instance_id] = time.monotonic() + SET_ASIDE_S
        self.live[instance.role].pop(instance.instance_id, None)
        self._count.labels(instance.role).set(len(self.live[instance.role]))  # as /health counts

    def client(self, instance: InstanceInfo) -> InstanceClient:
        """The instance's gRPC client (`unary`, `stream`); its channel stays open while a call on
        it runs, and is closed once the instance has left the registry and no call is left."""
        return self.clients.client(instance.role, instance.address)

    def counts(self) -> dict[str, int]:
        return {role: len(v) for role, v in self.live.items()}
