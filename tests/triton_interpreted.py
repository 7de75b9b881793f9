"""The CUDA ops' Triton kernels run by Triton's interpreter on the CPU, against the CPU reference:
the kernels' index arithmetic, masks and layouts are checked by CI, which has no GPU (speed and
the GPU's own numerics stay with the `gpu` tests). Small shapes (the interpreter runs a program at
a time, in numpy), the size limits of the ops lowered so that every path runs.

Run in a process of its own with TRITON_INTERPRET=1 (Triton reads it when a kernel is defined):
`TRITON_INTERPRET=1 python -m tests.triton_interpreted CHECK`; tests/test_triton_interpreted.py
does. A check raises AssertionError on a mismatch.
"""

from __future__ import annotations

import os
import sys

import torch

from pdserve.ops import cuda_conv, cuda_moe, cuda_route, reference
from pdserve.ops import reference_layers as ref
from pdserve.ops.moe import fused_moe_reference

E, K = 16, 4  # routed experts, top-k; the shared expert folded in as expert E


def routed_ids(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Each token's top-k experts and the shared one, as the model hands them to the experts."""
    ids = torch.randn(tokens, E, generator=gen).topk(K, dim=-1).indices
    return torch.cat([ids, torch.full((tokens, 1), E)], dim=1)


def check_align(gen: torch.Generator) -> None:
    """Counting alignment = the sort's layout: one program, then over chunks (the last partial)."""
    for tokens, block_m in [(1, 16), (6, 16), (13, 64)]:
        ids = routed_ids(tokens, gen)
        assert torch.equal(
            cuda_route.align_pairs(ids, E + 1, block_m), cuda_moe.pairs_by_sort(ids, E + 1, block_m)
        )
    cuda_route.MAX_ALIGN_PAIRS, cuda_route.ALIGN_CHUNK = 40, 32
    for tokens, block_m in [(9, 16), (23, 16), (23, 64)]:  # 45 and 115 pairs: 2 and 4 chunks
        ids = routed_ids(tokens, gen)
        assert torch.equal(
            cuda_route.align_pairs(ids, E + 1, block_m), cuda_moe.pairs_by_sort(ids, E + 1, block_m)
        )


def check_route(gen: torch.Generator) -> None:
    """Softmax top-k + renormalise (+ the shared expert's sigmoid gate) per token."""
    for shared in (False, True):
        logits = torch.randn(7, E + int(shared), generator=gen)
        weights, ids = cuda_route.route_topk(logits, E, K)
        want_w, want_ids = ref.route_topk(logits, E, K)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


def check_conv(gen: torch.Generator) -> None:
    """Packed causal conv prefill (sequences shorter and longer than the history), its new history,
    then a decode step on top."""
    channels, width, slots = 48, 4, 6
    lengths = [1, 5, 2, 9]
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    pool = torch.randn(slots, channels, width - 1, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slot_ids = torch.tensor([5, 0, 3, 1])
    got_pool, want_pool = pool.clone(), pool.clone()
    got = cuda_conv.causal_conv1d_prefill(x, weight, cu, got_pool, slot_ids)
    want = reference.causal_conv1d_prefill(x, weight, cu, want_pool, slot_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_pool, want_pool)
    step = torch.randn(len(lengths), channels, generator=gen)
    got = cuda_conv.causal_conv1d_step(step, weight, got_pool, slot_ids)
    want = reference.causal_conv1d_step(step, weight, want_pool, slot_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_pool, want_pool)


def check_moe(gen: torch.Generator) -> None:
    """The grouped GEMMs (gate/up with SiLU, then down weighted by pair) over the aligned rows, at
    decode and prefill tile sizes, the alignment over chunks in the second."""
    hidden, inter = 32, 16
    w13 = torch.randn(E + 1, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(E + 1, hidden, inter, generator=gen) * 0.2
    cuda_route.MAX_ALIGN_PAIRS, cuda_route.ALIGN_CHUNK = 40, 32
    for tokens in (3, 21):
        x = torch.randn(tokens, hidden, generator=gen)
        ids = routed_ids(tokens, gen)
        weights = torch.rand(tokens, K + 1, generator=gen)
        for reduce in (False, True):
            got = cuda_moe.fused_moe_triton(x, w13, w2, weights, ids, reduce)
            want = fused_moe_reference(x, w13, w2, weights, ids, reduce)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


CHECKS = {"align": check_align, "route": check_route, "conv": check_conv, "moe": check_moe}

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1: the kernels must be defined for the interpreter")
    CHECKS[sys.argv[1]](torch.Generator().manual_seed(0))
    print(f"{sys.argv[1]}: ok")
