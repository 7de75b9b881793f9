"""What a chat answer's text becomes: reasoning, content and tool calls (`ChatOutputParser`).

The router's flags choose the parsers, with vLLM's names (`ChatParsingConfig`):
  --reasoning-parser qwen3           `<think>...</think>` -> `reasoning_content` (router.reasoning)
  --tool-call-parser qwen3_coder     XML calls (Qwen3-Coder, Qwen3.5/3.6; alias qwen3_xml)
                     hermes          JSON calls in <tool_call> (router.tool_parser_*)
  --enable-auto-tool-choice          `tool_choice: "auto"` (the default with tools) is allowed
A request's `OutputParsing` says which apply to it (tools, `tool_choice`, what the prompt
opened); each choice gets its own `ChatOutputParser`, fed the text deltas in order (the
reasoning parser first, the tool parser over the content it leaves). Streamed or not, the
same parser reads the text, so both give the same reasoning, content and calls.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.tokenizer import Tokenizer
from router.reasoning import THINK_END, THINK_START, Qwen3ReasoningParser, prompt_opens_thinking
from router.tool_parser_hermes import HermesToolParser
from router.tool_parser_qwen3_coder import Qwen3CoderToolParser
from router.tool_parsers import TOOL_CALL_END, TOOL_CALL_START, ToolCall, ToolCallDelta, ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "hermes": HermesToolParser,
}
REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
PARSED_TAGS = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END)


def tags_decode_to_nothing(tokenizer: Tokenizer | None) -> bool:
    """Are the tags the parsers read special tokens that skip_special_tokens drops from the text?
    (Qwen3's own tokenizer.json keeps them as text; a converted one may not: then a parsing
    request is decoded with skip_special_tokens=false unless the client chose.)"""
    if tokenizer is None:
        return False
    ids = [i for tag in PARSED_TAGS if (i := tokenizer.token_to_id(tag)) is not None]
    return any(tokenizer.decode([i]) == "" for i in ids)


@dataclass(frozen=True, slots=True)
class ChatParsingConfig:
    """The router's output-parsing flags (vLLM's names and meanings)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChatParsingConfig:
        return cls(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The output-parsing flags, as vLLM spells them."""
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool calls are read from the text: qwen3_coder (Qwen3.5/3.6 XML calls), hermes (JSON)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split <think>...</think> into reasoning_content",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose its tool calls (tool_choice "auto"); needs --tool-call-parser',
    )


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ChatDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls

    def as_openai(self) -> dict:
        """A stream delta; tool calls as OpenAI's `{index, id, type, function}`, one per call."""
        delta: dict = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        calls: list[dict] = []
        for piece in self.tool_calls:
            if calls and calls[-1]["index"] == piece.index:
                calls[-1]["function"]["arguments"] += piece.arguments
            elif piece.id is not None:
                function = {"name": piece.name, "arguments": piece.arguments}
                calls.append({"index": piece.index, "id": piece.id, "type": "function", "function": function})
            else:
                calls.append({"index": piece.index, "function": {"arguments": piece.arguments}})
        if calls:
            delta["tool_calls"] = calls
        return delta


class ChatOutputParser:
    """One choice's text -> reasoning, content and tool calls, a delta at a time."""

    def __init__(
        self,
        reasoning: Qwen3ReasoningParser | None,
        tools: ToolParser | None,
        include_reasoning: bool = True,
        named_function: bool = False,
    ) -> None:
        self.reasoning_parser = reasoning
        self.tool_parser = tools
        self.include_reasoning = include_reasoning
        self.named_function = named_function  # tool_choice named the function: finishes as "stop"
        self.reasoning: list[str] = []
        self.content: list[str] = []

    @property
    def calls(self) -> list[ToolCall]:
        return [] if self.tool_parser is None else self.tool_parser.calls

    def feed(self, text: str) -> ChatDelta:
        return self._advance(text, final=False)

    def finish(self) -> ChatDelta:
        return self._advance("", final=True)

    def _advance(self, text: str, final: bool) -> ChatDelta:
        out = ChatDelta()
        if self.reasoning_parser is None:
            content = text
        else:
            parser = self.reasoning_parser
            reasoning, content = parser.finish() if final else parser.feed(text)
            out.reasoning = reasoning if self.include_reasoning else ""
        if self.tool_parser is None:
            out.content = content
        else:
            parsed = self.tool_parser.feed(content)
            if final:
                finished = self.tool_parser.finish()
                parsed.content += finished.content
                parsed.calls += finished.calls
            out.content, out.tool_calls = parsed.content, parsed.calls
        self.reasoning.append(out.reasoning)
        self.content.append(out.content)
        return out

    def message(self) -> dict:
        """The final assistant message (after `finish()`)."""
        calls, content, reasoning = self.calls, "".join(self.content), "".join(self.reasoning)
        # no content beside calls or reasoning is null, as vLLM's parsers answer
        message: dict = {"role": "assistant", "content": content or (None if calls or reasoning else "")}
        if self.reasoning_parser is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """A generation that stopped after tool calls finished for "tool_calls", unless the request
        named the function (`tool_choice: {"type": "function", ...}`): that one stays "stop", as
        OpenAI and vLLM answer a call the client forced."""
        return "tool_calls" if reason == "stop" and self.calls and not self.named_function else reason


@dataclass(frozen=True, slots=True)
class OutputParsing:
    """What the parsers of one chat request's choices are made of."""

    reasoning_parser: str | None = None
    prompt_opened_thinking: bool = False
    include_reasoning: bool = True
    tool_parser: str | None = None  # None: tool calls are not parsed (no tools, tool_choice "none")
    tools: tuple[dict, ...] = ()
    parallel_tool_calls: bool = True
    named_function: bool = False  # tool_choice named the function the answer must call

    @classmethod
    def for_request(
        cls,
        config: ChatParsingConfig,
        prompt: str,
        tools: list[dict] | None,
        parse_tools: bool,
        parallel_tool_calls: bool,
        include_reasoning: bool,
        named_function: bool = False,
    ) -> OutputParsing:
        return cls(
            reasoning_parser=config.reasoning_parser,
            prompt_opened_thinking=prompt_opens_thinking(prompt),
            include_reasoning=include_reasoning,
            tool_parser=config.tool_call_parser if parse_tools else None,
            tools=tuple(tools or ()),
            parallel_tool_calls=parallel_tool_calls,
            named_function=named_function and parse_tools,
        )

    @property
    def active(self) -> bool:
        return self.reasoning_parser is not None or self.tool_parser is not None

    def new_parser(self) -> ChatOutputParser | None:
        if not self.active:
            return None
        reasoning = tools = None
        if self.reasoning_parser is not None:
            reasoning = REASONING_PARSERS[self.reasoning_parser](self.prompt_opened_thinking)
        if self.tool_parser is not None:
            tools = TOOL_PARSERS[self.tool_parser](list(self.tools), self.parallel_tool_calls)
        return ChatOutputParser(reasoning, tools, self.include_reasoning, self.named_function)
