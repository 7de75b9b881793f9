"""The hybrid prefix cache: a request served from a cached prefix (shared KV pages + a restored
GDN checkpoint) equals the same request computed from scratch; entries are evicted, not leaked."""

from __future__ import annotations

from pdserve import LLM, SamplingParams
from pdserve.check import checkpoint_differences, checkpoint_states, prefill_states, relative_differences
from tests.helpers import assert_no_leaks, random_prompts
from tests.offline_llms import tiny_llm

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def shared_prefix_prompts(prefix_len: int, suffix_lens: tuple[int, ...], seed: int) -> list[list[int]]:
    prefix, *suffixes = random_prompts((prefix_len, *suffix_lens), seed=seed)
    return [prefix + s for s in suffixes]


def test_chunk_ends_are_checkpoints(cached_llm: LLM, plain_llm: LLM) -> None:
    """A prompt the token budget cuts into chunks leaves a checkpoint where each chunk ended (no
    pass of its own); a prompt sharing its first 230 tokens reuses the one at 200."""
    first, more, other = random_prompts((260, 20, 40), seed=10)
    cache, scheduler = cached_llm.engine.prefix_cache, cached_llm.engine.scheduler
    scheduler.max_num_batched_tokens = 100
    try:
        cached_llm.generate(first + more, GREEDY)
    finally:
        scheduler.max_num_batched_tokens = 8192
    chunks = sorted(e.num_tokens for e in cache.entries.values() if e.kind == "chunk")
    assert chunks == [100, 200]
    sibling = first[:230] + other
    out = cached_llm.generate(sibling, GREEDY)[0]
    assert out.num_cached_tokens == 200
    assert out.token_ids == plain_llm.generate(sibling, GREEDY)[0].token_ids


def test_siblings_checkpoint_where_they_diverge(cached_llm: LLM, plain_llm: LLM) -> None:
    """Three prompts sharing 150 tokens: the first keeps its end and its generation's; the
    second finds no checkpoint (a miss, "diverged") and saves one where it leaves the first
    (token 150, a branch point); the third computes only its own suffix."""
    first, second, third = shared_prefix_prompts(150, (30, 40, 50), seed=11)
    cache = cached_llm.engine.prefix_cache
    cached_llm.generate(first, GREEDY)
    assert [(e.kind, e.num_tokens) for e in cache.entries.values()] == [
        ("end", 180),
        ("decode", 180 + GREEDY.max_tokens),  # the last token too: the engine ran one step ahead
    ]
    assert cached_llm.generate(second, GREEDY)[0].num_cached_tokens == 0
    assert cache.stats.misses["diverged"] >= 1
    assert any(e.kind == "branch" and e.num_tokens == 150 for e in cache.entries.values())
    seen = []
    execute = cached_llm.engine.runner.execute
    cached_llm.engine.runner.execute = lambda s, patch=None: (
        seen.append((s, execute(s, patch))) or seen[-1][1]
    )
    try:
        out = cached_llm.generate(third, GREEDY)[0]
    finally:
        del cached_llm.engine.runner.execute
    first_pass = seen[0][0][0]
    assert first_pass.num_new_tokens == len(third) - 150, "only the uncached suffix is computed"
    assert out.num_cached_tokens == 150
    assert out.token_ids == plain_llm.generate(third, GREEDY)[0].token_ids


def test_cached_logits_and_states_equal_uncached(cached_llm: LLM, plain_llm: LLM) -> None:
    first, extra = random_prompts((180, 60), seed=12)
    cached_llm.generate(first, SamplingParams(max_tokens=1))
    second = first + extra  # restores the checkpoint at first's end (inside a page)
    (warm,) = prefill_states(cached_llm.engine, [second], token_budget=4096)
    (cold,) = prefill_states(plain_llm.engine, [second], token_budget=4096)
    for key, diff in relative_differences(warm, cold).items():
        assert diff <= 1e-4, f"{key} differs by {diff:.2e} with the prefix from the cache"


def test_packed_burst_with_a_shared_prefix_equals_uncached(cached_llm: LLM, plain_llm: LLM) -> None:
    """Cold, packed: nothing to reuse. The same burst again: each prompt finds its own end
    entry, unusable (its last token must be computed), and checkpoints its last token but one;
    a third time every prompt computes one token."""
    prompts = shared_prefix_prompts(130, (20, 35, 50, 70), seed=13)
    expected = [o.token_ids for o in plain_llm.generate(prompts, GREEDY)]
    assert [o.token_ids for o in cached_llm.generate(prompts, GREEDY)] == expected  # cold, packed
    assert [o.token_ids for o in cached_llm.generate(prompts, GREEDY)] == expected
    again = cached_llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == expected
    assert [o.num_cached_tokens for o in again] == [len(p) - 1 for p in prompts]


def test_checkpoints_packed_equal_alone(cached_llm: LLM) -> None:
    """The pack check: prompts ending with a generation prompt (a resume point 8 tokens before
    each end), prefilled packed and one at a time, take the same checkpoints with the same GDN
    states (a resume point mid-pass, each end, each answer's)."""
    suffix = tuple(random_prompts((8,), seed=40)[0])
    prompts = [p + list(suffix) for p in random_prompts((70, 129, 200), seed=41)]
    alone = checkpoint_states(cached_llm.engine, prompts, suffix, packed=False)
    packed = checkpoint_states(cached_llm.engine, prompts, suffix, packed=True)
    expected = [("resume", len(p) - 8) for p in prompts] + [("end", len(p)) for p in prompts]
    expected += [("decode", len(p) + 1) for p in prompts]  # the answer's token too (one step ahead)
    assert sorted((c.kind, c.num_tokens) for c in alone.values()) == sorted(expected)
    for name, diff in checkpoint_differences(packed, alone).items():
        assert diff <= 1e-4, f"{name} of a checkpoint differs by {diff:.2e} packed"
    assert not cached_llm.engine.prefix_cache.entries, "the check leaves the cache empty"


def test_entries_are_evicted_under_memory_pressure(tiny_model_dir, plain_llm: LLM) -> None:
    llm = tiny_llm(
        tiny_model_dir,
        max_model_len=256,
        num_kv_pages=40,
        enable_prefix_caching=True,
        num_prefix_checkpoints=2,
    )
    prompts = random_prompts((200, 190, 180, 170, 160), seed=14)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [llm.generate(p, params)[0] for p in prompts]  # each saves a checkpoint; only 2 fit
    tiers = [e.tier for e in llm.engine.prefix_cache.entries.values()]
    assert tiers.count("gpu") <= 2 and "host" in tiers, "the others went to the host tier"
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_llm.generate(prompts, params)]
    # a prompt needing more pages than are free evicts cache entries instead of failing
    big = random_prompts((250,), seed=15)[0]
    assert len(llm.generate(big, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
    llm.engine.prefix_cache.clear()
    assert_no_leaks(llm.engine)


def test_cached_tokens_reach_the_usage(cached_llm: LLM) -> None:
    prompt, more = random_prompts((100, 10), seed=16)
    assert cached_llm.generate(prompt, SamplingParams(max_tokens=1))[0].num_cached_tokens == 0
    assert cached_llm.generate(prompt + more, SamplingParams(max_tokens=1))[0].num_cached_tokens == 100
    checkpoints = cached_llm.engine.prefix_cache.checkpoints
    assert checkpoints.states is cached_llm.engine.runner.state_pool, "a checkpoint is a state slot"


def test_preemption_with_the_cache_is_exact(tiny_model_dir, plain_llm: LLM) -> None:
    """A pool too small for the batch: sequences are preempted and readmitted (restoring cached
    prefixes), cache entries evicted; the tokens still equal an uncached roomy engine's."""
    llm = tiny_llm(
        tiny_model_dir,
        max_model_len=256,
        num_kv_pages=26,
        enable_prefix_caching=True,
        num_prefix_checkpoints=4,
    )
    preempted = []
    preempt = llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda seq: preempted.append(seq.request_id) or preempt(seq)
    prompts = shared_prefix_prompts(140, (30, 40, 50, 60), seed=17)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert preempted, "the tight pool should have forced a preemption"
    assert got == [o.token_ids for o in plain_llm.generate(prompts, params)]
    llm.engine.prefix_cache.clear()
    assert_no_leaks(llm.engine)


def test_eviction_spares_the_entry_being_restored(cached_llm: LLM) -> None:
    """Making room for a request must not evict the very entry it is about to restore."""
    cache = cached_llm.engine.prefix_cache
    for seed in (18, 19):
        cached_llm.generate(shared_prefix_prompts(140, (10,), seed=seed)[0], SamplingParams(max_tokens=1))
    older, *newer = list(cache.entries.values())
    while len(cache.entries) > 1:
        assert cache.evict_one(keep=older)
    assert list(cache.entries.values()) == [older]
    assert not cache.evict_one(keep=older), "the kept entry is the only one left"
    assert cache.evict_one() and not cache.entries
