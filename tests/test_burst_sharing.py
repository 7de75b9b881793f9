"""A burst of prompts sharing a long prefix computes it once (`pdserve.engine.burst_sharing`): the
first prompt's pass leaves a checkpoint where they part, the others wait that one pass and restore
it; their outputs equal those without the cache. A short shared prefix is not worth the wait."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine import burst_sharing
from pdserve.engine.engine_thread import EngineThread
from tests.helpers import assert_no_leaks
from tests.test_prefix_cache import GREEDY, shared_prefix_prompts


def passes_of(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, list]:
    """(outputs, [prompt tokens each pass computed]) of one `generate` of the whole burst."""
    runner, seen = llm.engine.runner, []
    execute = runner.execute

    def counted(scheduled, patch=None):
        seen.append(sum(s.num_new_tokens for s in scheduled if s.num_new_tokens > 1))
        return execute(scheduled, patch)

    runner.execute = counted
    try:
        outs = llm.generate(prompts, params)
    finally:
        del runner.execute
    return outs, [n for n in seen if n]


def test_a_burst_sharing_a_long_prefix_computes_it_once(cached_llm: LLM, plain_llm: LLM) -> None:
    shared = 5 * cached_llm.engine.prefix_cache.block_size  # 320 tokens
    assert shared >= burst_sharing.MIN_SHARED_TOKENS
    prompts = shared_prefix_prompts(shared, (20, 25, 30, 35), seed=61)
    outs, prefilled = passes_of(cached_llm, prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, shared, shared, shared]
    assert prefilled == [shared + 20, 25 + 30 + 35]  # the prefix once, then the three tails
    entries = cached_llm.engine.prefix_cache.entries.values()
    assert any(e.kind == "branch" and e.num_tokens == shared for e in entries)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_llm.generate(prompts, GREEDY)]


def test_a_short_shared_prefix_does_not_wait(cached_llm: LLM) -> None:
    prompts = shared_prefix_prompts(128, (20, 25, 30), seed=62)  # below MIN_SHARED_TOKENS
    outs, prefilled = passes_of(cached_llm, prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert prefilled == [3 * 128 + 20 + 25 + 30]  # one pass, as without the cache


def test_a_pass_that_fails_gives_back_the_checkpoints_it_reserved(
    cached_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sibling's branch checkpoint, reserved for a pass that then fails, is freed with the
    requests the failure ends (it had leaked a state slot for good)."""
    engine = cached_llm.engine
    shared = 5 * engine.prefix_cache.block_size
    for prompt in shared_prefix_prompts(shared, (20, 25), seed=63):
        engine.add_request(prompt, GREEDY)

    def failing(scheduled, patch=None):
        assert any(s.saves for s in scheduled)  # the branch checkpoint was reserved in it
        raise RuntimeError("an injected failure")

    monkeypatch.setattr(engine.runner, "execute", failing)
    EngineThread(engine, on_outputs=lambda outputs: None, on_error=lambda ids, why: None)._safe_step()
    assert not engine.has_unfinished()
    assert_no_leaks(engine)
