"""Running a service process: its gRPC server(s), its heartbeat in Redis, prefix-key publishing
(`pdserve.prefix_publishing`), and a clean stop on SIGINT/SIGTERM.

Lifecycle: load the model (the host) -> listen (one server per role) -> register each role +
heartbeat (TTL) -> serve until a signal -> deregister (routers stop sending work) -> drain
calls -> stop. Background tasks never die of one error: a Redis outage is logged and retried,
and the registry and prefix ownership come back by themselves when Redis does.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial

from pdserve.heap import freeze_startup_heap
from pdserve.prefix_publishing import PrefixPublisher
from pdserve.registry import HEARTBEAT_TTL_BEATS, InstanceInfo
from pdserve.rpc import RpcServer, join_host_port
from pdserve.serving import EngineHost, ServiceConfig, service_config_from_args, start_logging

log = logging.getLogger("pdserve.serving")


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host other processes dial: explicit, else the bind host, else (0.0.0.0) our hostname."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


async def listen(config: ServiceConfig, servers: dict[str, RpcServer]) -> dict[str, str]:
    """Start each role's server (roles after the first on the next ports): role -> the address
    other processes dial."""
    advertised = advertised_host(config.host, config.advertise_host)
    addresses: dict[str, str] = {}
    for i, (role, server) in enumerate(servers.items()):
        port = config.port + i if config.port else 0
        addresses[role] = join_host_port(advertised, await server.start(config.host, port))
    return addresses


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets (in the main thread; elsewhere only cancellation stops)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    return stop


class Registration:
    """Each role's entry in Redis, kept alive by a heartbeat (TTL 3 beats: routers drop a hung
    instance, `pdserve up` restarts it, pdserve.hang_watch), and the prefix keys the host holds,
    published beside them. Nothing is done without a registry."""

    def __init__(self, config: ServiceConfig, host: EngineHost, addresses: dict[str, str]) -> None:
        self.config, self.host, self.addresses = config, host, addresses
        self.registry = host.registry
        self.started = time.time()
        self.tasks: list[asyncio.Task] = []

    def info(self, role: str) -> InstanceInfo:
        return InstanceInfo(
            role=role,
            instance_id=self.config.instance_id,
            address=self.addresses[role],
            load=self.host.load(),
            started_at=self.started,
            extra=self.host.extra(),
        )

    async def start(self) -> None:
        if self.registry is None:
            return
        beat, ttl = self.config.heartbeat_s, HEARTBEAT_TTL_BEATS * self.config.heartbeat_s
        for role in self.addresses:
            await self.registry.register(self.info(role), ttl_s=ttl)
            info = partial(self.info, role)
            stuck = partial(self.host.thread.stuck, self.config.engine_stuck_s)
            beats = self.registry.heartbeat_forever(info, interval_s=beat, ttl_s=ttl, stuck=stuck)
            self.tasks.append(asyncio.create_task(beats))
        publisher = PrefixPublisher(self.registry, self.host, self.config.instance_id, beat)
        self.tasks.append(asyncio.create_task(publisher.run()))  # new keys at once

    async def stop(self) -> None:
        """Routers stop picking this instance: the heartbeats end and every role's entry goes."""
        for task in self.tasks:
            task.cancel()
        if self.registry is None:
            return
        for role in self.addresses:
            try:
                await self.registry.deregister(role, self.config.instance_id)
            except Exception as e:  # Redis gone: our key expires by its TTL anyway
                log.warning("could not deregister %s %s: %s", role, self.config.instance_id, e)
        await self.registry.close()


async def run_service(
    config: ServiceConfig,
    host: EngineHost,
    servers: dict[str, RpcServer],
    on_ready: Callable[[dict[str, str]], None] | None = None,
) -> None:
    """Serve `servers` (role -> server) until SIGINT/SIGTERM (or cancellation); `on_ready`
    gets role -> address once registered."""
    host.start()
    addresses = await listen(config, servers)
    stop = stop_on_signals()
    registration = Registration(config, host, addresses)
    roles = "+".join(servers)
    try:
        await registration.start()
        log.info("%s %s serving on %s", roles, config.instance_id, addresses)
        if config.freeze_heap:
            freeze_startup_heap()
        if on_ready is not None:
            on_ready(addresses)
        await stop.wait()
    finally:
        await registration.stop()
        for server in servers.values():  # deregistered: open streams get shutdown_timeout_s to end
            await server.stop(grace=config.shutdown_timeout_s)
        host.stop()
        log.info("%s %s stopped", roles, config.instance_id)


def service_main(
    serve: Callable[[ServiceConfig], Awaitable[None]], args: argparse.Namespace, role: str
) -> int:
    """`pdserve prefill|decode|engine`: serve until a signal. A configuration that cannot start
    (it does not fit in memory, a bad checkpoint, a port taken) stops with one line, no traceback."""
    start_logging()
    try:
        asyncio.run(serve(service_config_from_args(args, role)))
    except (ValueError, OSError) as e:
        print(f"pdserve {role}: cannot start: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
