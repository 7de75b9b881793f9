"""Old vs new for each per-layer op at the Qwen3.6-35B-A3B shape: `python -m pdserve.ops.bench_layer_ops`.

"old" is what the model ran before the fused ops: the plain torch formulas of
`pdserve.ops.reference_layers` (several kernels each) on CUDA tensors, the MoE pairs ordered by a
device sort, the shared expert as its own GEMMs; "new" is the `pdserve.ops.cuda_layers` kernel (or
the folded MoE). Each is timed as replays of a CUDA graph of many calls (`do_bench_cudagraph`,
median of 10), as a captured decode step runs it, at decode batches 4 and 32.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from pdserve.model.layers import RotaryEmbedding
from pdserve.ops import cuda_layers, cuda_moe, cuda_route
from pdserve.ops import reference_layers as ref

HIDDEN, E, K, INTER = 2048, 256, 8, 512
H, HKV, D, ROT, HV, DV = 16, 2, 256, 64, 32, 128
BF16 = torch.bfloat16
ROWS: list[tuple[str, int, float, float]] = []


def us(fn: Callable[[], object]) -> float:
    return 1e3 * do_bench_cudagraph(fn, rep=20, return_mode="median")


def compare(op: str, tokens: int, old: Callable[[], object], new: Callable[[], object]) -> None:
    ROWS.append((op, tokens, us(old), us(new)))


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(BF16)


def old_moe_sum_add_norm(routed: torch.Tensor, shared, residual, weight) -> torch.Tensor:
    moe = routed.sum(dim=1, dtype=torch.float32).to(routed.dtype) + shared
    return ref.rms_norm(residual + moe, weight, 1e-6)


def old_moe_block(x, gate, shared_gate, w13, w2, shared_gate_up, shared_down) -> torch.Tensor:
    weights, ids = ref.route_topk(F.linear(x, gate), E, K)
    routed = cuda_moe.fused_moe_triton(x, w13, w2, weights, ids)
    g, u = F.linear(x, shared_gate_up).chunk(2, dim=-1)
    shared = torch.sigmoid(F.linear(x, shared_gate)) * F.linear(F.silu(g) * u, shared_down)
    return routed + shared


def new_moe_block(x, router, experts_w13, experts_w2) -> torch.Tensor:
    weights, ids = cuda_layers.route_topk(F.linear(x, router)[:, : E + 1], E, K)
    return cuda_moe.fused_moe_triton(x, experts_w13, experts_w2, weights, ids, reduce=False)


def sorted_layout(ids: torch.Tensor) -> torch.Tensor:
    return cuda_moe.pairs_by_sort(ids, E + 1, 16)


def bench(tokens: int, moe_weights: tuple[torch.Tensor, ...]) -> None:
    x, residual, w = rand(tokens, HIDDEN), rand(tokens, HIDDEN), rand(HIDDEN, scale=0.3)
    compare("rms_norm", tokens, partial(ref.rms_norm, x, w, 1e-6), partial(cuda_layers.rms_norm, x, w, 1e-6))
    compare("add_rms_norm (mixer out)", tokens, partial(ref.add_rms_norm, x, residual, w, 1e-6),
            partial(cuda_layers.add_rms_norm, x, residual, w, 1e-6))  # fmt: skip
    parts = rand(tokens, K + 1, HIDDEN)
    compare("MoE sum + residual + norm", tokens,
            partial(old_moe_sum_add_norm, parts[:, :K], parts[:, K], residual, w),
            partial(cuda_layers.add_rms_norm, parts, residual, w, 1e-6))  # fmt: skip
    o, zsrc, gw = rand(tokens, HV, DV), rand(tokens, 3 * HV * DV), rand(DV, scale=0.3)
    z = zsrc[:, HV * DV : 2 * HV * DV].view(tokens, HV, DV)
    old_gated = lambda: ref.gated_rms_norm(o.reshape(-1, 1, DV), z.reshape(-1, 1, DV), gw, 1e-6)  # noqa: E731
    compare("gated_rms_norm", tokens, old_gated, partial(cuda_layers.gated_rms_norm, o, z, gw, 1e-6))
    ab, a_log, dt_bias = rand(tokens, 2 * HV + 8), rand(HV), rand(HV)
    a, b = ab[:, :HV], ab[:, HV : 2 * HV]
    compare("gdn_gates", tokens, partial(ref.gdn_gates, a, b, a_log, dt_bias),
            partial(cuda_layers.gdn_gates, a, b, a_log, dt_bias))  # fmt: skip
    rotary = RotaryEmbedding(ROT, 1e7, 4096).cuda()
    qkv, dw = rand(tokens, (2 * H + 2 * HKV) * D), rand(D, scale=0.3)
    kv = rand(2, 64, 16, HKV, D)
    positions, slots = torch.randint(0, 4096, (tokens,), device="cuda"), torch.arange(tokens, device="cuda")
    args = (qkv, H, dw, dw, 1e-6, rotary.cos_cache, rotary.sin_cache, positions, kv, slots)
    compare("q/k norm + rotary + KV store", tokens, partial(ref.qk_norm_rope_store, *args),
            partial(cuda_layers.qk_norm_rope_store, *args))  # fmt: skip
    q, gate = cuda_layers.qk_norm_rope_store(*args)
    compare("output gate", tokens, partial(ref.output_gate, q, gate),
            partial(cuda_layers.output_gate, q, gate))  # fmt: skip
    logits = rand(tokens, E + 1)
    compare("router softmax+topk", tokens, partial(ref.route_topk, logits, E, K),
            partial(cuda_layers.route_topk, logits, E, K))  # fmt: skip
    _, ids = cuda_layers.route_topk(logits, E, K)
    compare("pairs -> expert blocks", tokens, partial(sorted_layout, ids),
            partial(cuda_route.align_pairs, ids, E + 1, 16))  # fmt: skip
    router, experts_w13, experts_w2 = moe_weights
    old = partial(old_moe_block, x, router[:E], router[E : E + 1], experts_w13[:E], experts_w2[:E],
                  experts_w13[E], experts_w2[E])  # fmt: skip
    counting, cuda_moe.align_pairs = cuda_moe.align_pairs, cuda_moe.pairs_by_sort  # the old block sorted
    try:
        old_us = us(old)
    finally:
        cuda_moe.align_pairs = counting
    ROWS.append(("MoE block (route, experts, shared)", tokens, old_us,
                 us(partial(new_moe_block, x, router, experts_w13, experts_w2))))  # fmt: skip


def main(argv: list[str]) -> None:
    torch.manual_seed(0)
    sizes = [int(a) for a in argv] or [4, 32]
    router = rand(272, HIDDEN, scale=0.02)  # E + 1 rows padded to a multiple of 16, as the model's
    moe_weights = (router, rand(E + 1, 2 * INTER, HIDDEN, scale=0.02), rand(E + 1, HIDDEN, INTER, scale=0.04))
    for tokens in sizes:
        bench(tokens, moe_weights)
    print(f"\n{'op':36} {'T':>5} {'old us':>9} {'new us':>9} {'speed-up':>8}")
    for op, tokens, old_us, new_us in ROWS:
        print(f"{op:36} {tokens:5d} {old_us:9.1f} {new_us:9.1f} {old_us / new_us:7.1f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
