"""The decode step's fused kernels under Triton's CPU interpreter (tests/triton_interpreted.py runs
them): routing + alignment in one program, the split-K skinny linear, the fused GDN decode mixer."""

from __future__ import annotations

import torch

from pdserve.ops import cuda_conv, cuda_gdn, cuda_layers, cuda_moe, cuda_norms
from pdserve.ops import reference_layers as ref

E, K = 16, 4  # routed experts, top-k; the shared expert folded in as expert E


def check_route_align(gen: torch.Generator) -> None:
    """Decode's one-program routing + alignment = route_topk then the sort's layout, at 1 to 32
    tokens, with and without the shared expert; then the routed experts against the reference."""
    from pdserve.ops import cuda_route_align
    from pdserve.ops.moe import fused_moe_reference

    for tokens, shared, block_m in [(1, True, 16), (5, True, 16), (32, True, 16), (9, False, 64)]:
        logits = torch.randn(tokens, E + int(shared), generator=gen)
        weights, ids, rows = cuda_route_align.route_align(logits, E, K, block_m)
        want_w, want_ids = ref.route_topk(logits, E, K)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
        assert torch.equal(rows, cuda_moe.pairs_by_sort(want_ids, E + int(shared), block_m))
    partials = torch.randn(5, 4, E + 1, generator=gen)  # the router's split-K partial sums
    weights, ids, rows = cuda_route_align.route_align(partials, E, K, 16, torch.float32)
    want_w, want_ids = ref.route_topk(partials.sum(dim=1), E, K)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(rows, cuda_moe.pairs_by_sort(want_ids, E + 1, 16))
    hidden, inter, tokens = 32, 16, 6
    w13 = torch.randn(E + 1, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(E + 1, hidden, inter, generator=gen) * 0.2
    x, logits = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, E + 1, generator=gen)
    got = cuda_moe.routed_experts(x, logits, w13, w2, E, K, reduce=False)
    torch.testing.assert_close(
        got, fused_moe_reference(x, w13, w2, *ref.route_topk(logits, E, K), reduce=False)
    )


def check_skinny(gen: torch.Generator) -> None:
    """Split-K partials of a decode-sized linear sum to x @ w^T (rows short of a tile, K not a
    multiple of the splits' share, a split left empty); one split is the product itself."""
    from pdserve.ops.cuda_skinny import skinny_linear

    for rows, n, k, splits in [(3, 40, 96, 2), (17, 64, 100, 3), (1, 24, 32, 4)]:
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        parts = skinny_linear(x, w, splits, block_n=16, block_k=16)
        assert parts.shape == (rows, splits, n) and parts.dtype == torch.float32
        torch.testing.assert_close(parts.sum(dim=1), x @ w.T, rtol=1e-5, atol=1e-4)
    x, w = torch.randn(5, 48, generator=gen), torch.randn(40, 48, generator=gen)
    torch.testing.assert_close(skinny_linear(x, w, 1, block_n=16, block_k=16), x @ w.T, rtol=1e-5, atol=1e-4)


def check_gdn_decode(gen: torch.Generator) -> None:
    """The fused decode mixer (the conv step, then gates + step + gated norm in one program a value
    head) = the four reference ops, over two steps; both pools updated alike."""
    from pdserve.ops import cuda_gdn_decode
    from pdserve.ops.gdn_decode import GdnTensors, gdn_decode_step_unfused

    batch, k_heads, v_heads, dk, dv, width, slots = 3, 2, 4, 16, 32, 4, 5
    channels = 2 * k_heads * dk + v_heads * dv
    weight, ids = torch.randn(channels, width, generator=gen), torch.tensor([4, 0, 2])
    A_log, dt_bias = torch.rand(v_heads, generator=gen) * 2.7, torch.randn(v_heads, generator=gen)
    norm_w = torch.rand(dv, generator=gen) + 0.5
    conv = torch.randn(slots, channels, width - 1, generator=gen)
    state = torch.randn(slots, v_heads, dk, dv, generator=gen) * 0.3
    for v_split, warps in [(1, 8), (2, 4), (4, 4)]:  # the whole state tile, or blocks of it in turn
        got_conv, want_conv, got_state, want_state = conv.clone(), conv.clone(), state.clone(), state.clone()
        for _ in range(2):
            x = torch.randn(batch, channels, generator=gen)
            z = torch.randn(batch, v_heads, dv, generator=gen)
            a, b = (torch.randn(batch, v_heads, generator=gen) * 6 for _ in range(2))
            got = cuda_gdn_decode.gdn_decode_step(
                x, z, a, b, GdnTensors(weight, got_conv, A_log, dt_bias, got_state, norm_w, 1e-6), ids,
                v_split=v_split, num_warps=warps,
            )  # fmt: skip
            want = gdn_decode_step_unfused(
                x, z, a, b, GdnTensors(weight, want_conv, A_log, dt_bias, want_state, norm_w, 1e-6), ids
            )
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got_conv, want_conv)
        torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    # bf16, against the four unfused Triton kernels: the same rounding points, to the bit
    bf = torch.bfloat16
    weight, dt_bias, norm_w = weight.to(bf), dt_bias.to(bf), norm_w.to(bf)
    fused = GdnTensors(weight, conv.to(bf), A_log, dt_bias, state.clone(), norm_w, 1e-6)
    apart = GdnTensors(weight, conv.to(bf), A_log, dt_bias, state.clone(), norm_w, 1e-6)
    for _ in range(2):
        x, z = (
            torch.randn(batch, channels, generator=gen).to(bf),
            torch.randn(batch, v_heads, dv, generator=gen).to(bf),
        )
        a, b = ((torch.randn(batch, v_heads, generator=gen) * 6).to(bf) for _ in range(2))
        got = cuda_gdn_decode.gdn_decode_step(x, z, a, b, fused, ids)
        q, k, v = cuda_conv.causal_conv1d_step(x, weight, apart.conv_pool, ids).split(
            [k_heads * dk] * 2 + [v_heads * dv], -1
        )
        g, beta = cuda_layers.gdn_gates(a, b, A_log, dt_bias)
        qkv = q.reshape(batch, k_heads, dk), k.reshape(batch, k_heads, dk), v.reshape(batch, v_heads, dv)
        o = cuda_gdn.gdn_recurrent_step(*qkv, g, beta, apart.recurrent_pool, ids, block_v=16)
        assert torch.equal(got, cuda_norms.gated_rms_norm(o, z, norm_w, 1e-6))
    assert torch.equal(fused.conv_pool, apart.conv_pool) and torch.equal(
        fused.recurrent_pool, apart.recurrent_pool
    )
