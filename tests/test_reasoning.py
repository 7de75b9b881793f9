"""`--reasoning-parser qwen3` on text, one piece and split at every position, alone and in front
of a tool parser (router.chat_output): the thought goes to reasoning_content, the rest is the
answer, and the joined stream equals the one-piece result."""

from __future__ import annotations

import pytest

from router.chat_output import ChatOutputParser, OutputParsing
from router.reasoning import Qwen3ReasoningParser, prompt_opens_thinking


def split(prompt_opened: bool, pieces: list[str]) -> tuple[str, str]:
    parser = Qwen3ReasoningParser(prompt_opened)
    outs = [*(parser.feed(p) for p in pieces), parser.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


@pytest.mark.parametrize(
    ("opened", "text", "expected"),
    [
        (True, "Let me think.\nOk.\n</think>\n\nThe answer.", ("Let me think.\nOk.", "The answer.")),
        (False, "<think>\nHmm </thin\n</think>\n\nHi <think> there", ("Hmm </thin", "Hi <think> there")),
        (True, "<think>\nDoubled tag.</think>Yes", ("Doubled tag.", "Yes")),
        (True, "Cut off by max_tokens </thi", ("Cut off by max_tokens </thi", "")),
        (False, "No thinking at all. </think> stays", ("", "No thinking at all. </think> stays")),
        (False, "  <thin", ("", "  <thin")),
        (False, "\n\n", ("", "\n\n")),
        (True, "", ("", "")),
    ],
)
def test_qwen3_reasoning_every_split(opened: bool, text: str, expected: tuple[str, str]) -> None:
    assert split(opened, [text]) == expected
    for cut in range(len(text) + 1):
        assert split(opened, [text[:cut], text[cut:]]) == expected, cut
    assert split(opened, list(text)) == expected


def test_streamed_reasoning_comes_before_the_end_tag() -> None:
    parser = Qwen3ReasoningParser(prompt_opened=True)
    assert parser.feed("Step one") == ("Step one", "")
    assert parser.feed(", step two</th") == (", step two", "")
    assert parser.feed("ink>\n\nDone") == ("", "Done")


def test_prompt_opens_thinking() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def run_chat(parsing: OutputParsing, pieces: list[str]) -> dict:
    parser = parsing.new_parser()
    assert isinstance(parser, ChatOutputParser)
    for piece in pieces:
        parser.feed(piece)
    parser.finish()
    message = parser.message()
    for call in message.get("tool_calls", ()):
        call["id"] = "call_x"
    return message


def test_reasoning_then_tool_call() -> None:
    parsing = OutputParsing(reasoning_parser="qwen3", prompt_opened_thinking=True, tool_parser="qwen3_coder")
    call = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    text = "Need weather.\n</think>\n\n" + call
    expected = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Need weather.",
        "tool_calls": [
            {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"x": "1"}'}}
        ],
    }
    for cut in range(len(text) + 1):
        assert run_chat(parsing, [text[:cut], text[cut:]]) == expected, cut
    hidden = OutputParsing(reasoning_parser="qwen3", prompt_opened_thinking=True, include_reasoning=False)
    assert run_chat(hidden, ["secret</think>Hi"]) == {
        "role": "assistant",
        "content": "Hi",
        "reasoning_content": None,
    }


def test_nothing_to_parse_means_no_parser() -> None:
    assert OutputParsing().new_parser() is None
