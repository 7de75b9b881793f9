"""Packed prefill equals each prompt alone; chunked prefill equals unchunked; preemption is exact.

`pdserve.check.prefill_states` holds each prefill's memory (as the prefill service does for a
transfer) so the final GDN conv/recurrent states and the KV pages can be read back and compared.
"""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.check import PrefillState, prefill_states, relative_differences
from pdserve.engine.llm_engine import LLMEngine
from tests.helpers import assert_no_leaks, random_prompts

LENGTHS = (1, 7, 63, 64, 65, 200)
TOL = 1e-5


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=1024).engine


@pytest.fixture(autouse=True)
def no_leaks(engine: LLMEngine):
    yield
    assert_no_leaks(engine)


def assert_same(a: PrefillState, b: PrefillState, what: str, rtol: float = TOL) -> None:
    """Within `rtol` of the largest magnitude (fp32 rounding, nothing more)."""
    for key, diff in relative_differences(a, b).items():
        assert diff <= rtol, f"{what}: {key} differs by {diff:.2e} of its scale"


def test_packed_prefill_equals_each_prompt_alone(engine: LLMEngine) -> None:
    prompts = random_prompts(LENGTHS, seed=2)
    packed = prefill_states(engine, prompts, token_budget=4096)
    assert packed[0].passes == 1, "all prompts should share one pass"
    for prompt, together in zip(prompts, packed, strict=True):
        (alone,) = prefill_states(engine, [prompt], token_budget=4096)
        assert_same(together, alone, f"prompt of {len(prompt)} tokens")


def test_chunked_prefill_equals_unchunked(engine: LLMEngine) -> None:
    prompts = random_prompts((200, 65, 7), seed=3)
    whole = prefill_states(engine, prompts, token_budget=4096)
    chunked = prefill_states(engine, prompts, token_budget=24)
    assert chunked[0].passes >= 12, "a 24-token budget must chunk 272 tokens over many passes"
    for prompt, a, b in zip(prompts, whole, chunked, strict=True):
        # Chunk boundaries move the GDN scan's fp32 rounding (q/k RMSNorm can amplify it in K).
        assert_same(a, b, f"prompt of {len(prompt)} tokens chunked by 24", rtol=1e-4)


def test_a_short_tail_rides_in_the_pass_past_the_budget(engine: LLMEngine) -> None:
    """Under a 64-token budget a pass takes a prompt's tail of up to 4 tokens (1/16) past it, not
    leaving it a pass of its own: two prompts of 34 share one pass of 68; one of 35 more takes two;
    a 196-token prompt is chunked 64, 64, 68, one of 200 64, 64, 64, 8 (a tail of 8 is past it).
    Every prompt's states equal those it gets alone."""
    shares = [((34, 34), 1), ((35, 34), 2), ((196,), 3), ((200,), 4)]
    for seed, (lengths, passes) in enumerate(shares):
        prompts = random_prompts(lengths, seed=10 + seed)
        states = prefill_states(engine, prompts, token_budget=64)
        assert states[0].passes == passes, (lengths, states[0].passes)
        for prompt, together in zip(prompts, states, strict=True):
            (alone,) = prefill_states(engine, [prompt], token_budget=4096)
            assert_same(together, alone, f"prompt of {len(prompt)} tokens", rtol=1e-4)


def test_preemption_recomputes_exactly(tiny_model_dir) -> None:
    """A KV pool too small for every request forces preemption; greedy outputs are unchanged."""
    prompts = random_prompts((60, 50, 40, 30), seed=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=128)
    tight = LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=128, num_kv_pages=12)
    preempted = []
    preempt = tight.engine.scheduler.preempt

    def counting(seq):
        preempted.append(seq.request_id)
        preempt(seq)

    tight.engine.scheduler.preempt = counting
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert preempted, "the tight pool should have forced a preemption"
    assert got == expected
    assert_no_leaks(tight.engine)
    assert_no_leaks(roomy.engine)


def test_pdserve_check_command_passes_and_can_fail(tiny_model_dir, capsys) -> None:
    from pdserve.cli import main

    argv = ["check", "--model", str(tiny_model_dir), "--lengths", "1", "9", "40", "--chunk", "8"]
    assert main(argv) == 0
    assert "PASS" in capsys.readouterr().out
    assert main([*argv, "--tolerance", "0"]) == 1, "fp32 rounding is never exactly zero everywhere"
