"""Tool calls parsed out of generated text, a delta at a time: the base of `--tool-call-parser`.

A `ToolParser` (one per choice) splits the content of an answer into plain text and tool calls.
Outside a call it looks for the format's start tags (`<tool_call>`, ...), holding back a
possible partial tag; at a start tag a `CallBody` of the format takes over until the call
ends, reporting the function name as soon as it is known and the arguments (a JSON object as
text) in pieces as they form. Each call gets an id `call_<24 hex>`; its arguments pieces joined
are the final arguments string. The text before, between and after calls is the content, with
the whitespace next to a call trimmed; a format with `trims_before_call = False` (hermes, as
vLLM's hermes parser) keeps the text before a call as generated, its trailing whitespace too.

The formats (router.tool_parser_qwen3_coder, router.tool_parser_hermes) are bodies; joining the
deltas of any split of a text gives what one `feed` of the whole text gives (tested so).
With `parallel_tool_calls: false` only the first call is kept.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.stream_text import TrimmedText, find_first, partial_tag_length

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# ("name", function name) | ("arguments", a piece of the arguments JSON) | ("text", content)
Event = tuple[str, str]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call `index`: its first piece has the id and the name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolParse:
    """What one `feed` (or `finish`) produced: content text and tool-call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class CallBody(Protocol):
    def parse(self, text: str, final: bool) -> tuple[int, list[Event], bool]:
        """Read `text` (what follows the part already consumed): (characters consumed, events,
        whether the call ended). `final`: no more text comes; the call must end."""
        ...


def parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """{function name: its parameters JSON schema} of a request's tools (as the client sent them)."""
    schemas = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        if isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            schemas[function["name"]] = parameters if isinstance(parameters, dict) else {}
    return schemas


class ToolParser:
    """Content and tool calls of one choice; subclasses name their start tags and bodies."""

    start_tags: tuple[str, ...] = (TOOL_CALL_START,)
    trims_before_call: bool = True  # False: the whitespace before a call stays in the content

    def __init__(self, tools: list[dict[str, Any]] | None, parallel: bool = True) -> None:
        self.schemas = parameter_schemas(tools)
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._content = TrimmedText()
        self._body: CallBody | None = None
        self._current: ToolCall | None = None  # the call being read, once named (None: dropped)
        self._trimmed = ""  # the whitespace trimmed before the block being read

    def new_body(self, tag: str) -> CallBody:
        raise NotImplementedError

    def feed(self, text: str) -> ToolParse:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> ToolParse:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ToolParse:
        out = ToolParse()
        while True:
            if self._body is None:
                at, tag = find_first(self._buf, self.start_tags)
                if tag is None:
                    keep = 0 if final else partial_tag_length(self._buf, self.start_tags)
                    out.content += self._content.add(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    out.content += self._content.flush() if final else ""
                    return out
                out.content += self._content.add(self._buf[:at])
                if not self.trims_before_call:
                    out.content += self._content.flush()
                self._trimmed = self._content.flush()  # content again if the block is no call
                self._content.cut()
                self._buf = self._buf[at + (len(tag) if tag == TOOL_CALL_START else 0) :]
                self._body, self._current = self.new_body(tag), None
            used, events, ended = self._body.parse(self._buf, final)
            self._buf = self._buf[used:]
            for kind, value in events:
                self._emit(out, kind, value)
            if not ended:
                return out
            self._body = None

    def _emit(self, out: ToolParse, kind: str, value: str) -> None:
        if kind == "text":  # a block its format did not take as a call: content as written
            self._content.lstrip = False
            out.content += self._content.add(self._trimmed + value)
            self._trimmed = ""
        elif kind == "name":
            if self.parallel or not self.calls:
                self._current = ToolCall(new_call_id(), value)
                self.calls.append(self._current)
                out.calls.append(ToolCallDelta(len(self.calls) - 1, self._current.id, value))
        elif self._current is not None and value:
            self._current.arguments += value
            index = len(self.calls) - 1
            if out.calls and out.calls[-1].index == index:
                out.calls[-1].arguments += value
            else:
                out.calls.append(ToolCallDelta(index, arguments=value))
