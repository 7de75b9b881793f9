"""`pdserve bench-serve`: load a running OpenAI-compatible server with streaming requests.

For each `--concurrency` level: `--requests` random prompts of `--prompt-len` tokens, each asking
for `--output-len` tokens (ignore_eos), on /v1/completions (token-id prompts) or
/v1/chat/completions (text prompts); sent all at once or at `--request-rate` (Poisson), at most
`concurrency` in flight. Reports output tok/s over the level's duration (first request sent to
last answer), TTFT, TPOT and ITL (p50 / p99), end-to-end latency, and the requests that failed
(counted, with their reasons: the run goes on). vLLM's `bench serve` flag names work too.
Works against pdserve's router or any server taking token-id prompts (vLLM, SGLang).
docs/bench-serve.md compares its figures with AIPerf's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import time
from pathlib import Path

import httpx

from pdserve.bench_requests import (
    CHAT,
    COMPLETIONS,
    RequestFailure,
    RequestTiming,
    arrival_times,
    random_prompt,
    timed_request,
)

BACKEND_ENDPOINTS = {"vllm": COMPLETIONS, "openai": COMPLETIONS, "openai-chat": CHAT}  # vLLM's --backend


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


async def run_level(args: argparse.Namespace, concurrency: int) -> dict:
    """One concurrency level: send every request, time those that complete, count the others."""
    rng = random.Random(args.seed * 1_000_003 + concurrency)
    prompts = [random_prompt(rng, args.prompt_len, args.endpoint) for _ in range(args.requests)]
    arrivals = arrival_times(rng, len(prompts), args.request_rate)
    in_flight = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers) as client:
        start = time.perf_counter()

        async def send(prompt: list[int] | str, at: float) -> RequestTiming | RequestFailure:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with in_flight:
                return await timed_request(
                    client, args.url, args.endpoint, args.model, prompt, args.output_len
                )

        outcomes = await asyncio.gather(*(send(p, at) for p, at in zip(prompts, arrivals, strict=True)))
        seconds = time.perf_counter() - start
    return summarize(args, concurrency, outcomes, seconds)


def summarize(
    args: argparse.Namespace, concurrency: int, outcomes: list[RequestTiming | RequestFailure], seconds: float
) -> dict:
    timings = [o for o in outcomes if isinstance(o, RequestTiming)]
    errors = collections.Counter(o.error for o in outcomes if isinstance(o, RequestFailure))
    ttft = [t.ttft for t in timings]
    tpot = [t.tpot for t in timings if t.tpot is not None]
    itl = [x for t in timings for x in t.itl]
    return {
        "concurrency": concurrency,
        "endpoint": args.endpoint,
        "request_rate": args.request_rate,
        "requests": len(outcomes),
        "completed": len(timings),
        "failed": sum(errors.values()),
        "errors": dict(errors.most_common(5)),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "mean_prompt_tokens": mean([t.prompt_tokens for t in timings]),  # the server's count
        "mean_output_tokens": mean([t.output_tokens for t in timings]),
        "seconds": seconds,
        "request_throughput": len(timings) / seconds,
        "output_tok_s": sum(t.output_tokens for t in timings) / seconds,
        "ttft_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "tpot_ms": 1000 * percentile(tpot, 50),
        "tpot_p99_ms": 1000 * percentile(tpot, 99),
        "itl_ms": 1000 * percentile(itl, 50),
        "itl_p99_ms": 1000 * percentile(itl, 99),
        "e2e_ms": 1000 * percentile([t.e2e for t in timings], 50),
    }


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help, except where there is none to show (None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsShown
    add = parser.add_argument
    add("--url", "--base-url", default="http://127.0.0.1:8000", help="the server's base URL (no /v1)")
    add("--model", required=True, help="the served model name")
    add(
        "--endpoint",
        choices=[COMPLETIONS, CHAT],
        default=None,
        help=f"the API to load (default: {COMPLETIONS})",
    )
    add(
        "--backend",
        choices=sorted(BACKEND_ENDPOINTS),
        default=None,
        help="vLLM's: openai-chat means --endpoint " + CHAT,
    )
    add("--api-key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY, if set)")
    add(
        "--concurrency",
        "--max-concurrency",
        type=int,
        nargs="+",
        default=[4, 16, 32],
        help="requests in flight at most; one run per value",
    )
    add("--requests", "--num-prompts", type=int, default=64, help="requests per concurrency level")
    add(
        "--prompt-len",
        "--random-input-len",
        type=int,
        default=1024,
        help="prompt tokens (chat: one-token words)",
    )
    add("--output-len", "--random-output-len", type=int, default=256, help="tokens each request generates")
    add(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests sent a second, Poisson arrivals (inf: all at once)",
    )
    add("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    add("--timeout", type=float, default=600.0, help="seconds one request may take")
    add("--out", default=None, help="write the results as JSON here")
    add("--chart", default=None, help="write an SVG chart (vs vLLM and the roofline) here")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """--endpoint from --backend when only that is given; the key from $OPENAI_API_KEY."""
    implied = BACKEND_ENDPOINTS.get(args.backend) if args.backend else None
    if args.endpoint and implied and args.endpoint != implied:
        raise SystemExit(
            f"pdserve bench-serve: --backend {args.backend} loads {implied}, not {args.endpoint}"
        )
    args.endpoint = args.endpoint or implied or COMPLETIONS
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    if args.request_rate <= 0:
        raise SystemExit("pdserve bench-serve: --request-rate must be positive (inf: all at once)")
    return args


def report(result: dict) -> str:
    """One line per level (and one more naming the failures, if any)."""
    r = result
    line = (
        f"c={r['concurrency']:<3} {r['output_tok_s']:8.1f} tok/s  TTFT {r['ttft_ms']:7.1f} ms "
        f"(p99 {r['ttft_p99_ms']:.1f})  TPOT {r['tpot_ms']:6.1f} ms  ITL p99 {r['itl_p99_ms']:.1f} ms  "
        f"e2e {r['e2e_ms']:.0f} ms  {r['completed']}/{r['requests']} ok"
    )
    if r["failed"]:
        reasons = "; ".join(f"{error} (x{n})" for error, n in r["errors"].items())
        line += f"\n      failed {r['failed']} of {r['requests']}: {reasons}"
    return line


def run(args: argparse.Namespace) -> int:
    """0 when every level completed some requests (failures are counted, not fatal), else 1."""
    from pdserve.bench_chart import VLLM_SERVED_TOK_S, chart_svg

    args = resolve(args)
    results = []
    for c in args.concurrency:
        result = asyncio.run(run_level(args, c))
        results.append(result)
        print(report(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if args.chart:
        title = f"served, streaming, {args.prompt_len} -> {args.output_len} tokens"
        Path(args.chart).write_text(chart_svg(results, title, reference=VLLM_SERVED_TOK_S))
    return 0 if all(r["completed"] for r in results) else 1
