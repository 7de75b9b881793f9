"""lm-evaluation-harness (`lm-eval`, its `local-completions` model) against a real disaggregated
stack (router, prefill, decode processes), on task files written here (no hub, no download): a
`multiple_choice` task, whose log-likelihoods must equal the offline engine's for the same tokens
(fp32, 1e-4), and a `generate_until` task, whose answers must equal the offline engine's greedy
text. Also on the stack: `max_tokens: 0` returns the prompt's logprobs alone and leaves every
pool idle (no lease held, no decode stream opened)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.sampling.params import SamplingParams
from tests.stack import Stack, stack_fixture

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a small town"], "label": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "label": 0},
    {"question": "def fibonacci(n):", "choices": ["\n    return n", " pass", "\n    if n < 2:"], "label": 2},
]
GENERATE = [{"question": "Once upon a time", "answer": "x"}, {"question": "你好，世界", "answer": "y"}]
MAX_GEN_TOKS = 6
BUSY = ("running", "waiting", "held", "receiving", "incoming")
DECODE_STREAMS = "pdserve:decode_requests_total"  # the router's count, over every decode instance


def task_files(folder: Path) -> Path:
    """Two lm-eval tasks over local JSONL files (read by the `json` builder of `datasets`)."""
    for name, docs in (("mc", QUESTIONS), ("gen", GENERATE)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\n"
    (folder / "mc.yaml").write_text(
        f"task: pdserve_tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    (folder / "gen.yaml").write_text(
        f"task: pdserve_tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
        f"generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


stack = stack_fixture("lm-eval", num_prefill=1, num_decode=1)


@pytest.fixture
def offline(cached_llm) -> LLMEngine:
    """The offline engine (CPU, fp32, 512 tokens, the prefix cache on): the session's, its cache
    empty (tests/conftest.py)."""
    return cached_llm.engine


def run_offline(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError("the offline request did not finish")


def offline_loglikelihood(
    engine: LLMEngine, context: list[int], continuation: list[int]
) -> tuple[float, bool]:
    """lm-eval's (sum of the continuation's logprobs, whether each of its tokens is the argmax)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    entries = run_offline(engine, context + continuation, params).prompt_logprobs[len(context) :]
    greedy = all(next(iter(e["top_logprobs"])) == e["token_id"] for e in entries)
    return sum(e["logprob"] for e in entries), greedy


def test_lm_eval_local_completions(
    stack: Stack, offline: LLMEngine, tiny_model_dir, tmp_path, monkeypatch
) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # never the hub
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    lm = LocalCompletionsAPI(
        base_url=f"{stack.url}/v1/completions",
        model="tiny",
        tokenizer=str(tiny_model_dir),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        num_concurrent=2,
        max_retries=1,
        timeout=60,
    )
    tasks = TaskManager(include_path=str(task_files(tmp_path)), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["pdserve_tiny_mc", "pdserve_tiny_gen"], task_manager=tasks, log_samples=True
    )
    assert set(results["results"]) == {"pdserve_tiny_mc", "pdserve_tiny_gen"}

    scored = results["samples"]["pdserve_tiny_mc"]
    assert sum(len(s["arguments"]) for s in scored) == sum(len(q["choices"]) for q in QUESTIONS)
    for sample in scored:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            want, want_greedy = offline_loglikelihood(offline, context_ids, continuation_ids)
            got, got_greedy = resp[0]
            assert got == pytest.approx(want, abs=1e-4), (context, continuation)
            assert got_greedy == want_greedy

    generated = results["samples"]["pdserve_tiny_gen"]
    assert len(generated) == len(GENERATE)
    for sample in generated:
        context = sample["arguments"][0][0]
        params = SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS, stop=["\n"])
        want = run_offline(offline, lm.tok_encode(context), params).text
        assert sample["resps"][0][0] == want


def test_max_tokens_zero_returns_the_prompt_logprobs_and_holds_nothing(
    stack: Stack, offline: LLMEngine
) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = offline.tokenizer.encode(prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    decoded_before = stack.metric(DECODE_STREAMS)
    answer = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] == len(ids)
    ref = run_offline(offline, ids, SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [e["logprob"] for e in ref.prompt_logprobs[1:]], abs=1e-4
    )
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    # nothing is held for a decode instance: every pool idle as soon as the instances report
    deadline = time.monotonic() + 5
    while True:
        loads = list(stack.instance_loads().values())
        # idle: nothing running, queued, held under a lease or arriving, and every KV page free
        # but those the prefix cache keeps (its checkpoints hold state slots: not a lease's)
        idle = [
            not any(load.get(k) for k in BUSY)
            and load["free_kv_pages"] + load["prefix_cache_pages"] == load["kv_pages"]
            for load in loads
        ]
        if len(loads) == 2 and all(idle):
            break
        assert time.monotonic() < deadline, f"pools not idle: {loads}"
        time.sleep(0.1)
    assert stack.metric(DECODE_STREAMS) == decoded_before, "no decode stream may open for max_tokens 0"
