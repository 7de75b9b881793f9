"""Decode attention as the served engine calls it: `python -m pdserve.ops.bench_decode_attention`.

The captured decode graph hands the kernel a block table as wide as `max_model_len` (262,144
tokens: 16,384 pages), whatever the contexts; this times one layer's paged decode attention
(Qwen3.6 shape: 16 query heads, 2 KV heads, head dim 256, 16-token pages, bf16) with that table
and with a table just wide enough, at decode batches 1-32 and contexts 1K-128K, replayed from a
CUDA graph (median, `triton.testing.do_bench_cudagraph`), against the time to read the KV once
at ~4.1 TB/s. `--kernel MODULE` times another module's `paged_attention` (an older version).
"""

from __future__ import annotations

import argparse
import importlib
from functools import partial

import torch
from triton.testing import do_bench_cudagraph

H, HKV, D, PAGE = 16, 2, 256, 16
SERVED_PAGES = 262144 // PAGE
COPY_BYTES_PER_S = 4.1e12
CELLS = [(1, 131072), (4, 1280), (4, 8192), (4, 131072), (16, 1280), (16, 8192), (32, 1280), (32, 8192)]


def time_cell(paged_attention, batch: int, context: int, width: int) -> float:
    """Microseconds for one call at `batch` sequences of `context` tokens, tables `width` pages wide."""
    pages = context // PAGE
    kv = torch.randn(2, batch * pages + 1, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    tables[:, :pages] = torch.randperm(batch * pages, device="cuda").view(batch, pages).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    call = partial(paged_attention, q, kv, cu, seq_lens, tables, D**-0.5)
    return 1e3 * do_bench_cudagraph(call, rep=50, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="pdserve.ops.cuda_attention", help="module with paged_attention")
    args = parser.parse_args()
    paged_attention = importlib.import_module(args.kernel).paged_attention
    torch.manual_seed(0)
    print(f"{args.kernel}: one layer's decode attention, us (KV read floor at 4.1 TB/s)")
    print(f"{'batch':>5} {'context':>8} {'floor':>8} {'tight table':>12} {'served table':>13}")
    for batch, context in CELLS:
        floor = 1e6 * batch * context * 2 * HKV * D * 2 / COPY_BYTES_PER_S
        tight = time_cell(paged_attention, batch, context, context // PAGE)
        served = time_cell(paged_attention, batch, context, SERVED_PAGES)
        print(f"{batch:5} {context:8} {floor:8.1f} {tight:12.1f} {served:13.1f}", flush=True)


if __name__ == "__main__":
    main()
