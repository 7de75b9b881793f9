"""Structured output and forced tool calls end to end (issue 8, acceptance 1 and 2): the official
`openai` client against real router processes over a disaggregated stack (redis, a prefill and a
decode process: the prefill samples the first token under the grammar, the decode process goes
on from it). The tiny random model follows the grammar: 20 sampled strict json_schema answers
all validate; tool_choice "required" and a named function always give calls whose arguments
validate against the tool's schema, in the qwen3_coder and in the hermes format, streamed and
not; logit_bias steers an exact token; the refusals name their field."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from pdserve.rpc import free_port
from pdserve.tokenizer import load_tokenizer
from tests.chat_templates import QWEN_STYLE_TEMPLATE
from tests.stack import Stack

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Tell me about a person, as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["name", "hobbies", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC"]}, "utc_offset": {"type": "boolean"}},
    "required": ["zone"],
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
PARSERS = ("qwen3_coder", "hermes")
MAX_MODEL_LEN = "1024"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that renders tools (Qwen3.6-shaped)."""
    out = tmp_path_factory.mktemp("tiny-tools")
    for item in tiny_model_dir.iterdir():
        (out / item.name).symlink_to(item)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").unlink()
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN_STYLE_TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def routers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, openai.OpenAI]:
    """A stack whose router reads qwen3_coder calls, and a second router (hermes, with the qwen3
    reasoning parser) over the same prefill and decode processes."""
    length = ["--max-model-len", MAX_MODEL_LEN]  # the tools take ~250 prompt tokens
    flags = {"prefill": length, "decode": length, "router": [*length, "--tool-call-parser", "qwen3_coder"]}
    stack = Stack(model_dir, tmp_path_factory.mktemp("structured"), 1, 1, extra_flags=flags).start()
    port = free_port()
    try:
        stack._spawn(  # the second router: Stack starts one
            "router-hermes", "router", "--model", str(model_dir), "--served-model-name", MODEL,
            "--port", str(port), "--redis-url", stack.redis.url, "--max-model-len", MAX_MODEL_LEN,
            "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        )  # fmt: skip
        hermes = f"http://127.0.0.1:{port}"
        wait_healthy(hermes, stack.procs["router-hermes"])
        urls = {"qwen3_coder": stack.url, "hermes": hermes}
        yield {
            p: openai.OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0, timeout=120)
            for p, u in urls.items()
        }
    finally:
        stack.stop()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the second router exited"
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("decode") == 1:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def chat(client: openai.OpenAI, stream: bool, **kwargs: object) -> tuple[str | None, list[dict], str]:
    """(content, calls as {"name", "arguments"}, finish_reason) of one answer, stream or not."""
    kwargs.setdefault("messages", CHAT)
    if not stream:
        choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
        calls = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or ()
        ]
        assert all(c.id.startswith("call_") for c in choice.message.tool_calls or ())
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.index == len(calls):
                calls.append({"name": call.function.name, "arguments": ""})
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, calls, finish


# ---- response_format (acceptance 2)
def test_strict_json_schema_answers_all_validate(routers: dict[str, openai.OpenAI]) -> None:
    client = routers["qwen3_coder"]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }

    def ask(seed: int) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            response_format=response_format,
            temperature=1.0,
            seed=seed,
            max_tokens=320,
        )

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, range(20)))
    texts = [a.choices[0].message.content for a in answers]
    assert [a.choices[0].finish_reason for a in answers] == ["stop"] * 20, texts
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 10  # sampled, not one answer twenty times


def test_json_object_parses(routers: dict[str, openai.OpenAI], model_dir: Path) -> None:
    """Steered by logit_bias so the answer is exact: quotes first, then ':' and '}'."""
    tokenizer = load_tokenizer(model_dir)
    bias = {str(tokenizer.encode(c)[0]): b for c, b in (("{}", -100), ('"', 100), (":", 50), ("}", 50))}
    for stream in (False, True):
        content, _, finish = chat(
            routers["qwen3_coder"], stream, response_format={"type": "json_object"}, temperature=0,
            max_tokens=20, logit_bias=bias,
        )  # fmt: skip
        assert (json.loads(content), finish) == ({"": ""}, "stop")


def test_guided_fields_of_vllm(routers: dict[str, openai.OpenAI]) -> None:
    client = routers["qwen3_coder"]
    for seed in range(3):
        text = (
            client.completions.create(
                model=MODEL,
                prompt="Pick:",
                max_tokens=8,
                seed=seed,
                extra_body={"guided_choice": ["red", "green"]},
            )
            .choices[0]
            .text
        )
        assert text in ("red", "green")
    regex = client.completions.create(
        model=MODEL,
        prompt="Code:",
        max_tokens=10,
        seed=1,
        extra_body={"structured_outputs": {"regex": "[A-F]{3}-[0-9]{2}"}},
    ).choices[0]
    assert (len(regex.text), regex.text[3], regex.finish_reason) == (6, "-", "stop")


def test_logit_bias_steers_an_exact_token(routers: dict[str, openai.OpenAI], model_dir: Path) -> None:
    paris = load_tokenizer(model_dir).encode(" Paris")
    assert len(paris) == 1
    answer = routers["qwen3_coder"].completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        logit_bias={str(paris[0]): 100},
    )
    assert answer.choices[0].text == " Paris" * 4


# ---- forced tool calls (acceptance 1)
@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [
        ("required", True),
        ("required", False),
        ({"type": "function", "function": {"name": "get_weather"}}, True),
    ],
)
def test_forced_calls_are_valid(
    routers: dict[str, openai.OpenAI], parser: str, stream: bool, tool_choice: object, parallel: bool
) -> None:
    extra = {"chat_template_kwargs": {"enable_thinking": False}}  # hermes' router parses reasoning
    for seed in range(2):
        content, calls, finish = chat(
            routers[parser], stream, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
            temperature=1.0, seed=seed, max_tokens=300, extra_body=extra,
        )  # fmt: skip
        # a named function finishes "stop" (OpenAI and vLLM), "required" for "tool_calls"
        assert (content, finish) == (None, "stop" if isinstance(tool_choice, dict) else "tool_calls"), calls
        assert calls and (len(calls) == 1 or (parallel and tool_choice == "required"))
        if isinstance(tool_choice, dict):
            assert [c["name"] for c in calls] == ["get_weather"]
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("parser", PARSERS)
def test_a_named_function_with_fixed_arguments_is_exact(
    routers: dict[str, openai.OpenAI], parser: str
) -> None:
    fixed = {"type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "get_time", "parameters": fixed}}]
    for stream in (False, True):
        named = {"type": "function", "function": {"name": "get_time"}}
        _, calls, finish = chat(
            routers[parser], stream, tools=tools, tool_choice=named,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )  # fmt: skip
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"zone": "UTC"})]
        assert finish == "stop"  # the client forced the call: OpenAI and vLLM answer "stop"


# ---- refusals name their field
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": "x"}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "structural_tag", "format": "x"}}, "response_format.format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"logit_bias": {"12": 101}}, "logit_bias"),
        ({"logit_bias": {"999999999": 1}}, "logit_bias"),
        ({"bad_words": ["x"]}, "bad_words"),
    ],
)
def test_bad_structured_requests_are_400s(
    routers: dict[str, openai.OpenAI], fields: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        routers["qwen3_coder"].chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, extra_body=fields
        )
    assert e.value.response.json()["error"]["param"] == param


def test_a_grammar_that_does_not_compile_is_a_400(routers: dict[str, openai.OpenAI]) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        routers["qwen3_coder"].completions.create(
            model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "(unclosed"}
        )
    error = e.value.response.json()["error"]
    assert "does not compile" in error["message"] and error["param"] == "guided_regex", error
    schema = {"name": "s", "schema": {"type": "wat"}}  # the param names the field the spec came from
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            routers["qwen3_coder"].chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=4,
                stream=stream,
                response_format={"type": "json_schema", "json_schema": schema},
            )
        error = e.value.response.json()["error"]
        assert error["param"] == "response_format" and error["message"].startswith("response_format: "), error
