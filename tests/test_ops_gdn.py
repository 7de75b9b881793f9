"""The GDN ops (`gdn_chunk_prefill`, `gdn_recurrent_step`) against transformers' torch gated delta rule,
on odd packed lengths and shuffled state slots: outputs, and the states written back to the pool."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from pdserve import ops
from tests.ops_helpers import DK, DV, HK, POOL_SLOTS, TOL, cu_seqlens, gdn_inputs, other_slots, some_slots

# unwrap: the module names may be rebound to fla kernels when those are installed
hf_chunk_rule = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
hf_recurrent_rule = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)

LENGTHS = [1, 3, 15, 63, 64, 65, 200]
HF_GDN_FLAGS = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


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
