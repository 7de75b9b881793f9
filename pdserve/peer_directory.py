"""The instances this one reads from: prefill instances for a decode instance (leases), any
instance for a prefix pull (`pdserve.prefix_sharing`).

A lease names its holder by transfer-agent name (instance id + incarnation). The address to
reach it comes from the registry, never from the caller, so a decode instance dials no address
outside the registry; the handshake (protocol version + compatibility hash) runs once per agent.
A restarted instance has a new incarnation: its older agent is dropped when the new one is met,
and any agent whose transfer failed is forgotten, so the next request handshakes again.
The registry's view is refreshed in the background (`KNOWN_REFRESH_S`) and its last answer kept:
with Redis away, a peer met for the first time is still found (serving goes on without Redis).
The gRPC clients (`pdserve.instance_clients`, as the router's) follow that view: each refresh
closes the client of every address no longer registered (a peer restarted on a new port, expired,
removed) once its last call in flight (a handshake, a lease release, a pin) has ended; a call in
flight is never cut, and a late call to a connected peer that left opens one for its duration.
A refresh that fails (Redis away) closes nothing. An agent connected to and then gone from the
registry for `forget_after_s` (120 s: past any lease a draining instance may still hold, the
prefill's --handoff-timeout being 60 s) is dropped from the transfer agent too, so a fleet that
scales up and down does not grow the peer list without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.instance_clients import InstanceClient, InstanceClients, client_key
from pdserve.serving import EngineHost

log = logging.getLogger(__name__)
ENDPOINT_TIMEOUT_S = 10.0
KNOWN_REFRESH_S = 1.0


def instance_of(agent: str) -> str:
    """The instance id of an agent name `{instance_id}#{incarnation}`."""
    return agent.rpartition("#")[0] or agent


class PeerDirectory:
    """Peers of the registry roles `roles` (looked up in that order: a two-role engine registers
    as both, under one agent)."""

    def __init__(
        self, host: EngineHost, roles: tuple[str, ...] = ("prefill",), forget_after_s: float = 120.0
    ) -> None:
        self.host = host
        self.roles = roles
        self.forget_after_s = forget_after_s
        self._absent: dict[str, float] = {}  # connected agent -> when it was first seen gone
        self._addresses: dict[str, tuple[str, str]] = {}  # connected agent -> (role, address)
        self.clients = InstanceClients()  # those of addresses left closed once their calls end
        self._lock = asyncio.Lock()
        self._known: dict[str, tuple[str, str]] = {}  # agent -> (role, address), last registry view
        self._refresher: asyncio.Task | None = None
        try:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        except RuntimeError:  # built outside an event loop (tests): looked up on demand only
            pass

    async def connect(self, agent: str) -> str:
        """The peer name to pull from `agent` with, handshaking on first contact."""
        async with self._lock:
            if agent in self._addresses:
                return agent
            address = await self._lookup(agent)
            endpoint = await self.clients.client(*address).unary("endpoint", {}, timeout=ENDPOINT_TIMEOUT_S)
            if endpoint.get("agent") != agent:
                raise LookupError(f"{address} no longer runs agent {agent!r}")
            for old in [a for a in self._addresses if instance_of(a) == instance_of(agent)]:
                log.info("prefill %s restarted: dropping its old agent %s", instance_of(agent), old)
                await self.host.thread.call(self.forget, old)
            peer = await self.host.thread.call(self.host.agent.add_peer, endpoint)
            self._addresses[agent] = address
            return peer

    def client(self, agent: str) -> InstanceClient:
        """The gRPC client of a connected agent's instance (`unary`, `stream`)."""
        address = self._addresses.get(agent)
        if address is None:
            raise LookupError(f"agent {agent!r} is not connected")
        return self.clients.client(*address)

    def forget(self, agent: str) -> None:
        """Drop a peer (on the engine thread): after a failure, or when it was restarted."""
        if self._addresses.pop(agent, None) is None:
            return
        try:
            self.host.agent.remove_peer(agent)
        except Exception as e:  # the connection may be gone already
            log.warning("removing peer %s: %r", agent, e)

    async def _lookup(self, agent: str) -> tuple[str, str]:
        if self.host.registry is None:
            raise LookupError("no registry configured: peer instances cannot be found")
        try:
            await self.refresh()
        except Exception as e:  # Redis away: the last view it gave
            log.warning("registry unreachable (%s); looking %s up in its last view", e, agent)
        if agent in self._known:
            return self._known[agent]
        raise LookupError(f"agent {agent!r} is not in the registry ({'/'.join(self.roles)})")

    async def refresh(self) -> None:
        """Read the registry's peers; close the idle clients of addresses it no longer lists
        (the busy ones when their last call ends). Raises when Redis cannot be read."""
        known: dict[str, tuple[str, str]] = {}
        for role in self.roles:
            for info in await self.host.registry.instances(role):
                if info.extra.get("agent"):
                    known.setdefault(info.extra["agent"], (role, info.address))
        self._known = known
        self.clients.keep({client_key(role, address) for role, address in known.values()})

    async def close(self) -> None:
        """Stop refreshing and close every client (calls still in flight on them are cancelled)."""
        if self._refresher is not None:
            self._refresher.cancel()
        await self.clients.close()

    async def forget_departed(self) -> list[str]:
        """Drop the connected agents the last registry view has lacked for `forget_after_s`;
        their names."""
        now, dropped = time.monotonic(), []
        async with self._lock:  # not while `connect` hands one out
            for agent in [a for a in self._absent if a not in self._addresses]:
                del self._absent[agent]  # forgotten meanwhile (restarted, failed)
            for agent in list(self._addresses):
                if agent in self._known:
                    self._absent.pop(agent, None)
                elif (gone_s := now - self._absent.setdefault(agent, now)) >= self.forget_after_s:
                    del self._absent[agent]
                    log.info("peer agent %s left the registry %.0f s ago: dropped", agent, gone_s)
                    await self.host.thread.call(self.forget, agent)
                    dropped.append(agent)
        return dropped

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(KNOWN_REFRESH_S)
            if self.host.registry is None:
                return
            try:
                await self.refresh()
            except Exception:  # Redis away: keep the last view (the heartbeat logs the outage)
                continue
            try:
                await self.forget_departed()
            except Exception:  # the refresher must outlive it
                log.exception("dropping departed peer agents failed")
