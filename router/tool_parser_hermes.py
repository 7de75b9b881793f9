"""`--tool-call-parser hermes`: JSON tool calls inside `<tool_call>...</tool_call>` (Qwen2.5, Qwen3).

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
    </tool_call>

The object is scanned a character at a time (strings, escapes, nesting): the arguments string
is the JSON text the model wrote for an object `arguments` exactly. An `arguments` given as a
JSON string holding the object is decoded; `parameters` is read like `arguments`; no arguments
is `{}`. A call is reported when its block ends, name and arguments together, and only when the
arguments are a JSON object and the name a string: any other block (cut off by max_tokens,
broken JSON, no name) is content, its text as the model wrote it, as vLLM's hermes parser
answers (a client's `json.loads(arguments)` never fails on what we send). The price: a hermes
call's arguments are not streamed as they form (qwen3_coder's are). The text before a call is
content as the model wrote it, its trailing whitespace included (`'Sure. '`), as vLLM's hermes
parser answers it, streamed or not.
"""

from __future__ import annotations

import json

from router.stream_text import partial_tag_length
from router.tool_parsers import TOOL_CALL_END, TOOL_CALL_START, Event, ToolParser

ARGUMENT_KEYS = ("arguments", "parameters")


class HermesCall:
    """One `{"name": ..., "arguments": ...}` object, read as it arrives."""

    def __init__(self) -> None:
        self.mode = "before"  # -> "key_wait" -> "key" -> "colon" -> "value_wait" -> "value" ...
        self.in_string = self.escaped = False
        self.depth = 0  # nesting inside the value being read
        self.token: list[str] = []  # the key or value being read, as JSON text
        self.key = ""
        self.name: str | None = None
        self.arguments_state = "none"  # -> "streaming" (an object or array value) -> "done"
        self.pending: list[str] = []  # argument text read before the name was known
        self.held: list[Event] = []  # the call's events, until its block ends and is checked
        self.raw: list[str] = [TOOL_CALL_START]  # the block's text as the model wrote it

    def parse(self, text: str, final: bool) -> tuple[int, list[Event], bool]:
        end = text.find(TOOL_CALL_END)
        stop = end if end >= 0 else len(text) - (0 if final else partial_tag_length(text, (TOOL_CALL_END,)))
        events = self.held
        for char in text[:stop]:
            self._read(char, events)
        if end < 0 and not final:
            self._flush_arguments(events)
            self.raw.append(text[:stop])
            return stop, [], False
        if self.mode == "value" and self.depth == 0 and not self.in_string:  # a literal at the end
            self._value_done(events)
        if self.name is not None and self.arguments_state == "none":
            events.append(("arguments", "{}"))
        self._flush_arguments(events)
        used = len(text) if end < 0 else end + len(TOOL_CALL_END)
        self.raw.append(text[:used])
        return used, self._checked(), True

    def _checked(self) -> list[Event]:
        """The call (its name, then its arguments), or the block's text as content."""
        arguments = "".join(value for kind, value in self.held if kind == "arguments")
        try:
            valid = self.name is not None and isinstance(json.loads(arguments), dict)
        except ValueError:
            valid = False
        return [("name", self.name), ("arguments", arguments)] if valid else [("text", "".join(self.raw))]

    def _flush_arguments(self, events: list[Event]) -> None:
        if self.name is not None and self.pending:
            events.append(("arguments", "".join(self.pending)))
            self.pending.clear()

    def _read(self, char: str, events: list[Event]) -> None:
        mode = self.mode
        if mode in ("before", "key_wait", "colon", "value_wait") and char.isspace():
            return
        if mode == "before":
            self.mode = "key_wait" if char == "{" else "junk"
        elif mode == "key_wait":
            if char == '"':
                self.mode, self.token = "key", [char]
            elif char == "}":
                self.mode = "after"
            elif char != ",":
                self.mode = "junk"
        elif mode == "key":
            self.token.append(char)
            if self._string_closes(char):
                self.key, self.mode = _loads(self.token), "colon"
        elif mode == "colon":
            self.mode = "value_wait" if char == ":" else "junk"
        elif mode == "value_wait":
            self.mode, self.token, self.depth = "value", [], 0
            self._value_char(char, events)
        elif mode == "value":
            self._value_char(char, events)

    def _string_closes(self, char: str) -> bool:
        """Track a JSON string's escapes; True at its closing quote (the opening one is not fed)."""
        if self.escaped:
            self.escaped = False
        elif char == "\\":
            self.escaped = True
        elif char == '"':
            return True
        return False

    def _value_char(self, char: str, events: list[Event]) -> None:
        if self.depth == 0 and not self.in_string and self.token and char in ",}":
            self._value_done(events)  # the end of a literal (number, true, null)
            self.mode = "after" if char == "}" else "key_wait"
            return
        self.token.append(char)
        streamed = self.key in ARGUMENT_KEYS and self.arguments_state != "done"
        if self.in_string:
            self.in_string = not self._string_closes(char)
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
            if len(self.token) == 1 and streamed:
                self.arguments_state = "streaming"
        elif char in "}]":
            self.depth -= 1
        if self.arguments_state == "streaming" and streamed:
            self.pending.append(char)
        if self.depth <= 0 and not self.in_string and char in '"}]':
            self._value_done(events)
            self.mode = "key_wait"

    def _value_done(self, events: list[Event]) -> None:
        value = _loads(self.token)
        if self.key == "name" and isinstance(value, str) and self.name is None:
            self.name = value
            events.append(("name", value))
        elif self.key in ARGUMENT_KEYS and self.arguments_state == "none":
            self.arguments_state = "done"
            if isinstance(value, str):
                self.pending.append(value)
            elif value is None:
                self.pending.append("{}")
            else:
                self.pending.append(json.dumps(value, ensure_ascii=False))
        elif self.arguments_state == "streaming" and self.key in ARGUMENT_KEYS:
            self.arguments_state = "done"
        self._flush_arguments(events)
        self.token = []


def _loads(token: list[str]) -> object:
    try:
        return json.loads("".join(token))
    except ValueError:
        return None


class HermesToolParser(ToolParser):
    trims_before_call = False  # vLLM's hermes parser: the content is the text before <tool_call> as written

    def new_body(self, tag: str) -> HermesCall:
        return HermesCall()
