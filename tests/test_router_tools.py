"""Tools through the router, end to end with the `openai` client: the tools reach the chat
template (and the prompt), a tool-result turn renders, tool calls come back parsed (streamed and
not, qwen3_coder and hermes), one call or several. The shared routers over a scripted backend:
tests/scripted_chat_router.py; the tools, calls and `ask`: tests/scripted_chat.py."""

from __future__ import annotations

import json

import pytest

from pdserve.tokenizer import Tokenizer
from tests.scripted_chat import (
    CHAT,
    MODEL,
    TOOLS,
    WEATHER,
    XML_CALL,
    ScriptedRouters,
    ask,
    joined_stream,
)

pytest_plugins = ["tests.scripted_chat_router"]  # the shared routers and tokenizer
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


# ---- tools reach the template
def test_tools_are_in_the_prompt(scripted_routers: ScriptedRouters, qwen_style_tokenizer: Tokenizer) -> None:
    plain, backend = ask(scripted_routers, "qwen3_coder", "Hi", tool_choice="none")
    with_tools, _ = ask(scripted_routers, "qwen3_coder", "Hi", tools=TOOLS, tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    prompt = qwen_style_tokenizer.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt and '"name": "get_time"' in prompt
    # tool_choice none: tools rendered, the output is not parsed
    called, _ = ask(scripted_routers, "qwen3_coder", "</think>" + XML_CALL, tools=TOOLS, tool_choice="none")
    assert called.choices[0].message.content == XML_CALL and not called.choices[0].message.tool_calls


def test_a_tool_result_turn_renders(
    scripted_routers: ScriptedRouters, qwen_style_tokenizer: Tokenizer
) -> None:
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
    answer, backend = ask(
        scripted_routers, "qwen3_coder", "</think>It is 18C.", messages=history, tools=TOOLS
    )
    prompt = qwen_style_tokenizer.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>" in prompt
    assert answer.choices[0].message.content == "It is 18C." and answer.choices[0].finish_reason == "stop"


# ---- tool calls parsed, both formats, streamed and not
@pytest.mark.parametrize(("parser", "call"), [("qwen3_coder", XML_CALL), ("hermes", HERMES_CALL)])
def test_tool_call_parsed(scripted_routers: ScriptedRouters, parser: str, call: str) -> None:
    text = ("</think>\n\n" if parser == "qwen3_coder" else "") + "Let me check.\n\n" + call
    answer, backend = ask(scripted_routers, parser, text, tools=TOOLS)
    choice = answer.choices[0]
    content = "Let me check." + ("\n\n" if parser == "hermes" else "")  # hermes: as written (vLLM's)
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    [tool_call] = choice.message.tool_calls
    assert tool_call.id.startswith("call_") and tool_call.type == "function"
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "days": 2}

    client, _ = scripted_routers[parser]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, stream=True))
    streamed = joined_stream(chunks)
    assert streamed["finish"] == "tool_calls" and streamed["content"] == content
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
        ("get_weather", tool_call.function.arguments)
    ]
    with_args = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    if parser == "qwen3_coder":
        assert len(with_args) > 2  # the arguments came in pieces, as they formed
    else:
        assert len(with_args) == 1  # hermes: the call once its block closed and its JSON checked


def test_parallel_tool_calls(scripted_routers: ScriptedRouters) -> None:
    two = XML_CALL + "\n" + XML_CALL.replace("Paris", "Rome")
    answer, _ = ask(scripted_routers, "qwen3_coder", "</think>" + two, tools=TOOLS)
    calls = answer.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert calls[0].id != calls[1].id and answer.choices[0].message.content is None
    one, _ = ask(scripted_routers, "qwen3_coder", "</think>" + two, tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]
