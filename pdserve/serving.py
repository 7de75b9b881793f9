"""Running a prefill or decode service process: its gRPC server, its heartbeat in Redis, and a
clean stop on SIGINT/SIGTERM.

Lifecycle: load the model (the service object) -> listen -> register + heartbeat (TTL) ->
serve until a signal -> deregister (routers stop sending work) -> drain calls -> stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable
from typing import Protocol

from pdserve.registry import InstanceInfo, InstanceRegistry
from pdserve.rpc import RpcServer, join_host_port

log = logging.getLogger("pdserve.serving")


class Service(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def load(self) -> dict: ...


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host other processes dial: explicit, else the bind host, else (0.0.0.0) our hostname."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


async def run_service(
    role: str,
    instance_id: str,
    service: Service,
    server: RpcServer,
    host: str,
    port: int,
    advertise_host: str | None,
    redis_url: str | None,
    heartbeat_s: float = 1.0,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation); `on_ready(address)` once registered."""
    service.start()
    bound = await server.start(host, port)
    address = join_host_port(advertised_host(host, advertise_host), bound)
    registry = InstanceRegistry(redis_url) if redis_url else None
    started = time.time()

    def info() -> InstanceInfo:
        return InstanceInfo(
            role=role, instance_id=instance_id, address=address, load=service.load(), started_at=started
        )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    heartbeat = None
    try:
        if registry is not None:
            await registry.register(info(), ttl_s=3 * heartbeat_s)
            heartbeat = asyncio.create_task(
                registry.heartbeat_forever(info, interval_s=heartbeat_s, ttl_s=3 * heartbeat_s)
            )
        log.info("%s %s serving on %s", role, instance_id, address)
        if on_ready is not None:
            on_ready(address)
        await stop.wait()
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
        if registry is not None:
            try:
                await registry.deregister(role, instance_id)
            finally:
                await registry.close()
        await server.stop(grace=2.0)
        service.stop()
        log.info("%s %s stopped", role, instance_id)
