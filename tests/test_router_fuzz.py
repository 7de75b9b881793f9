"""The router against garbage: random JSON in every field of both generation endpoints, broken
bodies, wrong content types, random methods and paths, clients leaving mid-stream. The target is
the live router of tests/router_server.py (uvicorn on loopback, LocalBackend, tiny model, CPU, fp32).

Invariants: never a 5xx; every non-2xx is an OpenAI error object (a JSON one for stream=true too);
a 2xx is a valid completion or SSE stream; afterwards a greedy request answers as before and every
KV page and state slot is free. Requests stay tiny (max_tokens and n <= 4); the examples are
derandomized (every run sends the same ones)."""

from __future__ import annotations

import copy
import itertools
import json
import time
from collections.abc import Iterator
from types import UnionType
from typing import Any, Union, get_args, get_origin
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pdserve.engine.llm_engine import LLMEngine
from pdserve.tokenizer import compile_chat_template
from router.protocol import ChatCompletionRequest, CompletionRequest
from tests.helpers import assert_no_leaks
from tests.router_requests import MODEL

pytest_plugins = ["tests.router_server"]  # the shared engine and server

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BASE = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    COMPLETIONS: {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 2},
}
FIELDS = {CHAT: ChatCompletionRequest.model_fields, COMPLETIONS: CompletionRequest.model_fields}
BUDGET_FIELDS = ("max_tokens", "max_completion_tokens", "n")  # kept small: the run must stay fast
# derandomized: every run sends the same cases, so more examples only re-send a fixed corpus;
# 500 a route keeps the suite inside its CI budget (1,000 took 42 s of the 2-core machine)
FUZZ = settings(max_examples=500, deadline=None, database=None, derandomize=True)
FUZZ = settings(FUZZ, suppress_health_check=list(HealthCheck))

# ---- strategies: JSON values of every type, and edge values of each field's declared type
ODD_STRINGS = ["", "\x00", "x" * 100_000, "🙂" * 500, "<|im_start|>", "<|im_end|>", "<|endoftext|>", "NaN"]
ODD_STRINGS += ["-Infinity", "1e999", "-1", "true", "{{ 7 * 7 }}", "é\u0301", MODEL, "user", "assistant"]
SURROGATES = ["\ud800", "a\udfffb", "\udc80\ud800"]  # lone: json.dumps escapes them (NaN, Infinity: bare)
ODD_INTS = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400]
ODD_INTS += [248_076, 248_077]  # the tokenizer's last id, its vocabulary size
ODD_FLOATS = [1e308, -1e308, 5e-324, 1e-46, 1e-300, 1e-5, 0.999e-5, -0.0, 2.5, float("nan"), float("inf")]
TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
STRINGS = TEXT | st.sampled_from(ODD_STRINGS) | st.sampled_from(SURROGATES)
INTS = st.integers(-3, 8) | st.integers() | st.sampled_from(ODD_INTS)
FLOATS = st.floats() | st.floats(0, 2) | st.sampled_from(ODD_FLOATS)  # NaN, +-Infinity as JS literals
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | INTS | FLOATS | STRINGS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=8,
)
KEYS = TEXT | st.sampled_from(["user", "logit_bias", "tools", "eos_token", "bos_token", "enable_thinking"])
SIMPLE = {int: INTS, float: FLOATS, bool: st.booleans(), str: STRINGS, type(None): st.none()}


def typed(tp: Any) -> st.SearchStrategy:
    """Edge values of a declared type (unions, lists, dicts, models): they get past pydantic."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, UnionType):
        return st.one_of(*map(typed, args))
    if origin is list:
        return st.lists(typed(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(KEYS, JSON_VALUES, max_size=3)
    if isinstance(tp, type) and issubclass(tp, BaseModel):  # every field, and some unknown ones
        known = st.fixed_dictionaries({k: typed(f.annotation) for k, f in tp.model_fields.items()})
        return st.builds(lambda extra, known: {**extra, **known}, st.dictionaries(KEYS, JSON_VALUES), known)
    return SIMPLE.get(tp, JSON_VALUES)


def long_budget(value: Any) -> bool:
    """Could the router read `value` as a budget (or n) above 4, or as "no limit"?"""
    try:
        return value is None or float(value) > 4  # bools, numbers, numeric strings: pydantic coerces
    except (TypeError, ValueError, OverflowError):
        return False


@st.composite
def mutated_body(draw: st.DrawFn, path: str) -> Any:
    """A valid body, streamed or not, with garbage: 1/4 in one known field (an edge value of its type),
    1/2 in 1-3 fields (known or not; edge values or any JSON), else the whole body is any JSON."""
    kind = draw(st.integers(0, 3))
    if not kind:
        return draw(JSON_VALUES)
    body = {**copy.deepcopy(BASE[path]), "stream": draw(st.booleans())}
    for _ in range(1 if kind == 1 else draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(FIELDS[path])) if kind == 1 or draw(st.booleans()) else KEYS)
        field = FIELDS[path].get(name)
        value = draw(typed(field.annotation) if field and (kind == 1 or draw(st.booleans())) else JSON_VALUES)
        if name in BUDGET_FIELDS and long_budget(value):
            value = draw(st.integers(1, 4) | st.integers(min_value=257))  # n: past MAX_CHOICES
        body[name] = value
    return body


# ---- the server (shared), a client of it and a greedy answer from before the garbage
@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    no_reuse = httpx.Limits(max_keepalive_connections=0)  # a 500 closes its connection: a new one each
    with httpx.Client(base_url=server, timeout=60, limits=no_reuse) as client:
        yield client


GREEDY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "logprobs": 1}


@pytest.fixture(scope="module")
def greedy_before(http: httpx.Client) -> list[dict]:
    """A greedy answer (text, tokens, logprobs) from before the garbage: the last test asks again."""
    return http.post(COMPLETIONS, json=GREEDY).raise_for_status().json()["choices"]


# ---- invariants
def assert_error(response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:2000]}"
    assert response.headers["content-type"] == "application/json", response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and all(isinstance(error[k], str | None) for k in ("message", "param", "code"))


def assert_completion(path: str, body: dict) -> None:
    assert body["object"] == ("chat.completion" if path == CHAT else "text_completion"), body
    assert body["model"] == MODEL and body["choices"], body
    for i, choice in enumerate(body["choices"]):
        assert choice["index"] == i and choice["finish_reason"] in ("stop", "length"), choice
        assert isinstance(choice["message"]["content"] if path == CHAT else choice["text"], str), choice
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= 4 * len(body["choices"]), usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage


def assert_stream(path: str, response: httpx.Response) -> None:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text[-2000:]
    for event in map(json.loads, events[:-1]):
        assert "error" not in event, event
        assert event["object"] == ("chat.completion.chunk" if path == CHAT else "text_completion"), event


def post(http: httpx.Client, path: str, content: bytes | str, content_type: str | None) -> httpx.Response:
    """Sends a body to a generation endpoint and checks the invariants of whatever comes back."""
    headers = {"content-type": content_type} if content_type else {}
    response = http.post(path, content=content, headers=headers)
    if not 200 <= response.status_code < 300:
        assert_error(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert_stream(path, response)
    else:
        assert_completion(path, response.json())
    return response


@pytest.mark.usefixtures("greedy_before")
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@FUZZ
@given(data=st.data(), content_type=st.sampled_from(["application/json", None]))
def test_garbage_fields_and_bodies(
    http: httpx.Client, path: str, data: st.DataObject, content_type: str | None
) -> None:
    post(http, path, json.dumps(data.draw(mutated_body(path), label="body")), content_type)


BAD_FIELDS = [  # (path, fields over BASE, status, error param or None); streamed and not
    (CHAT, {"model": "\ud800"}, 400, None),  # found: a 500, the 404 naming the model could not be encoded
    (CHAT, {"messages": [{"role": "user", "content": "a\udfffb"}]}, 400, None),  # found: tokenizer TypeError
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc80"}]}]}, 400, None),
    (COMPLETIONS, {"prompt": ["ok", "\ud800"]}, 400, None),
    (CHAT, {"chat_template_kwargs": {"eos_token": "x"}}, 400, "chat_template_kwargs"),  # found: TypeError
    (CHAT, {"min_tokens": 1, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),  # found: failed the step
    (COMPLETIONS, {"prompt": [2**40], "echo": True}, 400, "prompt"),  # found: OverflowError in the echo
    (CHAT, {"top_p": 1e-46, "n": 2}, 200, None),  # found: 0 in float32, an empty nucleus failed the step
    (COMPLETIONS, {"seed": 2**64}, 400, "seed"),  # found: torch's "Overflow when unpacking long long"
]
BOTH = [  # garbage for both endpoints
    ({"temperature": "hot"}, 400, "temperature"), ({"top_p": 0, "stream_options": 7}, 400, "stream_options"),
    ({"n": -1}, 400, "n"), ({"max_tokens": 10**6}, 400, None), ({"model": "other"}, 404, "model"),
    ({"stop_token_ids": [-1], "stop": [1]}, 400, "stop"), ({"prompt": [], "messages": []}, 400, None),
    ({"min_tokens": 9, "temperature": float("nan")}, 400, None),
]  # fmt: skip
BAD_FIELDS += [(path, *case) for path in (CHAT, COMPLETIONS) for case in BOTH]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", BAD_FIELDS)
def test_bad_fields(http: httpx.Client, case: tuple[str, dict, int, str | None], stream: bool) -> None:
    """The bugs found, and garbage in stream=true requests: a JSON error, never a broken stream."""
    path, fields, status, param = case
    response = post(http, path, json.dumps({**BASE[path], "stream": stream, **fields}), "application/json")
    assert response.status_code == status
    assert status == 200 or param is None or response.json()["error"]["param"] == param


def test_template_errors_are_400(
    http: httpx.Client, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat template that loops over a kwarg gets a number: render() raised TypeError, a 500."""
    template = "{% for doc in documents %}{{ doc }}{% endfor %}{{ messages[0]['content'] }}"
    # the server's tokenizer is the engine's; its compiled template is a cached property
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    monkeypatch.setattr(engine.tokenizer, "_template", compile_chat_template(template))
    for documents, status in ((5, 400), (None, 400), (["a"], 200)):
        body = {**BASE[CHAT], "chat_template_kwargs": {"documents": documents}}
        assert post(http, CHAT, json.dumps(body), "application/json").status_code == status


DEEP = b"[" * 900 + b"]" * 900  # as deep as the parser goes
BAD_BODIES = [
    b"", b"{", b"not json at all", b"a=1&b=2", b'{"prompt": "x"}{"prompt": "y"}',
    b'{"model": "x", "messages": [{"role": "user", "content": "hi"}',  # truncated
    b"\xff\xfe\x00garbage\x80",  # not UTF-8
    b'{"prompt": "\xc3\x28", "messages": [{"role": "user", "content": "\xff"}]}',  # bad UTF-8 in strings
    b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser recurses
    b'{"max_tokens": 1, "b": %s, "messages": [{"role": "user", "content": "x", "a": %s}]}' % (DEEP, DEEP),
    b'{"max_tokens": ' + b"9" * 5_000 + b"}",  # beyond Python's int-from-string digit limit
    b'{"prompt": "x", "messages": [], "max_tokens": NaN, "temperature": Infinity}',
    b'{"prompt": [' + b"1," * 1_250_000 + b'1], "messages": "' + b"x" * 2_500_000 + b'"}',  # 5 MB
    b"\x00" * 5_000_000,  # 5 MB of garbage
    b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--x--\r\n",
    *(json.dumps(body).encode() for body in BASE.values()),  # valid, but not always declared as JSON
]  # fmt: skip
CONTENT_TYPES = ["application/json", "application/json; charset=latin-1", "text/plain", None]
CONTENT_TYPES += ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("content", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_broken_bodies(http: httpx.Client, path: str, content: bytes) -> None:
    for content_type in CONTENT_TYPES[: 1 if len(content) > 10**6 else None]:  # 5 MB once: a second each
        post(http, path, content, content_type)


METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "PROPFIND"])
PATHS = st.one_of(
    st.sampled_from([CHAT, COMPLETIONS, "/v1/models", "/health", "/metrics", "/", "/v1", "/v1/chat"]),
    st.text(st.characters(codec="ascii", exclude_characters="#?"), max_size=30).map(lambda p: "/" + p),
    st.text(max_size=10).map(lambda p: "/v1/" + p),
)


@settings(FUZZ, max_examples=150)
@given(method=METHODS, path=PATHS, body=st.none() | JSON_VALUES.map(json.dumps))
def test_methods_and_paths(http: httpx.Client, method: str, path: str, body: str | None) -> None:
    raw_path = quote(path, safe="/%:@!$&'()*+,;=~").encode()  # sent as it is, not normalised
    response = http.request(method, http.base_url.copy_with(raw_path=raw_path), content=body)
    assert response.status_code < 500, f"{method} {path}: {response.status_code} {response.text[:500]}"
    if not 200 <= response.status_code < 300 and method != "HEAD":
        assert_error(response)


# ---- clients that leave
def assert_all_free(engine: LLMEngine) -> None:
    """Once the engine is done with what is left (aborts of clients gone), nothing is held."""
    deadline = time.monotonic() + 20
    while (engine.has_unfinished() or engine.requests) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert_no_leaks(engine)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_disconnects_free_everything(http: httpx.Client, engine: LLMEngine, path: str) -> None:
    """Clients leaving mid-stream (after 1 to 6 lines, n of 1 or 3) leave nothing allocated."""
    long = {**BASE[path], "max_tokens": 100, "ignore_eos": True, "stream": True}
    for n, lines in [(1, 1), (1, 2), (3, 3), (1, 6), (3, 6)]:
        with http.stream("POST", path, json={**long, "n": n}) as response:
            assert len(list(itertools.islice(response.iter_lines(), lines))) == lines, response.status_code
    assert_all_free(engine)


# ---- afterwards (keep last)
def test_server_unharmed(http: httpx.Client, engine: LLMEngine, greedy_before: list[dict]) -> None:
    response = http.post(COMPLETIONS, json=GREEDY)
    assert response.status_code == 200 and response.json()["choices"] == greedy_before
    assert_all_free(engine)
