"""pdserve.ops against transformers' torch implementations and plain torch, on odd packed lengths."""

from __future__ import annotations

import inspect
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from pdserve import ops

# unwrap: the module names may be rebound to fla / causal-conv1d kernels when those are installed
hf_chunk_rule = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
hf_recurrent_rule = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)
hf_conv_fn = inspect.unwrap(hf.causal_conv1d_fn)
hf_conv_update = inspect.unwrap(hf.causal_conv1d_update)

LENGTHS = [1, 3, 15, 63, 64, 65, 200]
DK, DV, HK, POOL_SLOTS = 16, 8, 2, 12
TOL = dict(atol=2e-5, rtol=1e-5)
HF_GDN_FLAGS = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def some_slots(n: int) -> torch.Tensor:
    """n distinct slots out of POOL_SLOTS, shuffled, so never 0..n-1."""
    return torch.randperm(POOL_SLOTS)[:n].flip(0).contiguous()


def other_slots(slots: torch.Tensor) -> torch.Tensor:
    return torch.ones(POOL_SLOTS, dtype=torch.bool).index_fill(0, slots, False)


def gdn_inputs(num_tokens: int, hv: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return dict(
        q=torch.randn(num_tokens, HK, DK, dtype=dtype),
        k=torch.randn(num_tokens, HK, DK, dtype=dtype),
        v=torch.randn(num_tokens, hv, DV, dtype=dtype),
        g=-F.softplus(torch.randn(num_tokens, hv)) * torch.rand(hv) * 2,
        beta=torch.rand(num_tokens, hv).to(dtype),
    )


def hf_gdn(x: dict[str, torch.Tensor], state: torch.Tensor, chunked: bool = True):
    """transformers on one sequence ([L, ...] inputs, state [Hv, Dk, Dv]) -> (o [L, Hv, Dv], state)."""
    rule = hf_chunk_rule if chunked else hf_recurrent_rule
    q, k, v, g, beta = (x[name][None] for name in ("q", "k", "v", "g", "beta"))
    o, final = rule(q, k, v, g, beta, initial_state=state[None].clone(), **HF_GDN_FLAGS)
    return o[0], final[0]


@pytest.mark.parametrize("group", [1, 2, 4])
def test_gdn_prefill_packed_matches_transformers_per_sequence(group: int) -> None:
    hv = HK * group
    x = gdn_inputs(sum(LENGTHS), hv)
    pool = torch.randn(POOL_SLOTS, hv, DK, DV) * 0.5
    before = pool.clone()
    slots = some_slots(len(LENGTHS))
    o = ops.gdn_chunk_prefill(**x, cu_seqlens=cu_seqlens(LENGTHS), recurrent_pool=pool, slot_ids=slots)
    assert o.shape == (sum(LENGTHS), hv, DV) and o.dtype == torch.float32
    bounds = cu_seqlens(LENGTHS).tolist()
    for n, slot in enumerate(slots.tolist()):
        seq = {name: t[bounds[n] : bounds[n + 1]] for name, t in x.items()}
        for chunked in (True, False):
            want_o, want_state = hf_gdn(seq, before[slot], chunked)
            torch.testing.assert_close(o[bounds[n] : bounds[n + 1]], want_o, **TOL)
            torch.testing.assert_close(pool[slot], want_state, **TOL)
    assert torch.equal(pool[other_slots(slots)], before[other_slots(slots)])


@pytest.mark.parametrize("split", [1, 63, 64, 137, 199])
def test_gdn_prefill_split_in_two_calls_equals_one_call(split: int) -> None:
    x = gdn_inputs(200, hv=4)
    pool = torch.zeros(POOL_SLOTS, 4, DK, DV)
    pool[[3, 7]] = torch.randn(4, DK, DV)
    whole = ops.gdn_chunk_prefill(
        **x, cu_seqlens=cu_seqlens([200]), recurrent_pool=pool, slot_ids=torch.tensor([3])
    )
    parts = [
        ops.gdn_chunk_prefill(
            **{name: t[s] for name, t in x.items()},
            cu_seqlens=cu_seqlens([s.stop - s.start]),
            recurrent_pool=pool,
            slot_ids=torch.tensor([7]),
        )
        for s in (slice(0, split), slice(split, 200))
    ]
    torch.testing.assert_close(torch.cat(parts), whole, **TOL)
    torch.testing.assert_close(pool[7], pool[3], **TOL)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 256])
def test_gdn_prefill_chunk_size_does_not_change_the_result(chunk_size: int) -> None:
    x = gdn_inputs(sum(LENGTHS), hv=4)
    pool_64 = torch.randn(POOL_SLOTS, 4, DK, DV)
    pool = pool_64.clone()
    slots, cu = some_slots(len(LENGTHS)), cu_seqlens(LENGTHS)
    want = ops.gdn_chunk_prefill(**x, cu_seqlens=cu, recurrent_pool=pool_64, slot_ids=slots)
    got = ops.gdn_chunk_prefill(
        **x, cu_seqlens=cu, recurrent_pool=pool, slot_ids=slots, chunk_size=chunk_size
    )
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(pool, pool_64, **TOL)


def test_gdn_recurrent_step_matches_transformers_batched() -> None:
    batch, hv = 5, 4
    x = gdn_inputs(batch, hv)
    pool = torch.randn(POOL_SLOTS, hv, DK, DV)
    before, slots = pool.clone(), some_slots(batch)
    o = ops.gdn_recurrent_step(**x, recurrent_pool=pool, slot_ids=slots)
    q, k, v, g, beta = (x[name][:, None] for name in ("q", "k", "v", "g", "beta"))  # one token each
    want_o, want_state = hf_recurrent_rule(q, k, v, g, beta, initial_state=before[slots], **HF_GDN_FLAGS)
    torch.testing.assert_close(o, want_o[:, 0], **TOL)
    torch.testing.assert_close(pool[slots], want_state, **TOL)
    assert torch.equal(pool[other_slots(slots)], before[other_slots(slots)])


def test_gdn_decode_step_continues_prefill() -> None:
    """Prefill L tokens then one step == prefill L + 1 tokens (the prefill -> decode handover)."""
    lengths, hv = [3, 15, 64], 4
    x = gdn_inputs(sum(lengths) + len(lengths), hv)
    longer = cu_seqlens([n + 1 for n in lengths])
    last = longer[1:].long() - 1
    prompt = torch.ones(x["v"].shape[0], dtype=torch.bool).index_fill(0, last, False)
    pool = torch.zeros(POOL_SLOTS, hv, DK, DV)
    ops.gdn_chunk_prefill(
        **{name: t[prompt] for name, t in x.items()},
        cu_seqlens=cu_seqlens(lengths),
        recurrent_pool=pool,
        slot_ids=torch.tensor([0, 1, 2]),
    )
    stepped = ops.gdn_recurrent_step(
        **{name: t[last] for name, t in x.items()}, recurrent_pool=pool, slot_ids=torch.tensor([0, 1, 2])
    )
    whole = ops.gdn_chunk_prefill(
        **x, cu_seqlens=longer, recurrent_pool=pool, slot_ids=torch.tensor([5, 6, 7])
    )
    torch.testing.assert_close(stepped, whole[last], **TOL)
    torch.testing.assert_close(pool[[0, 1, 2]], pool[[5, 6, 7]], **TOL)


def test_gdn_bf16_inputs_keep_a_float32_state() -> None:
    x = gdn_inputs(70, hv=4, dtype=torch.bfloat16)
    pool16, pool32 = torch.zeros(2, 4, DK, DV), torch.zeros(2, 4, DK, DV)
    slot = torch.tensor([1])
    o16 = ops.gdn_chunk_prefill(**x, cu_seqlens=cu_seqlens([70]), recurrent_pool=pool16, slot_ids=slot)
    x32 = {name: t.float() for name, t in x.items()}
    o32 = ops.gdn_chunk_prefill(**x32, cu_seqlens=cu_seqlens([70]), recurrent_pool=pool32, slot_ids=slot)
    assert o16.dtype == torch.bfloat16 and pool16.dtype == torch.float32
    torch.testing.assert_close(o16.float(), o32, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(pool16, pool32)


# ---------------------------------------------------------------- causal conv1d
CHANNELS, WIDTH = 12, 4
CONV_LENGTHS = [1, 2, 3, 15, 64, 65]


def conv_call(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slot: int) -> torch.Tensor:
    """One sequence through causal_conv1d_prefill."""
    return ops.causal_conv1d_prefill(x, weight, cu_seqlens([x.shape[0]]), pool, torch.tensor([slot]))


def test_conv_prefill_packed_fresh_matches_transformers() -> None:
    x, weight = torch.randn(sum(CONV_LENGTHS), CHANNELS), torch.randn(CHANNELS, WIDTH)
    pool = torch.randn(POOL_SLOTS, CHANNELS, WIDTH - 1)
    slots = some_slots(len(CONV_LENGTHS))
    pool[slots] = 0.0
    before = pool.clone()
    out = ops.causal_conv1d_prefill(x, weight, cu_seqlens(CONV_LENGTHS), pool, slots)
    bounds = cu_seqlens(CONV_LENGTHS).tolist()
    for n, slot in enumerate(slots.tolist()):
        seq = x[bounds[n] : bounds[n + 1]]
        want = hf_conv_fn(seq.T[None], weight, activation="silu")[0].T
        torch.testing.assert_close(out[bounds[n] : bounds[n + 1]], want, **TOL)
        last_inputs = torch.cat([torch.zeros(WIDTH - 1, CHANNELS), seq])[-(WIDTH - 1) :].T
        assert torch.equal(pool[slot], last_inputs)
    assert torch.equal(pool[other_slots(slots)], before[other_slots(slots)])


@pytest.mark.parametrize("length", [1, 2, 5])
def test_conv_prefill_with_history_matches_transformers_update(length: int) -> None:
    x, weight = torch.randn(length, CHANNELS), torch.randn(CHANNELS, WIDTH)
    pool = torch.randn(POOL_SLOTS, CHANNELS, WIDTH - 1)
    hf_state = pool[4:5].clone()
    want = hf_conv_update(x.T[None], hf_state, weight, activation="silu")[0].T
    torch.testing.assert_close(conv_call(x, weight, pool, slot=4), want, **TOL)
    assert torch.equal(pool[4], hf_state[0])


@pytest.mark.parametrize("cuts", [[1], [2], [1, 2, 3], [5, 6, 7], [64]])
def test_conv_prefill_chained_equals_one_call(cuts: list[int]) -> None:
    x, weight = torch.randn(70, CHANNELS), torch.randn(CHANNELS, WIDTH)
    pool = torch.zeros(POOL_SLOTS, CHANNELS, WIDTH - 1)
    whole = conv_call(x, weight, pool, slot=2)
    edges = [0, *cuts, 70]
    chained = [conv_call(x[a:b], weight, pool, slot=9) for a, b in pairwise(edges)]
    torch.testing.assert_close(torch.cat(chained), whole, **TOL)
    assert torch.equal(pool[9], pool[2])


def test_conv_step_matches_transformers_update_and_continues_prefill() -> None:
    batch = 4
    x, weight = torch.randn(batch, 6, CHANNELS), torch.randn(CHANNELS, WIDTH)
    pool = torch.zeros(POOL_SLOTS, CHANNELS, WIDTH - 1)
    slots = some_slots(batch)
    for b, slot in enumerate(slots.tolist()):
        conv_call(x[b, :5], weight, pool, slot)
    hf_state = pool[slots].clone()
    out = ops.causal_conv1d_step(x[:, 5], weight, pool, slots)
    want = hf_conv_update(x[:, 5, :, None], hf_state, weight, activation="silu")[:, :, 0]
    torch.testing.assert_close(out, want, **TOL)
    assert torch.equal(pool[slots], hf_state)
    whole = torch.stack(
        [conv_call(x[b], weight, torch.zeros(1, CHANNELS, WIDTH - 1), 0)[-1] for b in range(batch)]
    )
    torch.testing.assert_close(out, whole, **TOL)


# ---------------------------------------------------------------- paged KV + attention
PAGES, PAGE_SIZE, HEAD_DIM = 24, 4, 8


def test_store_kv_writes_exactly_the_mapped_slots() -> None:
    kv_layer = torch.randn(2, PAGES, PAGE_SIZE, 2, HEAD_DIM)
    before = kv_layer.clone()
    slots = torch.randperm(PAGES * PAGE_SIZE)[:13]
    k, v = torch.randn(13, 2, HEAD_DIM), torch.randn(13, 2, HEAD_DIM)
    ops.store_kv(k, v, kv_layer, slots)
    pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    assert torch.equal(kv_layer[0, pages, offsets], k) and torch.equal(kv_layer[1, pages, offsets], v)
    written = torch.zeros(PAGES * PAGE_SIZE, dtype=torch.bool).index_fill(0, slots, True)
    unwritten = ~written.view(PAGES, PAGE_SIZE)
    assert torch.equal(kv_layer[:, unwritten], before[:, unwritten])


def eager_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """transformers' eager attention (repeat_kv): q [Q, H, D] are the last Q positions of k, v [L, Hkv, D]."""
    num_q, context = q.shape[0], k.shape[0]
    allowed = torch.arange(context)[None, :] <= torch.arange(context - num_q, context)[:, None]
    mask = torch.zeros(num_q, context).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    heads_first = [t.transpose(0, 1)[None] for t in (q, k, v)]
    out, _ = hf.eager_attention_forward(module, *heads_first, attention_mask=mask, scaling=scale)
    return out[0]


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize(
    "context_lens, query_lens",
    [([5, 33, 16, 1], [5, 7, 1, 1]), ([9, 4, 17, 1, 40], [1, 1, 1, 1, 1])],
    ids=["prefill", "decode"],
)
def test_paged_attention_matches_eager(group: int, context_lens: list[int], query_lens: list[int]) -> None:
    num_kv_heads, scale = 2, HEAD_DIM**-0.5
    kv_layer = torch.full((2, PAGES, PAGE_SIZE, num_kv_heads, HEAD_DIM), float("nan"))  # stale pages
    free_pages = torch.randperm(PAGES).tolist()
    block_tables = torch.zeros(len(context_lens), 12, dtype=torch.int32)
    queries, wants = [], []
    for n, (context, num_q) in enumerate(zip(context_lens, query_lens, strict=True)):
        pages = [free_pages.pop() for _ in range(-(-context // PAGE_SIZE))]
        block_tables[n, : len(pages)] = torch.tensor(pages)
        positions = torch.arange(context)
        slot_mapping = torch.tensor(pages)[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        k, v = torch.randn(2, context, num_kv_heads, HEAD_DIM).unbind(0)
        ops.store_kv(k, v, kv_layer, slot_mapping)
        queries.append(torch.randn(num_q, num_kv_heads * group, HEAD_DIM))
        wants.append(eager_causal(queries[-1], k, v, scale))
    o = ops.paged_attention(
        torch.cat(queries),
        kv_layer,
        cu_seqlens(query_lens),
        torch.tensor(context_lens, dtype=torch.int32),
        block_tables,
        scale,
    )
    torch.testing.assert_close(o, torch.cat(wants), **TOL)


# ---------------------------------------------------------------- shape checks
def prefill_args() -> dict:
    pool, cu = torch.zeros(POOL_SLOTS, 4, DK, DV), cu_seqlens([2, 3])
    return dict(**gdn_inputs(5, hv=4), cu_seqlens=cu, recurrent_pool=pool, slot_ids=some_slots(2))


def step_args() -> dict:
    return dict(
        **gdn_inputs(2, hv=4), recurrent_pool=torch.zeros(POOL_SLOTS, 4, DK, DV), slot_ids=some_slots(2)
    )


def conv_prefill_args() -> dict:
    x, weight, pool = (
        torch.randn(5, CHANNELS),
        torch.randn(CHANNELS, WIDTH),
        torch.zeros(3, CHANNELS, WIDTH - 1),
    )
    return dict(
        x=x, weight=weight, cu_seqlens=cu_seqlens([2, 3]), conv_pool=pool, slot_ids=torch.tensor([2, 0])
    )


def conv_step_args() -> dict:
    x, weight, pool = (
        torch.randn(2, CHANNELS),
        torch.randn(CHANNELS, WIDTH),
        torch.zeros(3, CHANNELS, WIDTH - 1),
    )
    return dict(x=x, weight=weight, conv_pool=pool, slot_ids=torch.tensor([2, 0]))


def kv_args() -> dict:
    k, v, kv_layer = torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), torch.zeros(2, 4, 4, 2, 8)
    return dict(k=k, v=v, kv_layer=kv_layer, slot_mapping=torch.tensor([5, 0, 9]))


def attention_args() -> dict:
    q, kv_layer, block_tables = (
        torch.randn(3, 4, 8),
        torch.zeros(2, 4, 4, 2, 8),
        torch.zeros(2, 3, dtype=torch.int32),
    )
    seq_lens = torch.tensor([2, 5], dtype=torch.int32)
    return dict(
        q=q, kv_layer=kv_layer, cu_seqlens_q=cu_seqlens([2, 1]), seq_lens=seq_lens, block_tables=block_tables
    )


VALID_CALLS = {
    ops.gdn_chunk_prefill: prefill_args,
    ops.gdn_recurrent_step: step_args,
    ops.causal_conv1d_prefill: conv_prefill_args,
    ops.causal_conv1d_step: conv_step_args,
    ops.store_kv: kv_args,
    ops.paged_attention: lambda: {**attention_args(), "scale": 0.3},
}
I32, I64 = torch.int32, torch.int64
BAD_CALLS = {  # name: (op, the arguments that differ from VALID_CALLS[op], error message pattern)
    "prefill k head dim": (ops.gdn_chunk_prefill, {"k": torch.zeros(5, HK, DK + 1)}, "Dk="),
    "prefill v tokens": (ops.gdn_chunk_prefill, {"v": torch.zeros(4, 4, DV)}, "T="),
    "prefill g rank": (ops.gdn_chunk_prefill, {"g": torch.zeros(5, 4, 1)}, r"g must be \[T, Hv\]"),
    "prefill pool Dv": (ops.gdn_chunk_prefill, {"recurrent_pool": torch.zeros(3, 4, DK, 2)}, "Dv="),
    "prefill Hv % Hk": (
        ops.gdn_chunk_prefill,
        {"q": torch.zeros(5, 3, DK), "k": torch.zeros(5, 3, DK)},
        "multiple",
    ),
    "prefill cu dtype": (ops.gdn_chunk_prefill, {"cu_seqlens": torch.tensor([0, 2, 5])}, "int32"),
    "prefill cu length": (ops.gdn_chunk_prefill, {"cu_seqlens": cu_seqlens([5])}, r"N\+1="),
    "prefill cu values": (ops.gdn_chunk_prefill, {"cu_seqlens": cu_seqlens([2, 2])}, "T=5"),
    "prefill slot dtype": (ops.gdn_chunk_prefill, {"slot_ids": torch.tensor([0, 1], dtype=I32)}, "int64"),
    "prefill chunk_size": (ops.gdn_chunk_prefill, {"chunk_size": 0}, "chunk_size"),
    "step batch": (ops.gdn_recurrent_step, {"slot_ids": torch.tensor([0, 1, 2])}, "B="),
    "conv weight channels": (ops.causal_conv1d_prefill, {"weight": torch.zeros(CHANNELS + 1, WIDTH)}, "C="),
    "conv pool width": (ops.causal_conv1d_prefill, {"conv_pool": torch.zeros(3, CHANNELS, WIDTH)}, "W-1="),
    "conv cu dtype": (ops.causal_conv1d_prefill, {"cu_seqlens": torch.tensor([0, 2, 5])}, "int32"),
    "conv step x": (ops.causal_conv1d_step, {"x": torch.zeros(2, CHANNELS + 1)}, "C="),
    "kv layer K/V dim": (ops.store_kv, {"kv_layer": torch.zeros(3, 4, 4, 2, 8)}, "2=3"),
    "kv slot dtype": (ops.store_kv, {"slot_mapping": torch.tensor([5, 0, 9], dtype=I32)}, "int64"),
    "kv layer strided": (
        ops.store_kv,
        {"kv_layer": torch.zeros(2, 4, 4, 8, 2).transpose(-1, -2)},
        "contiguous",
    ),
    "attention H % Hkv": (ops.paged_attention, {"q": torch.zeros(3, 3, 8)}, "multiple"),
    "attention head dim": (ops.paged_attention, {"q": torch.zeros(3, 4, 4)}, "D="),
    "attention tables": (ops.paged_attention, {"block_tables": torch.zeros(3, 3, dtype=I32)}, "N="),
    "attention seq_lens dtype": (ops.paged_attention, {"seq_lens": torch.tensor([2, 5], dtype=I64)}, "int32"),
    "attention queries": (ops.paged_attention, {"seq_lens": torch.tensor([1, 5], dtype=I32)}, "query tokens"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_mismatched_inputs_raise_value_error(case: str) -> None:
    op, changes, message = BAD_CALLS[case]
    with pytest.raises(ValueError, match=message):
        op(**{**VALID_CALLS[op](), **changes})


@pytest.mark.parametrize("op", VALID_CALLS, ids=lambda op: op.__name__)
def test_the_valid_calls_behind_the_bad_ones_run(op) -> None:
    op(**VALID_CALLS[op]())
