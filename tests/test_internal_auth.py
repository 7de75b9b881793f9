"""The closed internal plane, gRPC side: the internal secret and the calls it lets through.
Real gRPC servers on loopback; each test runs its own event loop. (Redis: test_redis_auth.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import msgpack
import pytest

from pdserve.internal_auth import SECRET_ENV, SECRET_FILE_ENV, RateLimitedWarning, auth_metadata
from pdserve.rpc import CLIENT_OPTIONS, RpcClient, RpcError, RpcServer, load_internal_secret

pytestmark = pytest.mark.timeout(60)
SECRET = b"s3cret-for-tests-0123456789"
SERVICE = "test.Guarded"


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without an internal secret in the environment; it sets its own."""
    for name in (SECRET_ENV, SECRET_FILE_ENV, "PDSERVE_REDIS_PASSWORD", "PDSERVE_REDIS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)


# ---- the secret
def test_secret_comes_from_the_file_first_then_the_variable(monkeypatch, tmp_path: Path) -> None:
    assert load_internal_secret() is None
    monkeypatch.setenv(SECRET_ENV, "from-the-variable-0123")
    assert load_internal_secret() == b"from-the-variable-0123"
    path = tmp_path / "secret"
    path.write_text("  from-the-file-0123456789\n")
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    assert load_internal_secret() == b"from-the-file-0123456789"


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "cannot read it"), ("\n", "the file is empty"), ("short", "16 to 4096 characters, got 5")],
)
def test_a_named_secret_file_that_is_unusable_is_an_error(monkeypatch, tmp_path, content, match) -> None:
    """Fail closed: a file that is named but missing, empty or weak is never "no secret"."""
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    monkeypatch.setenv(SECRET_ENV, "a-good-fallback-0123456789")  # the file wins, even broken
    with pytest.raises(ValueError, match=match):
        load_internal_secret()
    with pytest.raises(ValueError, match=match):
        RpcServer(SERVICE)
    monkeypatch.setenv(SECRET_ENV, "has a space in it 0123")
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        RpcClient("127.0.0.1:1", SERVICE, secret=b"has a space in it 0123")


# ---- gRPC
@contextlib.asynccontextmanager
async def guarded_server(secret: bytes | None, calls: list[str]) -> AsyncIterator[str]:
    """A server whose handlers record each call they run; yields its address."""
    server = RpcServer(SERVICE, secret=secret)

    async def echo(request: dict) -> dict:
        calls.append("echo")
        return {"echo": request}

    async def count(request: dict) -> AsyncIterator[dict]:
        calls.append("count")
        for i in range(request["n"]):
            yield {"i": i}

    server.unary("echo", echo)
    server.stream("count", count)
    port = await server.start("127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def outcome(address: str, secret: bytes | None) -> tuple[str, str]:
    """(unary result, stream result) of one client: "ok" or the status code name."""
    client = RpcClient(address, SERVICE, secret=secret)
    results = []
    try:
        try:
            assert await client.unary("echo", {"x": 1}, timeout=5) == {"echo": {"x": 1}}
            results.append("ok")
        except RpcError as e:
            results.append(e.code)
        try:
            assert [item async for item in client.stream("count", {"n": 3}, timeout=5)] == [
                {"i": 0},
                {"i": 1},
                {"i": 2},
            ]
            results.append("ok")
        except RpcError as e:
            results.append(e.code)
        return results[0], results[1]
    finally:
        await client.close()


def test_calls_without_the_secret_are_refused_before_the_handler_runs() -> None:
    async def main() -> None:
        calls: list[str] = []
        async with guarded_server(SECRET, calls) as address:
            assert await outcome(address, None) == ("UNAUTHENTICATED", "UNAUTHENTICATED")
            assert await outcome(address, b"the-wrong-secret-0123456789") == ("UNAUTHENTICATED",) * 2
            assert await outcome(address, SECRET + b"x") == ("UNAUTHENTICATED",) * 2
            assert calls == []  # no handler ran for a refused call
            assert await outcome(address, SECRET) == ("ok", "ok")
            assert calls == ["echo", "count"]
            client = RpcClient(address, SERVICE, secret=None)
            try:
                with pytest.raises(RpcError, match="needs the internal secret"):
                    await client.unary("echo", {}, timeout=5)
                # Ping stays open for healthchecks and tells no more than the method names
                assert await client.ping() == {"service": SERVICE, "methods": ["count", "echo"]}
            finally:
                await client.close()

    asyncio.run(main())


def test_a_refused_call_is_not_decoded(monkeypatch) -> None:
    """The gate runs before the body is decoded: a caller without the secret makes the server
    build nothing (a 200 MB msgpack array of nils had cost seconds of event loop and GBs), and
    an undecodable body is UNAUTHENTICATED without the secret, INVALID_ARGUMENT with it."""
    decoded: list[int] = []
    monkeypatch.setattr("pdserve.rpc.unpack", lambda body: decoded.append(len(body)) or msgpack.unpackb(body))

    async def status(address: str, method: str, body: bytes, secret: bytes | None) -> str:
        metadata = auth_metadata(secret) if secret else None
        async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
            kind = "unary_unary" if method == "echo" else "unary_stream"
            call = getattr(channel, kind)(f"/{SERVICE}/{method}")
            try:
                answer = call(body, timeout=10, metadata=metadata)
                await answer if method == "echo" else [item async for item in answer]
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name

    async def main() -> None:
        nils = b"\xdd" + (4_000_000).to_bytes(4, "big") + b"\xc0" * 4_000_000  # [None] * 4M
        async with guarded_server(SECRET, []) as address:
            for method in ("echo", "count"):
                assert await status(address, method, nils, None) == "UNAUTHENTICATED"
                assert await status(address, method, b"\xc1", None) == "UNAUTHENTICATED"
                assert decoded == []
                assert await status(address, method, b"\xc1", SECRET) == "INVALID_ARGUMENT"
                assert decoded == [1]
                decoded.clear()

    asyncio.run(main())


def test_the_container_healthcheck_needs_no_secret(monkeypatch) -> None:
    async def main() -> int:
        async with guarded_server(SECRET, []) as address:
            health = [sys.executable, "-m", "pdserve.rpc", address]
            done = await asyncio.to_thread(subprocess.run, health, capture_output=True, timeout=30)
            return done.returncode

    monkeypatch.setenv(SECRET_ENV, "not-the-servers-secret-0123")  # the healthcheck sends none
    assert asyncio.run(main()) == 0


def test_the_bearer_scheme_is_case_insensitive() -> None:
    async def main() -> None:
        async with guarded_server(SECRET, []) as address:
            client = RpcClient(address, SERVICE, secret=None)
            client._metadata = (("authorization", "bearer " + SECRET.decode()),)
            try:
                assert await client.unary("echo", {}, timeout=5) == {"echo": {}}
            finally:
                await client.close()

    asyncio.run(main())


def test_both_sides_take_the_secret_from_the_environment_by_default(monkeypatch) -> None:
    async def main() -> tuple[tuple[str, str], tuple[str, str]]:
        server = RpcServer(SERVICE)  # FROM_ENV
        server.unary("echo", lambda request: asyncio.sleep(0, {"echo": request}))
        server.stream("count", lambda request: _count(request["n"]))
        port = await server.start("127.0.0.1", 0)
        try:
            address = f"127.0.0.1:{port}"
            default_client = RpcClient(address, SERVICE)
            try:
                got = await default_client.unary("echo", {}, timeout=5)
            finally:
                await default_client.close()
            assert got == {"echo": {}}
            return await outcome(address, SECRET), await outcome(address, None)
        finally:
            await server.stop(0)

    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    assert asyncio.run(main()) == (("ok", "ok"), ("UNAUTHENTICATED", "UNAUTHENTICATED"))


async def _count(n: int) -> AsyncIterator[dict]:
    for i in range(n):
        yield {"i": i}


def test_a_server_without_a_secret_serves_every_client() -> None:
    """No secret configured anywhere: the plane is open, as before (and a client's secret is moot)."""

    async def main() -> None:
        async with guarded_server(None, []) as address:
            assert await outcome(address, None) == ("ok", "ok")
            assert await outcome(address, SECRET) == ("ok", "ok")

    asyncio.run(main())


def test_rate_limited_warning_counts_what_it_leaves_out(caplog) -> None:
    warn = RateLimitedWarning(logging.getLogger("test.rate"), every_s=0.2)
    with caplog.at_level(logging.WARNING, "test.rate"):
        for i in range(5):
            warn("dropped %s", i)
        assert [r.getMessage() for r in caplog.records] == ["dropped 0"]
        warn._last -= 1.0  # as if the period had passed
        warn("dropped %s", 5)
    assert caplog.records[-1].getMessage() == "dropped 5 (and 4 more like it since the last warning)"
