"""`pdserve bench-serve` against the shared live router: every request is timed and counted."""

from __future__ import annotations

import argparse
import asyncio

from pdserve.bench_serve import percentile, run_level
from tests.router_requests import MODEL

pytest_plugins = ["tests.router_server"]


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0


def test_bench_serve_times_every_request(server: str) -> None:
    args = argparse.Namespace(url=server, model=MODEL, requests=6, prompt_len=20, output_len=5, timeout=60.0)
    result = asyncio.run(run_level(args, concurrency=3))
    assert result["requests"] == 6
    assert result["output_tok_s"] > 0
    assert 0 < result["ttft_ms"] <= result["ttft_p99_ms"] and result["ttft_ms"] < result["e2e_ms"]
    assert result["tpot_ms"] > 0 and result["itl_p99_ms"] >= result["tpot_ms"]
