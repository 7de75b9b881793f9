"""The router's OpenAI layer, end to end on CPU: the live router of tests/router_server.py driven
by the official `openai` client (httpx where the client cannot send the request). Greedy outputs
must equal `pdserve.LLM`'s. Errors, disconnects and backend failures are in test_router_errors.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from tests.router_requests import CHAT, MAX_MODEL_LEN, MODEL

pytest_plugins = ["tests.router_server"]  # the shared engine, server and client

PROMPT = "The quick brown fox"
STREAM_WITH_USAGE = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)


def reference(offline: LLM, prompt: str | list[int], **params: object) -> tuple[str, list[int], str]:
    """(text, token ids, finish reason) of the offline API on the same prompt."""
    params = {"temperature": 0.0, "max_tokens": 8, **params}
    out = offline.generate(prompt, SamplingParams(**params))[0]
    return out.text, out.token_ids, out.finish_reason


def chat_prompt(offline: LLM, messages: list[dict] = CHAT) -> str:
    return offline.tokenizer.apply_chat_template(messages)


# ---- the happy paths
def test_models_and_health(client: openai.OpenAI, server: str) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{server}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_chat_matches_offline(client: openai.OpenAI, offline: LLM) -> None:
    text, ids, reason = reference(offline, chat_prompt(offline))
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.created > 0
    assert r.choices[0].message.role == "assistant"
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, reason)
    prompt_tokens = len(offline.tokenizer.encode(chat_prompt(offline)))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, len(ids))
    assert r.usage.total_tokens == prompt_tokens + len(ids)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_matches_offline(client: openai.OpenAI, offline: LLM) -> None:
    text, ids, reason = reference(offline, chat_prompt(offline))
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0, **STREAM_WITH_USAGE
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert "".join(c.choices[0].delta.content or "" for c in body) == text
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == [reason]
    assert last.choices == [] and last.usage.completion_tokens == len(ids)
    assert all(c.usage is None for c in body)


def test_continuous_usage_stats(client: openai.OpenAI, offline: LLM) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk of a choice carries that choice's
    usage so far (the role chunk: no output yet), the last chunk the request's totals."""
    prompt_tokens = len(offline.tokenizer.encode(chat_prompt(offline)))
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, n=2, stream=True, stream_options=options
    )
    *body, last = list(stream)
    assert last.choices == [] and last.usage.completion_tokens == 8
    seen = {0: [], 1: []}
    for c in body:
        assert c.usage.prompt_tokens == prompt_tokens
        assert c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens
        seen[c.choices[0].index].append(c.usage.completion_tokens)
    assert all(counts[0] == 0 and counts[-1] == 4 and counts == sorted(counts) for counts in seen.values())
    cmpl = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stream=True, stream_options=options
    )
    assert [c.usage.completion_tokens for c in cmpl if c.choices] == [1, 2, 3]
    plain = client.completions.create(  # without include_usage it asks for nothing, as in vLLM
        model=MODEL, prompt=PROMPT, max_tokens=3, stream=True, stream_options={"continuous_usage_stats": True}
    )
    assert all(c.usage is None for c in plain)


def test_null_means_default(server: str) -> None:
    """n, stream, logprobs and echo are nullable in OpenAI's API (and vLLM's): null is the default,
    as clients generated from the OpenAPI spec send it, never a 400."""
    nulls = {"n": None, "stream": None, "logprobs": None}
    bodies = {
        "/v1/chat/completions": {"model": MODEL, "messages": CHAT, "max_tokens": 2, **nulls},
        "/v1/completions": {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": None, **nulls},
    }
    for path, body in bodies.items():
        response = httpx.post(server + path, json=body, timeout=60)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert choice["logprobs"] is None and choice["finish_reason"] == "length"


def test_completions_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    text, _, _ = reference(offline, PROMPT)
    ids = offline.tokenizer.encode(PROMPT)
    for prompt in (PROMPT, ids):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert r.id.startswith("cmpl-") and r.choices[0].text == text
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    other = "Once upon a time"
    r = client.completions.create(model=MODEL, prompt=[PROMPT, other], max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [text, reference(offline, other)[0]]
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + text


def test_completions_stream(client: openai.OpenAI, offline: LLM) -> None:
    text, ids, _ = reference(offline, PROMPT, max_tokens=6)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, **STREAM_WITH_USAGE
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(ids) == 6


def test_stop_strings(client: openai.OpenAI, offline: LLM) -> None:
    full, _, _ = reference(offline, chat_prompt(offline), max_tokens=12)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.find(stop)]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stop=[stop])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (expected, "stop")
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stop=stop, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def answers(server: str, path: str, body: dict) -> tuple[dict, list[dict]]:
    """(the choice of a non-streamed answer, the choices of every chunk of the streamed one)."""
    choice = httpx.post(server + path, json=body, timeout=60).json()["choices"][0]
    lines = httpx.post(server + path, json={**body, "stream": True}, timeout=60).text.splitlines()
    events = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: {")]
    return choice, [c for event in events for c in event["choices"]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stop_reason(server: str, offline: LLM, path: str) -> None:
    """vLLM's `stop_reason` in every choice: the stop string or stop token id that ended it, null
    when the length did; streamed, every chunk's choice has it, set in the one that finishes."""
    chat = path == "/v1/chat/completions"
    full, ids, _ = reference(
        offline, chat_prompt(offline) if chat else PROMPT, max_tokens=12, ignore_eos=True
    )
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    base = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    base |= {"messages": CHAT} if chat else {"prompt": PROMPT}
    for fields, reason, expected in [
        ({"stop": [stop]}, "stop", stop),
        ({"stop_token_ids": [ids[3]]}, "stop", ids[3]),
        ({}, "length", None),
    ]:
        choice, streamed = answers(server, path, {**base, **fields})
        assert (choice["finish_reason"], choice["stop_reason"]) == (reason, expected), fields
        assert all("stop_reason" in c for c in streamed), streamed
        assert [(c["finish_reason"], c["stop_reason"]) for c in streamed if c["finish_reason"]] == [
            (reason, expected)
        ]
        assert all(c["stop_reason"] is None for c in streamed if not c["finish_reason"])


def test_stop_reason_of_an_eos_that_is_also_a_stop_token_id(
    server: str, engine: LLMEngine, offline: LLM
) -> None:
    """vLLM checks eos first: a token that is both eos and a stop token id finishes with
    stop_reason null, streamed or not (with ignore_eos it names itself)."""
    eos = reference(offline, PROMPT, max_tokens=12, ignore_eos=True)[1][3]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    saved = engine.eos_token_ids
    engine.eos_token_ids = (eos,)  # the served engine's eos: a token greedy decoding emits
    try:
        for ignore_eos, expected in [(False, None), (True, eos)]:
            choice, streamed = answers(
                server, "/v1/completions", {**body, "stop_token_ids": [eos], "ignore_eos": ignore_eos}
            )
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", expected), ignore_eos
            assert [(c["finish_reason"], c["stop_reason"]) for c in streamed if c["finish_reason"]] == [
                ("stop", expected)
            ]
    finally:
        engine.eos_token_ids = saved


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode())
        assert t.logprob == pytest.approx(max(top.logprob for top in t.top_logprobs))  # greedy: the argmax
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(t.top_logprobs == [] for t in streamed)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and top[token] == pytest.approx(value) and value <= 0


def test_n_choices_with_seed(client: openai.OpenAI, offline: LLM) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [
        reference(offline, PROMPT, max_tokens=6, temperature=1.0, seed=seed)[0] for seed in (7, 8)
    ]
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT)) and r.usage.completion_tokens == 12
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2, stream=True)
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in stream if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_extra_fields_and_vllm_extensions(client: openai.OpenAI, offline: LLM) -> None:
    text, _, _ = reference(offline, PROMPT, max_tokens=4, ignore_eos=True, min_tokens=2, top_k=5)
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        user="someone",
        extra_body={"ignore_eos": True, "min_tokens": 2, "top_k": 5, "not_a_field": [1]},
    )
    assert r.choices[0].text == text


def test_metrics(server: str) -> None:
    text = httpx.get(f"{server}/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        count = next(line for line in text.splitlines() if line.startswith(f"pdserve:{name}_count"))
        assert float(count.split()[-1]) > 0
        assert f'pdserve:{name}_bucket{{le="+Inf"}}' in text
    for line in ("pdserve:num_requests_running 0.0", "pdserve:num_requests_waiting 0.0"):
        assert line in text
    assert 'pdserve:request_success_total{finished_reason="length"}' in text
    assert "pdserve:prompt_tokens_total" in text and "pdserve:generation_tokens_total" in text
    assert "pdserve:local_engine_step_seconds_count" in text  # registered by the backend
