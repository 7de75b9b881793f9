"""The causal conv1d ops, `store_kv` and `paged_attention` against transformers' torch implementations,
on odd packed lengths, chained calls, shuffled state slots and pages, and grouped KV heads."""

from __future__ import annotations

import inspect
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from pdserve import ops
from tests.ops_helpers import CHANNELS, POOL_SLOTS, TOL, WIDTH, cu_seqlens, other_slots, some_slots

# unwrap: the module names may be rebound to causal-conv1d kernels when those are installed
hf_conv_fn = inspect.unwrap(hf.causal_conv1d_fn)
hf_conv_update = inspect.unwrap(hf.causal_conv1d_update)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ---------------------------------------------------------------- causal conv1d
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
