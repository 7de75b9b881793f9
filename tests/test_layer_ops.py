"""The per-layer ops (`pdserve.ops.layer_ops`, CPU reference) against transformers' Qwen3.5-MoE modules:
zero-centred and gated RMSNorm, q/k norm + partial rotary + KV store, the GDN gates, the router, and
the MoE block with its shared expert run apart or folded in as an extra expert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from pdserve import ops
from pdserve.config import ModelConfig
from pdserve.model.layers import RotaryEmbedding
from pdserve.model.moe import SparseMoe
from tests.ops_helpers import TOL

EPS = 1e-6


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def hf_norm(dim: int) -> hf.Qwen3_5MoeRMSNorm:
    norm = hf.Qwen3_5MoeRMSNorm(dim, eps=EPS)
    norm.weight.data.normal_(0.0, 0.3)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_residual_add_match_transformers(dtype: torch.dtype) -> None:
    norm = hf_norm(48)
    x, residual = torch.randn(7, 48).to(dtype), torch.randn(7, 48).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(ops.rms_norm(x, norm.weight, EPS), norm(x), **TOL)
        normed, new_residual = ops.add_rms_norm(x, residual, norm.weight, EPS)
        assert torch.equal(new_residual, residual + x)
        torch.testing.assert_close(normed, norm(residual + x), **TOL)
        # parts are summed in fp32 and rounded once, then added: the MoE's expert rows
        parts = torch.randn(7, 5, 48).to(dtype)
        normed, new_residual = ops.add_rms_norm(parts, residual, norm.weight, EPS)
        summed = residual + parts.float().sum(1).to(dtype)
        assert torch.equal(new_residual, summed)
        torch.testing.assert_close(normed, norm(summed), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    norm = hf.Qwen3_5MoeRMSNormGated(16, eps=EPS)
    norm.weight.data.normal_(1.0, 0.3)
    x = torch.randn(5, 4, 16).to(dtype)
    z = torch.randn(5, 100).to(dtype)[:, 10:74].view(5, 4, 16)  # a strided slice, as in_proj's z
    with torch.no_grad():
        want = norm(x.reshape(-1, 16), z.reshape(-1, 16)).reshape(5, 64)
    torch.testing.assert_close(ops.gated_rms_norm(x, z, norm.weight, EPS), want, **TOL)


def test_qk_norm_rope_store_matches_transformers() -> None:
    tokens, heads, kv_heads, dim, pages, page_size = 6, 4, 2, 32, 10, 4
    rotary = RotaryEmbedding(rotary_dim=8, base=10_000.0, max_positions=64)
    q_norm, k_norm = hf_norm(dim), hf_norm(dim)
    qkv = torch.randn(tokens, (2 * heads + 2 * kv_heads) * dim)
    positions = torch.randint(0, 64, (tokens,))
    slots = torch.randperm(pages * page_size)[:tokens]
    kv_layer = torch.randn(2, pages, page_size, kv_heads, dim)
    before = kv_layer.clone()
    q, gate = ops.qk_norm_rope_store(
        qkv, heads, q_norm.weight, k_norm.weight, EPS, rotary.cos_cache, rotary.sin_cache,
        positions, kv_layer, slots,
    )  # fmt: skip
    q_gate, k, v = qkv.split([2 * heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q, want_gate = q_gate.view(tokens, heads, 2 * dim).chunk(2, dim=-1)
    with torch.no_grad():
        want_q, want_k = hf.apply_rotary_pos_emb(
            q_norm(want_q), k_norm(k.view(tokens, kv_heads, dim)),
            rotary.cos_cache[positions], rotary.sin_cache[positions],
        )  # fmt: skip
    torch.testing.assert_close(q, want_q, **TOL)
    assert q.is_contiguous() and torch.equal(gate, want_gate)
    flat, flat_before = kv_layer.view(2, -1, kv_heads, dim), before.view(2, -1, kv_heads, dim)
    torch.testing.assert_close(flat[0, slots], want_k, **TOL)
    assert torch.equal(flat[1, slots], v.view(tokens, kv_heads, dim))
    untouched = torch.ones(pages * page_size, dtype=torch.bool).index_fill(0, slots, False)
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])
    gated = ops.output_gate(q, gate)
    torch.testing.assert_close(gated, (q * torch.sigmoid(gate)).reshape(tokens, -1), **TOL)


def test_gdn_gates_match_transformers_formula() -> None:
    ab = torch.randn(9, 20) * 4
    a, b = ab[:, 2:10], ab[:, 12:20]  # strided views, as in_proj's a and b
    A_log, dt_bias = torch.rand(8).log() + 1, torch.randn(8)
    g, beta = ops.gdn_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and (g <= 0).all()
    torch.testing.assert_close(g, -A_log.float().exp() * F.softplus(a.float() + dt_bias), **TOL)
    torch.testing.assert_close(beta, b.sigmoid(), **TOL)


def tiny_moe_configs(shared: int) -> tuple[ModelConfig, Qwen3_5MoeTextConfig]:
    sizes = dict(hidden_size=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16)
    ours = ModelConfig(
        vocab_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_conv_kernel_dim=4, shared_expert_intermediate_size=shared, layer_types=("full_attention",),
        **sizes,
    )  # fmt: skip
    return ours, Qwen3_5MoeTextConfig(shared_expert_intermediate_size=shared, **sizes)


def test_router_matches_transformers_and_appends_the_shared_gate() -> None:
    ours, theirs = tiny_moe_configs(shared=16)
    router = hf.Qwen3_5MoeTopKRouter(theirs)
    router.weight.data.normal_()
    x, shared_gate = torch.randn(11, 32), torch.randn(1, 32)
    with torch.no_grad():
        _, want_w, want_ids = router(x)
    weights, ids = ops.route_topk(F.linear(x, router.weight), 8, 3)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, **TOL)
    logits = F.linear(x, torch.cat([router.weight, shared_gate]))
    weights, ids = ops.route_topk(logits, 8, 3)
    assert torch.equal(ids[:, :3], want_ids) and (ids[:, 3] == 8).all()
    torch.testing.assert_close(weights[:, 3:], torch.sigmoid(x @ shared_gate.T), **TOL)
    with pytest.raises(ValueError, match="route_topk"):
        ops.route_topk(logits, 7, 3)


@pytest.mark.parametrize("shared", [16, 24], ids=["folded", "apart"])
def test_sparse_moe_matches_transformers(shared: int) -> None:
    ours_cfg, theirs_cfg = tiny_moe_configs(shared)
    theirs = hf.Qwen3_5MoeSparseMoeBlock(theirs_cfg)
    for p in theirs.parameters():
        p.data.normal_(0.0, 0.3)
    ours = SparseMoe(ours_cfg)
    assert ours.shared_folded == (shared == 16)
    with torch.no_grad():
        ours.gate.copy_(theirs.gate.weight)
        ours.w13.copy_(theirs.experts.gate_up_proj)
        ours.w2.copy_(theirs.experts.down_proj)
        ours.shared_gate_up.copy_(
            torch.cat([theirs.shared_expert.gate_proj.weight, theirs.shared_expert.up_proj.weight])
        )
        ours.shared_down.copy_(theirs.shared_expert.down_proj.weight)
        ours.shared_expert_gate.copy_(theirs.shared_expert_gate.weight)
        x = torch.randn(13, 32)
        parts = ours(x)
        want = theirs(x[None])[0]
    assert parts.shape == (13, 4, 32)
    torch.testing.assert_close(parts.sum(dim=1), want, **TOL)


def test_routed_moe_routes_router_partials_as_their_rounded_sum() -> None:
    """Router logits handed over as fp32 split-K partial sums [T, S, E + 1] (the decode path of
    `pdserve.ops.linear.router_logits`) route as their sum rounded to x's dtype; other ranks are a
    ValueError naming the shape."""
    from pdserve.ops.moe import routed_moe

    tokens, hidden, inter, experts, top_k = 5, 32, 16, 8, 2
    x = torch.randn(tokens, hidden).bfloat16()
    w13 = (torch.randn(experts + 1, 2 * inter, hidden) * 0.2).bfloat16()
    w2 = (torch.randn(experts + 1, hidden, inter) * 0.2).bfloat16()
    parts = torch.randn(tokens, 3, experts + 1)
    got = routed_moe(x, parts, w13, w2, experts, top_k, reduce=False)
    want = routed_moe(x, parts.sum(dim=1).bfloat16(), w13, w2, experts, top_k, reduce=False)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"router_logits \(5, 1, 3, 9\)"):
        routed_moe(x, parts[:, None], w13, w2, experts, top_k)
