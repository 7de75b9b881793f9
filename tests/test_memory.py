"""The memory pools: layout, allocation order, exhaustion, zeroed slots, double frees."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.memory import GdnStatePool, KvPagePool

CFG = ModelConfig(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    layer_types=("linear_attention",) * 3 + ("full_attention",),
)


def test_kv_pool_layout_and_lowest_first_runs() -> None:
    pool = KvPagePool(CFG, num_pages=10, page_size=4, dtype=torch.float32, device="cpu")
    assert pool.kv.shape == (1, 2, 10, 4, 2, 8)
    assert pool.kv.nbytes == 10 * KvPagePool.bytes_per_page(CFG, 4, torch.float32)
    a, b = pool.allocate(3), pool.allocate(2)
    assert a == [0, 1, 2] and b == [3, 4]
    pool.free(a)
    assert pool.allocate(4) == [0, 1, 2, 5], "freed pages come back lowest first"
    with pytest.raises(MemoryError):
        pool.allocate(5)
    assert pool.pages_for(0) == 0 and pool.pages_for(4) == 1 and pool.pages_for(5) == 2


def test_kv_pool_double_free_is_caught() -> None:
    pool = KvPagePool(CFG, num_pages=2, page_size=4, dtype=torch.float32, device="cpu")
    pages = pool.allocate(1)
    pool.free(pages)
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(pages + pages)


def test_state_pool_slots_are_zeroed_when_allocated() -> None:
    pool = GdnStatePool(
        CFG, num_slots=2, conv_dtype=torch.float32, recurrent_dtype=torch.float32, device="cpu"
    )
    assert pool.conv.shape == (3, 2, 2 * 16 + 32, 3) and pool.recurrent.shape == (3, 2, 4, 8, 8)
    slot = pool.allocate()
    pool.conv[:, slot] = 1.0
    pool.recurrent[:, slot] = 2.0
    pool.free(slot)
    again = pool.allocate()
    assert again == slot
    assert pool.conv[:, again].abs().sum() == 0 and pool.recurrent[:, again].abs().sum() == 0
    pool.allocate()
    with pytest.raises(MemoryError):
        pool.allocate()
