"""Running a prefill or decode service process: its gRPC server, its heartbeat in Redis, and a
clean stop on SIGINT/SIGTERM.

Lifecycle: load the model (the service object) -> listen -> register + heartbeat (TTL) ->
serve until a signal -> deregister (routers stop sending work) -> drain calls -> stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer import POOL_UNIT_DIMS, TransferAgent, model_identity
from pdserve.cli_args import add_engine_arguments, engine_config_from_args
from pdserve.config import EngineConfig
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.registry import InstanceInfo, InstanceRegistry
from pdserve.rpc import RpcServer, join_host_port

log = logging.getLogger("pdserve.serving")


@dataclass(slots=True)
class ServiceConfig:
    """What every service process has; `PrefillConfig` and `DecodeConfig` add their own knobs."""

    engine: EngineConfig
    instance_id: str = "instance-0"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    redis_url: str | None = None
    heartbeat_s: float = 1.0


def add_service_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--instance-id", default=f"{role}-{socket.gethostname()}")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--advertise-host", default=None, help="host other processes dial (default: --host)")


def service_config_fields(args: argparse.Namespace) -> dict:
    """The `ServiceConfig` fields of the flags of `add_service_arguments`."""
    return {
        "engine": engine_config_from_args(args),
        "instance_id": args.instance_id,
        "host": args.host,
        "port": args.port,
        "advertise_host": args.advertise_host,
        "redis_url": args.redis_url,
    }


def engine_transfer_agent(engine: LLMEngine, name: str, timeout_s: float = 30.0) -> TransferAgent:
    """A NIXL agent with the engine's KV pool and GDN state pools registered."""
    runner = engine.runner
    pools = {
        "kv": runner.kv_pool.kv,
        "conv": runner.state_pool.conv,
        "recurrent": runner.state_pool.recurrent,
    }
    model = model_identity(engine.config.model_config)
    return TransferAgent(name, pools, POOL_UNIT_DIMS, model, engine.config.page_size, timeout_s=timeout_s)


def load_report(engine: LLMEngine, **extra: int) -> dict:
    """An instance's load as the registry publishes it."""
    s, runner = engine.scheduler, engine.runner
    return {
        "running": len(s.running),
        "waiting": len(s.waiting),
        "free_kv_pages": runner.kv_pool.num_free,
        "free_state_slots": runner.state_pool.num_free,
        "kv_pages": runner.kv_pool.num_pages - runner.reserved,
        "state_slots": runner.state_pool.num_slots - runner.reserved,
        "prefix_cache_pages": engine.prefix_cache.num_pages if engine.prefix_cache else 0,
        **extra,
    }


def start_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


class EngineService:
    """What a prefill or decode service is built on: an engine, its pools registered with a NIXL
    agent, and the engine thread; subclasses supply the thread's three callbacks and their RPCs."""

    def __init__(self, config: ServiceConfig, transfer_timeout_s: float = 30.0) -> None:
        self.config = config
        self.engine = LLMEngine(config.engine)
        self.agent = engine_transfer_agent(self.engine, config.instance_id, transfer_timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.thread = EngineThread(self.engine, self._on_outputs, self._on_error, tick=self._tick)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.thread.start()

    def stop(self) -> None:
        self.thread.stop()
        self.agent.close()

    def load(self) -> dict:
        """The instance's load as the registry publishes it (heartbeat)."""
        return load_report(self.engine)

    def extra(self) -> dict:
        """Published with the instance (e.g. prefix-cache settings)."""
        return {}

    def prefix_keys(self) -> list[str]:
        """Cached prefix blocks this instance holds (hex), published in Redis."""
        return []

    # ---- the engine thread's callbacks
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def _on_error(self, request_ids: list[str], message: str) -> None:
        raise NotImplementedError

    def _tick(self) -> bool:
        return False


def prefix_cache_info(engine: LLMEngine) -> dict:
    """What a router needs to key prompts the way this instance's prefix cache does."""
    cache = engine.prefix_cache
    if cache is None:
        return {}
    return {"prefix_block_size": cache.block_size, "prefix_salt": cache.salt}


async def publish_prefix_keys(
    registry: InstanceRegistry, service: EngineService, instance_id: str, interval_s: float
) -> None:
    """Keep `{ns}:prefix:{hash}` -> this instance for every block its cache holds, with a TTL of
    a few intervals, so an evicted block (or a dead instance) drops out by itself."""
    while True:
        for key in service.prefix_keys():
            await registry.set_prefix_owner(key, instance_id, ttl_s=3 * interval_s)
        await asyncio.sleep(interval_s)


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host other processes dial: explicit, else the bind host, else (0.0.0.0) our hostname."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


async def run_service(
    role: str,
    config: ServiceConfig,
    service: EngineService,
    server: RpcServer,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation); `on_ready(address)` once registered."""
    instance_id, heartbeat_s = config.instance_id, config.heartbeat_s
    service.start()
    bound = await server.start(config.host, config.port)
    address = join_host_port(advertised_host(config.host, config.advertise_host), bound)
    registry = InstanceRegistry(config.redis_url) if config.redis_url else None
    started = time.time()

    def info() -> InstanceInfo:
        return InstanceInfo(
            role=role,
            instance_id=instance_id,
            address=address,
            load=service.load(),
            started_at=started,
            extra=service.extra(),
        )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    heartbeat = prefixes = None
    try:
        if registry is not None:
            await registry.register(info(), ttl_s=3 * heartbeat_s)
            prefixes = asyncio.create_task(publish_prefix_keys(registry, service, instance_id, heartbeat_s))
            heartbeat = asyncio.create_task(
                registry.heartbeat_forever(info, interval_s=heartbeat_s, ttl_s=3 * heartbeat_s)
            )
        log.info("%s %s serving on %s", role, instance_id, address)
        if on_ready is not None:
            on_ready(address)
        await stop.wait()
    finally:
        for task in (heartbeat, prefixes):
            if task is not None:
                task.cancel()
        if registry is not None:
            try:
                await registry.deregister(role, instance_id)
            except Exception as e:  # Redis gone: our key expires by its TTL anyway
                log.warning("could not deregister %s %s: %s", role, instance_id, e)
            finally:
                await registry.close()
        await server.stop(grace=2.0)
        service.stop()
        log.info("%s %s stopped", role, instance_id)
