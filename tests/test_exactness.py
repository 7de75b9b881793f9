"""The spine: pdserve's model equals transformers' Qwen3_5MoeForCausalLM on the tiny checkpoint.

Logits of packed prefills and of decode steps (with requests joining and finishing mid-way)
are compared with transformers' full forward over the same token sequence.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from tests.helpers import assert_no_leaks, random_prompts

PROMPT_LENGTHS = (1, 7, 63, 64, 65, 200)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=1024)


@pytest.fixture(autouse=True)
def no_leaks(llm: LLM):
    yield
    assert_no_leaks(llm.engine)


def record_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """Wrap the runner so every sampled row's logits are kept per request id."""
    seen: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(scheduled, patch=None):
        logits = execute(scheduled, patch)
        sampling = [s.seq.request_id for s in scheduled if s.samples]
        for rid, row in zip(sampling, logits, strict=True):
            seen.setdefault(rid, []).append(row.clone())
        return logits

    engine.runner.execute = recording
    return seen


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def test_packed_prefill_and_decode_match_transformers(llm: LLM, hf_model) -> None:
    engine = llm.engine
    seen = record_logits(engine)
    try:
        prompts = random_prompts(PROMPT_LENGTHS, seed=1)
        greedy = [
            SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (16, 5, 16, 9, 16, 12)
        ]
        # Four prompts share the first packed pass (then up to 16 decode steps); two more join
        # after three decode steps; requests finish at different steps.
        for i in range(4):
            engine.add_request(prompts[i], greedy[i], request_id=f"r{i}")
        outputs = {}
        steps = 0
        while engine.has_unfinished():
            if steps == 3:
                for i in (4, 5):
                    engine.add_request(prompts[i], greedy[i], request_id=f"r{i}")
            for out in engine.step():
                outputs[out.request_id] = out
            steps += 1
    finally:
        del engine.runner.execute
    for i, prompt in enumerate(prompts):
        out = outputs[f"r{i}"]
        assert out.finished and len(out.token_ids) == greedy[i].max_tokens
        ref = hf_logits(hf_model, prompt + out.token_ids[:-1])[len(prompt) - 1 :]
        # running ahead, the step after a request's last token computed it once more: that
        # row's token was dropped (pdserve.engine.run_ahead), so it is not compared
        ours = torch.stack(seen[f"r{i}"][: len(out.token_ids)])
        assert ours.shape == ref.shape
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4, f"prompt of {len(prompt)} tokens: max |logit diff| {diff}"


def test_greedy_generation_matches_transformers_generate(llm: LLM, hf_model) -> None:
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about GPUs."}])
    texts = ["The capital of France is", "def fibonacci(n):", "你好，世界", chat]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(texts, params)
    for text, out in zip(texts, outputs, strict=True):
        ids = tok.encode(text)
        assert out.prompt_token_ids == ids
        ref = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
        )[0, len(ids) :].tolist()
        assert out.token_ids == ref, f"prompt {text!r}"
        assert out.text == tok.decode(out.token_ids)
        assert out.finish_reason == "length"
