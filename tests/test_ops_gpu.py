"""The CUDA ops (`pdserve.ops.cuda`, `pdserve.ops.cuda_moe`) against the CPU reference, on fresh random
inputs: odd and packed lengths, chunked continuation, shuffled state slots, grouped heads, the real
Qwen3.6 head shapes, fp32 and bf16; outputs and the states written back. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import ops
from pdserve.ops import reference
from pdserve.ops.moe import fused_moe, fused_moe_reference

pytestmark = pytest.mark.gpu

LENGTHS = [1, 15, 63, 64, 65, 300]
SLOTS = 48
HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3.6-35B-A3B GDN heads
CONV_DIM, CONV_W = 8192, 4
H, HKV, D, PAGE = 16, 2, 256, 16  # gated attention heads, KV page size
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-4, torch.bfloat16: 1e-2}
FLA_TOL = {torch.float32: 5e-3, torch.bfloat16: 1e-2}  # fla's fp32 dots run in tf32


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and torch.isfinite(got).all()
    return ((got.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm()).item()


def cu(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def slots(n: int) -> torch.Tensor:
    return torch.randperm(SLOTS)[:n].flip(0).contiguous()


def gdn_inputs(tokens: int, hk: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return dict(
        q=torch.randn(tokens, hk, DK).to(dtype),
        k=torch.randn(tokens, hk, DK).to(dtype),
        v=torch.randn(tokens, HV, DV).to(dtype),
        g=-F.softplus(torch.randn(tokens, HV)) * torch.rand(HV) * 2,
        beta=torch.rand(tokens, HV).to(dtype),
    )


def cuda(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.cuda() for name, t in x.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk", [HK, HV])
def test_gdn_chunk_prefill_packed_and_chunked(dtype: torch.dtype, hk: int) -> None:
    x, pool, ids = gdn_inputs(sum(LENGTHS), hk, dtype), torch.randn(SLOTS, HV, DK, DV) * 0.3, slots(6)
    want_pool = pool.clone()
    want = reference.gdn_chunk_prefill(**x, cu_seqlens=cu(LENGTHS), recurrent_pool=want_pool, slot_ids=ids,
                                       chunk_size=64)  # fmt: skip
    got_pool = pool.cuda()
    got = ops.gdn_chunk_prefill(**cuda(x), cu_seqlens=cu(LENGTHS).cuda(), recurrent_pool=got_pool,
                                slot_ids=ids.cuda())  # fmt: skip
    assert got.dtype == dtype and rel_err(got, want) < FLA_TOL[dtype]
    assert rel_err(got_pool, want_pool) < FLA_TOL[dtype]
    # chunked continuation: the same tokens in two passes (split inside each sequence) give the same state
    first = [n // 2 for n in LENGTHS]
    bounds = cu(LENGTHS).tolist()
    head = torch.cat([torch.arange(b, b + f) for b, f in zip(bounds, first, strict=False)])
    tail = torch.cat([torch.arange(b + f, e) for b, f, e in zip(bounds, first, bounds[1:], strict=False)])
    pool2 = pool.cuda()
    keep = [i for i, f in enumerate(first) if f > 0]
    ops.gdn_chunk_prefill(**{n: t[head].cuda() for n, t in x.items()},
                          cu_seqlens=cu([first[i] for i in keep]).cuda(), recurrent_pool=pool2,
                          slot_ids=ids[keep].cuda())  # fmt: skip
    ops.gdn_chunk_prefill(**{n: t[tail].cuda() for n, t in x.items()},
                          cu_seqlens=cu([n - f for n, f in zip(LENGTHS, first, strict=True)]).cuda(),
                          recurrent_pool=pool2, slot_ids=ids.cuda())  # fmt: skip
    assert rel_err(pool2, want_pool) < FLA_TOL[dtype]


@pytest.mark.parametrize("tokens", [1, 31, 4096, 4097])
def test_l2_normalize_is_flas_l2norm(tokens: int) -> None:
    """The GDN prefill's own l2 norm (one config for every T) against fla's in-kernel one (which
    autotunes per bucket of T * H // 65,536; 4,097 tokens x 16 heads is the second bucket), on a
    strided q slice as the layer hands it: at most one bf16 rounding apart, nearly all equal."""
    from fla.modules.l2norm import l2norm_fwd

    from pdserve.ops.cuda_norms import l2_normalize

    mixed = torch.randn(tokens, 3 * HK * DK, device="cuda", dtype=torch.bfloat16)
    q = mixed[:, HK * DK : 2 * HK * DK].view(tokens, HK, DK)
    got = l2_normalize(q, torch.bfloat16, 1e-6)
    want = l2norm_fwd(q.contiguous())[0]
    assert got.is_contiguous() and got.shape == q.shape and got.dtype == torch.bfloat16
    diff = (got.float() - want.float()).abs()
    assert diff.max() <= 2**-8 * want.float().abs().max() and (diff == 0).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5, 32])
def test_gdn_recurrent_step_in_place(dtype: torch.dtype, batch: int) -> None:
    pool, ids = torch.randn(SLOTS, HV, DK, DV) * 0.3, slots(batch)
    want_pool, got_pool = pool.clone(), pool.cuda()
    for _ in range(3):
        x = gdn_inputs(batch, HK, dtype)
        want = reference.gdn_recurrent_step(**x, recurrent_pool=want_pool, slot_ids=ids)
        got = ops.gdn_recurrent_step(**cuda(x), recurrent_pool=got_pool, slot_ids=ids.cuda())
        assert got.dtype == dtype and rel_err(got, want) < TOL[dtype]
    assert rel_err(got_pool, want_pool) < 1e-5  # fp32 state, fp32 maths on both sides


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_prefill_then_steps(dtype: torch.dtype) -> None:
    pool, ids = torch.randn(SLOTS, CONV_DIM, CONV_W - 1).to(dtype), slots(len(LENGTHS))
    weight = torch.randn(CONV_DIM, CONV_W).to(dtype)
    x = torch.randn(sum(LENGTHS), CONV_DIM).to(dtype)
    want_pool, got_pool = pool.clone(), pool.cuda()
    want = reference.causal_conv1d_prefill(x, weight, cu(LENGTHS), want_pool, ids)
    got = ops.causal_conv1d_prefill(x.cuda(), weight.cuda(), cu(LENGTHS).cuda(), got_pool, ids.cuda())
    assert got.dtype == dtype and rel_err(got, want) < TOL[dtype]
    assert torch.equal(got_pool.cpu(), want_pool)  # the history is copied, never computed
    for _ in range(3):
        x = torch.randn(len(LENGTHS), CONV_DIM).to(dtype)
        want = reference.causal_conv1d_step(x, weight, want_pool, ids)
        got = ops.causal_conv1d_step(x.cuda(), weight.cuda(), got_pool, ids.cuda())
        assert rel_err(got, want) < TOL[dtype]
    assert torch.equal(got_pool.cpu(), want_pool)


def kv_setup(context: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned KV layer with every sequence's context stored in shuffled pages through store_kv."""
    pages = [-(-n // PAGE) + 1 for n in context]  # one spare page each: past-the-end entries are ignored
    perm = torch.randperm(sum(pages) + 3)
    tables = torch.zeros(len(context), max(pages), dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[at : at + n]
        at += n
    kv = torch.full((2, sum(pages) + 3, PAGE, HKV, D), float("nan"), dtype=dtype, device="cuda")
    mapping = torch.cat([tables[i].long()[torch.arange(n) // PAGE] * PAGE + torch.arange(n) % PAGE
                         for i, n in enumerate(context)])  # fmt: skip
    k, v = (torch.randn(sum(context), HKV, D).to(dtype) for _ in range(2))
    ops.store_kv(k.cuda(), v.cuda(), kv, mapping.cuda())
    want = torch.full_like(kv, float("nan")).cpu()
    reference.store_kv(k, v, want, mapping)
    assert torch.equal(kv.cpu().nan_to_num(7.0), want.nan_to_num(7.0))
    return kv, tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("context", "width"),
    [
        ([1, 15, 63, 64, 65, 300, 2049], None),
        # the captured decode graph's table is as wide as max_model_len (262,144 tokens): each
        # sequence splits its own length, a long one alone over every split
        ([1, 15, 63, 64, 65, 300, 2049], 16384),
        ([9000], 16384),
    ],
)
def test_paged_attention_decode(dtype: torch.dtype, context: list[int], width: int | None) -> None:
    kv, tables = kv_setup(context, dtype)
    q = torch.randn(len(context), H, D).to(dtype)
    args = (cu([1] * len(context)), torch.tensor(context, dtype=torch.int32))
    want = reference.paged_attention(q, kv.cpu(), *args, tables, D**-0.5)
    wide = tables if width is None else F.pad(tables, (0, width - tables.shape[1]))
    got = ops.paged_attention(q.cuda(), kv, *(a.cuda() for a in (*args, wide)), D**-0.5)
    assert got.dtype == dtype and rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("earlier", [False, True])
def test_paged_attention_prefill(dtype: torch.dtype, earlier: bool) -> None:
    q_lens = LENGTHS
    context = [n + (37 * i if earlier else 0) for i, n in enumerate(q_lens)]
    kv, tables = kv_setup(context, dtype)
    q = torch.randn(sum(q_lens), H, D).to(dtype)
    args = (cu(q_lens), torch.tensor(context, dtype=torch.int32), tables)
    want = reference.paged_attention(q, kv.cpu(), *args, D**-0.5)
    got = ops.paged_attention(q.cuda(), kv, *(a.cuda() for a in args), D**-0.5)
    assert got.dtype == dtype and rel_err(got, want) < TOL[dtype]
    given = ops.paged_attention(q.cuda(), kv, *(a.cuda() for a in args), D**-0.5, max_q_len=max(q_lens))
    assert torch.equal(given, got)  # the grid sized from the host's figure, no device read


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(H, HKV, D), (4, 2, 32), (6, 2, 64)])  # Qwen3.6, tiny, a group of 3
def test_gqa_tiled_prefill_kernel(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    """The GQA-tiled prefill kernel (a tile of tokens x the group's heads; unmasked blocks before the
    diagonal) against the reference, continuing earlier contexts of every alignment, over
    NaN-poisoned spare pages."""
    num_heads, num_kv_heads, head_dim = heads
    q_lens = [*LENGTHS, 130]
    context = [n + 37 * i for i, n in enumerate(q_lens)]
    pages = [-(-n // PAGE) + 1 for n in context]
    tables = torch.randperm(sum(pages) + 3)[: sum(pages)].split(pages)
    tables = torch.nn.utils.rnn.pad_sequence(list(tables), batch_first=True).int()
    kv = torch.full((2, sum(pages) + 3, PAGE, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    for i, n in enumerate(context):
        for at in range(n):
            kv[:, tables[i, at // PAGE], at % PAGE] = torch.randn(2, num_kv_heads, head_dim).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim).to(dtype)
    args = (cu(q_lens), torch.tensor(context, dtype=torch.int32), tables)
    want = reference.paged_attention(q, kv, *args, head_dim**-0.5)
    from pdserve.ops import cuda_prefill_attention  # Triton: not on CPU machines

    for block_m, block_n in ((None, None), (128, 32)):
        got = cuda_prefill_attention.paged_prefill(
            q.cuda(), kv.cuda(), *(a.cuda() for a in args), head_dim**-0.5, block_m=block_m, block_n=block_n
        )
        assert got.dtype == dtype and rel_err(got, want) < TOL[dtype], (block_m, block_n)
    # as 5 persistent programs (a long prompt's chunk beside decode steps): the same tiles, bit for bit
    kept = cuda_prefill_attention.paged_prefill(
        q.cuda(), kv.cuda(), *(a.cuda() for a in args), head_dim**-0.5, programs=5, block_m=128, block_n=32
    )
    assert torch.equal(kept, got)


def moe_inputs(tokens: int, experts: int, hidden: int, inter: int, dtype: torch.dtype):
    x = torch.randn(tokens, hidden, device="cuda").to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda") * inter**-0.5).to(dtype)
    probs = torch.randn(tokens, experts, device="cuda").softmax(-1)
    weights, ids = probs.topk(8, dim=-1)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).to(dtype), ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 15, 64, 300])
def test_fused_moe(dtype: torch.dtype, tokens: int) -> None:
    args = moe_inputs(tokens, 64, 256, 128, dtype)
    want = fused_moe_reference(*(a.double() if a.is_floating_point() else a for a in args))
    got = fused_moe(*args)
    assert got.dtype == dtype and rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("tokens", [4, 300, 4096])  # 4,096: the prefill tiles
def test_fused_moe_real_shape_both_kernels(tokens: int) -> None:
    from pdserve.ops.cuda_moe import fused_moe_grouped_mm, fused_moe_triton

    args = moe_inputs(tokens, 256, 2048, 512, torch.bfloat16)
    want = fused_moe_reference(*(a.float() if a.is_floating_point() else a for a in args))
    assert rel_err(fused_moe_triton(*args), want) < 1e-2
    assert rel_err(fused_moe_grouped_mm(*args), want) < 1e-2


def test_decode_ops_capture_in_a_cuda_graph() -> None:
    """Sync-free: the decode-path ops capture in one CUDA graph, and replays equal eager calls."""
    batch, dtype = 8, torch.bfloat16
    ids = slots(batch).cuda()
    gdn = cuda(gdn_inputs(batch, HK, dtype))
    state = torch.randn(SLOTS, HV, DK, DV, device="cuda") * 0.3
    conv_x = torch.randn(batch, CONV_DIM, device="cuda", dtype=dtype)
    conv_w = torch.randn(CONV_DIM, CONV_W, device="cuda", dtype=dtype)
    conv_pool = torch.randn(SLOTS, CONV_DIM, CONV_W - 1, device="cuda", dtype=dtype)
    context = [100 + 17 * i for i in range(batch)]
    kv, tables = kv_setup(context, dtype)
    tables, seq_lens = tables.cuda(), torch.tensor(context, dtype=torch.int32, device="cuda")
    q, cu_q = torch.randn(batch, H, D, device="cuda", dtype=dtype), cu([1] * batch).cuda()
    moe = moe_inputs(batch, 256, 2048, 512, dtype)

    def step() -> list[torch.Tensor]:
        return [
            ops.gdn_recurrent_step(**gdn, recurrent_pool=state, slot_ids=ids),
            ops.causal_conv1d_step(conv_x, conv_w, conv_pool, ids),
            ops.paged_attention(q, kv, cu_q, seq_lens, tables, D**-0.5),
            fused_moe(*moe),
        ]

    state0, conv0 = state.clone(), conv_pool.clone()
    eager = step()  # also compiles every kernel before capture
    state.copy_(state0), conv_pool.copy_(conv0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    state.copy_(state0), conv_pool.copy_(conv0)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert rel_err(got, want) < 1e-6
