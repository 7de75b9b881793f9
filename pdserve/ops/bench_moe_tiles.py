"""Tile sizes of the routed-expert GEMM at prefill sizes: `python -m pdserve.ops.bench_moe_tiles`.

A prefill pass of T tokens gives the Triton grouped GEMM (pdserve.ops.cuda_moe) T x 8 (token,
expert) pairs over 256 experts: from 1,024 tokens on, every expert gets dozens of rows and the
kernel is compute-bound (T x 8 x 3 x 2048 x 512 x 2 FLOPs). Each candidate tile (BLOCK_M,
BLOCK_N, BLOCK_K, warps, stages) runs both GEMMs of the block at the Qwen3.6 shape, CUDA-event
median (`triton.testing.do_bench`), checked against the default tiles' output; torch's
`_grouped_mm` is timed beside them. Prints, per T, each tile's time and TFLOP/s, the best first.
T <= 64 (`python -m pdserve.ops.bench_moe_tiles 4 16 32`): decode's tiles, each GEMM's swept apart;
65 <= T < 1,024 (`... 128 256 512`): a short pass's, 16- to 64-row tiles (the default switches from
16 to 64 rows above 4 pairs an expert, ~114 tokens). `--grouped-mm-parts`: torch._grouped_mm's
time part by part beside the Triton kernel's.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from pdserve.ops import cuda_moe, cuda_route
from pdserve.ops.bench_ops import BF16_FLOPS, HIDDEN, INTER, TOPK, E, rand

TILES = [
    dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, TIERS=0, num_warps=w, num_stages=s)
    for m, n, k, g, w, s in [
        *itertools.product((64, 128), (64, 128), (64,), (0,), (4, 8), (3, 4)),
        (64, 64, 128, 0, 4, 3),
        (64, 128, 128, 0, 8, 3),
        # launch order: GROUP_M row blocks across every column block before the next ones
        *itertools.product((128,), (128,), (64,), (1, 4, 8, 16, 32), (8,), (3, 4)),
        *itertools.product((64,), (64, 128), (64,), (4, 16), (4,), (3,)),
    ]
]
# an expert's last block, mostly padding, on a tile of half (TIERS 1) or a quarter (2) of the rows
TILES += [
    dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=64, GROUP_M=g, TIERS=t, num_warps=w, num_stages=3)
    for m, n, g, w in [(128, 128, 16, 8), (64, 64, 16, 4)]
    for t in (1, 2)
]


# decode steps (4-64 tokens: one or two rows an expert): BLOCK_M 16, weight-read bound; each GEMM's
# tile swept with the other's at its default
DECODE_TILES = [
    dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, GROUP_M=0, TIERS=0, num_warps=w, num_stages=s)
    for n, k, w, s in [
        *itertools.product((32, 64, 128), (64, 128, 256), (4,), (3, 4)),
        (64, 128, 2, 3), (64, 128, 8, 3), (32, 256, 2, 4), (128, 128, 8, 4),
    ]
]  # fmt: skip


# a short pass (65-1,023 tokens: a chat turn's new message, a stream's 128-token prompt) has ~2-30
# rows an expert, between decode's 16-row tile (up to 4 pairs an expert) and the 64-row one
SHORT_PASS_TILES = [
    dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, TIERS=0, num_warps=4, num_stages=s)
    for m, n, k, g, s in [
        *itertools.product((16, 32), (64, 128), (64, 128), (0,), (3, 4)),
        *itertools.product((64,), (64,), (64, 128), (0, 16), (3,)),
    ]
]  # fmt: skip


def sweep_decode(tokens: int) -> None:
    """Gate/up tiles (down at its default), then down tiles (gate/up at its default), at T tokens."""
    torch.manual_seed(tokens)
    w13, w2 = rand(E + 1, 2 * INTER, HIDDEN) * 0.02, rand(E + 1, HIDDEN, INTER) * 0.04
    x = rand(tokens, HIDDEN)
    weights, ids = torch.randn(tokens, E, device="cuda").softmax(-1).topk(TOPK, dim=-1)
    ids = torch.cat([ids, torch.full((tokens, 1), E, device="cuda")], dim=1)  # the shared expert
    weights = torch.cat([weights, torch.full((tokens, 1), 0.5, device="cuda")], dim=1).to(torch.bfloat16)
    default = cuda_moe._block_config(tokens * (TOPK + 1), E + 1)
    want = cuda_moe.fused_moe_triton(x, w13, w2, weights, ids, reduce=False)
    for role in ("gate_up", "down"):
        rows = []
        for cfg in [default, *DECODE_TILES]:
            kw = {"cfg": cfg} if role == "gate_up" else {"cfg": default, "cfg_down": cfg}
            run = lambda kw=kw: cuda_moe.fused_moe_triton(x, w13, w2, weights, ids, reduce=False, **kw)  # noqa: E731
            if (timed := _timed(run, want, f"T={tokens} {role} {_name(cfg)}")) is None:
                continue
            ms, err = timed
            rows.append((ms, f"{_name(cfg)}{' (default)' if cfg is default else ''}  err {err:.1e}"))
        rows.sort()
        print(f"\nT={tokens} decode, {role} tile swept (both GEMMs + alignment timed):")
        for ms, name in rows[:8]:
            print(f"  {ms * 1e3:9.1f} us  {name}")


def sweep(tokens: int, tiles: list[dict[str, int]] = TILES, skew: float = 0.0) -> list[tuple[float, str]]:
    """Every tile of `tiles` (and `_grouped_mm`) at T tokens; `skew` > 0 routes unevenly (expert e's
    logits shifted by skew * e / E, as trained routers favour some experts), 0 uniformly."""
    torch.manual_seed(tokens)
    w13, w2 = rand(E, 2 * INTER, HIDDEN) * 0.02, rand(E, HIDDEN, INTER) * 0.04
    x = rand(tokens, HIDDEN)
    logits = torch.randn(tokens, E, device="cuda") + skew * torch.arange(E, device="cuda") / E
    weights, ids = logits.softmax(-1).topk(TOPK, dim=-1)
    weights = weights.to(torch.bfloat16)
    flops = tokens * TOPK * 3 * HIDDEN * INTER * 2
    want = cuda_moe.fused_moe_triton(x, w13, w2, weights, ids)
    rows = []
    default = cuda_moe._block_config(tokens * TOPK, E)
    for cfg in [None, *tiles]:
        name = "default " + _name(default) if cfg is None else _name(cfg)
        run = lambda c=cfg: cuda_moe.fused_moe_triton(x, w13, w2, weights, ids, cfg=c)  # noqa: E731
        if (timed := _timed(run, want, f"T={tokens} {name}")) is None:
            continue
        ms, err = timed
        rows.append((ms, f"{name}  err {err:.1e}"))
    if tiles is TILES:
        ms = do_bench(lambda: cuda_moe.fused_moe_grouped_mm(x, w13, w2, weights, ids), rep=50)
        rows.append((ms, "torch._grouped_mm (sorted rows)"))
    rows.sort()
    print(f"\nT={tokens} ({tokens * TOPK} pairs, skew {skew}), {flops / 1e12:.2f} TFLOP:")
    for ms, name in rows:
        tflops = flops / ms / 1e9
        share = 100 * tflops / (BF16_FLOPS / 1e12)
        print(f"  {ms * 1e3:9.1f} us  {tflops:6.1f} TFLOP/s ({share:4.1f}%)  {name}")
    return rows


def sweep_tiers(tokens: int) -> None:
    """The pass's own tile with TIERS 0, 1 and 2, routed evenly and skewed (each run twice, to see
    the spread between runs of one tile)."""
    default = cuda_moe._block_config(tokens * TOPK, E)
    tiles = [dict(default, TIERS=t) for t in (0, 1, 2, 0, 1, 2)]
    for skew in (0.0, 4.0):
        sweep(tokens, tiles, skew)


def sweep_down(tokens: int) -> None:
    """The down GEMM's own tiles at a prefill size (gate/up at its default, whose BLOCK_M both keep):
    its K is the expert width (512), so its tiles may want to differ from gate/up's (K 2,048)."""
    torch.manual_seed(tokens)
    w13, w2 = rand(E, 2 * INTER, HIDDEN) * 0.02, rand(E, HIDDEN, INTER) * 0.04
    x = rand(tokens, HIDDEN)
    weights, ids = torch.randn(tokens, E, device="cuda").softmax(-1).topk(TOPK, dim=-1)
    weights = weights.to(torch.bfloat16)
    default = cuda_moe._block_config(tokens * TOPK, E)
    want = cuda_moe.fused_moe_triton(x, w13, w2, weights, ids)
    rows = []
    for n, k, g, w, st in itertools.product((128, 256), (64, 128), (0, 4, 16), (8,), (3, 4)):
        cfg = dict(default, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, num_warps=w, num_stages=st)
        run = lambda c=cfg: cuda_moe.fused_moe_triton(x, w13, w2, weights, ids, cfg=default, cfg_down=c)  # noqa: E731
        if (timed := _timed(run, want, f"T={tokens} down {_name(cfg)}")) is None:
            continue
        ms, err = timed
        rows.append((ms, f"down {_name(cfg)}{' (default)' if cfg == default else ''}  err {err:.1e}"))
    rows.sort()
    print(f"\nT={tokens}, down tile swept (gate/up {_name(default)}; both GEMMs + alignment timed):")
    for ms, name in rows[:10]:
        print(f"  {ms * 1e3:9.1f} us  {name}")


def grouped_mm_parts(tokens: int) -> None:
    """Where `torch._grouped_mm`'s MoE time goes at T tokens, part by part (rows already routed):
    is CUTLASS's grouped GEMM, without the gathers and the elementwise work around it, faster than
    the Triton kernel's two GEMMs? (Session 11 timed only the whole: 2,211 us at 8,192 tokens on the
    H200 against the Triton kernel's 1,523.)"""
    torch.manual_seed(tokens)
    w13, w2 = rand(E, 2 * INTER, HIDDEN) * 0.02, rand(E, HIDDEN, INTER) * 0.04
    x = rand(tokens, HIDDEN)
    weights, ids = torch.randn(tokens, E, device="cuda").softmax(-1).topk(TOPK, dim=-1)
    weights = weights.to(torch.bfloat16)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).to(torch.int32)
    offsets = counts.cumsum(0, dtype=torch.int32)
    rows = x.index_select(0, order // TOPK)
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    gate_up = torch._grouped_mm(rows, w13_t, offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    down = torch._grouped_mm(hidden, w2_t, offs=offsets)
    pairs = tokens * TOPK
    gemm = pairs * INTER * HIDDEN * 2  # FLOPs of one [pairs, 512] x [512, 2048] product
    scaled = weights.flatten()[order, None]
    parts = [
        ("sort + offsets", lambda: (torch.argsort(flat, stable=True), torch.bincount(flat, minlength=E)), 0),
        ("gather rows", lambda: x.index_select(0, order // TOPK), 0),
        ("gate/up GEMM", lambda: torch._grouped_mm(rows, w13_t, offs=offsets), 2 * gemm),
        ("silu * up", lambda: F.silu(gate) * up, 0),
        ("down GEMM", lambda: torch._grouped_mm(hidden, w2_t, offs=offsets), gemm),
        ("weights + scatter", lambda: torch.empty_like(down).index_copy_(0, order, down * scaled), 0),
        ("Triton, whole", lambda: cuda_moe.fused_moe_triton(x, w13, w2, weights, ids), 3 * gemm),
    ]
    cfg = cuda_moe._block_config(pairs, E)  # the Triton kernel's GEMMs alone, on its own row layout
    pair_of_row = cuda_route.align_pairs(ids, E, cfg["BLOCK_M"])
    flat_weights = weights.flatten().contiguous()

    def triton_gemm(a: torch.Tensor, w: torch.Tensor, gate_up: bool) -> Callable[[], torch.Tensor]:
        return lambda: cuda_moe.moe_gemm(a, w, pair_of_row, ids, flat_weights, cfg, gate_up)

    act = triton_gemm(x, w13, True)()
    parts += [
        ("Triton alignment", lambda: cuda_route.align_pairs(ids, E, cfg["BLOCK_M"]), 0),
        ("Triton gate/up + silu", triton_gemm(x, w13, True), 2 * gemm),
        ("Triton down + weights", triton_gemm(act, w2, False), gemm),
    ]
    print(f"\nT={tokens}: torch._grouped_mm by part (do_bench medians)")
    for name, run, flops in parts:
        ms = do_bench(run, rep=50)
        tflops = flops / ms / 1e9
        rate = f"  {tflops:6.1f} TFLOP/s ({100 * tflops / (BF16_FLOPS / 1e12):4.1f}%)" if flops else ""
        print(f"  {ms * 1e3:9.1f} us  {name}{rate}")


def _timed(run: Callable[[], torch.Tensor], want: torch.Tensor, label: str) -> tuple[float, float] | None:
    """(ms, max error relative to want's largest value) of one tile's run; None, said, for a tile
    that does not compile (shared memory)."""
    try:
        err = (run().float() - want.float()).abs().max().item() / want.float().abs().max().item()
        return do_bench(run, rep=50), err
    except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
        print(f"  {label}: {type(e).__name__}")
        return None


def _name(cfg: dict[str, int]) -> str:
    return "m{BLOCK_M} n{BLOCK_N} k{BLOCK_K} g{GROUP_M} t{TIERS} w{num_warps} s{num_stages}".format(**cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", nargs="*", type=int, default=[1024, 4096, 8192, 16384])
    parser.add_argument("--down", action="store_true", help="sweep the down GEMM's tile alone")
    parser.add_argument("--tiers", action="store_true", help="the pass's tile with TIERS 0, 1, 2")
    parser.add_argument("--grouped-mm-parts", action="store_true", help="torch._grouped_mm's time by part")
    args = parser.parse_args()
    for tokens in args.tokens:
        if args.grouped_mm_parts:
            grouped_mm_parts(tokens)
        elif tokens <= 64:
            sweep_decode(tokens)
        elif tokens < 1024 and not (args.down or args.tiers):
            sweep(tokens, SHORT_PASS_TILES)
        else:
            sweep_down(tokens) if args.down else sweep_tiers(tokens) if args.tiers else sweep(tokens)


if __name__ == "__main__":
    main()
