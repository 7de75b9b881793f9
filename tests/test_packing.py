"""Packed prefill equals each prompt alone; chunked prefill equals unchunked; preemption is exact.

Each prefill holds its memory (as the prefill service does for a transfer) so the final GDN
conv/recurrent states and the KV pages can be read back and compared.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling.sampler import SamplerOutput
from tests.helpers import assert_no_leaks, random_prompts

LENGTHS = (1, 7, 63, 64, 65, 200)
TOL = 1e-5


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=1024).engine


@pytest.fixture(autouse=True)
def no_leaks(engine: LLMEngine):
    yield
    engine.scheduler.max_num_batched_tokens = engine.config.max_num_batched_tokens
    assert_no_leaks(engine)


def prefill_and_read_state(engine: LLMEngine, prompts: list[list[int]], token_budget: int) -> list[dict]:
    """Prefill `prompts` together under `token_budget`; return each one's logits and final state."""
    engine.scheduler.max_num_batched_tokens = token_budget
    seqs = []
    for p in prompts:
        seq = engine.make_sequence(p, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        seq.hold_memory = True
        engine.requests[seq.request_id] = seq
        engine.scheduler.add(seq)
        seqs.append(seq)
    logits = {}
    passes = 0
    while engine.has_unfinished():
        scheduled = engine.scheduler.schedule()
        rows = engine.runner.execute(scheduled)
        sampling = [s.seq for s in scheduled if s.samples]
        for seq, row in zip(sampling, rows, strict=True):
            logits[seq.request_id] = row
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        engine.postprocess(sampling, SamplerOutput(token_ids=rows.argmax(dim=-1)))
        passes += 1
    kv, states = engine.runner.kv_pool, engine.runner.state_pool
    results = []
    for seq in seqs:
        n = len(seq.prompt_token_ids)
        pages = torch.tensor(seq.block_table)
        seq_kv = kv.kv[:, :, pages].flatten(2, 3)[:, :, :n].clone()
        results.append(
            {
                "logits": logits[seq.request_id],
                "conv": states.conv[:, seq.state_slot].clone(),
                "recurrent": states.recurrent[:, seq.state_slot].clone(),
                "kv": seq_kv,
                "passes": passes,
            }
        )
        engine.scheduler.release_held(seq)
    return results


def assert_same(a: dict, b: dict, what: str, rtol: float = TOL) -> None:
    """Max |a - b| within `rtol` of the largest magnitude (fp32 rounding, nothing more)."""
    for key in ("logits", "conv", "recurrent", "kv"):
        diff = (a[key] - b[key]).abs().max().item()
        scale = max(1.0, b[key].abs().max().item())
        assert diff <= rtol * scale, f"{what}: {key} differs by {diff} (scale {scale})"


def test_packed_prefill_equals_each_prompt_alone(engine: LLMEngine) -> None:
    prompts = random_prompts(LENGTHS, seed=2)
    packed = prefill_and_read_state(engine, prompts, token_budget=4096)
    assert packed[0]["passes"] == 1, "all prompts should share one pass"
    for prompt, together in zip(prompts, packed, strict=True):
        (alone,) = prefill_and_read_state(engine, [prompt], token_budget=4096)
        assert_same(together, alone, f"prompt of {len(prompt)} tokens")


def test_chunked_prefill_equals_unchunked(engine: LLMEngine) -> None:
    prompts = random_prompts((200, 65, 7), seed=3)
    whole = prefill_and_read_state(engine, prompts, token_budget=4096)
    chunked = prefill_and_read_state(engine, prompts, token_budget=24)
    assert chunked[0]["passes"] >= 12, "a 24-token budget must chunk 272 tokens over many passes"
    for prompt, a, b in zip(prompts, whole, chunked, strict=True):
        # Chunk boundaries move the GDN scan's fp32 rounding (q/k RMSNorm can amplify it in K).
        assert_same(a, b, f"prompt of {len(prompt)} tokens chunked by 24", rtol=1e-4)


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
