"""What a prefill or decode service process is built on: `ServiceConfig` (the one config of a
service process), `EngineHost` (an engine, its pools registered with a NIXL agent, the engine
thread) and `ServiceRole` (the prefill or decode half that a host serves; one host can serve
both: one engine holding both roles on one GPU).

The engine thread's callbacks go to every role; each takes the requests it knows. The host logs
a stats line every 10 s while it serves (pdserve.serving_stats; off with --disable-log-stats).
After each step that changed the prefix cache's entries, the host snapshots the keys it claims
and wakes its `publisher` (`pdserve.prefix_publishing`): a new entry goes to Redis right after
the step that made it, not at the next heartbeat; `prefix_published(version)` waits for that.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import secrets
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import kvtransfer
from kvtransfer import POOL_UNIT_DIMS, BaseTransferAgent, LocalCopyAgent, model_identity
from pdserve.cli_args import add_engine_arguments, engine_config_from_args
from pdserve.config import EngineConfig
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.warmup import warm_up, warm_up_grammars, warm_up_long_attention
from pdserve.ops import compile_watch
from pdserve.registry import HEARTBEAT_S, InstanceRegistry
from pdserve.serving_stats import STATS_INTERVAL_S, ServingStats, load_report

if TYPE_CHECKING:
    from pdserve.prefix_publishing import PrefixPublisher

log = logging.getLogger("pdserve.serving")
LOAD_REFRESH_S = 0.1  # how often the engine thread refreshes the published load


@dataclass(slots=True)
class ServiceConfig:
    """The one config object of a service process (prefill, decode, or both in one engine)."""

    engine: EngineConfig
    instance_id: str = "instance-0"
    host: str = "127.0.0.1"
    port: int = 0  # the prefill server's port; a decode server (of a two-role engine) takes port + 1
    advertise_host: str | None = None
    redis_url: str | None = None
    heartbeat_s: float = HEARTBEAT_S  # `pdserve up` judges hung services by this beat
    # the heartbeat stops while the engine thread is held in one turn this long (0: never)
    engine_stuck_s: float = 60.0
    # on SIGTERM, after deregistering: how long open calls (decode streams) may go on
    shutdown_timeout_s: float = 30.0
    # prefill: a held request's memory is freed after this long if nobody pulled it
    handoff_timeout_s: float = 60.0
    # prefill: requests queued (not yet prefilling) beyond which a new one is refused (retry later)
    max_queued_requests: int = 1024
    # decode: fail a state READ after this long
    transfer_timeout_s: float = 10.0
    # decode: give up on a request that found no memory for this long with nothing running to
    # free any; while sequences run it waits, renewing its lease every half of this (which must
    # stay below the prefill side's handoff_timeout_s)
    admission_timeout_s: float = 30.0
    # seconds between two stats lines in the log (pdserve.serving_stats); 0: none
    log_stats_interval_s: float = STATS_INTERVAL_S
    # once serving, freeze the start-up heap out of garbage collection (pdserve.heap): the
    # process's own entry sets it; services run inside a test process leave it off
    freeze_heap: bool = False


def add_service_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--instance-id", default=f"{role}-{socket.gethostname()}")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--advertise-host", default=None, help="host other processes dial (default: --host)")
    parser.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no stats line in the log every 10 s (throughputs, running, waiting, KV cache, prefix hits)",
    )
    parser.add_argument(
        "--engine-stuck-timeout",
        type=float,
        default=60.0,
        help="stop the heartbeat while the engine thread is held in one step or call this long (s; 0: never)",
    )
    if role in ("prefill", "engine"):
        parser.add_argument(
            "--handoff-timeout", type=float, default=60.0, help="free unpulled state after (s)"
        )
        parser.add_argument(
            "--max-queued-requests", type=int, default=1024, help="refuse new requests beyond this queue"
        )
    if role in ("decode", "engine"):
        parser.add_argument(
            "--transfer-timeout", type=float, default=10.0, help="fail a state READ after (s)"
        )
        parser.add_argument(
            "--admission-timeout",
            type=float,
            default=30.0,
            help="fail a handed-over request that found no memory this long with nothing running (s); "
            "while sequences run it waits, its lease renewed every half of this (keep it below the "
            "prefill side's --handoff-timeout)",
        )


def service_config_from_args(args: argparse.Namespace, role: str) -> ServiceConfig:
    """The `ServiceConfig` of the flags of `add_service_arguments(parser, role)`."""
    optional = {
        "handoff_timeout_s": getattr(args, "handoff_timeout", None),
        "max_queued_requests": getattr(args, "max_queued_requests", None),
        "transfer_timeout_s": getattr(args, "transfer_timeout", None),
        "admission_timeout_s": getattr(args, "admission_timeout", None),
    }
    engine = dataclasses.replace(engine_config_from_args(args), role="both" if role == "engine" else role)
    return ServiceConfig(
        engine=engine,
        instance_id=args.instance_id,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        redis_url=args.redis_url,
        log_stats_interval_s=0.0 if args.disable_log_stats else STATS_INTERVAL_S,
        engine_stuck_s=args.engine_stuck_timeout,
        freeze_heap=True,
        **{k: v for k, v in optional.items() if v is not None},
    )


def engine_transfer_agent(
    engine: LLMEngine, name: str, config: ServiceConfig, nixl: bool
) -> BaseTransferAgent:
    """The engine's KV pool and GDN state pools registered with a transfer agent: NIXL, listening
    only on the interface of the service's bind address; or, for an engine that hands over only
    to itself, an in-process agent (no NIXL, nothing listens)."""
    runner = engine.runner
    pools = {
        "kv": runner.kv_pool.kv,
        "conv": runner.state_pool.conv,
        "recurrent": runner.state_pool.recurrent,
    }
    args = (name, pools, POOL_UNIT_DIMS, model_identity(engine.config.model_config), engine.config.page_size)
    if not nixl:
        return LocalCopyAgent(*args)
    return kvtransfer.TransferAgent(*args, timeout_s=config.transfer_timeout_s, bind_host=config.host)


def start_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


class ServiceRole:
    """The prefill or the decode half of a service, on a host; gets the engine thread's callbacks."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.config = host.config
        self.engine = host.engine
        self.agent = host.agent
        self.thread = host.thread
        host.roles.append(self)

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return self.host.loop

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Take the outputs of the requests this role serves (on the engine thread)."""

    def on_error(self, request_ids: list[str], message: str) -> None:
        """The engine failed these requests (on the engine thread)."""

    def tick(self) -> bool:
        """The role's polling on the engine thread; True while it wants to be called again soon."""
        return False

    def load(self) -> dict:
        """Counters this role adds to the instance's published load."""
        return {}


class EngineHost:
    """An engine, its pools registered with a transfer agent (NIXL unless `nixl=False`: an
    engine that holds both roles hands over to itself only), and the engine thread. The agent's
    name is the instance id plus an incarnation, so a restarted instance is a new peer."""

    def __init__(self, config: ServiceConfig, nixl: bool = True) -> None:
        self.config = config
        self.engine = LLMEngine(config.engine)
        if self.engine.runner.device.type == "cuda":  # compile every shape before taking traffic
            compile_watch.install()  # from now on the engine thread names what compiles in a step
            warm_up(self.engine)
            built = compile_watch.take()
            log.info(
                "warm-up built %d Triton kernel specialisations (%.0f s)",
                len(built),
                sum(c.seconds for c in built),
            )
        warm_up_grammars(self.engine)  # before any request: its build would stall the event loop
        self.engine.scheduler.lease_ttl_s = config.handoff_timeout_s
        self.incarnation = secrets.token_hex(4)
        agent_name = f"{config.instance_id}#{self.incarnation}"
        self.agent = engine_transfer_agent(self.engine, agent_name, config, nixl)
        self.registry = InstanceRegistry(config.redis_url) if config.redis_url else None
        self.roles: list[ServiceRole] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._load: dict = load_report(self.engine)
        self._load_at = 0.0
        # (cache version, its keys): replaced whole on the engine thread, read on the event loop
        self._prefix_snapshot: tuple[int, list[str]] = (-1, [])
        self.publisher: PrefixPublisher | None = None  # set by the publisher (with a registry)
        caching = self.engine.prefix_cache is not None
        self.stats = ServingStats(config.instance_id, config.log_stats_interval_s, prefix_cache=caching)
        self.thread = EngineThread(self.engine, self._on_outputs, self._on_error, tick=self._tick)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread.start()
        self.thread.post(warm_up_long_attention, self.engine)  # first: torch caches its plan per thread

    def stop(self) -> None:
        self.thread.stop()
        self.agent.close()

    def load(self) -> dict:
        """The load as of the engine thread's last turn (never read across threads mid-change)."""
        return self._load

    def extra(self) -> dict:
        """Published with the instance: its transfer agent, the longest request it takes (its
        max_model_len, perhaps lowered by the memory plan) and prefix-cache keying."""
        info = {"agent": self.agent.name, "max_model_len": self.engine.config.max_model_len}
        cache = self.engine.prefix_cache
        if cache is not None:
            info |= {"prefix_block_size": cache.block_size, "prefix_salt": cache.salt}
        return info

    def prefix_keys(self) -> list[str]:
        """Cached prefix blocks this instance holds (hex), published in Redis."""
        return self._prefix_snapshot[1]

    def prefix_snapshot(self) -> tuple[int, list[str]]:
        """The cache version of the last snapshot and its keys."""
        return self._prefix_snapshot

    async def prefix_published(self, version: int) -> None:
        """Until the keys of snapshot `version` are in Redis (bounded; at once without Redis, or
        while it fails)."""
        if self.publisher is not None:
            await self.publisher.published(version)

    def _refresh_prefix_keys(self) -> None:
        """Snapshot the cache's keys when its entries changed, and wake the publisher (engine thread)."""
        cache = self.engine.prefix_cache
        if cache is None or cache.version == self._prefix_snapshot[0]:
            return
        # entries + tail markers (pdserve.prefix_keys)
        self._prefix_snapshot = (cache.version, cache.published_keys())
        if self.publisher is not None:
            self.publisher.notify()

    # ---- the engine thread's callbacks
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self.deliver(outputs)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Give the roles a step's outputs (on the engine thread)."""
        # before the roles stream the outputs: a finished request's entry is on its way to Redis
        # before its last token is on its way to the client (who may send the next turn at once)
        self._refresh_prefix_keys()
        self.stats.observe(outputs)
        for role in self.roles:
            role.on_outputs(outputs)

    def _on_error(self, request_ids: list[str], message: str) -> None:
        for role in self.roles:
            role.on_error(request_ids, message)

    def _tick(self) -> bool:
        busy = False
        for role in self.roles:
            busy = role.tick() or busy
        self._refresh_prefix_keys()  # entries made by a step without outputs, pulls, evictions
        now = time.monotonic()
        if now - self._load_at >= LOAD_REFRESH_S:
            load = load_report(self.engine)
            for role in self.roles:
                load |= role.load()
            self._load, self._load_at = load, now
            if (line := self.stats.line(load, now)) is not None:
                log.info(line)
        return busy
