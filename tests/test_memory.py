"""The memory pools: layout, allocation order, exhaustion, zeroed slots, double frees."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.memory import GdnStatePool, HostTier, KvPagePool, host_tier

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


def host_tier_of(device: str) -> tuple[HostTier, KvPagePool, GdnStatePool]:
    kv = KvPagePool(CFG, num_pages=6, page_size=4, dtype=torch.float32, device=device)
    states = GdnStatePool(
        CFG, num_slots=3, conv_dtype=torch.float32, recurrent_dtype=torch.float32, device=device
    )
    return HostTier(kv, states, budget_bytes=1 << 20, typical_tokens=8), kv, states


def fill_random(kv: KvPagePool, states: GdnStatePool) -> None:
    for pool in (kv.kv, states.conv, states.recurrent):
        pool.copy_(torch.randn(pool.shape, device=pool.device))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
@pytest.mark.parametrize("staging_pages", [None, 1, 2])
def test_host_tier_round_trip(device: str, staging_pages: int | None) -> None:
    """An entry stored on the host tier comes back bit for bit into other pages and slot, its
    host pages in several runs (a freed entry's and fresh ones), whether it moves through device
    staging whole or a page or two at a time (pieces that cut its runs); each host unit is one
    contiguous block (what lets a GPU copy run without the host waiting)."""
    tier, kv, states = host_tier_of(device)
    tier.staging_pages = staging_pages or tier.staging_pages
    fill_random(kv, states)
    first, spacer = tier.store([0, 2], 0), tier.store([3], 0)
    tier.free(*first)
    pages, slot = [4, 1, 5], 2
    want = (kv.kv[:, :, pages].clone(), states.conv[:, slot].clone(), states.recurrent[:, slot].clone())
    host_pages, host_ck = tier.store(pages, slot)
    assert sorted(host_pages) != list(range(min(host_pages), min(host_pages) + 3)), "one run only"
    assert all(tier.kv[h].is_contiguous() for h in host_pages) and tier.recurrent[host_ck].is_contiguous()
    fill_random(kv, states)  # the device copies are overwritten
    tier.load(host_pages, host_ck, [0, 3, 2], 1)
    got = (kv.kv[:, :, [0, 3, 2]], states.conv[:, 1], states.recurrent[:, 1])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    tier.free(host_pages, host_ck)
    tier.free(*spacer)
    assert (tier.num_free_pages, tier.num_free_checkpoints) == (tier.num_pages, tier.num_checkpoints)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tier_stages_a_long_entry_a_piece_at_a_time() -> None:
    """Storing (and loading) an entry of 192 pages asks the device for at most two pieces of
    staging at once, not two copies of the whole entry (a long prompt's entry on a device filled
    to its KV pool: a failed cudaMalloc there frees the cache and waits for the device)."""
    kv = KvPagePool(CFG, num_pages=256, page_size=16, dtype=torch.float32, device="cuda")
    states = GdnStatePool(
        CFG, num_slots=2, conv_dtype=torch.float32, recurrent_dtype=torch.float32, device="cuda"
    )
    budget = 2 * HostTier.entry_bytes(kv, states, typical_tokens=192 * 16)
    tier = HostTier(kv, states, budget_bytes=budget, typical_tokens=192 * 16)
    tier.staging_pages = 16
    assert tier.fits(192)
    fill_random(kv, states)
    pages = list(range(10, 202))
    want = kv.kv[:, :, pages].clone()
    page_bytes = kv.kv[:, :, 0].nbytes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    stored = tier.store(pages, 0)
    kv.kv.zero_()
    tier.load(*stored, pages, 1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # the whole entry at once took 2 x 192 pages; a piece at a time, at most three pieces live
    assert peak <= 3 * tier.staging_pages * page_bytes + (64 << 10), (peak, page_bytes)
    assert torch.equal(kv.kv[:, :, pages], want)


def test_host_tier_keeps_an_entrys_pages_in_one_run() -> None:
    """Host pages come back lowest first: a store after entries were freed takes one run (one
    copy), where a last-in-first-out list handed it their pages in reverse, one copy a page (the
    H200's conversations spent 4% of the engine thread in those copies)."""
    tier, kv, states = host_tier_of("cpu")
    first, second = tier.store([0, 1, 2], 0), tier.store([3, 4], 1)
    tier.free(*first)
    tier.free(*second)
    host_pages, _ = tier.store([5, 4, 3, 2], 2)
    assert host_pages == list(range(min(host_pages), min(host_pages) + 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tier_store_does_not_wait_for_the_stream() -> None:
    """Behind 200 ms of queued GPU work, a store returns at once (it queues its copies): a
    layer-major host pool made torch copy through pageable memory, synchronously."""
    tier, kv, states = host_tier_of("cuda")
    fill_random(kv, states)
    want = states.recurrent[:, 0].cpu()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(200e-3 * 1.5e9))  # ~200 ms of spinning at ~1.5 GHz
    start = time.perf_counter()
    host_pages, host_ck = tier.store([0, 1], 0)
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    waited = time.perf_counter() - start
    assert queued < 0.05 < waited, (queued, waited)
    assert torch.equal(tier.recurrent[host_ck], want)
    tier.free(host_pages, host_ck)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tier_store_goes_out_beside_the_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store's copies to the host run on the tier's copy stream: with 200 ms of work queued
    there ahead of them, the current stream's next work (a pass overwriting the stored pages and
    slot at once) is not held behind them, the host still gets what the device held at the store,
    and a load of the entry waits for it."""
    monkeypatch.setattr(host_tier, "MAX_ASIDE_BYTES", host_tier.ASIDE_BYTES_ON_GPU)
    tier, kv, states = host_tier_of("cuda")
    fill_random(kv, states)
    want = (kv.kv[:, :, [0, 1]].clone(), states.conv[:, 0].clone(), states.recurrent[:, 0].clone())
    torch.cuda.synchronize()
    with torch.cuda.stream(tier._copy_stream):
        torch.cuda._sleep(int(200e-3 * 1.5e9))  # ~200 ms of spinning at ~1.5 GHz
    start = time.perf_counter()
    stored = tier.store([0, 1], 0)
    fill_random(kv, states)
    torch.cuda.current_stream().synchronize()
    current = time.perf_counter() - start
    tier.load(*stored, [2, 3], 1)
    got = (kv.kv[:, :, [2, 3]], states.conv[:, 1], states.recurrent[:, 1])
    torch.cuda.current_stream().synchronize()
    assert current < 0.1 < time.perf_counter() - start, current
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
