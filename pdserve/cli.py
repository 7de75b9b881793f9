"""The `pdserve` command.

Each subcommand lives in its own module, which defines two functions:

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...          # the exit status

and is registered below with one line in `COMMANDS`. Only the chosen subcommand's module is
imported, so `pdserve make-tiny` never loads the server stack and `pdserve --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Command:
    module: str  # defines add_arguments(parser) and run(args) -> int
    help: str


COMMANDS: dict[str, Command] = {
    "make-tiny": Command("pdserve.tiny", "write a deterministic tiny random Qwen3.6-class checkpoint"),
    "up": Command("pdserve.launcher", "start Redis, prefill and decode services and a router here"),
    "router": Command("router.server", "the OpenAI-compatible HTTP router"),
    "prefill": Command("prefill_svc.server", "a gRPC prefill service instance"),
    "decode": Command("decode_svc.server", "a gRPC decode service instance"),
    "engine": Command("decode_svc.colocated", "one engine instance holding both roles (one GPU)"),
    "bench-serve": Command(
        "pdserve.bench_serve", "load a running server with streaming clients (AIPerf-style)"
    ),
    "bench-long": Command(
        "pdserve.bench_long", "long prompts against a running server, short streams decoding beside them"
    ),
    "check": Command("pdserve.check", "packed prefill equals each prompt alone, chunked equals whole"),
    "bench": Command("pdserve.bench", "offline throughput at the full Qwen3.6-35B-A3B shape, random weights"),
}


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the first argument that is not an option)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser, with the arguments of the chosen subcommand only (its module gets imported)."""
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode serving for Qwen3.6 hybrid-MoE models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _chosen(argv)
    for name, command in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        if name == chosen:
            module = importlib.import_module(command.module)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
