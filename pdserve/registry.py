"""Redis as the directory of live instances, and the prefix-ownership key space.

Key space (namespace `ns`, "pdserve" by default):

    {ns}:instance:{role}:{instance_id}   JSON of an `InstanceInfo`, with a TTL (a few seconds)
    {ns}:prefix:{block_hash}             the instance_id that holds that cached prefix block

An instance registers itself and then refreshes its key with `heartbeat_forever` (carrying its
current load) until it stops; one that crashes or hangs simply expires. The router reads
`instances(role)` to pick where a request goes. The prefix keys are filled by the prefix cache
later: the instance that saves a prefix checkpoint claims its block hash with
`set_prefix_owner`, and the router asks `prefix_owners` which instance holds a prompt's blocks.

`RedisServer` starts a private `redis-server` on a free loopback port (used by `pdserve up`
when no Redis URL is given, and by the tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from pdserve.rpc import free_port

log = logging.getLogger("pdserve.registry")
ROLES = ("prefill", "decode")


@dataclass(slots=True)
class InstanceInfo:
    """What one prefill or decode instance tells the others about itself.

    `load` is the instance's latest counters, e.g. {"running": n, "waiting": n,
    "free_kv_pages": n, "free_state_slots": n}; `extra` is anything else it wants known
    (model name, kvtransfer agent metadata, ...). Both must be JSON-serializable.
    """

    role: str
    instance_id: str
    address: str  # "host:port" of its gRPC server, reachable from the other instances
    load: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.instance_id:
            raise ValueError("instance_id must not be empty")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> InstanceInfo:
        return cls(**json.loads(text))


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")


class InstanceRegistry:
    """The instance and prefix keys of one namespace in one Redis (redis.asyncio).
    `async with InstanceRegistry(url) as registry:` closes the connections at the end."""

    def __init__(self, redis_url: str, namespace: str = "pdserve") -> None:
        self.namespace = namespace
        # short socket timeouts: a dead Redis must fail a heartbeat, not hang it
        self._redis = aioredis.from_url(
            redis_url, decode_responses=True, socket_connect_timeout=2.0, socket_timeout=2.0
        )

    def _instance_key(self, role: str, instance_id: str) -> str:
        return f"{self.namespace}:instance:{role}:{instance_id}"

    def _prefix_key(self, block_hash: str) -> str:
        return f"{self.namespace}:prefix:{block_hash}"

    async def ping(self) -> None:
        """Raise (redis.RedisError / OSError) when Redis does not answer."""
        await self._redis.ping()

    async def register(self, info: InstanceInfo, ttl_s: float = 3.0) -> None:
        """Write (or refresh) the instance's key; it expires after `ttl_s` without a refresh."""
        await self._redis.set(
            self._instance_key(info.role, info.instance_id), info.to_json(), px=max(1, round(ttl_s * 1000))
        )

    async def heartbeat_forever(
        self, get_info: Callable[[], InstanceInfo], interval_s: float = 1.0, ttl_s: float = 3.0
    ) -> None:
        """Register `get_info()` every `interval_s` until cancelled (run it as a task).

        Redis errors are logged and retried at the next beat: an instance outlives a Redis
        restart. Cancelling does not deregister; call `deregister` on a clean shutdown.
        """
        if ttl_s <= interval_s:
            raise ValueError(f"ttl_s ({ttl_s}) must exceed interval_s ({interval_s})")
        failing = False
        while True:
            try:
                await self.register(get_info(), ttl_s)
                if failing:
                    log.warning("heartbeat: Redis answers again")
                failing = False
            except (redis.RedisError, OSError) as e:
                if not failing:
                    log.warning("heartbeat: cannot reach Redis (%s); retrying every %.1fs", e, interval_s)
                failing = True
            await asyncio.sleep(interval_s)

    async def deregister(self, role: str, instance_id: str) -> None:
        """Remove the instance's key now (a clean shutdown); a no-op when it is gone."""
        await self._redis.delete(self._instance_key(role, instance_id))

    async def instances(self, role: str) -> list[InstanceInfo]:
        """The live instances of `role` (those whose heartbeat has not expired), by instance_id."""
        _check_role(role)
        keys = [key async for key in self._redis.scan_iter(match=self._instance_key(role, "*"), count=500)]
        if not keys:
            return []
        found = []
        for key, text in zip(keys, await self._redis.mget(keys), strict=True):
            if text is None:  # expired between SCAN and MGET
                continue
            try:
                found.append(InstanceInfo.from_json(text))
            except (ValueError, TypeError) as e:
                log.warning("ignoring malformed instance key %s: %s", key, e)
        return sorted(found, key=lambda info: info.instance_id)

    async def set_prefix_owner(self, block_hash: str, instance_id: str, ttl_s: float | None) -> None:
        """Record that `instance_id` holds the cached prefix block `block_hash` (for `ttl_s`, or
        until overwritten when None). Filled by the prefix cache later."""
        px = None if ttl_s is None else max(1, round(ttl_s * 1000))
        await self._redis.set(self._prefix_key(block_hash), instance_id, px=px)

    async def prefix_owners(self, block_hashes: list[str]) -> dict[str, str]:
        """{block_hash: instance_id} for the hashes that have an owner (others are left out)."""
        if not block_hashes:
            return {}
        owners = await self._redis.mget([self._prefix_key(h) for h in block_hashes])
        return {h: owner for h, owner in zip(block_hashes, owners, strict=True) if owner is not None}

    async def close(self) -> None:
        await self._redis.aclose()

    async def __aenter__(self) -> InstanceRegistry:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class RedisServer:
    """A private `redis-server` (no persistence) on a free loopback port, in a temp folder.

    with RedisServer() as server:
        registry = InstanceRegistry(server.url)
    """

    def __init__(self, binary: str = "redis-server", host: str = "127.0.0.1") -> None:
        self.binary = binary
        self.host = host
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING; raises RuntimeError when it does not."""
        if shutil.which(self.binary) is None:
            raise RuntimeError(f"{self.binary} not found (apt-get install redis-server)")
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        for _attempt in range(3):  # the free port can be taken before redis binds it: retry
            self.port = free_port(self.host)
            args = ["--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no"]
            with open(self._dir / "redis.log", "wb") as out:
                self._proc = subprocess.Popen(
                    [self.binary, *args, "--dir", str(self._dir)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            if self._wait_ready(timeout):
                return self
        tail = (self._dir / "redis.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"redis-server did not start:\n{tail}")

    def _wait_ready(self, timeout: float) -> bool:
        assert self._proc is not None
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and self._proc.poll() is None:
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.02)
        finally:
            client.close()
        self._proc.kill()
        self._proc.wait()
        return False

    def stop(self, grace: float = 5.0) -> None:
        """Terminate the server (kill it after `grace` seconds) and remove its folder."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self if self._proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
