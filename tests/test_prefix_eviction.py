"""Prefix cache eviction under pressure from many conversations (issue 9): with more
conversations than device checkpoints, what each conversation's next turn needs (the resume
point before its generation prompt, with a template that drops the reasoning) outlives the
answers' entries nobody reuses and the links a conversation has moved past; a prompt's exact
end, two tokens after its resume point, takes no checkpoint of its own."""

from __future__ import annotations

from pdserve import LLM, SamplingParams
from tests.helpers import assert_no_leaks, random_prompts
from tests.offline_llms import tiny_llm

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SUFFIX = (248068, 198)  # `<think>\n` in the Qwen3.6 vocabulary: a generation prompt's end
CONVERSATIONS, TURNS, NEW = 4, 4, 24
CHECKPOINTS = CONVERSATIONS + 1  # a resume point each, and room for one more


def test_conversations_keep_their_resume_points_over_answers(tiny_model_dir) -> None:
    llm: LLM = tiny_llm(tiny_model_dir, num_prefix_checkpoints=CHECKPOINTS)
    cache = llm.engine.prefix_cache
    cache.configure_host_tier(0)  # the device alone: eviction drops
    cache.resume_suffixes = [SUFFIX]
    bodies = random_prompts([96] * CONVERSATIONS, seed=61)
    for turn in range(TURNS):
        news = random_prompts([NEW] * CONVERSATIONS, seed=62 + turn)
        for c in range(CONVERSATIONS):  # the conversations' turns interleave, as served
            prompt = bodies[c] + list(SUFFIX)
            out = llm.generate(prompt, GREEDY)[0]
            if turn:  # everything before the previous generation prompt came from the cache
                assert out.num_cached_tokens == len(bodies[c]) - NEW, (turn, c)
            bodies[c] = bodies[c] + news[c]  # the answer dropped, a new user message
        # each conversation holds one live resume point; the answers' entries went first
        assert sum(e.kind == "resume" for e in cache.entries.values()) == CONVERSATIONS
    cache.clear()
    assert_no_leaks(llm.engine)


def test_a_packed_turn_restores_every_resume_point_from_the_device(tiny_model_dir) -> None:
    """All conversations' turns in one pass, as a served chat turn packs them: each new resume
    point takes the room of one its turn just restored (`CacheEntry.resumed`), not of one a later
    sequence of the same turn is about to restore. Ranked by hits, the fresh ones went first: with
    40 checkpoints for 32 conversations, 24 of 32 came back from the host tier every turn."""
    llm: LLM = tiny_llm(tiny_model_dir, num_prefix_checkpoints=CHECKPOINTS)
    cache = llm.engine.prefix_cache
    cache.configure_host_tier(4 << 20)  # room on the host: a demoted resume point would go there
    cache.resume_suffixes = [SUFFIX]
    bodies = random_prompts([96] * CONVERSATIONS, seed=63)
    for turn in range(TURNS):
        hits = dict(cache.stats.hit_requests)
        outs = llm.generate([body + list(SUFFIX) for body in bodies], GREEDY)
        if turn:
            assert [o.num_cached_tokens for o in outs] == [len(b) - NEW for b in bodies], turn
            assert cache.stats.hit_requests["gpu"] - hits["gpu"] == CONVERSATIONS, turn
            assert cache.stats.hit_requests["host"] == hits["host"], turn
        news = random_prompts([NEW] * CONVERSATIONS, seed=64 + turn)
        bodies = [body + new for body, new in zip(bodies, news, strict=True)]
    assert not [e for e in cache.entries.values() if e.kind == "resume" and e.tier == "host"]
    cache.clear()
    assert_no_leaks(llm.engine)


def test_an_end_next_to_a_resume_point_takes_no_checkpoint(cached_llm: LLM) -> None:
    cache = cached_llm.engine.prefix_cache
    cache.resume_suffixes = [SUFFIX]
    try:
        (body,) = random_prompts([90], seed=63)
        engine = cached_llm.engine
        seq = engine.requests[engine.add_request(body + list(SUFFIX), GREEDY, request_id="r")]
        while seq.num_computed_tokens < seq.num_prompt_tokens:
            cached_llm.engine.step()
        assert seq.last_checkpoint == len(body), "the resume point was checkpointed"
        assert not cache.wants_end_checkpoint(seq)
        seq.last_checkpoint = 0  # a prompt with no checkpoint near its end wants one
        assert cache.wants_end_checkpoint(seq)
    finally:
        cached_llm.engine.abort("r")
        while cached_llm.engine.has_unfinished():
            cached_llm.engine.step()
        cache.resume_suffixes = []
        cache.clear()


def test_a_link_a_conversation_moved_past_is_dropped_not_moved_to_the_host(tiny_model_dir) -> None:
    """Turn 2 restores turn 1's entry and makes its own: turn 1's is superseded, and under memory
    pressure it leaves the device without a copy to the host tier (which keeps its room, and the
    engine's stream its time, for entries that may come back), while turn 2's is moved there."""
    llm: LLM = tiny_llm(tiny_model_dir, num_prefix_checkpoints=4)
    cache = llm.engine.prefix_cache
    cache.configure_host_tier(8 << 20)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    turn1, more = random_prompts([80, 20], seed=64)
    llm.generate(turn1, one)
    (first,) = [e for e in cache.entries.values() if e.num_tokens == len(turn1)]
    llm.generate(turn1 + more, one)
    (second,) = [e for e in cache.entries.values() if e.num_tokens == len(turn1 + more)]
    assert first.superseded and first.hits == 0 and not second.superseded
    demoted = []
    demote = cache._demote
    cache._demote = lambda entry, keep: demoted.append(entry) or demote(entry, keep)
    while first.key in cache.entries or second.tier == "gpu":
        assert cache.evict_one(to_host=True)
    del cache._demote
    assert first not in demoted and second in demoted and cache.entries[second.key].tier == "host"
    cache.clear()
    assert_no_leaks(llm.engine)


def test_an_answer_the_next_prompt_re_renders_is_dropped_not_moved_to_the_host(tiny_model_dir) -> None:
    """Conversation A's template re-renders its answer: its second turn restores the resume point
    before the first answer and passes over the answer's entry, which is then superseded, the
    first to make room, and dropped (32 a turn went to the host tier on the H200 until
    `HostAdmission` learnt the kind never comes back). Conversation B's second turn extends its
    answer and restores that entry: not passed over."""
    llm: LLM = tiny_llm(tiny_model_dir, num_prefix_checkpoints=5)  # turn 1 makes 4 entries, turn 2 4 more
    cache = llm.engine.prefix_cache
    cache.configure_host_tier(8 << 20)  # room on the host: a demoted answer would go there
    cache.resume_suffixes = [SUFFIX]
    body_a, body_b, new_a, new_b = random_prompts([96, 100, NEW, NEW], seed=65)
    _, out_b = llm.generate([body_a + list(SUFFIX), body_b + list(SUFFIX)], GREEDY)
    answer_a, answer_b = sorted(
        (e for e in cache.entries.values() if e.kind == "decode"), key=lambda e: e.num_tokens
    )
    (resume_a,) = [e for e in cache.entries.values() if e.num_tokens == len(body_a)]
    assert cache.stats.demoted == 0
    restored = []
    restore = cache.restore
    cache.restore = lambda entry, seq: (
        restore(entry, seq) or restored.append((entry, answer_a.superseded, answer_b.superseded))
    )
    prompt_b = body_b + list(SUFFIX) + out_b.token_ids + new_b + list(SUFFIX)  # B keeps its answer
    outs = llm.generate([body_a + new_a + list(SUFFIX), prompt_b], GREEDY)
    del cache.restore
    assert [o.num_cached_tokens for o in outs] == [len(body_a), answer_b.num_tokens]
    # A restored its resume point: its answer is passed over; B restored its answer: not
    assert restored == [(resume_a, True, False), (answer_b, True, False)]
    # the turn's new entries made room: A's answer went first, dropped, not copied to the host
    assert answer_a.key not in cache.entries and cache.stats.demoted == 0
    assert not [e for e in cache.entries.values() if e.tier == "host"]
    cache.clear()
    assert_no_leaks(llm.engine)
