"""The CUDA per-layer ops (`pdserve.ops.cuda_layers`, the MoE alignment of `pdserve.ops.cuda_route`)
against the CPU reference on fresh random inputs at the Qwen3.6 shapes and odd sizes, fp32 and bf16,
outputs poisoned first; and a CUDA-graph capture of them all. Skipped without CUDA."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from pdserve import ops
from pdserve.ops import reference_layers as ref
from pdserve.ops.moe import fused_moe, fused_moe_reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
TOKENS = [1, 7, 33]
H, HKV, D, ROT = 16, 2, 256, 64  # gated attention heads, rotary channels
HV, DV, HIDDEN, E, K = 32, 128, 2048, 256, 8


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype and torch.isfinite(got).all()
    return ((got.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm()).item()


def dev(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.to(DEVICE) for x in xs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_norms(dtype: torch.dtype, tokens: int) -> None:
    x, residual = torch.randn(tokens, HIDDEN).to(dtype), torch.randn(tokens, HIDDEN).to(dtype)
    parts, weight = torch.randn(tokens, K + 1, HIDDEN).to(dtype), (torch.randn(HIDDEN) * 0.3).to(dtype)
    assert rel_err(ops.rms_norm(*dev(x, weight), 1e-6), ref.rms_norm(x, weight, 1e-6)) < TOL[dtype]
    for p in (x, parts):
        got = ops.add_rms_norm(*dev(p, residual, weight), 1e-6)
        want = ref.add_rms_norm(p, residual, weight, 1e-6)
        assert rel_err(got[0], want[0]) < TOL[dtype] and rel_err(got[1], want[1]) < TOL[dtype]
        if p is x:  # one part: the residual add is the unfused add, bit for bit
            assert torch.equal(got[1].cpu(), want[1])
    z_source = torch.randn(tokens, 3 * HV * DV).to(dtype)  # z: a strided slice, as in_proj's

    def z_of(source: torch.Tensor) -> torch.Tensor:
        return source[:, HV * DV : 2 * HV * DV].view(tokens, HV, DV)

    gx, gw = torch.randn(tokens, HV, DV).to(dtype), (1 + torch.randn(DV) * 0.3).to(dtype)
    got = ops.gated_rms_norm(gx.to(DEVICE), z_of(z_source.to(DEVICE)), gw.to(DEVICE), 1e-6)
    assert rel_err(got, ref.gated_rms_norm(gx, z_of(z_source), gw, 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_qk_norm_rope_store_and_output_gate(dtype: torch.dtype, tokens: int) -> None:
    from pdserve.model.layers import RotaryEmbedding

    rotary = RotaryEmbedding(ROT, 1e7, 4096)
    qkv = torch.randn(tokens, (2 * H + 2 * HKV) * D).to(dtype)
    qw, kw = (torch.randn(D) * 0.3).to(dtype), (torch.randn(D) * 0.3).to(dtype)
    positions = torch.randint(0, 4096, (tokens,))
    slots = torch.randperm(40 * 16)[:tokens]
    kv = torch.full((2, 40, 16, HKV, D), float("nan")).to(dtype)
    want_kv = kv.clone()
    args = (rotary.cos_cache, rotary.sin_cache, positions)
    want_q, want_gate = ref.qk_norm_rope_store(qkv, H, qw, kw, 1e-6, *args, want_kv, slots)
    got_kv = kv.to(DEVICE)
    got_q, got_gate = ops.qk_norm_rope_store(*dev(qkv), H, *dev(qw, kw), 1e-6, *dev(*args), got_kv,
                                             slots.to(DEVICE))  # fmt: skip
    assert rel_err(got_q, want_q) < TOL[dtype] and torch.equal(got_gate.cpu(), want_gate)
    written = got_kv.cpu().view(2, -1, HKV, D)
    assert rel_err(written[0, slots], want_kv.view(2, -1, HKV, D)[0, slots]) < TOL[dtype]
    assert torch.equal(written[1, slots], want_kv.view(2, -1, HKV, D)[1, slots])
    assert torch.equal(got_kv.cpu().isnan(), want_kv.isnan())  # no other slot written
    o = torch.randn(tokens, H, D).to(dtype)
    assert rel_err(ops.output_gate(o.to(DEVICE), got_gate), ref.output_gate(o, want_gate)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_gates(dtype: torch.dtype) -> None:
    ab = (torch.randn(37, 2 * HV + 5) * 6).to(dtype)  # a and b: strided slices, as in_proj's
    A_log, dt_bias = (torch.rand(HV) * 2.7).to(dtype), torch.randn(HV).to(dtype)
    ab_dev = ab.to(DEVICE)
    g, beta = ops.gdn_gates(ab_dev[:, 5 : 5 + HV], ab_dev[:, 5 + HV :], *dev(A_log, dt_bias))
    want_g, want_beta = ref.gdn_gates(ab[:, 5 : 5 + HV], ab[:, 5 + HV :], A_log, dt_bias)
    assert rel_err(g, want_g) < 1e-5 and rel_err(beta, want_beta) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True])
def test_route_topk(dtype: torch.dtype, shared: bool) -> None:
    logits = (torch.randn(45, E + 1) * 2).to(dtype)
    logits[3, 10:20] = logits[3, 30]  # ties: any of equal experts may be chosen, the weights agree
    if not shared:
        logits = logits[:, :E]
    weights, ids = ops.route_topk(logits.to(DEVICE), E, K)
    want_w, want_ids = ref.route_topk(logits, E, K)
    probs = torch.softmax(logits[:, :E].float(), dim=-1)
    got_probs = probs.gather(1, ids[:, :K].cpu())
    assert torch.allclose(got_probs, probs.gather(1, want_ids[:, :K]), rtol=1e-6, atol=0)
    assert all(len(set(row)) == K for row in ids[:, :K].tolist())
    assert rel_err(weights, want_w) < TOL[dtype]
    assert torch.equal(ids[:, K:].cpu(), want_ids[:, K:])  # the shared expert's id, when present


@pytest.mark.parametrize("tokens", [1, 5, 32, 300, 900, 911, 8192])
@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_align_pairs_equals_sorted_layout(tokens: int, block_m: int) -> None:
    """The counting alignment lays out exactly the rows the device-sort path does: in one program
    (up to 8,192 pairs) and over chunks (911 x 9 pairs: three chunks, the last of 7 pairs;
    8,192 tokens: a prefill pass, 18 chunks)."""
    from pdserve.ops import cuda_moe, cuda_route

    ids = torch.randn(tokens, E).topk(K, dim=-1).indices
    ids = torch.cat([ids, torch.full((tokens, 1), E)], dim=1).to(DEVICE)  # the folded shared expert
    got = cuda_route.align_pairs(ids, E + 1, block_m)
    want = cuda_moe.pairs_by_sort(ids, E + 1, block_m)
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("tokens", [4, 33])
def test_fused_moe_unreduced_with_folded_shared_expert(tokens: int) -> None:
    x = torch.randn(tokens, HIDDEN, device=DEVICE).bfloat16()
    w13 = (torch.randn(E + 1, 1024, HIDDEN, device=DEVICE) * HIDDEN**-0.5).bfloat16()
    w2 = (torch.randn(E + 1, HIDDEN, 512, device=DEVICE) * 512**-0.5).bfloat16()
    weights, ids = ops.route_topk(torch.randn(tokens, E + 1, device=DEVICE).bfloat16(), E, K)
    got = fused_moe(x, w13, w2, weights, ids, reduce=False)
    want = fused_moe_reference(x.float(), w13.float(), w2.float(), weights.float(), ids, reduce=False)
    assert got.shape == (tokens, K + 1, HIDDEN) and rel_err(got.float(), want) < 1e-2


def test_layer_ops_capture_in_a_cuda_graph() -> None:
    """Sync-free: the ops capture in one CUDA graph and replays equal eager calls."""
    from pdserve.model.layers import RotaryEmbedding

    tokens, dtype = 8, torch.bfloat16
    rotary = RotaryEmbedding(ROT, 1e7, 4096).to(DEVICE)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=dtype)
    w = torch.randn(HIDDEN, device=DEVICE, dtype=dtype) * 0.3
    qkv = torch.randn(tokens, (2 * H + 2 * HKV) * D, device=DEVICE, dtype=dtype)
    dw = torch.randn(D, device=DEVICE, dtype=dtype) * 0.3
    positions, slots = torch.randint(0, 4096, (tokens,), device=DEVICE), torch.arange(tokens, device=DEVICE)
    kv = torch.zeros(2, 4, 16, HKV, D, device=DEVICE, dtype=dtype)
    ab = torch.randn(tokens, 2 * HV, device=DEVICE, dtype=dtype)
    logits = torch.randn(tokens, E + 1, device=DEVICE, dtype=dtype)

    def step() -> list[torch.Tensor]:
        normed, residual = ops.add_rms_norm(x[:, None].expand(-1, 3, -1), x, w, 1e-6)
        q, gate = ops.qk_norm_rope_store(qkv, H, dw, dw, 1e-6, rotary.cos_cache, rotary.sin_cache,
                                         positions, kv, slots)  # fmt: skip
        g, beta = ops.gdn_gates(ab[:, :HV], ab[:, HV:], w[:HV].float(), w[HV : 2 * HV])
        weights, ids = ops.route_topk(logits, E, K)
        from pdserve.ops.cuda_route import align_pairs

        return [normed, residual, q, ops.output_gate(q, gate), g, beta, weights, ids.float(),
                align_pairs(ids, E + 1, 16).float(), ops.gated_rms_norm(q, q, dw, 1e-6)]  # fmt: skip

    eager = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("batch", "shape"), [(1, None), (4, None), (8, None), (9, None), (32, None), (32, (2, 8)), (32, (4, 4))]
)
def test_gdn_decode_step_equals_the_four_ops(batch: int, shape: tuple[int, int] | None) -> None:
    """The GDN decode mixer (fused up to FUSED_MAX_BATCH sequences: the conv, then gates + step +
    gated norm in one launch) = the four CUDA ops composed, and the CPU reference, over three bf16
    steps at the Qwen3.6 shape; the slots it ran on compared, conv histories to the bit. `shape`:
    the fused kernel at any batch, its state tile in (blocks, warps) (bench_step's gsplit, gwarps)."""
    from pdserve.ops import cuda_gdn_decode
    from pdserve.ops.gdn_decode import GdnTensors, gdn_decode_step, gdn_decode_step_unfused

    step = gdn_decode_step
    if shape is not None:
        step = partial(cuda_gdn_decode.gdn_decode_step, v_split=shape[0], num_warps=shape[1])

    hk, dk, slots, dtype = 16, 128, 40, torch.bfloat16
    channels = 2 * hk * dk + HV * DV
    weight = torch.randn(channels, 4, device=DEVICE, dtype=dtype) * 0.5
    A_log, dt_bias = torch.rand(HV, device=DEVICE) * 2.7, torch.randn(HV, device=DEVICE, dtype=dtype)
    norm_w = (torch.rand(DV, device=DEVICE) + 0.5).to(dtype)
    conv = torch.randn(slots, channels, 3, device=DEVICE, dtype=dtype)
    state = torch.randn(slots, HV, dk, DV, device=DEVICE) * 0.3
    ids = torch.randperm(slots, device=DEVICE)[:batch]
    fused, unfused, cpu = (
        GdnTensors(weight, conv.clone(), A_log, dt_bias, state.clone(), norm_w, 1e-6) for _ in range(3)
    )
    cpu = GdnTensors(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in cpu))
    for _ in range(3):
        x = torch.randn(batch, channels, device=DEVICE, dtype=dtype)
        z = torch.randn(batch, HV, DV, device=DEVICE, dtype=dtype)
        a, b = (torch.randn(batch, HV, device=DEVICE, dtype=dtype) * 4 for _ in range(2))
        got = step(x, z, a, b, fused, ids)
        composed = gdn_decode_step_unfused(x, z, a, b, unfused, ids)
        want = gdn_decode_step_unfused(*(t.cpu() for t in (x, z, a, b)), cpu, ids.cpu())
        assert rel_err(got, composed) < 1e-3 and rel_err(got, want) < TOL[dtype]
    assert torch.equal(fused.conv_pool, unfused.conv_pool) and torch.equal(
        fused.conv_pool.cpu(), cpu.conv_pool
    )
    assert rel_err(fused.recurrent_pool[ids], unfused.recurrent_pool[ids]) < 1e-5
    assert rel_err(fused.recurrent_pool[ids], cpu.recurrent_pool[ids.cpu()]) < 1e-3


@pytest.mark.parametrize("tokens", [1, 4, 32])
def test_route_align_equals_route_then_align(tokens: int) -> None:
    """Decode's one-program routing + row layout = route_topk then align_pairs (ids and rows to the
    bit, weights to rounding), at the Qwen3.6 shape with the shared expert folded in."""
    from pdserve.ops.cuda_route import align_pairs, route_topk
    from pdserve.ops.cuda_route_align import route_align

    logits = torch.randn(tokens, E + 1, device=DEVICE, dtype=torch.bfloat16)
    weights, ids, rows = route_align(logits, E, K, 16)
    want_w, want_ids = route_topk(logits, E, K)
    assert torch.equal(ids, want_ids) and torch.equal(rows, align_pairs(want_ids, E + 1, 16))
    assert rel_err(weights, want_w) < 4e-3  # bf16: a weight may round one ulp apart


@pytest.mark.parametrize("tokens", [1, 4, 32])
def test_skinny_projections_equal_cublas(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the split-K kernel switched on (`pdserve.ops.linear`), a decode step's projections give
    F.linear's product (in_proj shape) and, through the next add_rms_norm, its normed output and
    new residual (out_proj shape: fp32 partials summed and rounded once), to bf16 rounding."""
    from pdserve.ops import linear

    monkeypatch.setattr(linear, "SKINNY_UP_TO", 32)
    dtype = torch.bfloat16
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=dtype)
    w_in = torch.randn(12352, HIDDEN, device=DEVICE, dtype=dtype) * 0.02
    assert rel_err(linear.linear(x, w_in), torch.nn.functional.linear(x, w_in)) < 4e-3
    o = torch.randn(tokens, 4096, device=DEVICE, dtype=dtype)
    w_out, norm_w = (
        torch.randn(HIDDEN, 4096, device=DEVICE, dtype=dtype) * 0.02,
        torch.randn(HIDDEN, device=DEVICE, dtype=dtype),
    )
    parts = linear.linear_to_norm(o, w_out)
    assert parts.shape == (tokens, linear.SKINNY_SPLITS, HIDDEN) and parts.dtype == torch.float32
    got = ops.add_rms_norm(parts, x, norm_w, 1e-6)
    want = ops.add_rms_norm(torch.nn.functional.linear(o, w_out), x, norm_w, 1e-6)
    cpu = ref.add_rms_norm(parts.cpu(), x.cpu(), norm_w.cpu(), 1e-6)
    for g, w, c in zip(got, want, cpu, strict=True):
        assert rel_err(g, w) < 4e-3 and rel_err(g, c.to(DEVICE)) < 4e-3


@pytest.mark.parametrize("tokens", [1, 4, 32])
def test_router_partials_route_as_the_product(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the router's split-K partials on (`pdserve.ops.linear.ROUTER_UP_TO`), routing them gives
    the experts and weights of routing F.linear's bf16 logits (one program or route + align), at the
    Qwen3.6 router's shape ([E + 1 rounded up to 16, H]): both add in fp32 and round once to bf16,
    so they differ only where a sum lies within its summation-order error of a rounding boundary."""
    from pdserve.ops import cuda_route, cuda_route_align, linear

    monkeypatch.setattr(linear, "ROUTER_UP_TO", 32)
    dtype = torch.bfloat16
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=dtype)
    router = torch.randn(272, HIDDEN, device=DEVICE, dtype=dtype) * 0.5
    parts = linear.router_logits(x, router)[..., : E + 1]
    assert parts.shape == (tokens, linear.ROUTER_SPLITS, E + 1) and parts.dtype == torch.float32
    logits = torch.nn.functional.linear(x, router)[:, : E + 1]
    assert rel_err(parts.sum(dim=1), logits.float()) < 4e-3
    weights, ids = cuda_route.route_topk(parts, E, K, dtype)
    want_w, want_ids = cuda_route.route_topk(logits, E, K)
    assert torch.equal(ids.sort(dim=1).values, want_ids.sort(dim=1).values)
    assert weights.dtype == dtype and rel_err(weights.sort(dim=1).values, want_w.sort(dim=1).values) < 8e-3
    aligned_w, aligned_ids, rows = cuda_route_align.route_align(parts, E, K, 16, dtype)
    assert torch.equal(aligned_ids, ids) and rel_err(aligned_w, weights) < 4e-3
    assert torch.equal(rows, cuda_route.align_pairs(ids, E + 1, 16))
