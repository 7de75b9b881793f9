"""The prefix cache's host tier (issue 9, acceptance 1 and 3, on a CPU: the same code path as a
GPU's pinned pool): entries evicted from the device are copied to the host tier and restored
from it; a hit from there equals no cache, alone and packed; a workload reusing four times what
the device holds still hits; a clear leaves every pool at its idle figures."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.helpers import assert_no_leaks, random_prompts
from tests.offline_llms import tiny_llm

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
DEVICE_CHECKPOINTS = 3


@pytest.fixture(scope="module")
def tiered(tiny_model_dir) -> LLM:
    llm = tiny_llm(tiny_model_dir, num_prefix_checkpoints=DEVICE_CHECKPOINTS)
    llm.engine.prefix_cache.configure_host_tier(64 << 20)
    return llm


@pytest.fixture(autouse=True)
def idle_after(tiered: LLM):
    yield
    cache = tiered.engine.prefix_cache
    cache.clear()
    assert_no_leaks(tiered.engine)
    host = cache.host
    assert (host.num_free_pages, host.num_free_checkpoints) == (host.num_pages, host.num_checkpoints)


def test_host_hit_equals_no_cache_alone_and_packed(tiered: LLM, plain_llm: LLM) -> None:
    cache = tiered.engine.prefix_cache
    firsts = random_prompts((140, 150, 160, 170, 180), seed=51)
    more = random_prompts((20, 25), seed=52)
    demoted, evicted = cache.stats.demoted, cache.stats.evicted
    for prompt in firsts:  # each leaves two entries: the device holds three, the rest go to the host
        tiered.generate(prompt, GREEDY)
    on_host = sum(e.tier == "host" for e in cache.entries.values())
    assert on_host and cache.stats.demoted - demoted == on_host <= cache.stats.evicted - evicted
    (oldest,) = [e for e in cache.entries.values() if e.kind == "end" and e.num_tokens == 140]
    assert oldest.tier == "host"
    turns = [firsts[0] + more[0], firsts[1] + more[1]]  # both continue a prompt now on the host
    expected = [o.token_ids for o in plain_llm.generate(turns, GREEDY)]
    before = cache.stats.hit_tokens["host"]
    alone = tiered.generate(turns[0], GREEDY)[0]
    assert alone.num_cached_tokens == 140 and alone.token_ids == expected[0]
    packed = tiered.generate([turns[1], turns[0] + more[1]], GREEDY)
    assert packed[0].num_cached_tokens == 150 and packed[0].token_ids == expected[1]
    assert cache.stats.hit_tokens["host"] - before >= 290


def test_four_times_the_device_cache_still_hits(tiered: LLM) -> None:
    """Conversations whose previous turns need four times the device's checkpoints: every
    turn after the first reuses >= 90% of its previous prompt + answer, through the host tier."""
    cache = tiered.engine.prefix_cache
    conversations = random_prompts([100 + 3 * i for i in range(4 * DEVICE_CHECKPOINTS)], seed=53)
    host_before = cache.stats.hit_tokens["host"]
    reused = reusable = 0
    previous: list[int] = []  # each conversation's last prompt + answer, in tokens
    for turn in range(3):
        outs = tiered.generate(conversations, GREEDY)
        if previous:
            reused += sum(o.num_cached_tokens for o in outs)
            reusable += sum(previous)
        messages = random_prompts([10] * len(conversations), seed=60 + turn)
        previous = [len(c) + len(o.token_ids) for c, o in zip(conversations, outs, strict=True)]
        conversations = [c + o.token_ids + m for c, o, m in zip(conversations, outs, messages, strict=True)]
    assert reused >= 0.9 * reusable, f"{reused} of {reusable} reusable tokens"
    from_host = cache.stats.hit_tokens["host"] - host_before
    assert from_host >= 0.6 * reused, f"only {from_host} of {reused} from the host tier"


def test_a_long_prompts_chunk_entries_are_not_copied_out_while_it_holds_their_pages(tiny_model_dir) -> None:
    """A prompt prefilled in many chunks saves an entry at each chunk's end; with few device
    checkpoints its earlier ones are evicted while it runs. Their pages are its own too: a copy
    to the host tier would free none, so they are dropped (the H100's 131K-token prompt copied its
    growing prefixes out, hundreds of MiB each, in the engine's stream). Once it has finished,
    its entries own their pages, and an eviction moves them to the host tier as before; the
    outputs are those without the cache."""
    llm = tiny_llm(tiny_model_dir, num_prefix_checkpoints=DEVICE_CHECKPOINTS, max_num_batched_tokens=48)
    cache = llm.engine.prefix_cache
    cache.configure_host_tier(64 << 20)
    long_prompt, *others = random_prompts((480, 120, 130, 140, 150), seed=71)
    (got,) = llm.generate([long_prompt], GREEDY)
    assert cache.stats.evicted >= 5, "the prompt's own chunk entries were evicted while it ran"
    assert cache.stats.demoted == 0, f"{cache.stats.demoted} chunk entries copied to the host tier"
    llm.generate(others, GREEDY)  # their entries push the long prompt's last ones out
    assert cache.stats.demoted > 0, "entries owning their pages go to the host tier as before"
    plain = tiny_llm(tiny_model_dir, enable_prefix_caching=False)
    assert got.token_ids == plain.generate([long_prompt], GREEDY)[0].token_ids
    cache.clear()
    assert_no_leaks(llm.engine)
