"""`pdserve prefill`: one prefill instance (gRPC service `pdserve.Prefill`)."""

from __future__ import annotations

import argparse
import asyncio

from pdserve.rpc import RpcServer
from pdserve.serving import add_service_arguments, run_service, service_config_fields, start_logging
from prefill_svc.service import PrefillConfig, PrefillService


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser, "prefill")
    parser.add_argument("--handoff-timeout", type=float, default=60.0, help="free unpulled state after (s)")


async def serve(config: PrefillConfig) -> None:
    service = PrefillService(config)
    server = RpcServer("pdserve.Prefill")
    server.unary("prefill", service.prefill)
    server.unary("endpoint", service.endpoint)
    server.unary("release", service.release)
    await run_service("prefill", config, service, server)


def run(args: argparse.Namespace) -> int:
    start_logging()
    asyncio.run(serve(PrefillConfig(**service_config_fields(args), handoff_timeout_s=args.handoff_timeout)))
    return 0
