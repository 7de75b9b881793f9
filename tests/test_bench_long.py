"""`pdserve bench-long` against the shared live router (its max_model_len is 128): short streams
decode the whole run, each long prompt is answered and timed, and the streams' gaps are split
into the baseline window and each long prompt's prefill window. Nothing it sends reaches the
prefix cache's 64-token entries, so the shared engine still ends with every page free."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from pdserve.bench_long import StreamLog, add_arguments, run_bench, tail_shares
from tests.router_requests import MODEL

pytest_plugins = ["tests.router_server"]


def test_gaps_are_counted_in_the_window_they_end_in() -> None:
    log = StreamLog(requests=[[1.0, 2.0, 4.0], [3.5, 5.0]])
    assert log.gaps_ending_in(1.5, 4.0) == [1.0, 2.0]
    assert log.gaps_ending_in(4.5, 6.0) == [1.5]  # never a gap from one request to the next


def test_a_chunk_of_two_tokens_counts_its_gap_once_per_token() -> None:
    """A token whose text waits for the next one's (an incomplete UTF-8 character) arrives in a
    chunk of two: its 20 ms gap is two 10 ms gaps per token, one 20 ms gap between text chunks."""
    log = StreamLog(requests=[[1.00, 1.01, 1.03, 1.04]], tokens=[[1, 2, 4, 5]])
    assert log.gaps_ending_in(0.0, 2.0) == pytest.approx([0.01, 0.01, 0.01, 0.01])
    assert log.chunk_gaps_ending_in(0.0, 2.0) == pytest.approx([0.01, 0.02, 0.01])


def test_first_token_waits_are_those_of_requests_sent_in_the_window() -> None:
    log = StreamLog(requests=[[1.0, 2.0], [3.5, 5.0], []], sent=[0.5, 3.0, 3.2])
    assert log.first_token_waits(0.0, 1.0) == [0.5]
    assert log.first_token_waits(1.0, 4.0) == [0.5]  # the one sent at 3.2 has no token yet


def test_tail_shares_compare_the_client_with_the_router_histogram() -> None:
    """Cumulative bucket counts before and after a window: 10 router gaps in it, 2 above 20 ms and
    4 above 15 ms; the client saw 3 of 6 gaps above 15 ms, 1 above 20 and none above 30."""
    before = {0.015: 5.0, 0.02: 7.0, 0.03: 9.0, float("inf"): 10.0}
    after = {0.015: 11.0, 0.02: 15.0, 0.03: 17.0, float("inf"): 20.0}
    gaps = [0.010, 0.012, 0.014, 0.016, 0.018, 0.025]
    shares = tail_shares(gaps, before, after)
    assert shares["15ms"] == {"client": 0.5, "router": 0.4}
    assert shares["20ms"] == {"client": 1 / 6, "router": 0.2}
    assert shares["30ms"] == {"client": 0.0, "router": 0.2}
    assert tail_shares(gaps, {}, {})["20ms"]["router"] is None  # no such metric: the client's only


def test_long_prompts_beside_short_streams(server: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--url", server, "--model", MODEL, "--long", "30", "50", "--streams", "2"]
        + ["--stream-prompt-len", "8", "--stream-tokens", "40", "--baseline-s", "1.5", "--gap-s", "0.2"]
    )
    result = asyncio.run(run_bench(args))
    assert result["stream_errors"] == []
    assert result["baseline"]["gaps"] > 10 and result["baseline"]["itl_p50_ms"] > 0
    assert [r["prompt_tokens"] for r in result["long"]] == [30, 50]
    for r in result["long"]:
        assert r["error"] is None and 0 < r["ttft_s"] < 30
        assert r["prefill_tok_s"] == r["prompt_tokens"] / r["ttft_s"]
        assert r["text_chunk_itl_p99_ms"] >= r["itl_p99_ms"] > 0
        assert {"stream_ttft_max_ms", "stream_requests_sent"} <= r.keys()
        # the router's own inter-token histogram was read around the window
        assert all(share["router"] is not None for share in r["gaps_above"].values())
