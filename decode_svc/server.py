"""`pdserve decode`: one decode instance (gRPC service `pdserve.Decode`)."""

from __future__ import annotations

import argparse

from decode_svc.service import DecodeService
from pdserve.rpc import RpcServer
from pdserve.service_process import run_service, service_main
from pdserve.serving import (
    EngineHost,
    ServiceConfig,
    add_service_arguments,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser, "decode")


def decode_server(service: DecodeService) -> RpcServer:
    server = RpcServer("pdserve.Decode")
    server.stream("decode", service.decode)
    # prefix sharing: a prefill instance handshakes and pulls a cached conversation from here
    server.unary("endpoint", service.sharing.endpoint)
    server.unary("pin_prefix", service.sharing.pin_prefix)
    server.unary("unpin_prefix", service.sharing.unpin_prefix)
    server.unary("clear_prefix_cache", service.sharing.clear_prefix_cache)
    return server


async def serve(config: ServiceConfig) -> None:
    host = EngineHost(config)
    await run_service(config, host, {"decode": decode_server(DecodeService(host))})


def run(args: argparse.Namespace) -> int:
    return service_main(serve, args, "decode")
