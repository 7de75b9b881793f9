"""Prefix cache II, engine level: checkpoints at the exact end of a prompt and of a generation,
at a resume point and at a branch point; any kind of hit gives the tokens of no cache (greedy),
alone and packed with other prompts; stats count hits and misses; nothing leaks. Resume
suffixes set for a block come back as they were after it."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.resume_points import resume_suffix
from tests.chat_templates import QWEN_STYLE_TEMPLATE
from tests.helpers import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens_of(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_next_turn_reuses_the_whole_previous_turn(cached_llm: LLM, plain_llm: LLM) -> None:
    """A decode entry (prompt + every generated token but the last) serves the next turn, alone
    and packed with a cold prompt; the tokens equal the uncached engine's."""
    first, message, cold = random_prompts((150, 20, 90), seed=31)
    out = cached_llm.generate(first, GREEDY)[0]
    kinds = {e.kind: e.num_tokens for e in cached_llm.engine.prefix_cache.entries.values()}
    # every generated token but the last, or all of them when the engine ran a step ahead
    # (pdserve.engine.run_ahead: the last token was fed before the host saw it end the request)
    assert kinds["end"] == 150 and kinds["decode"] in (150 + GREEDY.max_tokens - 1, 150 + GREEDY.max_tokens)
    turn2 = first + out.token_ids + message
    expected = tokens_of(plain_llm, [turn2, cold])
    alone = cached_llm.generate(turn2, GREEDY)[0]
    assert alone.num_cached_tokens == kinds["decode"]
    assert alone.token_ids == expected[0]
    packed = cached_llm.generate([turn2, cold], GREEDY)
    assert [o.token_ids for o in packed] == expected
    assert packed[0].num_cached_tokens > 150 and packed[1].num_cached_tokens == 0


def test_prompt_that_drops_the_answer_reuses_the_previous_prompt(cached_llm: LLM, plain_llm: LLM) -> None:
    """The exact-end entry of a prompt (not on a block or page boundary) serves a prompt that
    diverges right after it; two such prompts packed share its partly filled last page, copied
    for each (neither corrupts the other, nor the entry)."""
    first, a, b = random_prompts((137, 25, 31), seed=32)
    cached_llm.generate(first, GREEDY)
    expected = tokens_of(plain_llm, [first + a, first + b])
    packed = cached_llm.generate([first + a, first + b], GREEDY)
    assert [o.token_ids for o in packed] == expected
    assert [o.num_cached_tokens for o in packed] == [137, 137]
    assert cached_llm.generate(first + a, GREEDY)[0].token_ids == expected[0]  # the entry is intact


def test_resume_point_of_a_template_that_drops_reasoning(cached_llm: LLM, plain_llm: LLM) -> None:
    """A generation prompt ending `<think>\\n`, which the next turn does not repeat: the prompt
    also checkpoints where that suffix starts, and the next turn reuses all the rest."""
    tokenizer = cached_llm.tokenizer
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    tokenizer.__dict__.pop("_template", None)
    try:
        suffix = resume_suffix(tokenizer)
    finally:
        tokenizer.chat_template = None
        tokenizer.__dict__.pop("_template", None)
    assert suffix == tuple(tokenizer.encode("<think>\n"))
    cached_llm.engine.prefix_cache.resume_suffixes = [suffix]
    body, answer = random_prompts((120, 30), seed=33)
    first = body + list(suffix)
    cached_llm.generate(first, GREEDY)
    turn2 = body + answer  # the answer without its reasoning: diverges where the suffix began
    out = cached_llm.generate(turn2, GREEDY)[0]
    assert out.num_cached_tokens == len(body)
    assert out.token_ids == plain_llm.generate(turn2, GREEDY)[0].token_ids


def test_resume_suffixes_are_put_back_after_the_block(cached_llm: LLM) -> None:
    """`using_resume_suffixes` (warm-up's, the pack check's): the suffixes given inside the
    block, the serving ones again after it, an exception inside it included."""
    cache = cached_llm.engine.prefix_cache
    serving = [(5, 6)]
    cache.resume_suffixes = serving
    with pytest.raises(RuntimeError, match="inside"), cache.using_resume_suffixes([(7, 8, 9)]):
        assert cache.resume_point([1, 2, 3, 7, 8, 9]) == 3 and cache.resume_point([1, 5, 6]) == 0
        raise RuntimeError("inside")
    assert cache.resume_suffixes is serving
    assert cache.resume_point([1, 2, 3, 7, 8, 9]) == 0 and cache.resume_point([1, 5, 6]) == 1


def test_branch_point_checkpoint_serves_the_third_sibling(cached_llm: LLM, plain_llm: LLM) -> None:
    """Two prompts that share 200 tokens then diverge: the second checkpoints the block boundary
    they share (192; their own last boundaries are at 256), so a third sibling reuses it."""
    shared, x, y, z = random_prompts((200, 100, 120, 60), seed=34)
    cache = cached_llm.engine.prefix_cache
    cached_llm.generate(shared + x, GREEDY)
    second = cached_llm.generate(shared + y, GREEDY)[0]
    assert second.num_cached_tokens == 0
    assert cache.stats.misses["diverged"] == 1, "it shared cached blocks, but no checkpoint"
    assert any(e.kind == "branch" and e.num_tokens == 192 for e in cache.entries.values())
    third = cached_llm.generate(shared + z, GREEDY)[0]
    assert third.num_cached_tokens == 192
    assert third.token_ids == plain_llm.generate(shared + z, GREEDY)[0].token_ids


def test_handed_over_prompt_becomes_an_entry_without_a_copy(cached_llm: LLM) -> None:
    """A prefill instance's request: HELD after its first token; once its lease is released
    (the decode side has read it), its slot and pages become the exact-end entry as they are."""
    engine = cached_llm.engine
    (prompt,) = random_prompts((100,), seed=35)
    seq = engine.make_sequence(prompt, GREEDY, "handed-over")
    seq.handoff = True
    engine.enqueue(seq)
    while not engine.scheduler.held:
        engine.step()
    slot, pages = seq.state_slot, list(seq.block_table)
    lease = engine.scheduler.held["handed-over"]
    assert engine.scheduler.release_lease("handed-over", lease.lease_id)
    (end,) = [e for e in engine.prefix_cache.entries.values() if e.kind == "end"]
    assert (end.num_tokens, end.checkpoint, end.pages) == (100, slot, pages)


def test_stats_count_hits_and_misses_by_reason(cached_llm: LLM) -> None:
    cache = cached_llm.engine.prefix_cache
    before = cache.stats.report()
    (prompt, more) = random_prompts((80, 10), seed=36)
    cached_llm.generate(prompt, SamplingParams(max_tokens=1))
    cached_llm.generate(prompt + more, SamplingParams(max_tokens=1))
    after = cache.stats.report()
    assert after["misses"]["no_entry"] - before["misses"]["no_entry"] == 1
    assert after["hit_tokens"]["gpu"] - before["hit_tokens"]["gpu"] == 80
    cache.clear()
    cached_llm.generate(prompt + more, SamplingParams(max_tokens=1))
    assert cache.stats.report()["misses"]["evicted"] - after["misses"]["evicted"] == 1


def test_eviction_keeps_reused_entries_and_pinned_ones(cached_llm: LLM) -> None:
    cache = cached_llm.engine.prefix_cache
    prompts = random_prompts((70, 70, 70, 70), seed=37)
    for p in prompts:
        cached_llm.generate(p, SamplingParams(max_tokens=1))
    entries = list(cache.entries.values())
    ends = [e for e in entries if e.kind == "end"]
    answers = [e for e in entries if e.kind == "decode"]  # each prompt's, one token on
    assert len(ends) == len(answers) == 4
    assert cache.evict_one()  # an answer's entry nobody reused goes first, the oldest
    assert answers[0].key not in cache.entries and all(e.key in cache.entries for e in ends)
    for answer in answers[1:]:
        answer.hits = 1
    ends[0].hits = 3  # the oldest was reused: the next oldest goes first
    pinned = cache.pin(ends[1].key)
    assert cache.evict_one()
    assert ends[0].key in cache.entries and ends[1].key in cache.entries
    assert ends[2].key not in cache.entries
    cache.clear()
    assert list(cache.entries.values()) == [pinned], "a pinned entry outlives a clear"
    cache.unpin(pinned)
