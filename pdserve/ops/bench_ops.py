"""Micro-benchmark of the CUDA ops at the Qwen3.6-35B-A3B shape: `python -m pdserve.ops.bench_ops`.

Each op is timed with CUDA events by `triton.testing.do_bench` (warm-up, L2 flushed between runs,
median) at decode batches 4/16/32 and a 4 x 1,024 prefill, and reported against the H200 ceilings
measured in docs (~4.1 TB/s device copy, ~790 TFLOP/s bf16 GEMM). Bytes are the fewest an op must move
(each input read once, each output written once); FLOPs count multiply-adds as two.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from pdserve import ops
from pdserve.ops import cuda_gdn, cuda_moe

COPY_BYTES_PER_S, BF16_FLOPS = 4.1e12, 790e12
HK, HV, DK, DV, CONV_DIM, CONV_W = 16, 32, 128, 128, 8192, 4
H, HKV, D, PAGE = 16, 2, 256, 16
E, TOPK, HIDDEN, INTER = 256, 8, 2048, 512
BF16 = torch.bfloat16
ROWS: list[tuple[str, str, float, float, float]] = []


def report(
    op: str,
    shape: str,
    fn: Callable[[], object],
    nbytes: float = 0.0,
    flops: float = 0.0,
    graph: bool = False,
) -> None:
    """Time fn; keep (op, shape, us, GB/s, TFLOP/s). graph: time replays of a CUDA graph of fn (sync-free
    decode ops), which drops the Python launch overhead that a captured decode step does not pay."""
    if graph:
        ms = do_bench_cudagraph(fn, rep=50, return_mode="median")
        op += " [graph]"
    else:
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    ROWS.append((op, shape, ms * 1e3, nbytes / ms / 1e6, flops / ms / 1e9))


def rand(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(dtype)


def fla_recurrent_step(*gdn: torch.Tensor, pool: torch.Tensor, ids: torch.Tensor) -> None:
    """fla's fused recurrent step over gathered states, scattered back: what a caller of fla pays."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    _, final = fused_recurrent_gated_delta_rule(
        *(x[:, None] for x in gdn),
        initial_state=pool.index_select(0, ids),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    pool.index_copy_(0, ids, final)


def bench_gdn() -> None:
    pool = torch.randn(64, HV, DK, DV, device="cuda") * 0.3
    for batch in (4, 16, 32):
        q, k, v = rand(batch, HK, DK), rand(batch, HK, DK), rand(batch, HV, DV)
        g, beta = -F.softplus(rand(batch, HV, dtype=torch.float32)), rand(batch, HV).sigmoid()
        ids = torch.randperm(64, device="cuda")[:batch]
        state_bytes = 2 * batch * HV * DK * DV * 4
        for block_v in (16, 32, 64):
            step = partial(cuda_gdn.gdn_recurrent_step, q, k, v, g, beta, pool, ids, block_v=block_v)
            report(f"gdn_recurrent_step bv={block_v}", f"B={batch}", step, state_bytes, graph=True)
        step = partial(fla_recurrent_step, q, k, v, g, beta, pool=pool, ids=ids)
        report("fla fused_recurrent + gather/scatter", f"B={batch}", step, state_bytes)
    lengths = [1024] * 4
    cu = F.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0)).int()
    t = sum(lengths)
    q, k, v = rand(t, HK, DK), rand(t, HK, DK), rand(t, HV, DV)
    g, beta = -F.softplus(rand(t, HV, dtype=torch.float32)), rand(t, HV).sigmoid()
    ids = torch.arange(4, device="cuda")
    prefill = partial(ops.gdn_chunk_prefill, q, k, v, g, beta, cu, pool, ids)
    report("gdn_chunk_prefill (fla)", "4x1024", prefill, t * (2 * HK * DK + HV * DV * 2) * 2)


def bench_conv() -> None:
    pool, w = rand(64, CONV_DIM, CONV_W - 1), rand(CONV_DIM, CONV_W)
    for batch in (4, 16, 32):
        x, ids = rand(batch, CONV_DIM), torch.randperm(64, device="cuda")[:batch]
        step = partial(ops.causal_conv1d_step, x, w, pool, ids)
        report(
            "causal_conv1d_step",
            f"B={batch}",
            step,
            batch * CONV_DIM * (2 * (CONV_W - 1) + 2) * 2,
            graph=True,
        )
    x, cu = rand(4096, CONV_DIM), torch.tensor([0, 1024, 2048, 3072, 4096], dtype=torch.int32, device="cuda")
    ids = torch.arange(4, device="cuda")
    prefill = partial(ops.causal_conv1d_prefill, x, w, cu, pool, ids)
    report("causal_conv1d_prefill", "4x1024", prefill, 4096 * CONV_DIM * 2 * 2)


def bench_attention() -> None:
    context = 1280
    pages_per_seq = context // PAGE
    kv = rand(2, 32 * pages_per_seq + 8, PAGE, HKV, D)
    for batch in (4, 16, 32):
        tables = torch.randperm(kv.shape[1], device="cuda")[: batch * pages_per_seq].view(batch, -1).int()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q, cu = rand(batch, H, D), torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        decode = partial(ops.paged_attention, q, kv, cu, seq_lens, tables, D**-0.5)
        kv_bytes, flops = batch * context * 2 * HKV * D * 2, batch * H * context * D * 4
        report("paged_attention decode", f"B={batch} ctx={context}", decode, kv_bytes, flops, graph=True)
    tables = torch.arange(4 * 64, device="cuda").view(4, 64).int()
    seq_lens = torch.full((4,), 1024, dtype=torch.int32, device="cuda")
    q, cu = rand(4096, H, D), torch.arange(0, 4097, 1024, dtype=torch.int32, device="cuda")
    prefill = partial(ops.paged_attention, q, kv, cu, seq_lens, tables, D**-0.5)
    nbytes, flops = 4096 * (H + 2 * HKV) * D * 2 * 2, 4 * H * 1024 * 1024 / 2 * D * 4
    report("paged_attention prefill", "4x1024", prefill, nbytes, flops)
    k = rand(4096, HKV, D)
    mapping = torch.randperm(kv.shape[1] * PAGE, device="cuda")[:4096]
    report("store_kv", "4096 tokens", partial(ops.store_kv, k, k, kv, mapping), 4096 * HKV * D * 2 * 4)


def bench_moe() -> None:
    w13, w2 = rand(E, 2 * INTER, HIDDEN) * 0.02, rand(E, HIDDEN, INTER) * 0.04
    for tokens in (4, 16, 32, 4096, 8192):
        x = rand(tokens, HIDDEN)
        weights, ids = torch.randn(tokens, E, device="cuda").softmax(-1).topk(TOPK, dim=-1)
        weights = weights.to(BF16)
        experts = ids.unique().numel()
        nbytes = experts * 3 * INTER * HIDDEN * 2 + tokens * HIDDEN * 4
        flops = tokens * TOPK * 3 * HIDDEN * INTER * 2
        for name, fn in (
            ("triton", cuda_moe.fused_moe_triton),
            ("grouped_mm", cuda_moe.fused_moe_grouped_mm),
        ):
            moe = partial(fn, x, w13, w2, weights, ids)
            report(
                f"fused_moe {name}", f"T={tokens} ({experts} experts)", moe, nbytes, flops, graph=tokens <= 32
            )


def main() -> None:
    torch.manual_seed(0)
    for part in (bench_gdn, bench_conv, bench_attention, bench_moe):
        try:
            part()
        except Exception as err:  # one broken op must not hide the others' numbers
            print(f"{part.__name__} failed: {err!r}")
    print(f"\n{'op':38} {'shape':26} {'us':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'%bf16':>6}")
    for op, shape, us, gbs, tflops in ROWS:
        print(f"{op:38} {shape:26} {us:9.1f} {gbs:7.0f} {100 * gbs / (COPY_BYTES_PER_S / 1e9):5.0f}% "
              f"{tflops:8.1f} {100 * tflops / (BF16_FLOPS / 1e12):5.1f}%")  # fmt: skip


if __name__ == "__main__":
    main()
