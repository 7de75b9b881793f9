"""Prefix entries reach Redis right after the step that made them (pdserve.prefix_publishing), not
at the instance's next heartbeat: a conversation's next turn, sent as soon as the answer is in,
is routed to the instance holding it. A service in-process, with a heartbeat longer than the
test; the engine thread never waits on Redis, and after an outage every key comes back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

import pytest

from pdserve.config import EngineConfig
from pdserve.registry import InstanceRegistry, RedisServer
from pdserve.rpc import RpcClient, RpcServer
from pdserve.sampling.params import SamplingParams
from pdserve.service_process import run_service
from pdserve.serving import EngineHost, ServiceConfig
from tests.helpers import random_prompts

pytestmark = pytest.mark.timeout(120)
PROMPT = random_prompts((80,), seed=5)[0]  # over one cache block (64)


@pytest.fixture
def redis(monkeypatch) -> RedisServer:
    server = RedisServer(password="publishing-test").start()
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", server.password)
    for var in ("PDSERVE_REDIS_PASSWORD_FILE", "PDSERVE_INTERNAL_SECRET", "PDSERVE_INTERNAL_SECRET_FILE"):
        monkeypatch.delenv(var, raising=False)
    yield server
    server.stop()


def host_of(tiny_model_dir, redis: RedisServer, heartbeat_s: float) -> EngineHost:
    engine = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=256)
    config = ServiceConfig(
        engine=engine,
        instance_id="publisher-0",
        redis_url=redis.url,
        heartbeat_s=heartbeat_s,
        shutdown_timeout_s=1.0,
    )
    return EngineHost(config, nixl=False)


def count_writes(host: EngineHost) -> Callable[[], int]:
    """How many prefix-key writes (Redis round-trips) the host's publisher has made."""
    registry, writes = host.registry, [0]
    write = registry.set_prefix_owners

    async def counted(*args, **kwargs) -> None:
        writes[0] += 1
        await write(*args, **kwargs)

    registry.set_prefix_owners = counted
    return lambda: writes[0]


async def serve(host: EngineHost) -> asyncio.Task:
    ready = asyncio.Event()
    servers = {"prefill": RpcServer("pdserve.Prefill")}  # no calls: requests go to the engine
    task = asyncio.create_task(run_service(host.config, host, servers, on_ready=lambda _: ready.set()))
    await asyncio.wait_for(ready.wait(), 30)
    return task


async def generate(host: EngineHost, prompt: list[int], max_tokens: int) -> list[str]:
    """Run one request to its end; the keys the host claims then (its snapshot is up to date).

    The engine's state is read on its thread, between steps: read from here, mid-step, it can
    show no work (the step in flight taken out, the request ended) and no entry yet."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    await host.thread.call(host.engine.add_request, prompt, params)
    cache = host.engine.prefix_cache

    def settled() -> bool:
        return not host.engine.has_unfinished() and set(host.prefix_keys()) == set(cache.published_keys())

    while not await host.thread.call(settled):
        await asyncio.sleep(0.002)
    return host.prefix_keys()


async def owned(redis: RedisServer, keys: list[str], within_s: float) -> float:
    """Seconds until every key names this instance in Redis (AssertionError after `within_s`)."""
    start = time.monotonic()
    async with InstanceRegistry(redis.url) as reader:
        while True:
            owners = await reader.prefix_owners(keys)
            if len(owners) == len(keys) and set(owners.values()) == {"publisher-0"}:
                return time.monotonic() - start
            assert time.monotonic() - start < within_s, (
                f"{len(keys) - len(owners)} of {len(keys)} keys missing"
            )
            await asyncio.sleep(0.005)


def test_new_entries_are_published_at_once_and_only_then(tiny_model_dir, redis: RedisServer) -> None:
    async def scenario() -> None:
        host = host_of(tiny_model_dir, redis, heartbeat_s=60.0)  # no beat within the test
        writes = count_writes(host)
        task = await serve(host)
        try:
            keys = await generate(host, PROMPT, max_tokens=4)
            assert keys, "the finished request left an entry"
            assert await owned(redis, keys, within_s=0.5) < 0.5
            # what the decode role waits for before a last token: the keys are there, no polling
            keys = await generate(host, random_prompts((90,), seed=8)[0], max_tokens=4)
            assert host.publisher is not None  # its own bound (50 ms) aside: no polling needed
            await host.publisher.published(host.prefix_snapshot()[0], timeout_s=5.0)
            await owned(redis, keys, within_s=0.0)
            # a long generation: many steps, entries made at its prompt's end and at its end only
            before = writes()
            tokens = 48
            keys = await generate(host, random_prompts((70,), seed=6)[0], max_tokens=tokens)
            await owned(redis, keys, within_s=0.5)
            assert 1 <= writes() - before <= 4, f"{writes() - before} writes for a {tokens}-step request"
            idle = writes()
            await asyncio.sleep(0.3)
            assert writes() == idle, "nothing changed: no write"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_redis_away_never_stalls_the_engine_and_keys_come_back(tiny_model_dir, redis: RedisServer) -> None:
    async def scenario() -> None:
        host = host_of(tiny_model_dir, redis, heartbeat_s=0.5)
        task = await serve(host)
        try:
            start = time.monotonic()
            await generate(host, PROMPT, max_tokens=16)
            baseline = time.monotonic() - start
            redis._fixed_port = redis.port
            redis.stop()
            start = time.monotonic()
            keys = await generate(host, random_prompts((75,), seed=7)[0], max_tokens=16)
            assert time.monotonic() - start < 3 * baseline + 0.5, "the engine waited on Redis"
            start = time.monotonic()
            assert host.publisher is not None  # Redis failing: no wait at all, whatever the bound
            await host.publisher.published(host.prefix_snapshot()[0], timeout_s=5.0)
            assert time.monotonic() - start < 0.2
            redis.start()  # empty: every key the host holds comes back at a beat
            await owned(redis, keys, within_s=5.0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_an_answer_ending_at_its_first_token_waits_for_its_entry(tiny_model_dir, redis: RedisServer) -> None:
    """A request that finishes on the prefill instance (max_tokens 1, no decode) is answered once
    its entry's keys are in Redis, as a decode instance's last token is. Redis is made slow
    (0.3 s a write) and the wait's bound long, so an answer sent before the write would show."""
    from prefill_svc.server import prefill_server
    from prefill_svc.service import PrefillService

    async def scenario() -> None:
        host = host_of(tiny_model_dir, redis, heartbeat_s=60.0)
        registry, write = host.registry, host.registry.set_prefix_owners

        async def slow(*args, **kwargs) -> None:
            await asyncio.sleep(0.3)
            await write(*args, **kwargs)

        registry.set_prefix_owners = slow
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        servers = {"prefill": prefill_server(PrefillService(host))}
        task = asyncio.create_task(run_service(host.config, host, servers, on_ready=ready.set_result))
        try:
            address = (await asyncio.wait_for(ready, 30))["prefill"]
            assert host.publisher is not None
            host.publisher.published = partial(host.publisher.published, timeout_s=5.0)
            client = RpcClient(address, "pdserve.Prefill")
            request = {"request_id": "one", "prompt_token_ids": PROMPT, "params": {"max_tokens": 1}}
            (result,) = [r async for r in client.stream("prefill", {"requests": [request]}, timeout=30)]
            await client.close()
            assert result["finished"] and result["lease"] is None
            keys = await host.thread.call(host.prefix_keys)
            assert keys, "the finished request left an entry"
            await owned(redis, keys, within_s=0.0)  # already there when the answer came
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
