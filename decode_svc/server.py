"""`pdserve decode`: one decode instance (gRPC service `pdserve.Decode`)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from decode_svc.service import DecodeConfig, DecodeService
from pdserve.launcher import add_engine_arguments, engine_config_from_args
from pdserve.rpc import RpcServer
from pdserve.serving import run_service


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--instance-id", default="decode-0")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--advertise-host", default=None, help="host other processes dial (default: --host)")
    parser.add_argument("--transfer-timeout", type=float, default=10.0, help="fail a state READ after (s)")


async def serve(config: DecodeConfig) -> None:
    service = DecodeService(config)
    server = RpcServer("pdserve.Decode")
    server.stream("decode", service.decode)
    await run_service(
        "decode",
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
    config = DecodeConfig(
        engine=engine_config_from_args(args),
        instance_id=args.instance_id,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        redis_url=args.redis_url,
        transfer_timeout_s=args.transfer_timeout,
    )
    asyncio.run(serve(config))
    return 0
