"""Decode's dense GEMMs, cuBLAS against split-K partials: `python -m pdserve.ops.bench_skinny`.

The four weight shapes a Qwen3.6-35B-A3B decode step multiplies by a few rows (GDN in_proj, attention
qkv, GDN out_proj and attention o_proj, bf16), at each row count: `F.linear` (cuBLAS) and
`cuda_skinny.skinny_linear` over a sweep of splits and tiles, each split-K one also timed with its
partials summed by torch (an upper bound: in the model the next `add_rms_norm` sums them).
`--rows 4 16 32` (the default). CUDA-event medians of 50 runs (`triton.testing.do_bench`, a cold
L2 each run), the weight read's achieved bandwidth beside each, every candidate checked against
cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from pdserve.ops.cuda_skinny import skinny_linear

SHAPES = {  # name: (N, K)
    "gdn in_proj": (2 * 2048 + 4096 + 4096 + 2 * 32, 2048),
    "attention qkv": (2 * 16 * 256 + 2 * 2 * 256, 2048),
    "gdn out_proj": (2048, 4096),
    "attention o_proj": (2048, 4096),
}
CANDIDATES = list(itertools.product((1, 2, 4, 8), (32, 64, 128), (128, 256), (4,))) + [(4, 64, 128, 8)]


def sweep(name: str, rows: int) -> None:
    n, k = SHAPES[name]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    want = F.linear(x, w).float()
    scale = want.abs().max().item()
    gbytes = n * k * 2 / 1e9
    timed = [(do_bench(lambda: F.linear(x, w), rep=50), "cuBLAS F.linear", 0.0)]
    for splits, block_n, block_k, warps in CANDIDATES:
        if block_k * splits > k:
            continue

        def run(s=splits, bn=block_n, bk=block_k, nw=warps) -> torch.Tensor:
            return skinny_linear(x, w, s, bn, bk, nw)

        def whole(s=splits, r=run) -> torch.Tensor:
            return r().float() if s == 1 else r().sum(dim=1)

        err = (whole() - want).abs().max().item() / scale
        label = f"splits {splits} n{block_n} k{block_k} w{warps}"
        timed.append((do_bench(run, rep=50), label, err))
        if splits > 1:
            timed.append((do_bench(whole, rep=50), label + " + torch sum", err))
    timed.sort()
    print(f"\n{name} [{n} x {k}], {rows} rows ({gbytes * 1e3:.1f} MB of weight):")
    for ms, label, err in timed[:8]:
        print(f"  {ms * 1e3:7.2f} us  {gbytes / ms * 1e3:6.0f} GB/s  {label}  err {err:.1e}")
    cublas = next(ms for ms, label, _ in timed if label.startswith("cuBLAS"))
    print(f"  cuBLAS: {cublas * 1e3:.2f} us ({gbytes / cublas * 1e3:.0f} GB/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16, 32])
    args = parser.parse_args()
    for rows in args.rows:
        for name in SHAPES:
            sweep(name, rows)


if __name__ == "__main__":
    main()
