"""Tools and reasoning through the router, end to end with the `openai` client: the tools reach the
chat template (and the prompt), a tool-result turn renders, tool calls come back parsed (streamed
and not, qwen3_coder and hermes), `<think>` becomes reasoning_content, `enable_thinking: false`
reaches the template; what is not built yet is a 400 naming the field.

The backend is scripted (the tiny random model never writes a tool call): it answers each request
with a set text, three characters an event, and remembers the requests (prompt ids, params). The
tokenizer is the tiny model's with a Qwen3.6-shaped template (tests/chat_templates.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tokenizers

from pdserve.tokenizer import Tokenizer, load_tokenizer
from router.app import create_app
from router.backend import GenerateRequest, TokenEvent
from router.chat_output import ChatParsingConfig, add_arguments
from tests.chat_templates import QWEN_STYLE_TEMPLATE
from tests.live_server import serving

MODEL = "tiny-qwen36"
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, TIME]
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


class ScriptedBackend:
    """Answers every request with `text`, three characters an event; keeps the requests."""

    def __init__(self) -> None:
        self.text = ""
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        self.requests.append(req)
        pieces = [self.text[i : i + 3] for i in range(0, len(self.text), 3)] or [""]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield TokenEvent([7], piece, None, last, "stop" if last else None)

    async def health(self) -> dict:
        return {}

    def max_model_len(self) -> int:
        return 4096


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    tiny = load_tokenizer(tiny_model_dir)
    return Tokenizer(tiny.backend, tiny.eos_token_ids, QWEN_STYLE_TEMPLATE, tiny.special_tokens)


CONFIGS = {
    "qwen3_coder": ChatParsingConfig("qwen3_coder", "qwen3", enable_auto_tool_choice=True),
    "hermes": ChatParsingConfig("hermes", None, enable_auto_tool_choice=True),
    "plain": ChatParsingConfig(),
}


@pytest.fixture(scope="module")
def routers(tokenizer: Tokenizer) -> Iterator[dict[str, tuple[openai.OpenAI, ScriptedBackend]]]:
    """A live router per parsing configuration, each with its own scripted backend."""
    with contextlib.ExitStack() as stack:
        out = {}
        for name, config in CONFIGS.items():
            backend = ScriptedBackend()
            url = stack.enter_context(serving(create_app(backend, tokenizer, MODEL, chat_parsing=config)))
            out[name] = (openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30), backend)
        yield out


def ask(routers: dict, name: str, text: str, **kwargs: object) -> tuple[object, ScriptedBackend]:
    client, backend = routers[name]
    backend.text = text
    return client.chat.completions.create(
        model=MODEL, messages=kwargs.pop("messages", CHAT), **kwargs
    ), backend


def joined_stream(chunks: list) -> dict:
    """A streamed answer joined as a client joins it: content, reasoning, calls by index."""
    out: dict = {"content": "", "reasoning": "", "calls": [], "finish": None, "first_call_chunks": []}
    for chunk in chunks:
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            if call.index == len(out["calls"]):
                assert call.id.startswith("call_") and call.type == "function" and call.function.name
                out["calls"].append({"id": call.id, "name": call.function.name, "arguments": ""})
            out["calls"][call.index]["arguments"] += call.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


# ---- tools reach the template
def test_tools_are_in_the_prompt(routers: dict, tokenizer: Tokenizer) -> None:
    plain, backend = ask(routers, "qwen3_coder", "Hi", tool_choice="none")
    with_tools, _ = ask(routers, "qwen3_coder", "Hi", tools=TOOLS, tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    prompt = tokenizer.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt and '"name": "get_time"' in prompt
    # tool_choice none: tools rendered, the output is not parsed
    called, _ = ask(routers, "qwen3_coder", "</think>" + XML_CALL, tools=TOOLS, tool_choice="none")
    assert called.choices[0].message.content == XML_CALL and not called.choices[0].message.tool_calls


def test_a_tool_result_turn_renders(routers: dict, tokenizer: Tokenizer) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]
    answer, backend = ask(routers, "qwen3_coder", "</think>It is 18C.", messages=history, tools=TOOLS)
    prompt = tokenizer.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>" in prompt
    assert answer.choices[0].message.content == "It is 18C." and answer.choices[0].finish_reason == "stop"


# ---- tool calls parsed, both formats, streamed and not
@pytest.mark.parametrize(("parser", "call"), [("qwen3_coder", XML_CALL), ("hermes", HERMES_CALL)])
def test_tool_call_parsed(routers: dict, parser: str, call: str) -> None:
    text = ("</think>\n\n" if parser == "qwen3_coder" else "") + "Let me check.\n\n" + call
    answer, backend = ask(routers, parser, text, tools=TOOLS)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [tool_call] = choice.message.tool_calls
    assert tool_call.id.startswith("call_") and tool_call.type == "function"
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "days": 2}

    client, _ = routers[parser]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, stream=True))
    streamed = joined_stream(chunks)
    assert streamed["finish"] == "tool_calls" and streamed["content"] == "Let me check."
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
        ("get_weather", tool_call.function.arguments)
    ]
    with_args = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(with_args) > 2  # the arguments came in pieces, as they formed


def test_parallel_tool_calls(routers: dict) -> None:
    two = XML_CALL + "\n" + XML_CALL.replace("Paris", "Rome")
    answer, _ = ask(routers, "qwen3_coder", "</think>" + two, tools=TOOLS)
    calls = answer.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert calls[0].id != calls[1].id and answer.choices[0].message.content is None
    one, _ = ask(routers, "qwen3_coder", "</think>" + two, tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]


# ---- reasoning
def test_reasoning_content(routers: dict, tokenizer: Tokenizer) -> None:
    text = "The user wants a greeting.\n</think>\n\nHello!"
    answer, backend = ask(routers, "qwen3_coder", text)
    message = answer.choices[0].message
    assert (message.reasoning_content, message.content) == ("The user wants a greeting.", "Hello!")
    assert tokenizer.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False).endswith(
        "<think>\n"
    )
    client, _ = routers["qwen3_coder"]
    streamed = joined_stream(list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True)))
    assert (streamed["reasoning"], streamed["content"], streamed["finish"]) == (
        "The user wants a greeting.",
        "Hello!",
        "stop",
    )
    # without a reasoning parser the text is the content, as it is
    plain, _ = ask(routers, "plain", text)
    assert plain.choices[0].message.content == text


def test_enable_thinking_false_reaches_the_template(routers: dict, tokenizer: Tokenizer) -> None:
    answer, backend = ask(
        routers, "qwen3_coder", "Hello!", extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    prompt = tokenizer.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (
        answer.choices[0].message.content == "Hello!" and answer.choices[0].message.reasoning_content is None
    )


def test_parsers_see_special_tags(routers: dict, tokenizer: Tokenizer) -> None:
    """The tiny tokenizer decodes <think> and <tool_call> as text, as Qwen's own: nothing to change;
    a tokenizer that makes them special has parsing requests decoded with skip_special_tokens=false."""
    _, backend = ask(routers, "qwen3_coder", "x")
    assert backend.requests[-1].params.skip_special_tokens is True
    hiding = json.loads(tokenizer.backend.to_str())
    for added in hiding["added_tokens"]:
        added["special"] = True
    backend_json = tokenizers.Tokenizer.from_str(json.dumps(hiding))
    special = Tokenizer(backend_json, tokenizer.eos_token_ids, QWEN_STYLE_TEMPLATE, tokenizer.special_tokens)
    with contextlib.ExitStack() as stack:
        hidden = {}
        for name in ("qwen3_coder", "plain"):
            backend = ScriptedBackend()
            app = create_app(backend, special, MODEL, chat_parsing=CONFIGS[name])
            url = stack.enter_context(serving(app))
            hidden[name] = (openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0), backend)
        _, backend = ask(hidden, "qwen3_coder", "x")
        assert backend.requests[-1].params.skip_special_tokens is False
        _, backend = ask(hidden, "qwen3_coder", "x", extra_body={"skip_special_tokens": True})
        assert backend.requests[-1].params.skip_special_tokens is True  # what the client says wins
        _, backend = ask(hidden, "plain", "x")
        assert backend.requests[-1].params.skip_special_tokens is True


# ---- never a silent 200
def post(routers: dict, name: str, body: dict) -> httpx.Response:
    client, _ = routers[name]
    return httpx.post(f"{client.base_url}chat/completions", json={"model": MODEL, "messages": CHAT, **body})


REFUSED = [
    ("qwen3_coder", {"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ("qwen3_coder", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ("qwen3_coder", {"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    ("qwen3_coder", {"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name", "required"),
    ("plain", {"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
    ("qwen3_coder", {"chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs", "does not read"),
    ("qwen3_coder", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "cannot set"),
    ("qwen3_coder", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("name", "body", "param", "fragment"), REFUSED)
def test_refused_tool_requests(
    routers: dict, name: str, body: dict, param: str, fragment: str, stream: bool
) -> None:
    response = post(routers, name, {**body, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_a_template_without_tools_refuses_them(tiny_model_dir: Path) -> None:
    tiny = load_tokenizer(tiny_model_dir)
    chatml = Tokenizer(tiny.backend, tiny.eos_token_ids, CHATML_TEMPLATE)  # never reads tools
    app = create_app(ScriptedBackend(), chatml, MODEL, chat_parsing=CONFIGS["qwen3_coder"])
    with serving(app) as url:
        body = {"model": MODEL, "messages": CHAT, "tools": TOOLS}
        response = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
        assert "does not render tools" in response.json()["error"]["message"]


def test_parsing_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice"]
    )
    assert ChatParsingConfig.from_args(args) == CONFIGS["qwen3_coder"]
    assert ChatParsingConfig.from_args(parser.parse_args([])) == ChatParsingConfig()
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ChatParsingConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        ChatParsingConfig("mistral")
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "deepseek_r1"])
