"""`pdserve prefill`: one prefill instance (gRPC service `pdserve.Prefill`)."""

from __future__ import annotations

import argparse

from pdserve.rpc import RpcServer
from pdserve.service_process import run_service, service_main
from pdserve.serving import (
    EngineHost,
    ServiceConfig,
    add_service_arguments,
)
from prefill_svc.service import PrefillService


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser, "prefill")


def prefill_server(service: PrefillService) -> RpcServer:
    server = RpcServer("pdserve.Prefill")
    server.stream("prefill", service.prefill)
    server.unary("endpoint", service.endpoint)
    server.unary("release", service.release)
    server.unary("renew", service.renew)
    server.unary("abort", service.abort)
    # prefix sharing (pdserve.prefix_sharing): a peer pulls a cached prefix; an operator clears
    server.unary("pin_prefix", service.sharing.pin_prefix)
    server.unary("unpin_prefix", service.sharing.unpin_prefix)
    server.unary("clear_prefix_cache", service.sharing.clear_prefix_cache)
    return server


async def serve(config: ServiceConfig) -> None:
    host = EngineHost(config)
    await run_service(config, host, {"prefill": prefill_server(PrefillService(host))})


def run(args: argparse.Namespace) -> int:
    return service_main(serve, args, "prefill")
