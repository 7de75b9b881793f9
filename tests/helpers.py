"""Helpers shared by the engine tests."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch

from pdserve.engine.llm_engine import LLMEngine


def random_prompts(lengths: tuple[int, ...] | list[int], seed: int, vocab: int = 240_000) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_no_leaks(engine: LLMEngine) -> None:
    """Every KV page and GDN state slot is back in its free pool, and no request is left, once
    the prefix cache (on by default) is cleared: what it held is all it held."""
    runner = engine.runner
    s = engine.scheduler
    assert not s.running and not s.waiting and not s.held and not s.receiving and not s.decoding
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
        assert not engine.prefix_cache.entries, "a cache entry is still pinned"
    reserved = runner.reserved  # held by the CUDA graphs' padding rows
    assert runner.kv_pool.num_free == runner.kv_pool.num_pages - reserved, "KV pages leaked"
    assert runner.state_pool.num_free == runner.state_pool.num_slots - reserved, "GDN state slots leaked"


@contextlib.contextmanager
def transformers_torch_gdn() -> Iterator[None]:
    """transformers' Qwen3.5-MoE runs its own torch GDN ops inside, never fla's kernels: some
    transformers versions send CPU tensors to fla's Triton kernels when fla is installed (as on
    the GPU machine), and the reference must be the exact fp32 torch path."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    saved = {name: getattr(modeling, name) for name in names if hasattr(modeling, name)}
    for name, fn in saved.items():
        setattr(modeling, name, inspect.unwrap(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(modeling, name, fn)
