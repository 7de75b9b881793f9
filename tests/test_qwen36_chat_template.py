"""The tiny model's Qwen3.6-shaped chat template (pdserve.qwen36_chat_template): tools in the system
turn in the Qwen3-Coder XML form, assistant tool calls, tool results, reasoning of the current turn
only, enable_thinking; rendered the same by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.tokenizer import Tokenizer, load_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "its name"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call-1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
}
TOOL_LOOP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "reasoning_content": "The tool knows.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call-1", "content": "-3 C"},
    {"role": "tool", "tool_call_id": "call-2", "content": "windy"},
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


def test_tools_render_in_the_system_turn_as_xml(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(TOOL_LOOP[:2], tools=[WEATHER])
    system, user = prompt.split("<|im_end|>\n")[:2]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<function>\n<name>get_weather</name>\n<description>The weather of a city.</description>" in system
    assert (
        "<parameter>\n<name>city</name>\n<type>string</type>\n<description>its name</description>" in system
    )
    assert '<enum>["c", "f"]</enum>' in system and '<required>["city"]</required>' in system
    assert "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>" in system
    assert user == "<|im_start|>user\nWeather in Oslo?"
    assert prompt.count("Be brief.") == 1  # the system message is inside the tools turn, not again
    without = tok.apply_chat_template(TOOL_LOOP[:2])
    assert without.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "# Tools" not in without


def test_tool_calls_and_tool_results_render(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(TOOL_LOOP, tools=[WEATHER])
    turns = prompt.split("<|im_start|>")
    assistant, results, generation = turns[-3], turns[-2], turns[-1]
    assert assistant == (
        "assistant\n<think>\nThe tool knows.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    )
    assert results == (
        "user\n<tool_response>\n-3 C\n</tool_response>\n<tool_response>\nwindy\n</tool_response><|im_end|>\n"
    )
    assert generation == "assistant\n<think>\n"


def test_non_string_arguments_render_as_json_and_earlier_reasoning_is_dropped(tok: Tokenizer) -> None:
    call = {"function": {"name": "plan", "arguments": {"days": 3, "stops": ["a", "b"], "note": "x\ny"}}}
    messages = [
        {"role": "user", "content": "Plan."},
        {"role": "assistant", "content": "<think>old thought</think>\n\nSure.", "tool_calls": [call, call]},
        {"role": "user", "content": "Again."},
    ]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert "old thought" not in prompt and "<|im_start|>assistant\nSure.\n\n<tool_call>" in prompt
    assert '<parameter=days>\n3\n</parameter>\n<parameter=stops>\n["a", "b"]\n</parameter>' in prompt
    assert "<parameter=note>\nx\ny\n</parameter>" in prompt
    assert prompt.count("<tool_call>") == 2 and "</tool_call>\n<tool_call>" in prompt


def test_enable_thinking_false_closes_an_empty_block(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(TOOL_LOOP[1:2], enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_string_arguments_are_refused(tok: Tokenizer) -> None:
    raw = {"function": {"name": "f", "arguments": '{"a": 1}'}}
    with pytest.raises(ValueError, match="arguments must be an object"):
        tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [raw]}])


def test_transformers_renders_the_same(tok: Tokenizer, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(
            TOOL_LOOP, tools=[WEATHER], tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert tok.apply_chat_template(TOOL_LOOP, tools=[WEATHER], **kwargs) == expected
        assert tok.encode(expected) == hf.encode(expected, add_special_tokens=False)
