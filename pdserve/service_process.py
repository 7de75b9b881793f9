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

from pdserve.prefix_publishing import PrefixPublisher
from pdserve.registry import InstanceInfo
from pdserve.rpc import RpcServer, join_host_port
from pdserve.serving import EngineHost, ServiceConfig, service_config_from_args, start_logging

log = logging.getLogger("pdserve.serving")


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host other processes dial: explicit, else the bind host, else (0.0.0.0) our hostname."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


async def run_service(
    config: ServiceConfig,
    host: EngineHost,
    servers: dict[str, RpcServer],
    on_ready: Callable[[dict[str, str]], None] | None = None,
) -> None:
    """Serve `servers` (role -> server) until SIGINT/SIGTERM (or cancellation); `on_ready`
    gets role -> address once registered. Roles after the first listen on the next ports."""
    instance_id, heartbeat_s = config.instance_id, config.heartbeat_s
    host.start()
    addresses: dict[str, str] = {}
    for i, (role, server) in enumerate(servers.items()):
        port = config.port + i if config.port else 0
        bound = await server.start(config.host, port)
        addresses[role] = join_host_port(advertised_host(config.host, config.advertise_host), bound)
    registry = host.registry
    started = time.time()

    def info_of(role: str) -> Callable[[], InstanceInfo]:
        def info() -> InstanceInfo:
            return InstanceInfo(
                role=role,
                instance_id=instance_id,
                address=addresses[role],
                load=host.load(),
                started_at=started,
                extra=host.extra(),
            )

        return info

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    tasks: list[asyncio.Task] = []
    try:
        if registry is not None:
            for role in servers:
                await registry.register(info_of(role)(), ttl_s=3 * heartbeat_s)
                tasks.append(
                    asyncio.create_task(
                        registry.heartbeat_forever(
                            info_of(role), interval_s=heartbeat_s, ttl_s=3 * heartbeat_s
                        )
                    )
                )
            publisher = PrefixPublisher(registry, host, instance_id, heartbeat_s)  # new keys at once
            tasks.append(asyncio.create_task(publisher.run()))
        log.info("%s %s serving on %s", "+".join(servers), instance_id, addresses)
        if on_ready is not None:
            on_ready(addresses)
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        if registry is not None:
            for role in servers:
                try:
                    await registry.deregister(role, instance_id)
                except Exception as e:  # Redis gone: our key expires by its TTL anyway
                    log.warning("could not deregister %s %s: %s", role, instance_id, e)
            await registry.close()
        for server in servers.values():  # deregistered: open streams get shutdown_timeout_s to end
            await server.stop(grace=config.shutdown_timeout_s)
        host.stop()
        log.info("%s %s stopped", "+".join(servers), instance_id)


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
