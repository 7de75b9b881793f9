"""Warm-up runs one pass of every prefill size class (one prompt, one a token shorter, packed short
prompts, and with the prefix cache chat prompts ending in the generation prompt, one and packed,
then their follow-up turns) and leaves the engine as it found it: no request, no page or slot
held, no prefix-cache entry, no hit counted."""

from __future__ import annotations

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.resume_points import resume_suffix
from pdserve.engine.warmup import warm_up, warm_up_passes
from tests.helpers import assert_no_leaks


def test_warm_up_covers_every_size_and_leaves_nothing(tiny_model_dir) -> None:
    config = EngineConfig(
        model=str(tiny_model_dir), max_model_len=512, max_num_batched_tokens=128, enable_prefix_caching=True
    )
    engine = LLMEngine(config)
    suffix = resume_suffix(engine.tokenizer)
    assert suffix  # the Qwen3.6 template drops the reasoning opener of an earlier answer
    plain = warm_up_passes(engine)
    assert [sum(map(len, p)) for p in plain] == [16, 15, 32, 31, 64, 63, 64, 128, 127, 128]
    assert [len(p) for p in plain[6]] == [32, 32]
    passes = warm_up_passes(engine, suffix)
    chats = [p for p in passes if p not in plain]
    assert chats and all(tuple(q[-len(suffix) :]) == suffix for p in chats for q in p)
    assert any(len(p) == 4 for p in chats)  # packed chat prompts: checkpoints inside one pass
    follow_ups = [(a, b) for a, b in zip(chats, chats[1:], strict=False) if all(
        len(y) > len(x) and y[: len(x)] == x for x, y in zip(a, b, strict=True))]  # fmt: skip
    assert len(follow_ups) == len(chats) // 2

    restored, saved = [], []
    cache = engine.prefix_cache
    restore, commit = cache.restore, cache.commit_save
    cache.restore = lambda entry, seq: (restored.append(entry.kind), restore(entry, seq))[1]
    cache.commit_save = lambda seq, *a: (saved.append(a[-1]), commit(seq, *a))[1]
    seen: list[str] = []
    warm_up(engine, seen.append)
    assert len(seen) == len(passes) + 1 and "grammar tokenizer ready" in seen[-1]  # then xgrammar
    assert "resume" in saved  # saved inside a pass, at the generation prompt
    assert restored  # follow-up turns started from a checkpoint
    assert_no_leaks(engine)
    assert not cache.entries and cache.stats.report() == type(cache.stats)().report()
    assert cache.resume_suffixes == []  # set by the serving roles, not by warm-up
