"""Every op raises a specific ValueError on each kind of mismatched input, and the valid call each bad
one is derived from runs."""

from __future__ import annotations

import pytest
import torch

from pdserve import ops
from tests.ops_helpers import CHANNELS, DK, DV, HK, POOL_SLOTS, WIDTH, cu_seqlens, gdn_inputs, some_slots


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


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
