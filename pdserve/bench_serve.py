"""`pdserve bench-serve`: load a running OpenAI-compatible server the way AIPerf does.

`c` concurrent clients each stream completions of `--prompt-len` random token ids and
`--output-len` tokens (ignore_eos) back to back until `--requests` are done; reports output
tok/s, TTFT and inter-token latency (p50 / p99) and end-to-end latency, per concurrency.
Works against pdserve's router or any server taking token-id prompts (vLLM, SGLang).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(slots=True)
class RequestTiming:
    ttft: float
    itl: list[float]
    e2e: float
    output_tokens: int


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int
) -> RequestTiming:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError("the stream carried no text")
    itl = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return RequestTiming(arrivals[0] - start, itl, arrivals[-1] - start, tokens)


async def run_level(args: argparse.Namespace, concurrency: int) -> dict:
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                timings.append(await one_request(client, args.url, args.model, prompt, args.output_len))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    ttft = [t.ttft for t in timings]
    itl = [x for t in timings for x in t.itl]
    return {
        "concurrency": concurrency,
        "requests": len(timings),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "seconds": seconds,
        "output_tok_s": sum(t.output_tokens for t in timings) / seconds,
        "ttft_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "tpot_ms": 1000 * percentile(itl, 50),
        "itl_p99_ms": 1000 * percentile(itl, 99),
        "e2e_ms": 1000 * percentile([t.e2e for t in timings], 50),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (no /v1)")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument("--chart", default=None, help="write an SVG chart (vs vLLM and the roofline) here")


def run(args: argparse.Namespace) -> int:
    from pdserve.bench import draw
    from pdserve.bench_chart import VLLM_SERVED_TOK_S, chart_svg

    results = []
    for c in args.concurrency:
        result = asyncio.run(run_level(args, c))
        results.append(result)
        print(
            draw([result])
            + f"  TTFT p99 {result['ttft_p99_ms']:.1f} ms  ITL p99 {result['itl_p99_ms']:.1f} ms",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if args.chart:
        title = f"served, streaming, {args.prompt_len} -> {args.output_len} tokens"
        Path(args.chart).write_text(chart_svg(results, title, reference=VLLM_SERVED_TOK_S))
    return 0
