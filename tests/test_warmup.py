"""Warm-up runs one pass of every prefill size class (one prompt, one a token shorter, then packed
short prompts) and
leaves the engine as it found it: no request, no page or slot held, no prefix-cache entry."""

from __future__ import annotations

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.warmup import warm_up, warm_up_passes
from tests.helpers import assert_no_leaks


def test_warm_up_covers_every_size_and_leaves_nothing(tiny_model_dir) -> None:
    config = EngineConfig(
        model=str(tiny_model_dir), max_model_len=512, max_num_batched_tokens=128, enable_prefix_caching=True
    )
    engine = LLMEngine(config)
    passes = warm_up_passes(engine)
    assert [sum(p) for p in passes] == [16, 15, 32, 31, 64, 63, 64, 128, 127, 128]
    assert passes[6] == [32, 32]
    seen: list[str] = []
    warm_up(engine, seen.append)
    assert len(seen) == len(passes) + 1 and "grammar tokenizer ready" in seen[-1]  # then xgrammar
    assert_no_leaks(engine)
    assert not engine.prefix_cache.entries
