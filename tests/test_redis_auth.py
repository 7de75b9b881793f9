"""The closed internal plane, Redis side: a password that no command line shows, and registry
values that a client without the internal secret cannot forge. A real redis-server."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pdserve.registry import InstanceInfo, InstanceRegistry, RedisServer

pytestmark = pytest.mark.timeout(60)
SECRET = b"s3cret-for-tests-0123456789"


@pytest.fixture(autouse=True)
def no_password_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PDSERVE_INTERNAL_SECRET", "PDSERVE_INTERNAL_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("PDSERVE_REDIS_PASSWORD", "PDSERVE_REDIS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)


# ---- Redis: the password
ODD_PASSWORD = 'p w"\\x{}$(id)\n\t'  # every kind of character redis.conf could trip over


def command_lines() -> str:
    """Every command line `ps` can show on this machine."""
    return subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("password", ["pw-0123456789abcdef", ODD_PASSWORD])
def test_redis_password_is_required_and_on_no_command_line(password: str) -> None:
    with RedisServer(password=password) as server:
        assert password not in server.url and password not in " ".join(server._proc.args)
        assert password.strip() not in command_lines()
        assert password.encode() not in Path(f"/proc/{server.pid}/cmdline").read_bytes()
        with redis.Redis(host=server.host, port=server.port) as anonymous:
            with pytest.raises(redis.AuthenticationError):
                anonymous.ping()
        with redis.Redis(host=server.host, port=server.port, password=password) as client:
            assert client.ping()

        async def main() -> None:
            async with InstanceRegistry(server.url, "pw") as registry:
                with pytest.raises(redis.AuthenticationError):
                    await registry.register(info("decode", "d-0"))
            async with InstanceRegistry(server.url, "pw", password=password) as registry:
                await registry.register(info("decode", "d-0"))
                assert [i.instance_id for i in await registry.instances("decode")] == ["d-0"]

        asyncio.run(main())


def test_redis_password_from_the_url_or_the_environment(monkeypatch) -> None:
    """`redis://user:pass@...` works, and so does a URL without one plus PDSERVE_REDIS_PASSWORD
    (for the default user and for an ACL user named in the URL)."""
    with RedisServer(password="default-user-pw-0123") as server:
        with redis.Redis(host=server.host, port=server.port, password=server.password) as admin:
            admin.execute_command("ACL", "SETUSER", "pdserve", "on", ">acl-user-pw-0123", "~acl:*", "+@all")
        hostport = f"{server.host}:{server.port}"

        async def registered(url: str, namespace: str) -> list[str]:
            async with InstanceRegistry(url, namespace) as registry:
                await registry.register(info("prefill", "p-0"))
                return [i.instance_id for i in await registry.instances("prefill")]

        async def main() -> None:
            assert await registered(f"redis://:default-user-pw-0123@{hostport}/0", "url") == ["p-0"]
            assert await registered(f"redis://pdserve:acl-user-pw-0123@{hostport}/0", "acl") == ["p-0"]
            with pytest.raises(redis.RedisError, match="permissions|NOPERM|No permissions"):
                await registered(f"redis://pdserve:acl-user-pw-0123@{hostport}/0", "not-acl")
            monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", "acl-user-pw-0123")
            assert await registered(f"redis://pdserve@{hostport}/0", "acl") == ["p-0"]
            monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", "default-user-pw-0123")
            assert await registered(server.url, "env") == ["p-0"]
            # a password in the URL wins over the environment's
            monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", "wrong-password-0123")
            assert await registered(f"redis://:default-user-pw-0123@{hostport}/0", "url") == ["p-0"]

        asyncio.run(main())


# ---- Redis: signed values
@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def info(role: str, instance_id: str, address: str = "127.0.0.1:50051") -> InstanceInfo:
    return InstanceInfo(role, instance_id, address, load={"running": 0}, started_at=1.5)


def test_instances_written_without_the_secret_are_dropped(redis_server: RedisServer, caplog) -> None:
    attacker = redis.Redis(host=redis_server.host, port=redis_server.port, decode_responses=True)

    async def main() -> None:
        async with (
            InstanceRegistry(redis_server.url, "sig", secret=SECRET) as signed,
            InstanceRegistry(redis_server.url, "sig", secret=b"another-secret-0123456789") as other,
            InstanceRegistry(redis_server.url, "sig", secret=None) as unsigned,
        ):
            assert signed.signed and not unsigned.signed
            await signed.register(info("decode", "d-0"))
            await other.register(info("decode", "by-another-secret"))
            await unsigned.register(info("decode", "by-no-secret"))
            evil = info("decode", "evil", address="203.0.113.9:50051")
            attacker.set("sig:instance:decode:evil", evil.to_json())  # plain JSON
            stored = json.loads(attacker.get("sig:instance:decode:d-0"))
            forged = {"value": evil.to_json(), "hmac": stored["hmac"]}  # d-0's MAC on other text
            attacker.set("sig:instance:decode:evil2", json.dumps(forged))
            attacker.set("sig:instance:decode:copy", json.dumps(stored))  # a valid value, other key
            with caplog.at_level(logging.WARNING, "pdserve.registry"):
                assert [i.instance_id for i in await signed.instances("decode")] == ["d-0"]
                assert (await signed.instances("decode"))[0] == info("decode", "d-0")
            dropped = [r for r in caplog.records if "unsigned or wrong signature" in r.getMessage()]
            assert len(dropped) == 1  # rate-limited: one warning for several dropped keys
            # without a secret everything that parses is taken: the forged keys were really there
            seen = {i.instance_id for i in await unsigned.instances("decode")}
            assert {"evil", "d-0", "by-no-secret", "by-another-secret"} <= seen

    try:
        asyncio.run(main())
    finally:
        attacker.close()


def test_prefix_owners_written_without_the_secret_are_dropped(redis_server: RedisServer) -> None:
    attacker = redis.Redis(host=redis_server.host, port=redis_server.port, decode_responses=True)

    async def main() -> None:
        async with (
            InstanceRegistry(redis_server.url, "psig", secret=SECRET) as signed,
            InstanceRegistry(redis_server.url, "psig", secret=None) as unsigned,
        ):
            await signed.set_prefix_owner("aa", "prefill-0", ttl_s=30)
            await signed.set_prefix_owner("bb", "prefill-1", ttl_s=30)
            attacker.set("psig:prefix:cc", "evil-prefill")
            attacker.set("psig:prefix:dd", attacker.get("psig:prefix:aa"))  # replayed under another key
            hashes = ["aa", "bb", "cc", "dd", "ee"]
            assert await signed.prefix_owners(hashes) == {"aa": "prefill-0", "bb": "prefill-1"}
            owners = {"aa": "prefill-0", "bb": "prefill-1", "cc": "evil-prefill", "dd": "prefill-0"}
            assert await unsigned.prefix_owners(hashes) == owners

    try:
        asyncio.run(main())
    finally:
        attacker.close()
