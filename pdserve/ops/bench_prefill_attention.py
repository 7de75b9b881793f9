"""Prefill attention at the Qwen3.6 shape (16 query heads, 2 KV heads, head dim 256, 16-token
pages), kernel against kernel: `python -m pdserve.ops.bench_prefill_attention`.

Workloads: a wave of follow-up turns (32 x 272 new tokens over 3,072 cached ones), a first
prefill (32 x 1,024), and the last chunk of long prompts (8,192 new tokens over 131,072 and
262,144). Implementations: the GQA-tiled kernel (`cuda_prefill_attention`) at its default tile
and at others, torch SDPA (flash / cuDNN / efficient, over K/V
gathered from the pages, lower-right causal mask; equal lengths, so one batched call), and for the
one-sequence chunks `long_attention`'s two-part split on cuDNN and flash. Each is
timed with CUDA events (`triton.testing.do_bench`, median) and checked against the default
tile's output. Prints TFLOP/s (causal FLOPs only) against the ~790 TFLOP/s bf16 peak.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench

from pdserve.ops import cuda_prefill_attention

H, HKV, D, PAGE = 16, 2, 256, 16
WORKLOADS = {"wave": (32, 272, 3072), "first": (32, 1024, 1024), "long128k": (1, 8192, 131072),
             "long256k": (1, 8192, 262144)}  # fmt: skip
BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
TILES = [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 3)]


def setup(seqs: int, q_len: int, context: int) -> tuple:
    pages = context // PAGE
    kv = torch.randn(2, seqs * pages + 1, PAGE, HKV, D, device="cuda").to(torch.bfloat16)
    tables = (torch.randperm(seqs * pages, device="cuda") + 1).view(seqs, pages).int()
    q = torch.randn(seqs * q_len, H, D, device="cuda").to(torch.bfloat16)
    cu = torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((seqs,), context, dtype=torch.int32, device="cuda")
    return q, kv, cu, seq_lens, tables


def sdpa(backend: SDPBackend, q, kv, cu, seq_lens, tables, scale) -> torch.Tensor:
    seqs, context = seq_lens.shape[0], int(seq_lens[0])
    q_len = q.shape[0] // seqs
    k, v = (kv[i][tables.long()].view(seqs, context, HKV, D).transpose(1, 2) for i in (0, 1))
    qb = q.view(seqs, q_len, H, D).transpose(1, 2)
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(
            qb, k, v, attn_mask=causal_lower_right(q_len, context), scale=scale, enable_gqa=True
        )
    return o.transpose(1, 2).reshape(q.shape)


def split(backend: str, q, kv, cu, seq_lens, tables, scale) -> torch.Tensor:
    """`long_attention.long_chunk_attention` with `backend`'s kernels for both parts."""
    from pdserve.ops import long_attention

    long_attention.BACKEND = backend
    before = int(seq_lens[0]) - q.shape[0]
    return long_attention.long_chunk_attention(q, kv, tables[0], before, scale)


def causal_flops(seqs: int, q_len: int, context: int) -> float:
    visible = q_len * (context - q_len) + q_len * (q_len + 1) / 2
    return seqs * visible * H * D * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--default-tile-only", action="store_true", help="no sweep of the kernel's tiles")
    args = parser.parse_args()
    print(f"{'workload':<10} {'implementation':<34} {'ms':>9} {'TFLOP/s':>8} {'rel err':>9}")
    for name in args.workloads:
        shape = WORKLOADS[name]
        inputs = (*setup(*shape), D**-0.5)
        flops = causal_flops(*shape)
        impls: dict[str, Callable[[], torch.Tensor]] = {
            "gqa default tile": partial(cuda_prefill_attention.paged_prefill, *inputs, shape[1])
        }
        for bm, bn, warps, stages in [] if args.default_tile_only else TILES:
            impls[f"gqa m{bm} n{bn} w{warps} s{stages}"] = partial(
                cuda_prefill_attention.paged_prefill, *inputs, shape[1],
                block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
            )  # fmt: skip
        for backend in BACKENDS:
            impls[f"sdpa {backend.name.lower()}"] = partial(sdpa, backend, *inputs)
        if shape[0] == 1:  # one long chunk: the two-part split (`long_attention`) on each backend
            for backend in ("cudnn", "flash"):
                impls[f"split, {backend} parts"] = partial(split, backend, *inputs)
        want = None
        for label, fn in impls.items():
            try:
                out = fn()
                ms = do_bench(fn, warmup=5, rep=40, return_mode="median")
            except Exception as e:  # a backend that does not take this shape: say why, go on
                print(f"{name:<10} {label:<34} {type(e).__name__}: {str(e).splitlines()[0][:60]}")
                continue
            want = out if want is None else want
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            print(f"{name:<10} {label:<34} {ms:9.3f} {flops / ms / 1e9:8.1f} {err:9.2e}", flush=True)
            del out


if __name__ == "__main__":
    main()
