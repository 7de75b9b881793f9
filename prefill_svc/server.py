"""`pdserve prefill`: one prefill instance (gRPC service `pdserve.Prefill`)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.launcher import add_engine_arguments, engine_config_from_args
from pdserve.rpc import RpcServer
from pdserve.serving import run_service
from prefill_svc.service import PrefillConfig, PrefillService


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--instance-id", default="prefill-0")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--advertise-host", default=None, help="host other processes dial (default: --host)")
    parser.add_argument("--handoff-timeout", type=float, default=60.0, help="free unpulled state after (s)")


async def serve(config: PrefillConfig) -> None:
    service = PrefillService(config)
    server = RpcServer("pdserve.Prefill")
    server.unary("prefill", service.prefill)
    server.unary("endpoint", service.endpoint)
    server.unary("release", service.release)
    await run_service(
        "prefill",
        config.instance_id,
        service,
        server,
        config.host,
        config.port,
        config.advertise_host,
        config.redis_url,
        config.heartbeat_s,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = PrefillConfig(
        engine=engine_config_from_args(args),
        instance_id=args.instance_id,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        redis_url=args.redis_url,
        handoff_timeout_s=args.handoff_timeout,
    )
    asyncio.run(serve(config))
    return 0
