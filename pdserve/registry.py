"""Redis as the directory of live instances, and the prefix-ownership key space.

Key space (namespace `ns`, "pdserve" by default):

    {ns}:instance:{role}:{instance_id}   JSON of an `InstanceInfo`, with a TTL (a few seconds)
    {ns}:prefix:{block_hash}             the instance_id that holds that cached prefix block

An instance registers itself and then refreshes its key with `heartbeat_forever` (carrying its
current load) until it stops; one that crashes or hangs simply expires. The router reads
`instances(role)` to pick where a request goes. The prefix keys name which instance holds each
prefix-cache entry: an instance writes its new ones after the step that made them
(`set_prefix_owners`, from pdserve.prefix_publishing) and all of them every heartbeat, and the
router asks `prefix_owners` which instance holds a prompt's blocks.

`RedisServer` (`pdserve.redis_server`, importable from here too) starts a private
`redis-server` on a free loopback port (used by `pdserve up` without a Redis URL, and by tests).

Closed to others (`pdserve.internal_auth`):
- Password / ACL user: `redis://user:pass@host:port` in the URL, or, when the URL has none,
  PDSERVE_REDIS_PASSWORD_FILE / PDSERVE_REDIS_PASSWORD (so no command line shows it).
- Signed values: with the internal secret, every value is the envelope
  `{"value": <text>, "hmac": <hex HMAC-SHA256 of the key and the text>}`; readers drop values
  that are unsigned or do not verify (a rate-limited warning), so a client that can write to
  Redis but lacks the secret cannot add an instance or claim a prefix. Readers without a secret
  accept both forms. (A signed value can be replayed under its own key until overwritten: a
  copy of a live instance's entry, never a new address.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis

from pdserve.internal_auth import (
    FROM_ENV,
    RateLimitedWarning,
    SecretArg,
    load_redis_password,
    open_value,
    registry_signing_key,
    resolve_secret,
    seal_value,
)
from pdserve.redis_server import RedisServer as RedisServer  # re-exported: its old home

log = logging.getLogger("pdserve.registry")
REDIS_CONNECTIONS = 32  # per registry client; calls beyond wait for one (at most 2 s)
ROLES = ("prefill", "decode")
NAMESPACE = "pdserve"
HEARTBEAT_S = 1.0  # a service refreshes its instance key this often (ServiceConfig.heartbeat_s)
HEARTBEAT_TTL_BEATS = 3  # ... with a TTL of this many beats: a hung one drops out after 3 s
PREFIX_WRITE_SLICE = 128  # prefix keys a pipeline (~3-6 ms of the event loop's time each)


def instance_key(role: str, instance_id: str, namespace: str = NAMESPACE) -> str:
    """The Redis key of one instance's entry (its heartbeat)."""
    return f"{namespace}:instance:{role}:{instance_id}"


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
    `async with InstanceRegistry(url) as registry:` closes the connections at the end.

    `password`: used when the URL has none (default: `load_redis_password()`). `secret`: signs
    what this registry writes and checks what it reads (FROM_ENV: `load_internal_secret()`).
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str = NAMESPACE,
        secret: SecretArg = FROM_ENV,
        password: str | None = None,
    ) -> None:
        self.namespace = namespace
        secret = resolve_secret(secret)
        self._signing_key = None if secret is None else registry_signing_key(secret)
        self._warn_unsigned = RateLimitedWarning(log)
        if urlsplit(redis_url).password is None:
            password = password if password is not None else load_redis_password()
        else:
            password = None  # the URL's own
        # short socket timeouts: a dead Redis must fail a heartbeat, not hang it. A blocking pool:
        # redis-py's default pool (100 connections) fails a call at once when all are taken, which
        # 64 concurrent requests' prefix lookups did (each then routed by load alone, a warning each)
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url,
            max_connections=REDIS_CONNECTIONS,
            timeout=2.0,  # the longest a call waits for a free connection
            decode_responses=True,
            socket_connect_timeout=2.0,
            socket_timeout=2.0,
            **({} if password is None else {"password": password}),
        )
        self._redis = aioredis.Redis.from_pool(pool)

    @property
    def signed(self) -> bool:
        """Whether values are signed on write and checked on read."""
        return self._signing_key is not None

    def _seal(self, key: str, value: str) -> str:
        return seal_value(self._signing_key, key, value)

    def _open(self, key: str, stored: str) -> str | None:
        value = open_value(self._signing_key, key, stored)
        if value is None:
            self._warn_unsigned("dropping Redis key %s: unsigned or wrong signature (no secret?)", key)
        return value

    def _instance_key(self, role: str, instance_id: str) -> str:
        return instance_key(role, instance_id, self.namespace)

    def _prefix_key(self, block_hash: str) -> str:
        return f"{self.namespace}:prefix:{block_hash}"

    async def server_id(self) -> str:
        """The Redis server's run id: it changes when Redis restarts (empty, without persistence)."""
        return (await self._redis.info("server"))["run_id"]

    async def ping(self) -> None:
        """Raise (redis.RedisError / OSError) when Redis does not answer."""
        await self._redis.ping()

    async def register(self, info: InstanceInfo, ttl_s: float = 3.0) -> None:
        """Write (or refresh) the instance's key; it expires after `ttl_s` without a refresh."""
        key = self._instance_key(info.role, info.instance_id)
        await self._redis.set(key, self._seal(key, info.to_json()), px=max(1, round(ttl_s * 1000)))

    async def heartbeat_forever(
        self,
        get_info: Callable[[], InstanceInfo],
        interval_s: float = 1.0,
        ttl_s: float = 3.0,
        stuck: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Register `get_info()` every `interval_s` until cancelled (run it as a task).

        Redis errors are logged and retried at the next beat: an instance outlives a Redis
        restart. While `stuck()` gives a reason, no beat is sent (the key expires: routers stop
        sending work, `pdserve up` restarts the service). Cancelling does not deregister; call
        `deregister` on a clean shutdown.
        """
        if ttl_s <= interval_s:
            raise ValueError(f"ttl_s ({ttl_s}) must exceed interval_s ({interval_s})")
        failing, was_stuck = False, False
        while True:
            reason = stuck()
            if (reason is not None) != was_stuck:  # said once each way
                log.warning("heartbeat: %s", f"stopped: {reason}" if reason else "beating again")
                was_stuck = reason is not None
            if was_stuck:
                await asyncio.sleep(interval_s)
                continue
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
        for key, stored in zip(keys, await self._redis.mget(keys), strict=True):
            text = None if stored is None else self._open(key, stored)
            if text is None:  # expired between SCAN and MGET, or not signed
                continue
            try:
                info = InstanceInfo.from_json(text)
            except (ValueError, TypeError) as e:
                log.warning("ignoring malformed instance key %s: %s", key, e)
                continue
            if info.role != role or key != self._instance_key(role, info.instance_id):
                log.warning("ignoring instance key %s: it holds %s %r", key, info.role, info.instance_id)
                continue
            found.append(info)
        return sorted(found, key=lambda info: info.instance_id)

    async def set_prefix_owner(self, block_hash: str, instance_id: str, ttl_s: float | None) -> None:
        """Record that `instance_id` holds the cached prefix block `block_hash` (for `ttl_s`, or
        until overwritten when None). Filled by the prefix cache later."""
        px = None if ttl_s is None else max(1, round(ttl_s * 1000))
        key = self._prefix_key(block_hash)
        await self._redis.set(key, self._seal(key, instance_id), px=px)

    async def set_prefix_owners(self, block_hashes: list[str], instance_id: str, ttl_s: float) -> None:
        """`set_prefix_owner` for many hashes: pipelines (not transactions) of PREFIX_WRITE_SLICE
        keys, the event loop free while each one's answer comes. Building and reading a pipeline
        is ~20-45 us of Python a key: one pipeline for the 4,096 keys of a 262K-token prompt held
        the loop 25-75 ms at once, and every token stream of the process waited (issue 12)."""
        px = max(1, round(ttl_s * 1000))
        for start in range(0, len(block_hashes), PREFIX_WRITE_SLICE):
            async with self._redis.pipeline(transaction=False) as pipe:
                for block_hash in block_hashes[start : start + PREFIX_WRITE_SLICE]:
                    key = self._prefix_key(block_hash)
                    pipe.set(key, self._seal(key, instance_id), px=px)
                await pipe.execute()

    async def prefix_owners(self, block_hashes: list[str]) -> dict[str, str]:
        """{block_hash: instance_id} for the hashes that have an owner (others are left out)."""
        if not block_hashes:
            return {}
        keys = [self._prefix_key(h) for h in block_hashes]
        owners = {}
        for block_hash, key, stored in zip(block_hashes, keys, await self._redis.mget(keys), strict=True):
            owner = None if stored is None else self._open(key, stored)
            if owner is not None:
                owners[block_hash] = owner
        return owners

    async def close(self) -> None:
        await self._redis.aclose()

    async def __aenter__(self) -> InstanceRegistry:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
