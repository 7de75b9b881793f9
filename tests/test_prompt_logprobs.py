"""Prompt logprobs (vLLM's `prompt_logprobs`) from the engine equal transformers' full-prompt
forward (fp32, 1e-4), also when chunked prefill spreads a prompt over several passes packed with
other requests; a request that does not ask gets none; `max_tokens=0` scores the prompt only."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.sampling.params import SamplingParams
from tests.helpers import assert_no_leaks, random_prompts

TOP = 3
BUDGET = 24  # tokens per pass: the longer prompts are chunked, and share passes with the others


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    config = EngineConfig(
        str(tiny_model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=BUDGET
    )
    return LLMEngine(config)


def reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over the whole prompt: row p predicts token p + 1."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
    """Run the requests to the end; every page and slot is free again (the cache's, if any, aside)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    if engine.prefix_cache is None:
        assert_no_leaks(engine)
    return [outputs[i] for i in ids]


def assert_matches(entries: list, prompt: list[int], ref: torch.Tensor, top: int) -> None:
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for p in range(1, len(prompt)):
        entry, row = entries[p], ref[p - 1]
        assert entry["token_id"] == prompt[p]
        assert entry["logprob"] == pytest.approx(row[prompt[p]].item(), abs=1e-4)
        own = row[prompt[p]]  # the rank within the 1e-4 tolerance (a random model has near ties)
        assert int((row > own + 1e-4).sum()) + 1 <= entry["rank"] <= int((row > own - 1e-4).sum()) + 1
        values, ids = row.topk(top)
        assert list(entry["top_logprobs"]) == ids.tolist()
        assert list(entry["top_logprobs"].values()) == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_equal_transformers_across_chunks(engine, hf_model) -> None:
    prompts = random_prompts((1, 5, 37, 70, 9), seed=3)
    asked = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    params = [asked, asked, asked, asked, plain]
    outputs = run(engine, prompts, params)
    for prompt, out, sp in zip(prompts, outputs, params, strict=True):
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), TOP)
    # the output tokens are those of the same requests without prompt logprobs
    again = run(engine, prompts, [plain] * len(prompts))
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]


def test_zero_alternatives_give_the_token_alone(engine, hf_model) -> None:
    prompt = random_prompts((30,), seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (out,) = run(engine, [prompt], [params])
    assert all(entry["top_logprobs"] == {} for entry in out.prompt_logprobs[1:])
    ref = reference(hf_model, prompt)
    got = [e["logprob"] for e in out.prompt_logprobs[1:]]
    want = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-4)


def test_max_tokens_zero_scores_the_prompt_only(engine, hf_model) -> None:
    prompt = random_prompts((50,), seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)
    (out,) = run(engine, [prompt], [params])
    assert out.finished and out.finish_reason == "length"
    assert out.token_ids == [] and out.new_token_ids == []
    assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), 1)


def test_prefix_cache_hits_are_skipped_for_prompt_logprobs(cached_llm, hf_model) -> None:
    cached = cached_llm.engine  # CPU, fp32, 512 tokens, the prefix cache on and empty (tests/conftest.py)
    prompt = random_prompts((200,), seed=6)[0]
    run(cached, [prompt], [SamplingParams(temperature=0, max_tokens=1)])  # fills the cache
    assert cached.prefix_cache.entries, "the first request must leave a cache entry"
    (out,) = run(cached, [prompt], [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)])
    assert out.num_cached_tokens == 0
    assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), 2)
    cached.prefix_cache.clear()
    assert_no_leaks(cached)
