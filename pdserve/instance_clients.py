"""gRPC clients of peer instances, one per registered address, closed once it has left.

Shared by the router (`router/instances.py`: the prefill and decode instances it sends work to)
and the decode role (`pdserve/peer_directory.py`: the prefill instances holding the states it READs).
A service restarted on a new port, or gone from the registry (heartbeat expired, removed),
leaves a client behind; a long-running process whose peers restart would keep every one of
them open (a channel, its socket, its reconnect attempts). So:

- `client(role, address)` hands out an `InstanceClient`; every call through it (unary or
  stream) counts as in flight on that address's `RpcClient` from its start to its end.
- `keep(keys)`, after each registry refresh, closes the clients of addresses not registered any
  more that have nothing in flight. One that has calls in flight is closed when its last call
  ends: no call is ever cancelled here, so a call to an instance that just died fails as before
  (keepalive: UNAVAILABLE within a few seconds), and one to an instance that left the registry
  but still answers finishes.
- A call to an address that has left (a late lease release or abort) opens a client again for
  its duration.
Not thread-safe: every call, `keep` and `close` run on the one event loop of their process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.rpc import RpcClient

SERVICES = {"prefill": "pdserve.Prefill", "decode": "pdserve.Decode"}  # registry role -> gRPC service


def client_key(role: str, address: str) -> str:
    """What a client is kept by: an instance restarted on a new port is a new key."""
    return f"{role}@{address}"


@dataclass(slots=True, eq=False)
class _Open:
    client: RpcClient
    calls: int = 0  # in flight


class InstanceClients:
    """The open clients by `client_key`; `services` maps a role to its gRPC service name."""

    def __init__(self, services: dict[str, str] = SERVICES) -> None:
        self._services = services
        self._open: dict[str, _Open] = {}
        self._kept: frozenset[str] = frozenset()
        self._closing: set[asyncio.Task] = set()

    def client(self, role: str, address: str) -> InstanceClient:
        """The client of the `role` instance at `address` (its channel opens with its first call)."""
        return InstanceClient(self, role, address)

    def keys(self) -> set[str]:
        """The addresses (as `client_key`s) with a client open now."""
        return set(self._open)

    def keep(self, keys: set[str]) -> None:
        """The registered addresses: close the idle clients of every other one now, and the busy
        ones when their last call ends."""
        self._kept = frozenset(keys)
        for key in [k for k, o in self._open.items() if k not in keys and o.calls == 0]:
            self._drop(key)

    async def close(self) -> None:
        """Close every client (calls still in flight on them are cancelled)."""
        opened, self._open = list(self._open.values()), {}
        for o in opened:
            await o.client.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def _acquire(self, role: str, address: str) -> tuple[str, _Open]:
        key = client_key(role, address)
        o = self._open.get(key)
        if o is None:
            o = self._open[key] = _Open(RpcClient(address, self._services[role]))
        o.calls += 1
        return key, o

    def _release(self, key: str, o: _Open) -> None:
        o.calls -= 1
        if o.calls == 0 and key not in self._kept and self._open.get(key) is o:
            self._drop(key)

    def _drop(self, key: str) -> None:
        task = asyncio.get_running_loop().create_task(self._open.pop(key).client.close())
        self._closing.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._closing.discard)


class InstanceClient:
    """One instance's client as `InstanceClients.client` hands it out: `unary` and `stream` as
    `RpcClient`'s, each keeping the address's channel open until it ends."""

    def __init__(self, clients: InstanceClients, role: str, address: str) -> None:
        self._clients, self.role, self.address = clients, role, address

    async def unary(self, name: str, request: dict, timeout: float | None = None) -> dict:
        key, o = self._clients._acquire(self.role, self.address)
        try:
            return await o.client.unary(name, request, timeout)
        finally:
            self._clients._release(key, o)

    async def stream(self, name: str, request: dict, timeout: float | None = None) -> AsyncIterator[dict]:
        key, o = self._clients._acquire(self.role, self.address)
        try:  # aclosing: the call is cancelled before its channel may close
            async with contextlib.aclosing(o.client.stream(name, request, timeout)) as items:
                async for item in items:
                    yield item
        finally:
            self._clients._release(key, o)
