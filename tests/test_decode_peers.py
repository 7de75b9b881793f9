"""The decode role's gRPC clients of its prefill peers (pdserve/peer_directory.py, through
pdserve/instance_clients.py), on loopback with a real redis-server and real gRPC servers standing
in for prefill instances (each with its own transfer agent, `LocalCopyAgent`): after prefill
instances restart on new ports or leave the registry, the decode side holds channels and sockets
only for the live ones; a transfer in flight (its READ done, its lease release still answering)
on a peer that left is never cut, and its client is closed once the release has its answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from kvtransfer import POOL_UNIT_DIMS, LocalCopyAgent, TransferHandle, pool_units
from pdserve.instance_clients import SERVICES
from pdserve.peer_directory import PeerDirectory
from pdserve.peer_reads import PeerReads
from pdserve.registry import InstanceInfo, InstanceRegistry, RedisServer
from pdserve.rpc import RpcServer
from tests.test_peer_reads import MODEL, PAGE, pools
from tests.test_router_instances import connected_ports, eventually, open_channels

pytestmark = pytest.mark.timeout(60)
RESTARTS = 4
INTACT = ({"intact": True}, "")  # a lease release's answer, and no why


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


class InlineThread:
    """The engine thread of the stand-in decode host: its calls run at once, on the loop."""

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)


def decode_host(registry: InstanceRegistry, name: str) -> SimpleNamespace:
    """What `PeerDirectory` and `PeerReads` use of an `EngineHost`, without an engine."""
    agent = LocalCopyAgent(name, pools(0), POOL_UNIT_DIMS, MODEL, PAGE)
    return SimpleNamespace(
        registry=registry, agent=agent, thread=InlineThread(), loop=asyncio.get_running_loop()
    )


@dataclass
class Prefill:
    """A stand-in prefill instance: its agent, a gRPC server answering `endpoint` and `release`
    (after `gate` opens), its registry entry."""

    agent: LocalCopyAgent
    server: RpcServer
    info: InstanceInfo
    gate: asyncio.Event

    @property
    def port(self) -> int:
        return int(self.info.address.rsplit(":", 1)[1])


async def started(registry: InstanceRegistry, instance_id: str, incarnation: int) -> Prefill:
    agent = LocalCopyAgent(f"{instance_id}#{incarnation}", pools(1), POOL_UNIT_DIMS, MODEL, PAGE)
    server, gate = RpcServer(SERVICES["prefill"]), asyncio.Event()
    gate.set()

    async def endpoint(request: dict) -> dict:
        return dict(agent.endpoint())

    async def release(request: dict) -> dict:
        await gate.wait()
        return {"intact": True}

    server.unary("endpoint", endpoint)
    server.unary("release", release)
    address = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
    info = InstanceInfo("prefill", instance_id, address, extra={"agent": agent.name})
    await registry.register(info, ttl_s=60)
    return Prefill(agent, server, info, gate)


async def transfer(peers: PeerDirectory, reads: PeerReads, holder: str, rid: str) -> asyncio.Future:
    """A decode hand-over from `holder` as `DecodeService` runs it: handshake, READ, then the
    lease release, whose (answer, why) the returned future gets."""
    loop = asyncio.get_running_loop()
    answered: asyncio.Future = loop.create_future()
    peer = await peers.connect(holder)

    def done(handle: TransferHandle) -> None:
        release = {"request_id": rid}
        reads.let_go(holder, "release", release, then=lambda a, why: answered.set_result((a, why)))

    def failed(why: str) -> None:
        answered.set_exception(AssertionError(f"the READ failed: {why}"))

    assert reads.start(rid, holder, peer, pool_units([1], 0), pool_units([2], 1), done, failed)
    reads.tick()
    return answered


def test_restarted_and_removed_prefill_peers_leave_no_client_behind(redis_url: str) -> None:
    """prefill-0 restarts on a new port RESTARTS times (the old process gone); each time another
    prefill instance leaves the registry while it still answers. The decode side took a state
    from each. Before, it kept a channel per address it ever called: 2 x RESTARTS + 1 of them,
    and a connection to each removed instance that was still up."""

    async def main() -> None:
        async with InstanceRegistry(redis_url, "peers-1", secret=None) as registry:
            peers = PeerDirectory(decode_host(registry, "decode-0#1"))
            reads = PeerReads(peers.host, peers)
            baseline = open_channels()
            gone: list[Prefill] = []
            live = await started(registry, "prefill-0", 0)
            try:
                for restart in range(RESTARTS):
                    leaving = await started(registry, f"leaving-{restart}", 0)
                    for p in (live, leaving):
                        rid = f"r{restart}-{p.info.instance_id}"
                        assert await (await transfer(peers, reads, p.agent.name, rid)) == INTACT
                    await registry.deregister("prefill", leaving.info.instance_id)  # still up
                    await live.server.stop(0)  # prefill-0 restarts on a new port
                    gone += [leaving, live]
                    live = await started(registry, "prefill-0", restart + 1)
                    assert await (await transfer(peers, reads, live.agent.name, f"r{restart}")) == INTACT
                    assert await eventually(lambda: open_channels() - baseline == 1), restart
                    assert connected_ports({p.port for p in gone}) == set()
                assert peers.clients.keys() == {f"prefill@{live.info.address}"}
            finally:
                await peers.close()
                for p in (live, *gone):
                    await p.server.stop(0)
            assert await eventually(lambda: open_channels() == baseline)

    asyncio.run(main())


def test_a_transfer_in_flight_outlives_its_peer_leaving_the_registry(redis_url: str) -> None:
    """A state READ from prefill-0 whose lease release is still waiting for an answer when
    prefill-0 leaves the registry: the refresh that sees it gone keeps the call's channel, the
    release gets its answer (the state is used), and only then is the client closed."""

    async def main() -> None:
        async with InstanceRegistry(redis_url, "peers-2", secret=None) as registry:
            peers = PeerDirectory(decode_host(registry, "decode-0#2"))
            reads = PeerReads(peers.host, peers)
            baseline = open_channels()
            holder = await started(registry, "prefill-0", 0)
            try:
                holder.gate.clear()  # its release answers only once the gate opens
                answered = await transfer(peers, reads, holder.agent.name, "r-1")
                await asyncio.sleep(0.2)
                assert not answered.done() and len(reads) == 0  # READ done, release in flight
                await registry.deregister("prefill", "prefill-0")
                await peers.refresh()
                assert peers.clients.keys() == {f"prefill@{holder.info.address}"}  # in use: kept
                assert open_channels() == baseline + 1
                assert connected_ports({holder.port}) == {holder.port}
                holder.gate.set()
                assert await asyncio.wait_for(answered, 5) == INTACT
                assert await eventually(lambda: open_channels() == baseline)  # its last call ended
                assert peers.clients.keys() == set()
                assert await eventually(lambda: connected_ports({holder.port}) == set())
            finally:
                await peers.close()
                await holder.server.stop(0)

    asyncio.run(main())


def test_a_peer_gone_from_the_registry_is_dropped_from_the_agent_after_the_grace(redis_url: str) -> None:
    """A prefill instance scaled away: the decode side's transfer agent keeps it through the
    grace (its leases may still be read while it drains), then drops it; the one that stays is
    kept."""

    async def main() -> None:
        async with InstanceRegistry(redis_url, "peers-3", secret=None) as registry:
            peers = PeerDirectory(decode_host(registry, "decode-0#1"), forget_after_s=0.3)
            reads = PeerReads(peers.host, peers)
            staying, leaving = await started(registry, "staying", 0), await started(registry, "leaving", 0)
            try:
                for p in (staying, leaving):
                    assert await (await transfer(peers, reads, p.agent.name, f"r-{p.agent.name}")) == INTACT
                await registry.deregister("prefill", "leaving")
                await peers.refresh()
                assert await peers.forget_departed() == []  # first seen gone: the grace starts
                assert set(peers.host.agent.peers) == {staying.agent.name, leaving.agent.name}
                await asyncio.sleep(0.4)
                await peers.refresh()
                assert await peers.forget_departed() == [leaving.agent.name]
                assert set(peers.host.agent.peers) == {staying.agent.name}
            finally:
                await peers.close()
                for p in (staying, leaving):
                    await p.server.stop(0)

    asyncio.run(main())
