"""Tool requests the router refuses, never a silent 200: a 400 naming the field for what is not
built yet or is malformed (streamed and not), for tools a template would not render; and the
chat-parsing flags, with the combinations they refuse. The shared routers over a scripted
backend: tests/scripted_chat_router.py; the tools and configurations: tests/scripted_chat.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest

from pdserve.tokenizer import Tokenizer, load_tokenizer
from router.app import create_app
from router.chat_output import ChatParsingConfig, add_arguments
from tests.live_server import serving
from tests.scripted_chat import CHAT, CONFIGS, MODEL, TOOLS, WEATHER, ScriptedBackend, ScriptedRouters

pytest_plugins = ["tests.scripted_chat_router"]  # the shared routers
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def post(routers: ScriptedRouters, name: str, body: dict) -> httpx.Response:
    client, _ = routers[name]
    return httpx.post(f"{client.base_url}chat/completions", json={"model": MODEL, "messages": CHAT, **body})


UNIQUE_XS = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
UNIQUE_TOOL = {
    "type": "function",
    "function": {"name": "pick", "parameters": {"type": "object", "properties": {"xs": UNIQUE_XS}}},
}
REFUSED = [
    ("qwen3_coder", {"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ("qwen3_coder", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ("qwen3_coder", {"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    ("qwen3_coder", {"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name", "required"),
    ("plain", {"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
    ("qwen3_coder", {"chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs", "does not read"),
    ("qwen3_coder", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "cannot set"),
    # a forced call's arguments are held to its schema: a keyword xgrammar drops is refused
    ("hermes", {"tools": [UNIQUE_TOOL], "tool_choice": "required"}, "tools",
     "'uniqueItems' at #/properties/xs"),
    ("qwen3_coder", {"tools": [WEATHER, UNIQUE_TOOL], "tool_choice": {"type": "function",
        "function": {"name": "pick"}}}, "tools", "not support yet"),
    ("qwen3_coder", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("name", "body", "param", "fragment"), REFUSED)
def test_refused_tool_requests(
    scripted_routers: ScriptedRouters, name: str, body: dict, param: str, fragment: str, stream: bool
) -> None:
    response = post(scripted_routers, name, {**body, "stream": stream})
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
