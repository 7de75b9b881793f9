"""Warm-up runs one pass of every prefill size class (one prompt, one a token shorter, packed short
prompts, and with the prefix cache chat prompts ending in the generation prompt, one and packed,
then their follow-up turns) and leaves the engine as it found it: no request, no page or slot
held, no prefix-cache entry, no hit counted.

One engine serves the module. Its budget of 64 tokens runs every kind of pass (sizes 16 to 64,
17 passes; a budget of 128 only adds 7 bigger ones), and the passes of a 128-token budget are
checked as lists. Its 16-token prefix blocks let those short chat prompts save and restore
checkpoints (64-token blocks, the default, admit no entry under 64 tokens)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.resume_points import resume_suffix
from pdserve.engine.warmup import PACKED_CHATS, warm_up, warm_up_passes
from tests.helpers import assert_no_leaks


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_model_len=512,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        prefix_block_size=16,
    )
    return LLMEngine(config)


def with_budget(engine: LLMEngine, tokens: int) -> LLMEngine:
    """A shallow copy of `engine` whose config has a budget of `tokens` a pass: what
    `warm_up_passes` reads of an engine so configured (its model, limits and cache are the
    same), without loading one."""
    bigger = copy.copy(engine)
    bigger.config = dataclasses.replace(engine.config, max_num_batched_tokens=tokens)
    return bigger


def test_warm_up_passes_cover_every_size(engine: LLMEngine) -> None:
    suffix = resume_suffix(engine.tokenizer)
    assert suffix  # the Qwen3.6 template drops the reasoning opener of an earlier answer
    bigger = with_budget(engine, 128)
    plain = warm_up_passes(bigger)
    assert [sum(map(len, p)) for p in plain] == [16, 15, 32, 31, 64, 63, 64, 128, 127, 128]
    assert [len(p) for p in plain[6]] == [32, 32]
    passes = warm_up_passes(bigger, suffix)
    chats = [p for p in passes if all(tuple(q[-len(suffix) :]) == suffix for q in p)]
    assert [sum(map(len, p)) for p in passes if p not in chats] == [sum(map(len, p)) for p in plain]
    assert chats and all(tuple(q[-len(suffix) :]) == suffix for p in chats for q in p)
    assert any(len(p) == 4 for p in chats)  # packed chat prompts: checkpoints inside one pass
    follow_ups = [(a, b) for a, b in zip(chats, chats[1:], strict=False) if all(
        len(y) > len(x) and y[: len(x)] == x for x, y in zip(a, b, strict=True))]  # fmt: skip
    assert len(follow_ups) == len(chats) // 2
    # no prompt starts as another does but a follow-up as its turn: nothing else hits the cache
    starts = [tuple(q[:4]) for p in passes for q in p]  # a cache key chains from the first block
    assert len(set(starts)) == len(starts) - sum(len(b) for _, b in follow_ups)

    run = warm_up_passes(engine, suffix)  # what the test below runs: the sizes up to 64
    assert run == passes[: len(run)] and sum(map(len, passes[len(run)])) == 128
    assert {len(p) for p in run} == {1, 2, PACKED_CHATS}  # alone, packed short ones, packed chats


def test_warm_up_meets_every_moe_tile_and_alignment_class(engine: LLMEngine) -> None:
    """The MoE kernels' constexprs change with a pass's size (`_block_config`'s tiles; one
    alignment program, or chunks of `align_chunk` pairs): at the served shape (256 experts, 8 + the
    shared one a token) and the default budget, warm-up's own passes (all but follow-ups, which
    prefill only their new turn) meet every class a pass of 1 to 8,704 tokens can be in (8,192
    and a short prompt's tail past it, `Scheduler._takes_tail`)."""
    from pdserve.bench import QWEN36_35B_A3B
    from pdserve.engine.scheduler import TAIL_SHARE
    from pdserve.ops.cuda_moe import _block_config
    from pdserve.ops.cuda_route import MAX_ALIGN_PAIRS, align_chunk

    experts, per_token = QWEN36_35B_A3B["num_experts"], QWEN36_35B_A3B["num_experts_per_tok"] + 1

    def kernels_for(tokens: int) -> tuple:
        pairs = tokens * per_token
        return tuple(_block_config(pairs, experts).items()), pairs > MAX_ALIGN_PAIRS and align_chunk(pairs)

    budget = 8192
    served = copy.copy(engine)
    served.config = copy.copy(engine.config)  # the served limits, past what the tiny model allows
    served.config.max_num_batched_tokens, served.config.max_model_len = budget, 32768
    passes = warm_up_passes(served, resume_suffix(engine.tokenizer))
    follow_up = lambda a, b: len(a) == len(b) and all(y[: len(x)] == x for x, y in zip(a, b, strict=True))  # noqa: E731
    fresh = [p for before, p in zip([[]] + passes, passes, strict=False) if not follow_up(before, p)]
    met = {kernels_for(sum(map(len, p))) for p in fresh}
    longest = budget + budget // TAIL_SHARE  # a pass may take a short tail past the budget
    assert {kernels_for(t) for t in range(1, longest + 1)} <= met and len(met) >= 5


def test_warm_up_runs_every_pass_and_leaves_nothing(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes = warm_up_passes(engine, resume_suffix(engine.tokenizer))
    restored, saved = [], []
    cache = engine.prefix_cache
    restore, commit = cache.restore, cache.commit_save
    monkeypatch.setattr(
        cache, "restore", lambda entry, seq: (restored.append(entry.kind), restore(entry, seq))[1]
    )
    monkeypatch.setattr(cache, "commit_save", lambda seq, *a: (saved.append(a[-1]), commit(seq, *a))[1])
    seen: list[str] = []
    warm_up(engine, seen.append)
    assert len(seen) == len(passes)
    assert "resume" in saved  # saved inside a pass, at the generation prompt
    follow_ups = sum(len(b) for a, b in zip(passes, passes[1:], strict=False) if all(
        y[: len(x)] == x for x, y in zip(a, b, strict=True)))  # fmt: skip
    assert restored and set(restored) == {"resume"} and len(restored) <= follow_ups  # only theirs
    assert not cache.entries and cache.stats.report() == type(cache.stats)().report()
    assert_no_leaks(engine)  # (clears the cache first: its entries are checked above)
    assert cache.resume_suffixes == []  # set by the serving roles, not by warm-up


def test_grammars_are_built_before_a_service_takes_requests(tiny_model_dir) -> None:
    """Every service builds structured outputs' vocabulary at start, on CPU too: built by the
    first structured request on the engine thread it stalled the event loop past the heartbeat's
    expiry (the router then dropped the instance and answered 503)."""
    from pdserve.config import EngineConfig
    from pdserve.sampling import grammar
    from pdserve.serving import EngineHost, ServiceConfig

    engine = EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256)
    host = EngineHost(ServiceConfig(engine=engine, instance_id="grammars"), nixl=False)
    try:
        assert id(host.engine.tokenizer) in grammar._by_tokenizer
    finally:
        host.agent.close()


def test_long_attention_is_warmed_up_to_the_budget_and_its_tail(engine: LLMEngine, monkeypatch) -> None:
    """`warm_up_long_attention` builds the long-chunk attention's plans for chunks up to the
    budget and a short tail past it (a long prompt's last chunk may take its tail whole), on the
    default stream and, on a GPU, on the background lane's (on a CPU there is none: one call)."""
    from pdserve.engine import warmup
    from pdserve.engine.scheduler import TAIL_SHARE

    calls = []
    monkeypatch.setattr(warmup.long_attention, "warm_up", lambda kv, heads, chunk: calls.append(chunk))
    long_one = with_budget(engine, 8192)
    long_one.config = dataclasses.replace(long_one.config, long_attention_from=256, max_model_len=512)
    warmup.warm_up_long_attention(long_one)
    assert calls == [8192 + 8192 // TAIL_SHARE]
    calls.clear()
    long_one.config = dataclasses.replace(long_one.config, long_attention_from=0)  # off: nothing to warm
    warmup.warm_up_long_attention(long_one)
    assert calls == []
