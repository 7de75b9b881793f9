"""Which of a long prompt's chunks stall the engine thread in `long_chunk_attention`? (issue 12:
served at 131K/262K the background pass's first attention layer held the host 142 ms at one
chunk, 85-90 ms at another and 51 ms at the 262K prompt's last, odd-sized chunk; H100, sessions
29 and 31). `python -m pdserve.ops.bench_long_stalls [--context 131072] [--chunk 8192] [--rows 4]`.
It named the 142 ms one (session 32): the first chunk in parts (the 4th, of 8,188 tokens beside 4
decode rows) launched the flash tail's kernels for the first time, which loads them; warm-up now
runs whole chunks too, and session 32's served run had none of the three.

One full-shape attention layer's KV pages (zeros), the engine's warm-up (`long_attention.warm_up`
on this thread's default stream), then every chunk of a `--context`-token prompt in turn, first
on the default stream, then again on a background stream (a CUDA green context's, as the engine's
background pass): for each call the host time of the launch (what stalls the engine thread) and
the whole call's time. A first-time cost seen on the green stream but not on the default stream
is per CUDA context (kernels loaded lazily into the green context), not per shape. Then the last
chunk of an odd length (`--chunk` - 8), the 262K prompt's case. `--warm-green`: warm up on the
green stream too, as the engine does since session 31.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.engine.background_pass import background_stream
from pdserve.engine.scheduler import longest_chunk
from pdserve.ops import long_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 2, 256, 16  # Qwen3.6-35B-A3B's full-attention layers


def timed_call(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, before: int) -> tuple[float, float]:
    """(host ms to launch, ms to finish) of one chunk's attention after `before` cached tokens."""
    torch.cuda.current_stream().synchronize()
    began = time.perf_counter()
    long_attention.long_chunk_attention(q, kv, table, before, HEAD_DIM**-0.5)
    launched = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    return 1e3 * (launched - began), 1e3 * (time.perf_counter() - began)


def sweep(label: str, kv: torch.Tensor, table: torch.Tensor, context: int, chunk: int) -> None:
    """Every chunk in parts of a `context`-token prompt prefilled `chunk` tokens at a time (the
    engine's chunks beside decode rows are the budget less those rows: 8,188 beside 4)."""
    q = torch.randn(chunk, HEADS, HEAD_DIM, dtype=kv.dtype, device=kv.device)
    first = -(-long_attention.KEY_BLOCK // chunk) * chunk
    for before in range(first, context - chunk + 1, chunk):
        host, total = timed_call(q, kv, table, before)
        flag = "  <- stall" if host > 20 else ""
        print(f"[{label}] chunk after {before:7d}: host {host:7.1f} ms, whole {total:7.1f} ms{flag}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=8192, help="the token budget")
    parser.add_argument("--rows", type=int, default=4, help="decode rows beside the chunks")
    parser.add_argument("--warm-green", action="store_true", help="warm up on the green stream too")
    args = parser.parse_args()
    device = torch.device("cuda")
    pages = -(-args.context // PAGE)
    kv = torch.zeros(2, pages, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    table = torch.arange(pages, dtype=torch.int32, device=device)
    longest = longest_chunk(args.chunk)  # what the engine's warm-up covers
    began = time.perf_counter()
    long_attention.warm_up(kv, HEADS, longest)
    torch.cuda.synchronize()
    print(f"warm-up (default stream): {1e3 * (time.perf_counter() - began):.0f} ms")
    stream = background_stream(device, None)
    if args.warm_green:
        began = time.perf_counter()
        with torch.cuda.stream(stream):
            long_attention.warm_up(kv, HEADS, longest)
            stream.synchronize()
        print(f"warm-up (green stream): {1e3 * (time.perf_counter() - began):.0f} ms")
    sweep("default", kv, table, args.context, args.chunk - args.rows)
    with torch.cuda.stream(stream):
        sweep("green", kv, table, args.context, args.chunk - args.rows)
        odd = args.chunk - 8
        q = torch.randn(odd, HEADS, HEAD_DIM, dtype=kv.dtype, device=device)
        host, total = timed_call(q, kv, table, args.context - args.chunk)
        print(f"[green] odd last chunk of {odd}: host {host:.1f} ms, whole {total:.1f} ms")
        host, total = timed_call(q, kv, table, args.context - args.chunk)
        print(f"[green] the same again: host {host:.1f} ms, whole {total:.1f} ms")


if __name__ == "__main__":
    main()
