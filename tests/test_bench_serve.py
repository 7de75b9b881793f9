"""`pdserve bench-serve`: against the shared live router, completions and chat, every request
timed and counted; against a server that fails some requests, each failure counted with its
reason and the run going on; the API key sent; Poisson arrivals; vLLM's flag names."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench_requests import CHAT, COMPLETIONS, arrival_times
from pdserve.bench_serve import add_arguments, percentile, resolve, run_level
from tests.live_server import serving
from tests.router_requests import MODEL

pytest_plugins = ["tests.router_server"]


def bench_args(url: str, *argv: str, env_key: str | None = None) -> argparse.Namespace:
    """The flags as `pdserve bench-serve` parses and resolves them."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.MonkeyPatch.context() as patch:
        if env_key is None:
            patch.delenv("OPENAI_API_KEY", raising=False)
        else:
            patch.setenv("OPENAI_API_KEY", env_key)
        return resolve(parser.parse_args(["--base-url", url, "--model", MODEL, *argv]))


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0


def test_vllm_flag_names() -> None:
    args = bench_args(
        "http://h:1",
        *("--max-concurrency", "8", "--num-prompts", "5", "--random-input-len", "7"),
        *("--random-output-len", "3", "--request-rate", "2.5", "--backend", "openai-chat"),
    )
    assert (args.url, args.concurrency, args.requests, args.prompt_len, args.output_len) == (
        "http://h:1",
        [8],
        5,
        7,
        3,
    )
    assert (args.request_rate, args.endpoint, args.api_key) == (2.5, CHAT, None)
    assert bench_args("http://h:1", env_key="sk-env").api_key == "sk-env"
    assert bench_args("http://h:1", "--api-key", "sk-flag", env_key="sk-env").api_key == "sk-flag"
    with pytest.raises(SystemExit, match="openai-chat loads"):
        bench_args("http://h:1", "--backend", "openai-chat", "--endpoint", COMPLETIONS)


def test_poisson_arrivals() -> None:
    assert arrival_times(random.Random(0), 3, float("inf")) == [0.0, 0.0, 0.0]
    times = arrival_times(random.Random(0), 4000, 50.0)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.1)  # exponential: stdev = mean


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_times_every_request(server: str, endpoint: str) -> None:
    args = bench_args(
        server, "--endpoint", endpoint, "--requests", "6", "--prompt-len", "20", "--output-len", "5"
    )
    result = asyncio.run(run_level(args, concurrency=3))
    assert (result["requests"], result["completed"], result["failed"], result["errors"]) == (6, 6, 0, {})
    assert result["mean_output_tokens"] == 5 and result["output_tok_s"] > 0
    if endpoint == COMPLETIONS:
        assert result["mean_prompt_tokens"] == 20
    else:  # 20 one-token words in the chat template
        assert 20 < result["mean_prompt_tokens"] <= 40
    assert 0 < result["ttft_ms"] <= result["ttft_p99_ms"] and result["ttft_ms"] < result["e2e_ms"]
    assert result["tpot_ms"] > 0 and result["itl_ms"] > 0 and result["itl_p99_ms"] >= result["itl_ms"]


def flaky_server(seen: list[dict]) -> FastAPI:
    """Answers by the prompt's first token id modulo 3: 0 a 503, 1 a stream that ends in an error
    event, 2 three text chunks and the usage. Records each request's Authorization header."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        kind = body["prompt"][0] % 3
        seen.append({"auth": request.headers.get("authorization"), "kind": kind})
        if kind == 0:
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)

        def events() -> list[str]:
            chunks = [{"choices": [{"index": 0, "text": "ab"}]}] * 3
            if kind == 1:
                chunks = chunks[:1] + [{"error": {"message": "engine failed"}}]
            else:
                chunks.append({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 3}})
            return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]

        return StreamingResponse(iter(events()), media_type="text/event-stream")

    return app


def test_failures_are_counted_and_the_key_sent() -> None:
    seen: list[dict] = []
    with serving(flaky_server(seen)) as url:
        args = bench_args(url, "--requests", "30", "--prompt-len", "8", "--output-len", "3", env_key="sk-1")
        args.request_rate = 200.0  # Poisson arrivals over about 0.15 s
        result = asyncio.run(run_level(args, concurrency=4))
    kinds = [s["kind"] for s in seen]
    assert len(seen) == 30 and {s["auth"] for s in seen} == {"Bearer sk-1"}
    assert result["completed"] == kinds.count(2) > 0
    assert result["failed"] == kinds.count(0) + kinds.count(1) == 30 - result["completed"]
    assert result["errors"] == {
        'HTTP 503: {"error":{"message":"busy"}}': kinds.count(0),
        "error event: engine failed": kinds.count(1),
    }
    assert result["mean_output_tokens"] == 3 and result["request_throughput"] > 0
