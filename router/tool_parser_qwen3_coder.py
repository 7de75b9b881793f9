"""`--tool-call-parser qwen3_coder`: the XML tool calls of Qwen3-Coder, Qwen3.5 and Qwen3.6.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

becomes `get_weather` with arguments `{"city": "Paris", "days": 3}`. A value is the text between
the tags less one newline at each end, converted by the type its JSON schema gives the
parameter (`coerce_value`); a parameter the schema does not know is a string. A string value is
streamed as it forms (its JSON escapes, piece by piece), any other when it is complete. Lenient
as the models need: a missing `</parameter>` ends at the next tag, missing `</function>` or
`</tool_call>` at the end of the text, and a bare `<function=...>` (no `<tool_call>`) is a call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from router.stream_text import find_first, partial_tag_length
from router.tool_parsers import TOOL_CALL_END, TOOL_CALL_START, Event, ToolParser

FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
VALUE_ENDS = (PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
MAX_NAME_CHARS = 512  # a "<function=" or "<parameter=" with no ">" this far is no tag
_INTEGER = re.compile(r"[+-]?\d+")


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows (`type`, a list of them, anyOf/oneOf, enum, const)."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    types: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types |= schema_types(sub)
    values = schema.get("enum") or ([schema["const"]] if "const" in schema else [])
    names = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}
    types |= {names.get(type(v), "object") for v in values}
    return types


def is_string_only(types: set[str]) -> bool:
    return not types or types == {"string"}


def coerce_value(text: str, types: set[str]) -> Any:
    """A parameter's text as the schema's types read it; the text itself when none fits."""
    value = text.strip()
    lowered = value.lower()
    if "null" in types and lowered in ("null", "none"):
        return None
    if types & {"integer", "number"} and _INTEGER.fullmatch(value):
        return int(value)
    if "number" in types:
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            if number == number and abs(number) != float("inf"):  # JSON has no NaN nor infinity
                return number
    if "boolean" in types and lowered in ("true", "false"):
        return lowered == "true"
    if types & {"object", "array"} or not types & {"string", "integer", "number", "boolean", "null"}:
        try:
            return json.loads(value)
        except ValueError:
            pass
    return text


def json_string_body(text: str) -> str:
    """`text` JSON-escaped, without the quotes (escaping is per character: pieces concatenate)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderCall:
    """One `<function=...>...</function>` call, read as it arrives. A block the text ends in
    before a function is named (cut off by max_tokens: `<tool_call>\n<func`) is content as the
    model wrote it, as vLLM's parser answers a text without `<function=`; a complete block that
    holds no call is dropped."""

    def __init__(self, schemas: dict[str, dict], tag: str = TOOL_CALL_START) -> None:
        self.schemas = schemas
        self.raw: list[str] | None = [tag if tag == TOOL_CALL_START else ""]  # None: named
        self.state = "function"  # -> "parameters" <-> "value" -> "close"; or "skip" (no call)
        self.properties: dict = {}
        self.num_parameters = 0
        self.string_value = False  # the value being read is streamed as a JSON string
        self.value = ""  # a non-string value so far, or a string's text not sent yet
        self.types: set[str] = set()  # of the parameter being read
        self.lead_checked = False  # the newline after <parameter=...> is dropped

    def parse(self, text: str, final: bool) -> tuple[int, list[Event], bool]:
        used, events, ended = self._parse(text, final)
        if self.raw is not None:
            if any(kind == "name" for kind, _ in events):
                self.raw = None
            else:
                self.raw.append(text[:used])
                raw = "".join(self.raw)
                if final and ended and not raw.endswith(TOOL_CALL_END):
                    events.append(("text", raw))
        return used, events, ended

    def _parse(self, text: str, final: bool) -> tuple[int, list[Event], bool]:
        events: list[Event] = []
        pos = 0
        while True:
            if self.state == "value":
                pos, done = self._value(text, pos, final, events)
                if not done:
                    return pos, events, False
                continue
            rest = text[pos:].lstrip()
            pos = len(text) - len(rest)
            if self.state == "close":  # after </function>: its </tool_call>, if it has one
                if rest.startswith(TOOL_CALL_END):
                    return pos + len(TOOL_CALL_END), events, True
                return pos, events, final or not TOOL_CALL_END.startswith(rest)
            if self.state == "skip":  # a <tool_call> block that holds no call: dropped to its end
                at = text.find(TOOL_CALL_END, pos)
                if at >= 0 or final:
                    return (len(text) if at < 0 else at + len(TOOL_CALL_END)), events, True
                return len(text) - partial_tag_length(text[pos:], (TOOL_CALL_END,)), events, False
            tag = FUNCTION_START if self.state == "function" else PARAMETER_START
            if rest.startswith(tag):
                close = rest.find(">", len(tag))
                if close < 0 and not final and len(rest) < MAX_NAME_CHARS:
                    return pos, events, False
                name = rest[len(tag) : close].strip() if close >= 0 else ""
                if not name:  # no tag after all: the rest of the block is dropped
                    if self.state == "parameters":
                        events.append(("arguments", "}" if self.num_parameters else "{}"))
                    self.state = "skip"
                    continue
                pos += close + 1
                if self.state == "function":
                    events.append(("name", name))
                    self.properties = self.schemas.get(name, {}).get("properties") or {}
                    self.state = "parameters"
                else:
                    events.append(("arguments", self._open_value(name)))
                    self.state = "value"
                continue
            ends = (FUNCTION_END, TOOL_CALL_END) if self.state == "parameters" else (TOOL_CALL_END,)
            end = next((e for e in ends if rest.startswith(e)), None)
            if end is not None or (final and self.state == "parameters"):
                if self.state == "parameters":
                    events.append(("arguments", "}" if self.num_parameters else "{}"))
                pos += len(end or "")
                if end == FUNCTION_END:
                    self.state = "close"
                    continue
                return pos, events, True
            if not final and any(t.startswith(rest) for t in (tag, *ends)):
                return pos, events, False  # "", "</func": wait for more
            if self.state == "function":
                self.state = "skip"
                continue
            nxt = rest.find("<", 1)  # stray text between parameters: skipped
            pos = len(text) if nxt < 0 else pos + nxt

    def _open_value(self, name: str) -> str:
        self.types = schema_types(self.properties.get(name))
        self.string_value = is_string_only(self.types)
        self.value, self.lead_checked = "", False
        opening = ("{" if not self.num_parameters else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        self.num_parameters += 1
        return opening + ('"' if self.string_value else "")

    def _value(self, text: str, pos: int, final: bool, events: list[Event]) -> tuple[int, bool]:
        """Read the value from `pos`: (where reading stopped, whether the value ended)."""
        at, tag = find_first(text, VALUE_ENDS, pos)
        end = len(text) if tag is None else at
        if tag is None and not final:
            end -= partial_tag_length(text[pos:], VALUE_ENDS)
        self.value += text[pos:end]
        if not self.lead_checked and (self.value or tag is not None or final):
            self.value = self.value.removeprefix("\n")
            self.lead_checked = True
        if tag is None and not final:
            if self.string_value and self.lead_checked:
                held = "\n" if self.value.endswith("\n") else ""
                if sent := self.value[: len(self.value) - len(held)]:
                    events.append(("arguments", json_string_body(sent)))
                self.value = held
            return end, False
        value = self.value.removesuffix("\n")
        if self.string_value:
            events.append(("arguments", json_string_body(value) + '"'))
        else:
            events.append(("arguments", json.dumps(coerce_value(value, self.types), ensure_ascii=False)))
        self.state = "parameters"
        return (end + len(PARAMETER_END) if tag == PARAMETER_END else end), True


class Qwen3CoderToolParser(ToolParser):
    start_tags = ("<tool_call>", FUNCTION_START)

    def new_body(self, tag: str) -> Qwen3CoderCall:
        return Qwen3CoderCall(self.schemas, tag)
