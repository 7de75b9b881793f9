"""The router's gRPC clients of the instances (router/instances.py, pdserve/instance_clients.py),
on loopback with a real redis-server and real gRPC servers: after instances restart on new
ports or leave the registry, the router holds channels and sockets only for the live ones; a
call in flight to one that left is never cut by the router (it flows on while the instance
answers, and fails with UNAVAILABLE, as before, when the instance dies)."""

from __future__ import annotations

import asyncio
import gc
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from pdserve.registry import InstanceInfo, InstanceRegistry, RedisServer
from pdserve.rpc import RpcError, RpcServer
from router.instances import SERVICES, InstanceSet
from router.metrics import RouterMetrics

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent
RESTARTS = 4


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


def decode_server() -> RpcServer:
    """A stand-in decode instance: unary `echo`, stream `forever` (an item every 10 ms)."""
    server = RpcServer(SERVICES["decode"])

    async def echo(request: dict) -> dict:
        return {"echo": request}

    async def forever(request: dict) -> AsyncIterator[dict]:
        i = 0
        while True:
            yield {"i": i}
            i += 1
            await asyncio.sleep(0.01)

    server.unary("echo", echo)
    server.stream("forever", forever)
    return server


async def serve_until_killed() -> None:
    """The peer process of the dying-instance test: a decode stand-in; prints its port."""
    print(await decode_server().start("127.0.0.1", 0), flush=True)
    await asyncio.Event().wait()


def open_channels() -> int:
    """The gRPC channels alive in this process (by type: `isinstance` would read `__class__`,
    which some of torch's deprecated objects warn about)."""
    gc.collect()
    return sum(issubclass(type(o), grpc.aio.Channel) for o in gc.get_objects())


def connected_ports(ports: set[int]) -> set[int]:
    """Those of `ports` this process holds an established TCP connection to."""
    return {
        c.raddr.port
        for c in psutil.Process().net_connections("tcp")
        if c.raddr and c.status == psutil.CONN_ESTABLISHED and c.raddr.port in ports
    }


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether `check()` holds within `timeout` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return check()


async def started(registry: InstanceRegistry, instance_id: str) -> tuple[RpcServer, InstanceInfo]:
    server = decode_server()
    info = InstanceInfo("decode", instance_id, f"127.0.0.1:{await server.start('127.0.0.1', 0)}")
    await registry.register(info, ttl_s=60)
    return server, info


def test_an_instance_set_aside_leaves_the_live_gauge_at_once(redis_url: str) -> None:
    """/metrics' instances_live drops with /health's count when an instance fails a call, not at
    the next registry read (the robustness audit saw decode 1 there and 0 on /health)."""

    async def main() -> list[float | None]:
        async with InstanceRegistry(redis_url, "gauge-1", secret=None) as registry:
            metrics = RouterMetrics()
            instances = InstanceSet(registry, metrics)
            servers = [await started(registry, f"gauge-{i}") for i in range(2)]
            try:
                await instances.refresh()
                gauge = ("pdserve:instances_live", {"role": "decode"})
                before = metrics.registry.get_sample_value(*gauge)
                instances.set_aside(servers[0][1])
                return [
                    before,
                    metrics.registry.get_sample_value(*gauge),
                    float(instances.counts()["decode"]),
                ]
            finally:
                await instances.close()
                for server, info in servers:
                    await registry.deregister("decode", info.instance_id)
                    await server.stop(0)

    assert asyncio.run(main()) == [2.0, 1.0, 1.0]


def test_restarted_and_removed_instances_leave_no_client_behind(redis_url: str) -> None:
    """decode-0 restarts on a new port RESTARTS times (the old process gone); each time another
    instance leaves the registry while its process still answers. Every instance served a call.
    Before, the router kept a channel per address it ever called: 2 x RESTARTS + 1 of them, and
    a connection to each removed instance that was still up."""

    async def main() -> None:
        async with InstanceRegistry(redis_url, "clients-1", secret=None) as registry:
            instances = InstanceSet(registry, RouterMetrics())
            baseline = open_channels()
            removed: list[RpcServer] = []
            removed_ports: set[int] = set()
            server, live = await started(registry, "decode-0")
            try:
                for restart in range(RESTARTS):
                    other, leaving = await started(registry, f"leaving-{restart}")
                    await instances.refresh()
                    for info in (live, leaving):  # counted in flight as router/disagg.py does
                        instances.in_flight[info.instance_id] += 1
                        reply = await instances.client(info).unary("echo", {"n": restart}, 5)
                        instances.in_flight[info.instance_id] -= 1
                        assert reply == {"echo": {"n": restart}}
                    await registry.deregister("decode", leaving.instance_id)  # still up
                    removed.append(other)
                    removed_ports.add(int(leaving.address.rsplit(":", 1)[1]))
                    await server.stop(0)  # decode-0 restarts on a new port
                    server, live = await started(registry, "decode-0")
                    await instances.refresh()
                    assert list(instances.live["decode"].values()) == [live]
                    assert await instances.client(live).unary("echo", {}, 5) == {"echo": {}}
                    assert await eventually(lambda: open_channels() - baseline == 1), restart
                    assert connected_ports(removed_ports) == set()
                assert instances.clients.keys() == {f"decode@{live.address}"}
                assert set(instances.in_flight) <= {"decode-0"}  # the counts of those gone dropped
            finally:
                await instances.close()
                for s in (server, *removed):
                    await s.stop(0)
            assert await eventually(lambda: open_channels() == baseline)

    asyncio.run(main())


async def stream_until_it_fails(
    registry: InstanceRegistry, instances: InstanceSet, peer: subprocess.Popen, baseline: int
) -> str:
    """Open a decode stream to the `peer` process, take it out of the registry, check the stream
    flows on and its client stays, SIGKILL the peer: the code of the stream's error (returned,
    so that its traceback, which holds the channel, is gone when the caller counts channels)."""
    info = InstanceInfo("decode", "decode-0", f"127.0.0.1:{int(peer.stdout.readline())}")
    await registry.register(info, ttl_s=60)
    await instances.refresh()
    stream = instances.client(info).stream("forever", {})
    try:
        assert (await anext(stream))["i"] == 0
        await registry.deregister("decode", "decode-0")
        await instances.refresh()
        assert instances.live["decode"] == {}
        assert [(await anext(stream))["i"] for _ in range(5)] == [1, 2, 3, 4, 5]
        assert open_channels() == baseline + 1  # in use: kept
        peer.send_signal(signal.SIGKILL)
        start = time.monotonic()
        async for _ in stream:
            pass
        return "stream ended without an error"
    except RpcError as e:
        assert time.monotonic() - start < 8.0
        return e.code
    finally:
        await stream.aclose()


PEER = "import asyncio, tests.test_router_instances as t; asyncio.run(t.serve_until_killed())"


def test_a_call_in_flight_outlives_its_instance_leaving_the_registry(redis_url: str) -> None:
    """A decode stream keeps flowing after its instance left the registry (the router does not
    cut it); when the instance then dies, the stream fails with UNAVAILABLE within seconds, as
    before, and only then is its client closed."""
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True, cwd=ROOT)

    async def main() -> str:
        async with InstanceRegistry(redis_url, "clients-2", secret=None) as registry:
            instances = InstanceSet(registry, RouterMetrics())
            baseline = open_channels()
            code = await stream_until_it_fails(registry, instances, peer, baseline)
            assert await eventually(lambda: open_channels() == baseline)  # its last call ended: closed
            assert instances.clients.keys() == set()
            await instances.close()
            return code

    try:
        assert asyncio.run(asyncio.wait_for(main(), 30)) == "UNAVAILABLE"
    finally:
        peer.kill()
        peer.wait()
