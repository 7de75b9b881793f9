"""pdserve.rpc (gRPC + msgpack) and pdserve.registry (Redis instances and prefix owners), on
loopback with a real redis-server. Each test runs its own event loop (asyncio.run)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from pdserve.registry import InstanceInfo, InstanceRegistry, RedisServer
from pdserve.rpc import RpcClient, RpcError, RpcServer, free_port

pytestmark = pytest.mark.timeout(60)
SERVICE = "test.Echo"
ROOT = Path(__file__).resolve().parent.parent


def echo_server(closed: asyncio.Event | None = None) -> RpcServer:
    """unary echo/fail, stream count/forever/fail_after; `closed` is set when `forever` ends."""
    server = RpcServer(SERVICE)
    errors = {"value": ValueError("bad prompt"), "key": KeyError("req-7"), "bug": RuntimeError("boom")}
    errors["rpc"] = RpcError("RESOURCE_EXHAUSTED", "no free pages")

    async def echo(request: dict) -> dict:
        return {"echo": request}

    async def fail(request: dict) -> dict:
        raise errors[request["kind"]]

    async def count(request: dict) -> AsyncIterator[dict]:
        for i in range(request["n"]):
            yield {"i": i}

    async def forever(request: dict) -> AsyncIterator[dict]:
        try:
            i = 0
            while True:
                yield {"i": i}
                i += 1
                await asyncio.sleep(0.01)
        finally:
            if closed is not None:
                closed.set()

    async def fail_after(request: dict) -> AsyncIterator[dict]:
        yield {"i": 0}
        raise ValueError("stream broke")

    server.unary("echo", echo)
    server.unary("fail", fail)
    server.stream("count", count)
    server.stream("forever", forever)
    server.stream("fail_after", fail_after)
    return server


@contextlib.asynccontextmanager
async def connected(closed: asyncio.Event | None = None) -> AsyncIterator[RpcClient]:
    """An echo server on a free port and a client of it; both closed at the end."""
    server = echo_server(closed)
    port = await server.start("127.0.0.1", 0)
    client = RpcClient(f"127.0.0.1:{port}", SERVICE)
    try:
        yield client
    finally:
        await client.close()
        await server.stop(0)


def test_unary_and_stream_round_trip() -> None:
    async def main() -> None:
        async with connected() as client:
            message = {"ids": [1, 2, 3], "blob": b"\x00\xff" * 1000, "logprobs": {7: -0.5}, "x": None}
            assert await client.unary("echo", message, timeout=5) == {"echo": message}
            big = {"blob": bytes(64 * 1024 * 1024)}  # above gRPC's default 4 MiB limit
            assert len((await client.unary("echo", big, timeout=20))["echo"]["blob"]) == 64 * 1024 * 1024
            items = [item async for item in client.stream("count", {"n": 5}, timeout=5)]
            assert items == [{"i": i} for i in range(5)]
            methods = ["count", "echo", "fail", "fail_after", "forever"]
            assert await client.ping() == {"service": SERVICE, "methods": methods}
            with pytest.raises(OSError):  # the port is taken
                await echo_server().start("127.0.0.1", int(client.address.rsplit(":", 1)[1]))

    asyncio.run(main())


def test_errors_map_to_status_codes_and_server_keeps_serving() -> None:
    async def main() -> None:
        async with connected() as client:
            expected = {
                "value": ("INVALID_ARGUMENT", "bad prompt"),
                "key": ("NOT_FOUND", "'req-7'"),
                "bug": ("INTERNAL", "RuntimeError: boom"),
                "rpc": ("RESOURCE_EXHAUSTED", "no free pages"),
            }
            for kind, (code, message) in expected.items():
                with pytest.raises(RpcError) as info:
                    await client.unary("fail", {"kind": kind}, timeout=5)
                assert (info.value.code, info.value.message) == (code, message)
            with pytest.raises(RpcError) as info:
                await client.unary("no_such_method", {}, timeout=5)
            assert info.value.code == "UNIMPLEMENTED"
            got = []
            with pytest.raises(RpcError) as info:
                async for item in client.stream("fail_after", {}, timeout=5):
                    got.append(item)
            assert got == [{"i": 0}]
            assert (info.value.code, info.value.message) == ("INVALID_ARGUMENT", "stream broke")
            assert await client.unary("echo", {"still": "alive"}, timeout=5) == {"echo": {"still": "alive"}}

    asyncio.run(main())


def test_dead_port_is_unavailable_quickly() -> None:
    async def main() -> None:
        client = RpcClient(f"127.0.0.1:{free_port()}", SERVICE)
        start = time.monotonic()
        try:
            with pytest.raises(RpcError) as info:
                await client.unary("echo", {})  # no deadline: must still fail fast
            assert info.value.code == "UNAVAILABLE"
            with pytest.raises(RpcError) as info:
                async for _ in client.stream("count", {"n": 1}):
                    pass
            assert info.value.code == "UNAVAILABLE"
        finally:
            await client.close()
        assert time.monotonic() - start < 5.0

    asyncio.run(main())


@pytest.mark.parametrize("how", ["break", "cancel_task"])
def test_cancelling_a_stream_reaches_the_handler(how: str) -> None:
    async def main() -> None:
        closed, got = asyncio.Event(), asyncio.Event()

        async def consume(client: RpcClient) -> None:
            stream = client.stream("forever", {})
            async for item in stream:
                if item["i"] == 3:
                    got.set()
                    if how == "break":
                        await stream.aclose()
                        return

        async with connected(closed) as client:
            task = asyncio.create_task(consume(client))
            await asyncio.wait_for(got.wait(), 5)
            if how == "cancel_task":
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.wait_for(closed.wait(), 5)  # the handler's generator was closed
            assert await client.unary("echo", {}, timeout=5) == {"echo": {}}

    asyncio.run(main())


async def serve_until_killed() -> None:
    """The peer process of the dead-peer tests: the echo server; prints its port."""
    print(await echo_server().start("127.0.0.1", 0), flush=True)
    await asyncio.Event().wait()


PEER = "import asyncio, tests.test_rpc_registry as t; asyncio.run(t.serve_until_killed())"


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_dead_peer_fails_its_stream_and_the_healthcheck(how: str) -> None:
    """killed: the connection resets. frozen (SIGSTOP): the socket stays open but nothing
    answers; only the keepalive pings can notice, within a few seconds."""
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        address = f"127.0.0.1:{int(peer.stdout.readline())}"
        health = [sys.executable, "-m", "pdserve.rpc", address]
        assert subprocess.run(health, capture_output=True, timeout=20).returncode == 0

        async def main() -> str:
            client = RpcClient(address, SERVICE)
            try:
                async for item in client.stream("forever", {}):
                    if item["i"] == 3:
                        peer.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
                return "stream ended without an error"
            except RpcError as e:
                return e.code
            finally:
                await client.close()

        start = time.monotonic()
        assert asyncio.run(asyncio.wait_for(main(), 15)) == "UNAVAILABLE"
        assert time.monotonic() - start < 8.0
        if how == "killed":
            assert subprocess.run(health, capture_output=True, timeout=20).returncode == 1
    finally:
        peer.kill()
        peer.wait()


# ---- registry
@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


def info(role: str, instance_id: str, **load: int) -> InstanceInfo:
    address = f"{instance_id}:50051"
    return InstanceInfo(role, instance_id, address, load=dict(load), started_at=1.5, extra={"model": "tiny"})


def test_register_list_deregister(redis_url: str) -> None:
    async def main() -> None:
        async with InstanceRegistry(redis_url, "t1") as registry, InstanceRegistry(redis_url, "t1b") as other:
            await registry.register(info("decode", "d-1", running=2))
            await registry.register(info("decode", "d-0", running=0))
            await registry.register(info("prefill", "p-0", waiting=1))
            await other.register(info("decode", "elsewhere"))  # another namespace
            decodes = await registry.instances("decode")
            assert [i.instance_id for i in decodes] == ["d-0", "d-1"]
            assert decodes[1] == info("decode", "d-1", running=2)
            assert [i.instance_id for i in await registry.instances("prefill")] == ["p-0"]
            await registry.deregister("decode", "d-0")
            assert [i.instance_id for i in await registry.instances("decode")] == ["d-1"]
            with pytest.raises(ValueError):
                await registry.instances("router")
            with pytest.raises(ValueError):
                info("router", "r-0")

    asyncio.run(main())


def test_heartbeat_keeps_an_instance_alive_until_it_stops(redis_url: str) -> None:
    async def main() -> None:
        beats = 0

        def current() -> InstanceInfo:
            nonlocal beats
            beats += 1
            return info("prefill", "p-0", running=beats)

        async with InstanceRegistry(redis_url, "t2") as registry:
            task = asyncio.create_task(registry.heartbeat_forever(current, interval_s=0.1, ttl_s=0.4))
            await asyncio.sleep(1.0)  # more than twice the TTL: alive only if it is refreshed
            (live,) = await registry.instances("prefill")
            assert live.load["running"] >= 5  # the load travels with each beat
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert len(await registry.instances("prefill")) == 1
            await asyncio.sleep(0.6)
            assert await registry.instances("prefill") == []  # the heartbeat stopped: expired

    asyncio.run(main())


def test_heartbeat_outlives_a_stopped_redis() -> None:
    server = RedisServer().start()

    async def main() -> None:
        async with InstanceRegistry(server.url) as registry:
            task = asyncio.create_task(registry.heartbeat_forever(lambda: info("decode", "d-0"), 0.05, 0.2))
            await asyncio.sleep(0.1)
            assert len(await registry.instances("decode")) == 1
            server.stop()
            with pytest.raises(redis.ConnectionError):
                await registry.ping()
            await asyncio.sleep(0.3)
            assert not task.done()  # logged and retried, not raised
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_prefix_owners(redis_url: str) -> None:
    async def main() -> None:
        async with InstanceRegistry(redis_url, "t3") as registry:
            assert await registry.prefix_owners([]) == {}
            await registry.set_prefix_owner("aa", "prefill-0", ttl_s=None)
            await registry.set_prefix_owner("bb", "prefill-1", ttl_s=30)
            await registry.set_prefix_owner("cc", "prefill-1", ttl_s=0.2)
            owners = {"aa": "prefill-0", "bb": "prefill-1", "cc": "prefill-1"}
            assert await registry.prefix_owners(["aa", "bb", "cc", "dd"]) == owners
            await asyncio.sleep(0.4)
            assert await registry.prefix_owners(["aa", "cc"]) == {"aa": "prefill-0"}

    asyncio.run(main())


def test_many_prefix_owners_are_written_in_slices_with_the_loop_free_between(redis_url: str) -> None:
    """A full write of a long prompt's keys (a 262K-token prompt leaves 4,096) goes in pipelines
    of PREFIX_WRITE_SLICE keys: every key lands, and the loop is never held for long: one
    pipeline held it for about half the write (building it, then reading its answers)."""

    async def main() -> None:
        async with InstanceRegistry(redis_url, "t4") as registry:
            hashes = [f"{i:032x}" for i in range(4096)]
            turns: list[float] = []

            async def other_task() -> None:  # a token stream's turns on the loop
                while True:
                    turns.append(time.perf_counter())
                    await asyncio.sleep(0)

            ticking = asyncio.create_task(other_task())
            await asyncio.sleep(0)
            start = time.perf_counter()
            await registry.set_prefix_owners(hashes, "prefill-0", ttl_s=30)
            took = time.perf_counter() - start
            ticking.cancel()
            held = max(b - a for a, b in zip(turns, turns[1:], strict=False))
            assert await registry.prefix_owners(hashes) == dict.fromkeys(hashes, "prefill-0")
            assert held < 0.2 * took, f"the loop was held {held * 1e3:.1f} ms of a {took * 1e3:.0f} ms write"

    asyncio.run(main())
