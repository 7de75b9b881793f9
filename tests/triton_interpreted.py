"""The CUDA ops' Triton kernels run by Triton's interpreter on the CPU, against the CPU reference:
the kernels' index arithmetic, masks and layouts are checked by CI, which has no GPU (speed and
the GPU's own numerics stay with the `gpu` tests). Small shapes (the interpreter runs a program at
a time, in numpy), the size limits of the ops lowered so that every path runs.

Run in a process of its own with TRITON_INTERPRET=1 (Triton reads it when a kernel is defined):
`TRITON_INTERPRET=1 python -m tests.triton_interpreted CHECK`; tests/test_triton_interpreted.py
does. A check raises AssertionError on a mismatch.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from pdserve.ops import (
    cuda_attention,
    cuda_conv,
    cuda_gdn,
    cuda_gdn_recurrent,
    cuda_layers,
    cuda_moe,
    cuda_norms,
    cuda_route,
    reference,
)
from pdserve.ops import reference_layers as ref
from pdserve.ops.moe import fused_moe_reference
from tests.triton_interpreted_decode import check_gdn_decode, check_route_align, check_skinny

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
    # every pair its own expert: one block each, the most the grid bound (`padded_rows`) allows
    spread = torch.randperm(E + 1, generator=gen)[: (E + 1) // 2 * 2].view(-1, 2)
    rows = cuda_route.align_pairs(spread, E + 1, 16)
    assert torch.equal(rows, cuda_moe.pairs_by_sort(spread, E + 1, 16))
    assert (rows.view(-1, 16)[:, 0] >= 0).sum() == spread.numel()
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
    # the router's split-K partial sums (fp32 [T, S, E + 1]), added; in bf16 rounded as the product
    # would be. The interpreter rounds to bf16 toward zero (the GPU to nearest), which may reorder
    # a near tie: bf16 compares each token's experts as a set, their weights to 2 ulps
    partials = torch.randn(7, 3, E + 1, generator=gen)
    for dtype, tol in [(torch.float32, 1e-6), (torch.bfloat16, 2**-6)]:
        weights, ids = cuda_route.route_topk(partials, E, K, dtype)
        want_w, want_ids = ref.route_topk(partials.sum(dim=1).to(dtype), E, K)
        ids, order = ids.sort(dim=1)
        want_ids, want_order = want_ids.sort(dim=1)
        assert weights.dtype == dtype and torch.equal(ids, want_ids)
        got_w, want_w = weights.gather(1, order), want_w.gather(1, want_order)
        torch.testing.assert_close(got_w, want_w, rtol=tol, atol=1e-7)


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
    # checkpoints on the way: after 1 of 5 tokens (history and x), 7 of 9 (x alone), none, and
    # one past the end (nothing); = the reference's, and = the history of a pass that stops there
    save_at, save_to = torch.tensor([0, 1, 3, 7], dtype=torch.int32), torch.tensor([5, 2, 4, 4])
    stop_pool = got_pool.clone()
    got = cuda_conv.causal_conv1d_prefill(x, weight, cu, got_pool, slot_ids, save_at=save_at, save_to=save_to)
    want = reference.causal_conv1d_prefill(x, weight, cu, want_pool, slot_ids, save_at, save_to)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_pool, want_pool)
    first = torch.tensor([0, 1, 8], dtype=torch.int32)  # sequence 1's first token, sequence 3's first 7
    reference.causal_conv1d_prefill(x[[1, *range(8, 15)]], weight, first, stop_pool, torch.tensor([0, 1]))
    assert torch.equal(got_pool[2], stop_pool[0]) and torch.equal(got_pool[4], stop_pool[1])


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
    # an expert's last block of 64 rows holding > 32, 17-32 and <= 16 pairs (a full tile, a half
    # and a quarter with TIERS 2): experts 0-3 get 70, 40, 20 and 9 of 139 pairs, the rest one each
    loads = [70, 40, 20, 9] + [1] * 12
    flat = torch.cat([torch.full((n,), e) for e, n in enumerate(loads)])
    ids = flat[torch.randperm(flat.numel(), generator=gen)].view(-1, 1)
    x = torch.randn(ids.shape[0], hidden, generator=gen)
    weights = torch.rand(ids.shape, generator=gen)
    want = fused_moe_reference(x, w13, w2, weights, ids)
    for tiers in (0, 1, 2):
        cfg = dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=16, GROUP_M=4, TIERS=tiers)
        got = cuda_moe.fused_moe_triton(x, w13, w2, weights, ids, cfg=cfg)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def check_norms(gen: torch.Generator) -> None:
    """RMSNorm; the residual add + RMSNorm of one part and of a MoE's expert rows; gated RMSNorm
    with a strided gate; the GDN prefill's q/k l2 norm."""
    hidden, heads, dim = 48, 4, 16
    x, residual = torch.randn(5, hidden, generator=gen), torch.randn(5, hidden, generator=gen)
    parts, weight = torch.randn(5, K + 1, hidden, generator=gen), torch.randn(hidden, generator=gen) * 0.3
    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)
    close(cuda_norms.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    for p in (x, parts):
        got, want = (
            cuda_norms.add_rms_norm(p, residual, weight, 1e-6),
            ref.add_rms_norm(p, residual, weight, 1e-6),
        )
        close(got[0], want[0])  # the normed
        close(got[1], want[1])  # the new residual stream
    gx, source = torch.randn(5, heads, dim, generator=gen), torch.randn(5, 3 * heads * dim, generator=gen)
    gate, gw = (
        source[:, heads * dim : 2 * heads * dim].view(5, heads, dim),
        1 + torch.randn(dim, generator=gen) * 0.3,
    )
    close(cuda_norms.gated_rms_norm(gx, gate, gw, 1e-6), ref.gated_rms_norm(gx, gate, gw, 1e-6))
    close(cuda_norms.l2_normalize(gx, torch.float32, 1e-6), reference._l2_normalized(gx))


def check_gdn_step(gen: torch.Generator) -> None:
    """The GDN gates, then three decode steps updating fp32 states in place in their slots."""
    batch, k_heads, v_heads, dk, dv, slots = 3, 2, 4, 16, 32, 5
    ab = torch.randn(batch, 2 * v_heads, generator=gen) * 6
    A_log, dt_bias = torch.rand(v_heads, generator=gen) * 2.7, torch.randn(v_heads, generator=gen)
    g, beta = cuda_layers.gdn_gates(ab[:, :v_heads], ab[:, v_heads:], A_log, dt_bias)
    want_g, want_beta = ref.gdn_gates(ab[:, :v_heads], ab[:, v_heads:], A_log, dt_bias)
    torch.testing.assert_close(g, want_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta, want_beta, rtol=1e-5, atol=1e-6)
    pool, ids = torch.randn(slots, v_heads, dk, dv, generator=gen) * 0.3, torch.tensor([4, 0, 2])
    got_pool, want_pool = pool.clone(), pool.clone()
    for _ in range(3):
        q, k = (torch.randn(batch, k_heads, dk, generator=gen) for _ in range(2))
        v = torch.randn(batch, v_heads, dv, generator=gen)
        got = cuda_gdn.gdn_recurrent_step(q, k, v, g, beta, got_pool, ids, block_v=16)
        want = reference.gdn_recurrent_step(q, k, v, g, beta, want_pool, ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, rtol=1e-5, atol=1e-5)


def check_gdn_prefill(gen: torch.Generator) -> None:
    """Short sequences a token at a time in one launch (`gdn_recurrent_prefill`) = the chunked
    reference: outputs, and each slot's final state (the others untouched)."""
    lengths, k_heads, v_heads, dk, dv, slots = [1, 4, 9], 2, 4, 16, 32, 5
    tokens = sum(lengths)
    q, k = (torch.randn(tokens, k_heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(tokens, v_heads, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(tokens, v_heads, generator=gen))
    beta = torch.rand(tokens, v_heads, generator=gen)
    cu = torch.tensor([0, 1, 5, 14], dtype=torch.int32)
    pool, ids = torch.randn(slots, v_heads, dk, dv, generator=gen) * 0.3, torch.tensor([3, 0, 4])
    want_pool = pool.clone()
    want = reference.gdn_chunk_prefill(q, k, v, g, beta, cu, want_pool, ids, 4)
    save_at, save_to = torch.tensor([0, 3, 9], dtype=torch.int32), torch.tensor([3, 1, 2])
    saved_pool = want_pool.clone()
    saved = reference.gdn_recurrent_prefill(q, k, v, g, beta, cu, saved_pool, ids, save_at, save_to)
    for prefetch in (False, True):  # inputs loaded as each step needs them, or a step ahead
        got_pool = pool.clone()
        got = cuda_gdn_recurrent.gdn_recurrent_prefill(
            q, k, v, g, beta, cu, got_pool, ids, 16, prefetch=prefetch
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_pool, want_pool, rtol=1e-4, atol=1e-4)
        # checkpoints on the way (after 3 of 4 tokens, 9 of 9, none) = the reference's copies
        args = (q, k, v, g, beta, cu, got_pool, ids, 16, 4, save_at, save_to, prefetch)
        got = cuda_gdn_recurrent.gdn_recurrent_prefill(*args)
        torch.testing.assert_close(got, saved, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_pool, saved_pool, rtol=1e-4, atol=1e-4)
        assert not torch.equal(got_pool[1], pool[1]) and not torch.equal(got_pool[2], pool[2])


def check_attention(gen: torch.Generator) -> None:
    """q/k RMSNorm + partial rotary + KV store (no other slot written) and the output gate; paged
    decode attention (split over each sequence's own length) and the GQA-tiled prefill continuing
    earlier contexts, over NaN-poisoned spare pages."""
    from pdserve.model.layers import RotaryEmbedding
    from pdserve.ops import cuda_prefill_attention

    heads, kv_heads, dim, page, pages = 4, 2, 32, 16, 12
    rotary = RotaryEmbedding(16, 1e7, 512)
    qkv = torch.randn(5, (2 * heads + 2 * kv_heads) * dim, generator=gen)
    qw, kw = torch.randn(dim, generator=gen) * 0.3, torch.randn(dim, generator=gen) * 0.3
    positions, slots = torch.tensor([0, 7, 100, 3, 511]), torch.tensor([3, 40, 17, 95, 60])
    got_kv = torch.full((2, pages, page, kv_heads, dim), float("nan"))
    want_kv = got_kv.clone()
    args = (rotary.cos_cache, rotary.sin_cache, positions)
    got_q, got_gate = cuda_layers.qk_norm_rope_store(qkv, heads, qw, kw, 1e-6, *args, got_kv, slots)
    want_q, want_gate = ref.qk_norm_rope_store(qkv, heads, qw, kw, 1e-6, *args, want_kv, slots)
    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5, equal_nan=True)
    close(got_q, want_q)
    close(got_kv, want_kv)
    o = torch.randn(5, heads, dim, generator=gen)
    close(cuda_layers.output_gate(o, got_gate), ref.output_gate(o, want_gate))
    context, q_lens = [21, 5, 40], [3, 5, 17]
    tables = torch.randperm(pages - 1, generator=gen)[:9].view(3, 3).int()
    kv = torch.full((2, pages, page, kv_heads, dim), float("nan"))
    for i, n in enumerate(context):
        for at in range(n):
            kv[:, tables[i, at // page], at % page] = torch.randn(2, kv_heads, dim, generator=gen)
    seq_lens = torch.tensor(context, dtype=torch.int32)
    q = torch.randn(3, heads, dim, generator=gen)
    ones = torch.arange(4, dtype=torch.int32)
    want = reference.paged_attention(q, kv, ones, seq_lens, tables, dim**-0.5)
    close(cuda_attention.paged_attention(q, kv, ones, seq_lens, tables, dim**-0.5), want)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    want = reference.paged_attention(q, kv, cu, seq_lens, tables, dim**-0.5)
    got = cuda_prefill_attention.paged_prefill(
        q, kv, cu, seq_lens, tables, dim**-0.5, max(q_lens), block_m=16, block_n=16
    )
    close(got, want)
    # as 3 persistent programs looping over the 3 x 9 tiles (tiles past a sequence's end skipped)
    kept = cuda_prefill_attention.paged_prefill(
        q, kv, cu, seq_lens, tables, dim**-0.5, max(q_lens), programs=3, block_m=16, block_n=16
    )
    torch.testing.assert_close(kept, got, rtol=0, atol=0)


DECODE_CHECKS = {"route_align": check_route_align, "skinny": check_skinny, "gdn_decode": check_gdn_decode}
CHECKS = {
    **DECODE_CHECKS,
    "align": check_align,
    "route": check_route,
    "conv": check_conv,
    "moe": check_moe,
    "norms": check_norms,
    "gdn_step": check_gdn_step,
    "gdn_prefill": check_gdn_prefill,
    "attention": check_attention,
}

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1: the kernels must be defined for the interpreter")
    CHECKS[sys.argv[1]](torch.Generator().manual_seed(0))
    print(f"{sys.argv[1]}: ok")
