"""The router's errors, end to end on CPU: bad requests and unknown routes get OpenAI-shaped errors
from the live router of tests/router_server.py and it keeps serving; a client that leaves stops
its generation; backend failures (fake backends) become errors before and during a stream. At the
end the shared engine's memory must be free after all the traffic of the router API tests."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from pdserve.engine.llm_engine import LLMEngine
from pdserve.tokenizer import Tokenizer, load_tokenizer
from router.app import create_app
from router.backend import BackendError, GenerateRequest, TokenEvent
from tests.helpers import assert_no_leaks
from tests.router_requests import CHAT, MAX_MODEL_LEN, MODEL

pytest_plugins = ["tests.router_server"]  # the shared engine, server and client


def wait_idle(engine: LLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or engine.requests:
        assert time.monotonic() < deadline, f"engine still busy: {list(engine.requests)}"
        time.sleep(0.02)


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
        ("/v1/chat/completions", b'{"model": "\xff"}', 400, "not JSON in UTF-8"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages: Field required"),
        ("/v1/chat/completions", {**CHAT_OK, "messages": "hello"}, 400, "messages"),
        ("/v1/chat/completions", {**CHAT_OK, "max_tokens": "lots"}, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT_OK, "temperature": -1}, 400, "temperature must be finite and >= 0"),
        ("/v1/chat/completions", json.dumps(CHAT_OK)[:-1] + ', "temperature": 1e999}', 400, "finite"),  # inf
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
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens must be"),
        # informational, yet typed (as OpenAI and vLLM answer it)
        ("/v1/chat/completions", {**CHAT_OK, "user": 5}, 400, "user: Input should be a valid string"),
        # vLLM's 400 too: usage options for a stream that is not one
        (
            "/v1/chat/completions",
            {**CHAT_OK, "stream_options": {"include_usage": True}},
            400,
            "stream is true",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {}}, 400, "stream is true"),
    ],
)
def test_bad_requests(server: str, path: str, body: dict | str | bytes, status: int, fragment: str) -> None:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    response = httpx.post(server + path, content=content, headers={"content-type": "application/json"})
    assert_error(response, status, fragment)


# ---- fields the router knows but has not built: a 400 naming the field, never a silent 200
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
COMPLETION_OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
# (path, fields, the param named). Built since, and tested where they are built: logit_bias,
# allowed_token_ids, response_format, structured_outputs and guided_* (tests/test_structured_*),
# prompt_logprobs and completions echo + logprobs (tests/test_echo_logprobs.py)
NOT_BUILT = [
    (CHAT_PATH, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT_PATH, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT_PATH, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CHAT_PATH, {"web_search_options": {}}, None),  # {} asks for nothing
    (CHAT_PATH, {"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    (CHAT_PATH, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT_PATH, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CHAT_PATH, {"use_beam_search": True}, "use_beam_search"),
    (COMPLETIONS_PATH, {"best_of": 3}, "best_of"),
    (COMPLETIONS_PATH, {"suffix": "end"}, "suffix"),
    (CHAT_PATH, {"echo": True}, "echo"),
    (CHAT_PATH, {"bad_words": ["x"]}, "bad_words"),
    (CHAT_PATH, {"chat_template": "{{ messages }}"}, "chat_template"),
    # JSON-schema keywords xgrammar drops without a word: refused, never answered unchecked
    (CHAT_PATH, {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format"),
    (COMPLETIONS_PATH, {"structured_outputs": {"json": {"type": "object", "properties": {
        "a": {"not": {"type": "string"}}}}}}, "structured_outputs"),
    (CHAT_PATH, {"guided_json": json.dumps({"$defs": {"D": {"type": "object", "if": {"required": ["a"]}}},
        "$ref": "#/$defs/D"})}, "guided_json"),
    (COMPLETIONS_PATH, {"guided_json": {"type": "number", "multipleOf": 0.5}}, "guided_json"),
    # ... but a property named like one, or a value that holds one, is data
    (CHAT_PATH, {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"not": {"enum": [{"uniqueItems": True}]}}}}}}, None),
    # neutral values and informational fields pass
    (CHAT_PATH, {"logit_bias": {}, "response_format": {"type": "text"}, "modalities": ["text"]}, None),
    (COMPLETIONS_PATH, {"best_of": 1, "echo": False, "suffix": None, "prompt_logprobs": None}, None),
    (COMPLETIONS_PATH, {"best_of": 1, "n": None}, None),  # n null is n 1
    (CHAT_PATH, {"user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}, None),
    (CHAT_PATH, {"tool_choice": "none", "parallel_tool_calls": True}, None),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "fields", "param"), NOT_BUILT)
def test_not_built_fields_are_refused(
    server: str, path: str, fields: dict, param: str | None, stream: bool
) -> None:
    body = {**(CHAT_OK if path == CHAT_PATH else COMPLETION_OK), "stream": stream, **fields}
    # a field that passes is answered: the first structured request makes xgrammar's view of the
    # vocabulary (this LocalBackend stack has no service warm-up; built, 2.8 s alone on the 2-core
    # CI machine, past httpx's 5 s default with the other worker busy; less once on disk)
    response = httpx.post(server + path, json=body, timeout=60)
    if param is None:
        assert response.status_code == 200, response.text
        return
    assert_error(response, 400, "not supported yet")
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter", error


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


def aborted(server: str) -> float:
    """The router's request_success_total{finished_reason="abort"} (0 before the first abort)."""
    name = 'pdserve:request_success_total{finished_reason="abort"}'
    lines = [x for x in httpx.get(f"{server}/metrics").text.splitlines() if x.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(server: str, engine: LLMEngine, stream: bool) -> None:
    """A client that leaves stops its generation: 100 tokens would take 100 engine steps; the
    router counts it as finished_reason="abort" (as vLLM does)."""
    before, aborts = engine_steps(server), aborted(server)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 100, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server}/v1/chat/completions", json=body) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= 4:
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):  # leaves after ~20 steps of an idle machine's ~5 ms
            httpx.post(f"{server}/v1/chat/completions", json=body, timeout=0.1)
    wait_idle(engine)
    assert engine_steps(server) - before < 50
    deadline = time.monotonic() + 10  # the generation's task closes right after the engine's abort
    while aborted(server) == aborts and time.monotonic() < deadline:
        time.sleep(0.02)
    assert aborted(server) == aborts + 1


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
    response = http.post("/v1/chat/completions", json={**CHAT_OK, "stream": stream})
    assert_error(response, 503, "no prefill")
    assert response.headers["retry-after"] == "1"  # every 503 says when to come back
    http = fake_client(tokenizer, 0, RuntimeError("boom"))
    assert_error(http.post("/v1/completions", json={"prompt": "x", "stream": stream}), 500, "boom")
    assert_error(http.get("/health"), 503, "no instance alive")


def test_backend_fails_mid_stream(tokenizer: Tokenizer) -> None:
    http = fake_client(tokenizer, 2, BackendError("decode instance lost", 500))
    events = sse_events(http.post("/v1/chat/completions", json={**CHAT_OK, "stream": True}))
    assert [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:3]] == ["", "t0", "t1"]
    assert json.loads(events[3])["error"]["message"] == "decode instance lost" and events[4:] == ["[DONE]"]
    assert_error(http.post("/v1/chat/completions", json=CHAT_OK), 500, "decode instance lost")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_wrong_content_type_names_the_header(tokenizer: Tokenizer, content_type: str | None) -> None:
    """A JSON body sent under another Content-Type (or none) is refused, as vLLM refuses it, with a
    400 naming the header and what it should be, not "request body: Input should be a dict"."""
    http = fake_client(tokenizer, 2, None)
    headers = {} if content_type is None else {"content-type": content_type}
    for path, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", CHAT_OK),
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [1]}),
    ]:
        response = http.post(path, content=json.dumps(body), headers=headers)
        assert_error(response, 400, "Content-Type header")
        message = response.json()["error"]["message"]
        assert "expected 'application/json'" in message and (content_type or "missing") in message
        ok = http.post(
            path, content=json.dumps(body), headers={"content-type": "application/json; charset=utf-8"}
        )
        assert ok.status_code == 200, ok.text


def test_openapi_schema_says_400_where_the_router_answers_400(tokenizer: Tokenizer) -> None:
    """FastAPI documents a 422 for every body it validates; the router answers 400 (and 401, 413,
    429, 503 with the error object): a schema-driven client or fuzzer must see what it gets."""
    schema = fake_client(tokenizer, 0, None).get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(
            responses
        )
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert (
        "HTTPValidationError" not in json.dumps(schema) and "ErrorResponse" in schema["components"]["schemas"]
    )


def test_cached_tokens_reported(tokenizer: Tokenizer) -> None:
    r = fake_client(tokenizer, 2, None).post("/v1/completions", json={"prompt": "x y", "n": 2}).json()
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert r["usage"]["completion_tokens"] == 4 and [c["text"] for c in r["choices"]] == ["t0t1", "t0t1"]


# ---- the shared engine, last
def test_engine_memory_all_free(server: str, engine: LLMEngine) -> None:
    """After all the traffic of the shared server (this module's and that of every module sharing it
    on this worker: finished, stopped, failed, disconnected), nothing is held once the prefix cache
    (on by default) is cleared: a prompt of a block or more leaves an entry holding its pages, by
    design. The engine thread is idle here (no request), so the test thread may clear it."""
    wait_idle(engine)
    assert_no_leaks(engine)
