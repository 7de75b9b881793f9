"""The prefill pass's small kernels' tiles at the Qwen3.6 shape: `python -m pdserve.ops.bench_prefill_tiles`.

Two kernels of an 8K-token prefill pass cost more than their bandwidth (session 13's profile, one
H200: 8 x 1,024 tokens): the causal conv (pdserve.ops.cuda_conv, 7.3 ms over 30 layers, ~4x its
bytes at 4.3 TB/s) and the MoE alignment over chunks (pdserve.ops.cuda_route, 3.7 ms over 40 layers:
one `tl.sort` of ALIGN_CHUNK pairs a program). Each candidate runs at the pass sizes given, is
checked against the default's output (both must be exact: the arithmetic per element does not
change with the tile), and is timed by `triton.testing.do_bench` (median, us). Prints the best first.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

from pdserve.ops import cuda_conv, cuda_moe, cuda_route

CONV_DIM, CONV_W, EXPERTS, TOP_K = 8192, 4, 256, 8  # GDN conv channels (q, k, v), kernel; MoE routing
CONV_TILES = [
    dict(BT=t, BC=c, num_warps=w) for t, c, w in itertools.product((16, 32, 64), (64, 128, 256), (4, 8))
]
ALIGN_CHUNKS = (256, 512, 1024, 2048, 4096)


def conv_sweep(prompts: int, length: int) -> None:
    tokens = prompts * length
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, CONV_DIM, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(CONV_DIM, CONV_W, device="cuda", generator=gen).bfloat16()
    history = torch.randn(prompts + 1, CONV_DIM, CONV_W - 1, device="cuda", generator=gen).bfloat16()
    pool = history.clone()  # the timed runs' (each run rewrites the histories it reads)
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32, device="cuda")
    slots = torch.arange(1, prompts + 1, device="cuda")

    def run(tile: dict | None) -> torch.Tensor:
        return cuda_conv.causal_conv1d_prefill(x, weight, cu, history.clone(), slots, tile)

    want = run(None)
    floor_us = 2 * x.numel() * x.element_size() / 4.3e12 * 1e6  # read x, write out
    rows = []
    for tile in [None, *CONV_TILES]:
        name = f"default {cuda_conv.PREFILL_TILE}" if tile is None else str(tile)
        try:
            same = torch.equal(run(tile), want)
            us = 1e3 * do_bench(lambda t=tile: cuda_conv.causal_conv1d_prefill(x, weight, cu, pool, slots, t))
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
            print(f"  conv {name}: {type(e).__name__}")
            continue
        rows.append((us, f"{name}{'' if same else '  OUTPUT DIFFERS'}"))
    print(f"\nconv prefill + history, {prompts} x {length} tokens (bandwidth floor {floor_us:.0f} us):")
    for us, name in sorted(rows):
        print(f"  {us:8.1f} us  {name}")


def align_sweep(tokens: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.randn(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
    ids = torch.cat([ids, torch.full((tokens, 1), EXPERTS, device="cuda")], dim=1)  # the shared expert
    rows, default, one_up_to = [], cuda_route.ALIGN_CHUNK, cuda_route.MAX_ALIGN_PAIRS
    chosen = "one program" if ids.numel() <= one_up_to else f"chunks of {default}"
    for block_m in (64, 128):
        want = cuda_moe.pairs_by_sort(ids, EXPERTS + 1, block_m)
        sort_us = 1e3 * do_bench(lambda b=block_m: cuda_moe.pairs_by_sort(ids, EXPERTS + 1, b))
        rows.append((sort_us, f"BLOCK_M {block_m}: the device sort (reference)"))
        # one program for every pair (where P_PAD fits), then a program per chunk of each size
        for chunk, up_to in [(default, 1 << 16), *((c, 0) for c in ALIGN_CHUNKS)]:
            if up_to and ids.numel() > 2 * one_up_to:
                continue
            cuda_route.ALIGN_CHUNK, cuda_route.MAX_ALIGN_PAIRS = chunk, up_to
            try:
                same = torch.equal(cuda_route.align_pairs(ids, EXPERTS + 1, block_m), want)
                us = 1e3 * do_bench(lambda b=block_m: cuda_route.align_pairs(ids, EXPERTS + 1, b))
            finally:
                cuda_route.ALIGN_CHUNK, cuda_route.MAX_ALIGN_PAIRS = default, one_up_to
            name = "one program" if up_to else f"chunks of {chunk}"
            mark = " (default)" if name == chosen else ""
            rows.append((us, f"BLOCK_M {block_m}: {name}{mark}{'' if same else '  LAYOUT DIFFERS'}"))
    print(f"\nalignment of {tokens} x {TOP_K + 1} pairs over {EXPERTS + 1} experts:")
    for us, name in sorted(rows):
        print(f"  {us:8.1f} us  {name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", nargs="+", default=["8x1024", "1x8192", "32x1024"], help="PxL")
    parser.add_argument("--align-only", action="store_true", help="only the MoE alignment")
    args = parser.parse_args()
    for p in args.passes:
        prompts, length = (int(v) for v in p.split("x"))
        if not args.align_only:
            conv_sweep(prompts, length)
        align_sweep(prompts * length)


if __name__ == "__main__":
    main()
