"""The small endpoints and flags vLLM users script against, in-process (router.app over a recording
backend, the tiny model's tokenizer and Qwen3.6-shaped chat template): /tokenize and /detokenize
(vLLM's shapes; a chat's count is its prompt_tokens, tools and tool-result turns included),
/version, /ping; several served names; generation_config.json defaults, --seed and
--max-logprobs as the requests reaching the backend show them."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from pdserve.request_defaults import RequestDefaults, choice_seed
from pdserve.tokenizer import Tokenizer, load_tokenizer
from router.api_flags import ApiOptions
from router.app import create_app, pdserve_version
from router.backend import GenerateRequest, TokenEvent
from tests.live_server import serving
from tests.schema_checks import check_answer

NAMES = ("qwen-tiny", "./models/tiny", "alias")
CHAT = [{"role": "user", "content": "Weather in Oslo?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_TURNS = [
    *CHAT,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "-3 C and windy"},
]
MAX_MODEL_LEN = 4096


class RecordingBackend:
    """Answers every request with one token ("ok"), logprobs when asked; keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        self.requests.append(req)
        k = req.params.logprobs
        logprobs = (
            None
            if k is None
            else [{"token_id": 7, "logprob": -0.5, "top_logprobs": {i: -1.0 - i for i in range(k)}}]
        )
        yield TokenEvent([7], "ok", logprobs, True, "stop")

    async def health(self) -> dict:
        return {"prefill": 1, "decode": 1}

    def max_model_len(self) -> int:
        return MAX_MODEL_LEN


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def served(tokenizer: Tokenizer) -> Iterator[tuple[str, RecordingBackend]]:
    backend = RecordingBackend()
    defaults = RequestDefaults({"temperature": 0.7, "top_k": 20, "max_tokens": 50}, seed=1234)
    api = ApiOptions(model_root="/models/tiny", defaults=defaults, max_logprobs=5)
    with serving(create_app(backend, tokenizer, NAMES, api=api)) as url:
        yield url, backend


@pytest.fixture(scope="module")
def client(served: tuple[str, RecordingBackend]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="x", max_retries=0, timeout=30)


def post(served: tuple[str, RecordingBackend], path: str, body: dict) -> httpx.Response:
    headers = {
        "content-type": "application/json"
    }  # json.dumps escapes a lone surrogate; httpx would not send it
    return httpx.post(f"{served[0]}{path}", content=json.dumps(body), headers=headers, timeout=30)


# ---- /tokenize, /detokenize
def test_tokenize_a_prompt_and_back(served: tuple, tokenizer: Tokenizer) -> None:
    answer = post(
        served, "/tokenize", {"model": "alias", "prompt": "Hello <think> world", "return_token_strs": True}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == tokenizer.encode("Hello <think> world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"][0] == "Hello" and "<think>" in body["token_strs"]
    back = post(served, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello <think> world"}
    long = body["tokens"] * (MAX_MODEL_LEN // len(body["tokens"]))  # decoded on a worker thread
    assert post(served, "/detokenize", {"tokens": long}).json() == {"prompt": tokenizer.decode(long)}
    plain = post(served, "/tokenize", {"prompt": "Hi"}).json()
    assert plain["token_strs"] is None and plain["count"] == 1


def test_a_chat_counts_as_its_prompt_tokens_tools_and_tool_results_included(served: tuple, client) -> None:
    counts = {}
    for name, extra in (("plain", {}), ("tools", {"tools": [WEATHER]})):
        got = post(served, "/tokenize", {"messages": TOOL_TURNS, **extra}).json()
        answer = client.chat.completions.create(
            model=NAMES[0], messages=TOOL_TURNS, tool_choice="none", **extra
        )
        assert answer.usage.prompt_tokens == got["count"] == len(served[1].requests[-1].prompt_token_ids)
        counts[name] = got["count"]
        text = post(served, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"]
        assert "<|im_start|>user\n<tool_response>\n-3 C and windy\n</tool_response><|im_end|>" in text
        assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>" in text
        assert text.endswith("<|im_start|>assistant\n<think>\n")
        assert ("<name>get_weather</name>" in text) == (name == "tools")
    assert counts["tools"] > counts["plain"]
    no_prompt = post(served, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    thinking_off = post(
        served, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert no_prompt["count"] < thinking_off.json()["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": 7}, 400, "prompt"),
        ("/tokenize", {"prompt": "\ud800"}, 400, None),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ x }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"nope": 1}}, 400, "chat_template_kwargs"),
        ("/detokenize", {"tokens": [1, 248_077]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "12"}, 400, "tokens"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
        ("/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}, 400, "tokens"),  # none the server makes
    ],
)
def test_bad_tokenize_requests_are_openai_errors(
    served: tuple, path: str, body: dict, status: int, param
) -> None:
    answer = post(served, path, body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert param is None or error["param"] == param, error


# ---- /version, /ping, /v1/models
def test_version_and_ping(served: tuple) -> None:
    url = served[0]
    assert (
        httpx.get(f"{url}/version").json() == {"version": pdserve_version()}
        and pdserve_version() != "unknown"
    )
    for method in ("GET", "POST"):
        answer = httpx.request(method, f"{url}/ping")
        assert answer.status_code == 200 and answer.content == b""


def test_every_served_name_is_accepted_and_answers_carry_the_first(client: openai.OpenAI) -> None:
    cards = client.models.list().data
    assert [card.id for card in cards] == list(NAMES)
    assert {card.model_extra["root"] for card in cards} == {"/models/tiny"}
    for name in NAMES:
        chat = client.chat.completions.create(model=name, messages=CHAT)
        completion = client.completions.create(model=name, prompt="Hi")
        assert chat.model == completion.model == NAMES[0]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="tiny", messages=CHAT)


def test_a_model_card_is_retrieved_by_name(client: openai.OpenAI) -> None:
    """OpenAI's GET /v1/models/{model}: each served name's card, as the list has it; another is a 404."""
    listed = {card.id: card.model_dump() for card in client.models.list().data}
    assert {name: client.models.retrieve(name).model_dump() for name in NAMES} == listed
    with pytest.raises(openai.NotFoundError, match="does not exist") as missing:
        client.models.retrieve("tiny")
    assert missing.value.body["code"] == "model_not_found"


# ---- request defaults
def test_generation_config_defaults_fill_what_the_request_leaves_unset(served: tuple, client) -> None:
    backend = served[1]
    client.chat.completions.create(model=NAMES[0], messages=CHAT)
    params = backend.requests[-1].params
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 20, 50)
    client.chat.completions.create(
        model=NAMES[0], messages=CHAT, temperature=0.0, max_tokens=9, extra_body={"top_k": 3}
    )
    params = backend.requests[-1].params
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 3, 9)
    client.completions.create(model=NAMES[0], prompt="Hi")  # completions' own default of 16 stays
    assert backend.requests[-1].params.max_tokens == 16 and backend.requests[-1].params.temperature == 0.7


def test_seed_seeds_the_requests_that_set_none(served: tuple, client) -> None:
    backend = served[1]
    client.chat.completions.create(model=NAMES[0], messages=CHAT, n=2)
    first = [r.params.seed for r in backend.requests[-2:]]
    client.chat.completions.create(model=NAMES[0], messages=CHAT)
    second = backend.requests[-1].params.seed
    assert first[0] is not None and first[1] == choice_seed(first[0], 1) and second not in first
    client.chat.completions.create(model=NAMES[0], messages=CHAT, seed=5)
    assert backend.requests[-1].params.seed == 5


def test_an_unseeded_server_leaves_requests_unseeded(tokenizer: Tokenizer) -> None:
    backend = RecordingBackend()
    with serving(create_app(backend, tokenizer, "m")) as url:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}).status_code == 200
    assert backend.requests[-1].params.seed is None


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 6}, "prompt_logprobs"),
    ],
)
def test_max_logprobs(served: tuple, path: str, body: dict, param: str) -> None:
    answer = post(served, path, body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert "--max-logprobs" in answer.json()["error"]["message"]
    name = "top_logprobs" if param == "top_logprobs" else param
    assert post(served, path, {**body, name: 5}).status_code == 200


def test_bad_defaults_and_options_stop_the_start(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature"):
        RequestDefaults.load(tmp_path)
    with pytest.raises(ValueError, match="max-logprobs"):
        ApiOptions(max_logprobs=21)


# ---- schemathesis over the two routes' own OpenAPI document: answers as declared, never a 5xx
@pytest.fixture(scope="module")
def tokenize_schema(tokenizer: Tokenizer) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(RecordingBackend(), tokenizer, NAMES))
    schema.config.seed = 8
    return schema


tokenize_routes = schemathesis.pytest.from_fixture("tokenize_schema").include(
    path_regex="^/(tokenize|detokenize)$"
)


@tokenize_routes.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_tokenize_routes_answer_as_declared(case: schemathesis.Case) -> None:
    check_answer(case, case.call(timeout=30))
