"""One instance holding both roles decodes a handed-over request on at once (`decode_in_place`):
its tokens wait under the lease until the decode stream claims it, and are the tokens the
engine gives without a hand-over; a lease released or expired before it is claimed stops the
request and frees its memory; a request that ends before the claim keeps its last output."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling.params import SamplingParams
from tests.helpers import assert_no_leaks, random_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tiny_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256))


@pytest.fixture(scope="module")
def in_place_engine(tiny_model_dir) -> LLMEngine:
    engine = tiny_engine(tiny_model_dir)
    engine.decode_in_place = True
    return engine


@pytest.fixture
def engine(in_place_engine: LLMEngine) -> LLMEngine:
    """The module's engine decoding in place, as a fresh one: idle, every page and slot free and
    the prefix cache empty (each test leaves it so, and asserts it)."""
    assert_no_leaks(in_place_engine)
    return in_place_engine


def hand_over(engine: LLMEngine, prompt: list[int], rid: str, params: SamplingParams = PARAMS) -> str:
    """Queue `prompt` as a prefill role would and step until its first token: the lease id."""
    seq = engine.make_sequence(prompt, params, rid)
    seq.handoff = True
    engine.enqueue(seq)
    while True:
        for out in engine.step():
            if out.request_id == rid:
                assert out.lease_id is not None and len(out.new_token_ids) == 1
                return out.lease_id


def test_tokens_wait_for_the_claim_and_equal_the_plain_engine(engine: LLMEngine, tiny_model_dir) -> None:
    prompt = random_prompts((40,), seed=5, vocab=1000)[0]
    plain = tiny_engine(tiny_model_dir)
    plain.add_request(prompt, PARAMS, "plain")
    expected = []
    while plain.has_unfinished():
        expected += [t for out in plain.step() for t in out.new_token_ids]

    lease_id = hand_over(engine, prompt, "r")
    for _ in range(4):  # it decodes on before anyone claims it, and nothing comes out
        assert [out for out in engine.step() if out.request_id == "r"] == []
    assert engine.resume_held("r", "not-its-lease") is None
    kept = engine.resume_held("r", lease_id)
    assert len(kept) >= 3 and not any(out.finished for out in kept)  # 4 steps, one running ahead
    outputs = list(kept)
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert len(expected) == PARAMS.max_tokens
    assert [t for out in outputs for t in out.new_token_ids] == expected[1:]
    assert_no_leaks(engine)


def test_a_request_that_ends_before_the_claim_keeps_its_outputs(engine: LLMEngine) -> None:
    lease_id = hand_over(engine, random_prompts((20,), seed=6, vocab=1000)[0], "r")
    while engine.has_unfinished():
        engine.step()
    kept = engine.resume_held("r", lease_id)
    assert sum(len(out.new_token_ids) for out in kept) == PARAMS.max_tokens - 1
    assert kept[-1].finished and engine.resume_held("r", lease_id) is None
    assert_no_leaks(engine)


@pytest.mark.parametrize("how", ["released", "expired", "aborted"])
def test_a_lease_not_claimed_stops_the_request(engine: LLMEngine, how: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    lease_id = hand_over(engine, random_prompts((20,), seed=7, vocab=1000)[0], "r", params)
    engine.step()
    if how == "released":
        assert engine.scheduler.release_lease("r", lease_id)
    elif how == "expired":
        engine.scheduler.decoding["r"].expires = 0.0
        assert engine.scheduler.expire_leases(now=1.0) == ["r"]
    else:
        assert engine.abort("r")
    while engine.has_unfinished():
        assert [out for out in engine.step() if out.request_id == "r"] == []
    assert engine.resume_held("r", lease_id) is None
    assert_no_leaks(engine)


def test_a_hand_over_aborted_while_its_pass_is_in_flight(engine: LLMEngine, tiny_model_dir) -> None:
    """Decoding in place, a prompt's pass runs ahead: the step that ends it leaves it in flight.
    Aborted then (its first token not yet seen), nothing leaks, and a longer prompt that begins
    as it did, handed over next, starts from the prompt-end checkpoint the pass's launch copied
    and gives the tokens of an engine that never saw the first."""
    prompt, more = random_prompts((70, 12), seed=8, vocab=1000)
    plain = tiny_engine(tiny_model_dir)
    plain.add_request(prompt + more, PARAMS, "plain")
    expected = []
    while plain.has_unfinished():
        expected += [t for out in plain.step() for t in out.new_token_ids]

    seq = engine.make_sequence(prompt, PARAMS, "gone")
    seq.handoff = True
    engine.enqueue(seq)
    assert [out for out in engine.step() if out.request_id == "gone"] == []  # its pass is in flight
    assert engine.scheduler.decoding == {} and seq.num_computed_tokens == len(prompt)
    assert engine.abort("gone")
    while engine.has_unfinished():
        assert [out for out in engine.step() if out.request_id == "gone"] == []

    lease_id = hand_over(engine, prompt + more, "again")
    stats = engine.prefix_cache.stats
    assert stats.hit_requests["gpu"] == 1 and stats.hit_tokens["gpu"] == len(prompt)
    while engine.has_unfinished():
        engine.step()
    kept = engine.resume_held("again", lease_id)
    assert [t for out in kept for t in out.new_token_ids] == expected[1:]
    assert_no_leaks(engine)
