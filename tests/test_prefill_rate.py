"""The prompt-token rate behind the prefix cache's pull-or-recompute choice: measured from each
step's own time, whether steps come back to back, run ahead, or alone between idle waits."""

from __future__ import annotations

import time

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.prefill_rate import PrefillRate
from pdserve.sampling.params import SamplingParams


def test_each_step_is_timed_from_when_the_device_could_start_it() -> None:
    rate = PrefillRate(tokens_per_s=1_000.0)
    rate.measured(100, scheduled_at=10.0, done_at=10.01)  # alone: 10,000 tokens/s
    assert rate.tokens_per_s == pytest.approx(0.8 * 1_000 + 0.2 * 10_000)
    before = rate.tokens_per_s
    # run ahead: scheduled at 10.005 while the step before ran until 10.01, done at 10.02
    rate.measured(100, scheduled_at=10.005, done_at=10.02)
    assert rate.tokens_per_s == pytest.approx(0.8 * before + 0.2 * 10_000)
    before = rate.tokens_per_s
    rate.measured(8, scheduled_at=11.0, done_at=11.001)  # too few prompt tokens: a decode step
    rate.measured(100, scheduled_at=20.0, done_at=22.0)  # longer than a step: a stall
    assert rate.tokens_per_s == before


@pytest.mark.parametrize("run_ahead", [True, False])
def test_prompts_alone_between_idle_waits_are_measured(tiny_model_dir, run_ahead: bool) -> None:
    """A prefill instance that gets one request at a time still learns its rate: the idle time
    between requests never counts as a step's."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    engine.run_ahead = run_ahead
    prior = engine.prefill_rate.tokens_per_s
    for i in range(3):
        engine.add_request([5 + i] * 200, SamplingParams(temperature=0.0, max_tokens=1), f"r{i}")
        while engine.has_unfinished():
            engine.step()
        time.sleep(0.3)  # idle: the next step is scheduled long after this one was done
    started = time.perf_counter()
    engine.add_request([9] * 200, SamplingParams(temperature=0.0, max_tokens=1), "timed")
    while engine.has_unfinished():
        engine.step()
    ceiling = 200 / (time.perf_counter() - started)  # the whole request took longer than its step
    assert engine.prefill_rate.tokens_per_s != prior
    assert engine.prefill_rate.tokens_per_s > 0.2 * ceiling  # idle waits would have made it ~0
