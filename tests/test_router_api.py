"""The router's OpenAI layer, end to end on CPU: the tiny model in an LLMEngine behind a
LocalBackend, served by uvicorn on a loopback port and driven by the official `openai` client
(httpx where the client cannot send the request). Greedy outputs must equal `pdserve.LLM`'s.
Backend failures are tested with fake backends; the engine's memory must be free at the end."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.tokenizer import Tokenizer, load_tokenizer
from router.app import create_app
from router.backend import BackendError, GenerateRequest, LocalBackend, TokenEvent
from router.metrics import RouterMetrics

MODEL = "tiny-qwen36"
MAX_MODEL_LEN = 128
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
PROMPT = "The quick brown fox"
STREAM_WITH_USAGE = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN
    )
    return LLMEngine(config)


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(engine: LLMEngine) -> Iterator[str]:
    metrics = RouterMetrics()
    backend = LocalBackend(engine, metrics)
    app = create_app(backend, engine.tokenizer, MODEL, metrics)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)
    backend.close()


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def reference(offline: LLM, prompt: str | list[int], **params: object) -> tuple[str, list[int], str]:
    """(text, token ids, finish reason) of the offline API on the same prompt."""
    params = {"temperature": 0.0, "max_tokens": 8, **params}
    out = offline.generate(prompt, SamplingParams(**params))[0]
    return out.text, out.token_ids, out.finish_reason


def chat_prompt(offline: LLM, messages: list[dict] = CHAT) -> str:
    return offline.tokenizer.apply_chat_template(messages)


def wait_idle(engine: LLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or engine.requests:
        assert time.monotonic() < deadline, f"engine still busy: {list(engine.requests)}"
        time.sleep(0.02)


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


# ---- errors: the OpenAI shape, and the server keeps answering
def assert_error(response: httpx.Response, status: int, fragment: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


CHAT_OK = {"model": MODEL, "messages": CHAT, "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/chat/completions", '{"model": "x", "messages": [', 400, "malformed JSON"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages: Field required"),
        ("/v1/chat/completions", {**CHAT_OK, "messages": "hello"}, 400, "messages"),
        ("/v1/chat/completions", {**CHAT_OK, "max_tokens": "lots"}, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT_OK, "temperature": -1}, 400, "temperature must be >= 0"),
        ("/v1/chat/completions", {**CHAT_OK, "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", {**CHAT_OK, "stop": 5}, 400, "stop: must be a string or a list"),
        ("/v1/chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {**CHAT_OK, "n": 0}, 400, "n must be"),
        ("/v1/chat/completions", {**CHAT_OK, "chat_template_kwargs": {"messages": []}}, 400, "cannot set"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt must not be empty"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", 1]}, 400, "prompt: must be a string"),
        ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "vocabulary"),
        ("/v1/completions", {"model": MODEL, "prompt": [10**9], "stream": True}, 400, "vocabulary"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be"),
    ],
)
def test_bad_requests(server: str, path: str, body: dict | str, status: int, fragment: str) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(server + path, content=content, headers={"content-type": "application/json"})
    assert_error(response, status, fragment)


def test_client_errors_and_routes(client: openai.OpenAI, server: str) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert_error(e.value.response, 404, "gpt-4")
    assert e.value.response.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=-3)
    assert_error(e.value.response, 400, "max_tokens must be at least 1")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1] * MAX_MODEL_LEN)
    assert_error(e.value.response, 400, "maximum context length is 128")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1] * 100, max_tokens=50)
    assert_error(e.value.response, 400, "maximum context length")
    assert_error(httpx.get(f"{server}/v1/nothing"), 404, "Invalid URL (GET /v1/nothing)")
    assert_error(httpx.get(f"{server}/v1/chat/completions"), 405, "GET /v1/chat/completions")
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # still serving
    assert r.usage.completion_tokens == 2


def engine_steps(server: str) -> float:
    text = httpx.get(f"{server}/metrics").text
    return float(
        next(x for x in text.splitlines() if x.startswith("pdserve:local_engine_step_seconds_count")).split()[
            -1
        ]
    )


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(server: str, engine: LLMEngine, stream: bool) -> None:
    """A client that leaves stops its generation: 100 tokens would take 100 engine steps."""
    before = engine_steps(server)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 100, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server}/v1/chat/completions", json=body) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= 4:
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/chat/completions", json=body, timeout=0.3)
    wait_idle(engine)
    assert engine_steps(server) - before < 50


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


def test_engine_memory_all_free(server: str, engine: LLMEngine) -> None:
    """After all the traffic above (finished, stopped, failed, disconnected), nothing is held."""
    wait_idle(engine)
    kv, states = engine.runner.kv_pool, engine.runner.state_pool
    assert kv.num_free == kv.num_pages and states.num_free == states.num_slots


# ---- backend failures, with fake backends
class FakeBackend:
    """Yields `tokens` events, then fails with `error` (or finishes when it is None)."""

    def __init__(self, tokens: int, error: Exception | None) -> None:
        self.tokens, self.error = tokens, error

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        for i in range(self.tokens):
            last = i == self.tokens - 1 and self.error is None
            yield TokenEvent([100 + i], f"t{i}", None, last, "length" if last else None, cached_tokens=3)
        if self.error is not None:
            raise self.error

    async def health(self) -> dict:
        raise BackendError("no instance alive", 503)

    def max_model_len(self) -> int:
        return 64


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


def fake_client(tokenizer: Tokenizer, tokens: int, error: Exception | None) -> TestClient:
    return TestClient(create_app(FakeBackend(tokens, error), tokenizer, MODEL), raise_server_exceptions=False)


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_backend_fails_before_first_token(tokenizer: Tokenizer, stream: bool) -> None:
    http = fake_client(tokenizer, 0, BackendError("no prefill instance", 503))
    assert_error(http.post("/v1/chat/completions", json={**CHAT_OK, "stream": stream}), 503, "no prefill")
    http = fake_client(tokenizer, 0, RuntimeError("boom"))
    assert_error(http.post("/v1/completions", json={"prompt": "x", "stream": stream}), 500, "boom")
    assert_error(http.get("/health"), 503, "no instance alive")


def test_backend_fails_mid_stream(tokenizer: Tokenizer) -> None:
    http = fake_client(tokenizer, 2, BackendError("decode instance lost", 500))
    events = sse_events(http.post("/v1/chat/completions", json={**CHAT_OK, "stream": True}))
    assert [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:3]] == ["", "t0", "t1"]
    assert json.loads(events[3])["error"]["message"] == "decode instance lost" and events[4:] == ["[DONE]"]
    assert_error(http.post("/v1/chat/completions", json=CHAT_OK), 500, "decode instance lost")


def test_cached_tokens_reported(tokenizer: Tokenizer) -> None:
    r = fake_client(tokenizer, 2, None).post("/v1/completions", json={"prompt": "x y", "n": 2}).json()
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert r["usage"]["completion_tokens"] == 4 and [c["text"] for c in r["choices"]] == ["t0t1", "t0t1"]
