"""`pdserve decode`: one decode instance (gRPC service `pdserve.Decode`)."""

from __future__ import annotations

import argparse
import asyncio

from decode_svc.service import DecodeConfig, DecodeService
from pdserve.rpc import RpcServer
from pdserve.serving import add_service_arguments, run_service, service_config_fields, start_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser, "decode")
    parser.add_argument("--transfer-timeout", type=float, default=10.0, help="fail a state READ after (s)")


async def serve(config: DecodeConfig) -> None:
    service = DecodeService(config)
    server = RpcServer("pdserve.Decode")
    server.stream("decode", service.decode)
    await run_service("decode", config, service, server)


def run(args: argparse.Namespace) -> int:
    start_logging()
    asyncio.run(serve(DecodeConfig(**service_config_fields(args), transfer_timeout_s=args.transfer_timeout)))
    return 0
