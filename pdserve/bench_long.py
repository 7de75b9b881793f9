"""`pdserve bench-long`: long prompts against a running server while short streams decode beside them.

`--streams` short requests stream tokens for the whole run (each one sent again when it ends;
their first requests ask for 1/N, 2/N, ... of `--stream-tokens`, so they do not end together).
After `--baseline-s` seconds of them alone, each `--long` prompt (random token ids on
/v1/completions) is sent in turn, waiting for its answer before the next. Reports each long
prompt's TTFT (and the prefill rate it implies), and the short streams' inter-token latency
(p50 / p99, per token: a chunk's gap shared by the tokens its running usage counts, as the
router's histogram does; and the p99 between text chunks beside it) in the baseline window and
while each long prompt was prefilling (from its send to its first token): the figures issue 12
asks for; and the TTFT of the short requests sent during that window (a short request must not
wait for a long prefill). Pure HTTP client: runs against any server that takes token-id prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.bench_requests import COMPLETIONS, RequestFailure, request_body, timed_request
from pdserve.bench_serve import percentile


@dataclass(slots=True)
class StreamLog:
    """Every text chunk's arrival time of the short streams and the output tokens counted so far
    at it, per request (so gaps never span two)."""

    requests: list[list[float]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # output tokens counted at each arrival
    sent: list[float] = field(default_factory=list)  # when each request was sent
    errors: list[str] = field(default_factory=list)

    def gaps_ending_in(self, start: float, end: float) -> list[float]:
        """The gaps between tokens, each chunk's gap shared by the tokens it brought (as the
        router's histogram counts them): a token whose text is an incomplete UTF-8 character
        comes in the next token's chunk, and with random weights ~1% did, each a double gap at
        the client that no step had (H100, session 32)."""
        gaps = []
        for i, times in enumerate(self.requests):
            counts = self.tokens[i] if i < len(self.tokens) else range(1, len(times) + 1)
            for a, b, n, m in zip(times, times[1:], counts, counts[1:], strict=False):
                if start <= b <= end:
                    gaps += [(b - a) / max(1, m - n)] * max(1, m - n)
        return gaps

    def chunk_gaps_ending_in(self, start: float, end: float) -> list[float]:
        """The gaps between text chunks, whatever tokens they carry (the text as a reader sees it)."""
        return [
            b - a
            for times in self.requests
            for a, b in zip(times, times[1:], strict=False)
            if start <= b <= end
        ]

    def first_token_waits(self, start: float, end: float) -> list[float]:
        """TTFT of each request sent in [start, end) that got a token."""
        return [
            times[0] - sent
            for sent, times in zip(self.sent, self.requests, strict=True)
            if times and start <= sent < end
        ]


async def short_stream(
    client: httpx.AsyncClient, args: argparse.Namespace, seed: int, log: StreamLog
) -> None:
    rng = random.Random(seed)
    tokens = max(1, args.stream_tokens * (seed + 1) // args.streams)  # staggered ends
    while True:  # until cancelled
        prompt = [rng.randrange(1000, 100_000) for _ in range(args.stream_prompt_len)]
        arrivals: list[float] = []
        counts: list[int] = []
        log.requests.append(arrivals)
        log.tokens.append(counts)
        log.sent.append(time.perf_counter())
        done = await timed_request(
            client, args.url, COMPLETIONS, args.model, prompt, tokens, arrivals, tokens_so_far=counts
        )
        tokens = args.stream_tokens
        if isinstance(done, RequestFailure):
            log.errors.append(done.error)
            await asyncio.sleep(1.0)


def long_body(args: argparse.Namespace, length: int) -> bytes:
    """A long prompt's request body, made and encoded before the streams start: on the event loop
    that reads them, a 262K-token prompt's ids and JSON took ~210 ms (2-core box), a gap the
    client itself put in every stream."""
    rng = random.Random(length)
    prompt = [rng.randrange(1000, 100_000) for _ in range(length)]
    return json.dumps(request_body(COMPLETIONS, args.model, prompt, args.long_output_tokens)).encode()


async def long_request(client: httpx.AsyncClient, args: argparse.Namespace, length: int, body: bytes) -> dict:
    arrivals: list[float] = []
    start = time.perf_counter()
    done = await timed_request(
        client, args.url, COMPLETIONS, args.model, [], args.long_output_tokens, arrivals, encoded=body
    )
    first = arrivals[0] if arrivals else time.perf_counter()
    return {
        "prompt_tokens": length,
        "error": done.error if isinstance(done, RequestFailure) else None,
        "sent": start,
        "first_token": first,
        "ttft_s": first - start,
    }


ITL_BUCKET = "pdserve:inter_token_latency_seconds_bucket"
TAIL_GAPS_S = (0.015, 0.02, 0.03)  # the shares of gaps above these, as the router and the client saw them


async def router_itl_buckets(client: httpx.AsyncClient, url: str) -> dict[float, float]:
    """The router's inter-token histogram (cumulative count by upper bound, summed over labels);
    empty when the server has no such metric (not a pdserve router)."""
    try:
        text = (await client.get(url.rstrip("/") + "/metrics")).text
    except httpx.HTTPError:
        return {}
    counts: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(ITL_BUCKET):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            counts[bound] = counts.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def tail_shares(gaps: list[float], before: dict[float, float], after: dict[float, float]) -> dict:
    """Of the gaps above each of TAIL_GAPS_S: the share the client saw, and the share the router
    saw between the engine's token events in the same window (all its streams; the long request
    has none while it prefills; the router's window runs on to the long request's end, a few
    steps more). A client share above the router's is added after the router."""
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    shares = {}
    for bound in TAIL_GAPS_S:
        client = sum(g > bound for g in gaps) / max(1, len(gaps))
        below = after.get(bound, 0.0) - before.get(bound, 0.0)
        router = (total - below) / total if total and bound in after else None
        shares[f"{1000 * bound:g}ms"] = {"client": client, "router": router}
    return shares


def itl_figures(gaps: list[float]) -> dict:
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    return {"itl_p50_ms": 1000 * p50, "itl_p99_ms": 1000 * p99, "gaps": len(gaps)}


async def run_bench(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    log = StreamLog()
    bodies = {length: long_body(args, length) for length in args.long}
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers) as client:
        tasks = [asyncio.create_task(short_stream(client, args, seed, log)) for seed in range(args.streams)]
        begin = time.perf_counter()
        await asyncio.sleep(args.baseline_s)
        baseline = itl_figures(log.gaps_ending_in(begin + args.baseline_s / 4, time.perf_counter()))
        longs = []
        for length in args.long:
            buckets = await router_itl_buckets(client, args.url)
            result = await long_request(client, args, length, bodies[length])
            window = result.pop("sent"), result.pop("first_token")
            gaps = log.gaps_ending_in(*window)
            result |= itl_figures(gaps)
            result["text_chunk_itl_p99_ms"] = itl_figures(log.chunk_gaps_ending_in(*window))["itl_p99_ms"]
            result["gaps_above"] = tail_shares(gaps, buckets, await router_itl_buckets(client, args.url))
            waits = log.first_token_waits(*window)
            result["stream_requests_sent"] = len(waits)
            result["stream_ttft_max_ms"] = 1000 * max(waits, default=0.0)
            result["prefill_tok_s"] = length / result["ttft_s"]
            result["itl_p99_over_baseline_p50"] = result["itl_p99_ms"] / baseline["itl_p50_ms"]
            longs.append(result)
            print(report_line(result), flush=True)
            await asyncio.sleep(args.gap_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"streams": args.streams, "baseline": baseline, "long": longs, "stream_errors": log.errors[:5]}


def report_line(r: dict) -> str:
    if r["error"]:
        return f"{r['prompt_tokens']:>8} tokens: FAILED {r['error']}"
    return (
        f"{r['prompt_tokens']:>8} tokens: TTFT {r['ttft_s']:6.2f} s ({r['prefill_tok_s']:,.0f} tok/s)  "
        f"streams' ITL p50 {r['itl_p50_ms']:.1f} / p99 {r['itl_p99_ms']:.1f} ms "
        f"({r['itl_p99_over_baseline_p50']:.1f}x the baseline p50, {r['gaps']} gaps; "
        f"between text chunks p99 {r['text_chunk_itl_p99_ms']:.1f} ms); "
        f"{r['stream_requests_sent']} short ones sent meanwhile, TTFT max {r['stream_ttft_max_ms']:.0f} ms"
        + "".join(
            f"; > {bound}: client {s['client']:.2%}"
            + (f", router {s['router']:.2%}" if s["router"] is not None else "")
            for bound, s in r.get("gaps_above", {}).items()
        )
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000", help="the server's base URL (no /v1)")
    add("--model", required=True, help="the served model name")
    add("--api-key", default=None, help="sent as a Bearer token")
    add("--long", type=int, nargs="+", default=[131072, 262136], help="long prompt lengths, sent in turn")
    add("--long-output-tokens", type=int, default=8, help="tokens each long prompt generates")
    add("--streams", type=int, default=4, help="short streams decoding the whole time")
    add("--stream-prompt-len", type=int, default=128)
    add("--stream-tokens", type=int, default=1024, help="tokens a short request asks for (then sent again)")
    add("--baseline-s", type=float, default=10.0, help="seconds of short streams alone before the first long")
    add("--gap-s", type=float, default=2.0, help="seconds between long prompts")
    add("--timeout", type=float, default=600.0)
    add("--out", default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    """0 when every long prompt was answered and the streams never failed."""
    result = asyncio.run(run_bench(args))
    b = result["baseline"]
    itl = f"ITL p50 {b['itl_p50_ms']:.1f} / p99 {b['itl_p99_ms']:.1f} ms"
    print(f"baseline: {args.streams} streams alone, {itl}")
    for error in result["stream_errors"]:
        print("stream error:", error)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if not result["stream_errors"] and not any(r["error"] for r in result["long"]) else 1
