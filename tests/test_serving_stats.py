"""The stats line a service logs while serving (pdserve.serving_stats): counted from a real
engine's outputs (prompt tokens once, on the instance that prefilled; every generated token; the
prefix-cache hit rate), formatted as vLLM's, quiet when idle; and logged by a serving host."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import asdict, dataclass, field

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.messages import DecodeStart, Lease
from pdserve.sampling.params import SamplingParams
from pdserve.serving import EngineHost, ServiceConfig
from pdserve.serving_stats import ServingStats, prefilled_here
from tests.helpers import random_prompts

LOAD = {"running": 2, "waiting": 1, "held": 0, "receiving": 0, "kv_pages": 200, "free_kv_pages": 150}


@dataclass
class FakeOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


def run_to_end(engine: LLMEngine, stats: ServingStats) -> dict[str, RequestOutput]:
    """Step until done, counting; each request's first output (it says the cached tokens)."""
    firsts = {}
    while engine.has_unfinished():
        outputs = engine.step()
        stats.observe(outputs)
        firsts |= {out.request_id: out for out in outputs if prefilled_here(out)}
    return firsts


def test_counts_an_engines_outputs(tiny_model_dir) -> None:
    """Prompt tokens once a request (cached ones too), every generated token; the hit rate is
    cached over prompt tokens: a conversation's next turn finds the previous turn in the cache."""
    config = EngineConfig(
        model=str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        max_model_len=256,
        enable_prefix_caching=True,
    )
    engine = LLMEngine(config)
    stats = ServingStats("engine-0", interval_s=10.0, prefix_cache=True)
    prompts = random_prompts((130, 7), seed=5, vocab=1000)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    firsts = run_to_end(engine, stats)
    assert [firsts[i].num_cached_tokens for i in ids] == [0, 0]
    assert (stats.prompt_tokens, stats.generation_tokens) == (137, 8)
    assert stats.hit_rate() == 0.0
    answer = list(firsts[ids[0]].token_ids)  # the request's own list: complete now
    engine.add_request(prompts[0] + answer + [5] * 20, params)  # 154 tokens
    (first,) = run_to_end(engine, stats).values()
    cached = first.num_cached_tokens
    assert cached > 0
    assert (stats.prompt_tokens, stats.generation_tokens) == (291, 12)
    assert stats.hit_rate() == pytest.approx(cached / 291)
    line = stats.line(LOAD, now=stats.last_line_at + 10.0)
    assert line == (
        "engine-0: Avg prompt throughput: 29.1 tokens/s, Avg generation throughput: 1.2 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
        f"Prefix cache hit rate: {100 * cached / 291:.1f}%"
    )
    assert (stats.prompt_tokens, stats.generation_tokens) == (0, 0)  # counting starts over


def test_a_received_request_counts_no_prompt() -> None:
    """A decode instance starts from the first token the prefill instance sampled: its first
    output already holds two tokens, one of them new."""
    prefilled = FakeOutput([1, 2, 3], token_ids=[7], new_token_ids=[7])
    received = FakeOutput([1, 2, 3], token_ids=[7, 8], new_token_ids=[8])
    assert prefilled_here(prefilled) and not prefilled_here(received)
    stats = ServingStats("decode-0")
    stats.observe([received, FakeOutput([1, 2, 3], [7, 8, 9], [9])])
    assert (stats.prompt_tokens, stats.generation_tokens) == (0, 2)


def test_too_early_idle_and_handover_fields() -> None:
    stats = ServingStats("prefill-0", interval_s=10.0)
    start = stats.last_line_at
    idle = {"running": 0, "waiting": 0, "kv_pages": 100, "free_kv_pages": 100}
    assert stats.line(idle, now=start + 10) is None  # idle from the start: nothing to say
    stats.observe([FakeOutput([1] * 20, [5], [5])])
    assert stats.line(idle, now=start + 15) is None  # 5 s after the last line: too early
    line = stats.line({**idle, "held": 1}, now=start + 20)
    assert line == (
        "prefill-0: Avg prompt throughput: 2.0 tokens/s, Avg generation throughput: 0.1 tokens/s, "
        "Running: 0 reqs, Waiting: 0 reqs, Held: 1 reqs, KV cache usage: 0.0%"
    )
    assert stats.line(idle, now=start + 30).startswith("prefill-0: Avg prompt throughput: 0.0 tokens/s")
    assert stats.line(idle, now=start + 40) is None  # one line of zeros, then quiet
    assert ServingStats("off", interval_s=0).line(LOAD, now=time.monotonic() + 100) is None


def test_a_serving_host_logs_the_line(tiny_model_dir, caplog: pytest.LogCaptureFixture) -> None:
    """An engine holding both roles, its stats every 0.3 s: a request through prefill and decode
    shows up as prompt and generation throughput, then the host goes quiet."""
    from decode_svc.service import DecodeService
    from prefill_svc.service import PrefillService

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = random_prompts((40,), seed=9, vocab=1000)[0]

    async def scenario() -> None:
        engine = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=128)
        host = EngineHost(
            ServiceConfig(engine=engine, instance_id="both", log_stats_interval_s=0.3), nixl=False
        )
        prefill, decode = PrefillService(host), DecodeService(host)
        host.start()
        try:
            request = {"request_id": "r0", "prompt_token_ids": prompt, "params": asdict(params)}
            (first,) = [r async for r in prefill.prefill({"requests": [request]})]
            start = DecodeStart("r0", prompt, asdict(params), first["token_id"], Lease(**first["lease"]))
            async for _ in decode.decode(start.to_wire()):
                pass
            await asyncio.sleep(1.2)  # a line of zeros after the work, then none
        finally:
            host.stop()

    with caplog.at_level(logging.INFO, logger="pdserve.serving"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("both: Avg prompt")]
    pattern = (
        r"both: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
    )
    pattern += r"Running: \d+ reqs, Waiting: \d+ reqs, .*KV cache usage: [\d.]+%"
    pattern += r"(?:, Prefix cache hit rate: [\d.]+%)?$"  # with the prefix cache (on by default)
    rates = [tuple(map(float, re.match(pattern, line).groups())) for line in lines]
    assert sum(prompt for prompt, _ in rates) > 0 and sum(gen for _, gen in rates) > 0
    assert rates[-1] == (0.0, 0.0) and len(rates) <= 5, lines  # 1.2 s idle at the end: one zero line
