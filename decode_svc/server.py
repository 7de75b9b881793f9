"""`pdserve decode`: one decode instance (gRPC service `pdserve.Decode`)."""

from __future__ import annotations

import argparse
import asyncio

from decode_svc.service import DecodeService
from pdserve.rpc import RpcServer
from pdserve.service_process import run_service
from pdserve.serving import (
    EngineHost,
    ServiceConfig,
    add_service_arguments,
    service_config_from_args,
    start_logging,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser, "decode")


def decode_server(service: DecodeService) -> RpcServer:
    server = RpcServer("pdserve.Decode")
    server.stream("decode", service.decode)
    return server


async def serve(config: ServiceConfig) -> None:
    host = EngineHost(config)
    await run_service(config, host, {"decode": decode_server(DecodeService(host))})


def run(args: argparse.Namespace) -> int:
    start_logging()
    asyncio.run(serve(service_config_from_args(args)))
    return 0
