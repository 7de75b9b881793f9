"""The prefill instances a decode instance reads from.

A lease names its holder by transfer-agent name (instance id + incarnation). The address to
reach it comes from the registry, never from the caller, so a decode instance dials no address
outside the registry; the handshake (protocol version + compatibility hash) runs once per agent.
A restarted instance has a new incarnation: its older agent is dropped when the new one is met,
and any agent whose transfer failed is forgotten, so the next request handshakes again.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.rpc import RpcClient
from pdserve.serving import EngineHost

log = logging.getLogger(__name__)
ENDPOINT_TIMEOUT_S = 10.0


def instance_of(agent: str) -> str:
    """The instance id of an agent name `{instance_id}#{incarnation}`."""
    return agent.rpartition("#")[0] or agent


class PeerDirectory:
    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self._addresses: dict[str, str] = {}  # connected agent -> its gRPC address
        self._clients: dict[str, RpcClient] = {}  # address -> client
        self._lock = asyncio.Lock()

    async def connect(self, agent: str) -> str:
        """The peer name to pull from `agent` with, handshaking on first contact."""
        async with self._lock:
            if agent in self._addresses:
                return agent
            address = await self._lookup(agent)
            endpoint = await self._client(address).unary("endpoint", {}, timeout=ENDPOINT_TIMEOUT_S)
            if endpoint.get("agent") != agent:
                raise LookupError(f"{address} no longer runs agent {agent!r}")
            for old in [a for a in self._addresses if instance_of(a) == instance_of(agent)]:
                log.info("prefill %s restarted: dropping its old agent %s", instance_of(agent), old)
                await self.host.thread.call(self.forget, old)
            peer = await self.host.thread.call(self.host.agent.add_peer, endpoint)
            self._addresses[agent] = address
            return peer

    def client(self, agent: str) -> RpcClient:
        """The gRPC client of a connected agent's instance."""
        address = self._addresses.get(agent)
        if address is None:
            raise LookupError(f"prefill agent {agent!r} is not connected")
        return self._client(address)

    def forget(self, agent: str) -> None:
        """Drop a peer (on the engine thread): after a failure, or when it was restarted."""
        if self._addresses.pop(agent, None) is None:
            return
        try:
            self.host.agent.remove_peer(agent)
        except Exception as e:  # the connection may be gone already
            log.warning("removing peer %s: %r", agent, e)

    async def _lookup(self, agent: str) -> str:
        registry = self.host.registry
        if registry is None:
            raise LookupError("no registry configured: prefill instances cannot be found")
        for info in await registry.instances("prefill"):
            if info.extra.get("agent") == agent:
                return info.address
        raise LookupError(f"prefill agent {agent!r} is not in the registry")

    def _client(self, address: str) -> RpcClient:
        if address not in self._clients:
            self._clients[address] = RpcClient(address, "pdserve.Prefill")
        return self._clients[address]
