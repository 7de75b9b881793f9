"""`pdserve engine`: one engine instance holding both roles (the one-GPU layout).

The prefill and decode roles share one `EngineHost`: the weights are loaded once and one set of
pools serves both. It registers as a prefill and as a decode instance (two gRPC servers, on
`--port` and the port after it), so the router runs the same protocol as with separate
instances: a burst to the prefill server, then a decode stream. A lease whose agent is this
engine is decoded in place: the request decodes on at once after its first token (its tokens
wait under the lease until the decode stream claims it), its pages and state slot never move,
and no bytes move (no NIXL agent either).
"""

from __future__ import annotations

import argparse

from decode_svc.server import decode_server
from decode_svc.service import DecodeService
from pdserve.service_process import run_service, service_main
from pdserve.serving import (
    EngineHost,
    ServiceConfig,
    add_service_arguments,
)
from prefill_svc.server import prefill_server
from prefill_svc.service import PrefillService


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser, "engine")


async def serve(config: ServiceConfig) -> None:
    host = EngineHost(config, nixl=False)  # it hands over to itself only
    host.engine.decode_in_place = True  # the second token does not wait for the router
    servers = {
        "prefill": prefill_server(PrefillService(host)),
        "decode": decode_server(DecodeService(host)),
    }
    await run_service(config, host, servers)


def run(args: argparse.Namespace) -> int:
    return service_main(serve, args, "engine")
