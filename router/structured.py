"""Structured output asked of the router -> the `structured_outputs` spec of SamplingParams.

What a request may send (one of them; two is a 400):
  response_format  {"type": "json_object"} -> any JSON object; {"type": "json_schema",
                   "json_schema": {"name", "schema", "strict"}} -> JSON valid against the schema;
                   {"type": "structural_tag", "format": ...} -> an xgrammar structural tag;
                   {"type": "text"} -> nothing
  structured_outputs   vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object" |
                   "structural_tag": ..., "disable_any_whitespace": bool}
  guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names of the same
  tool_choice      "required" or {"type": "function", "function": {"name"}} (chat): a structural
                   tag of tool calls in the format of --tool-call-parser (`tool_call_format`)

The spec is plain JSON data, compiled by the engine (pdserve.sampling.grammar): the router has no
grammar library. With --reasoning-parser the spec carries the reasoning tags, so a prompt that
opens a reasoning block leaves the reasoning free and constrains what follows it.

Tool calls, exactly as the output parsers read them (router.tool_parser_*):
  qwen3_coder   <tool_call>\\n<function=NAME>\\n then per parameter, in the schema's order (the
                required ones always, the others optional) <parameter=P>\\nVALUE\\n</parameter>\\n,
                then </function>\\n</tool_call>. A string VALUE is raw text: an enum or const one
                of its strings, a `pattern` that regex, `minLength`/`maxLength` that many
                characters other than "<", else any text without the call's tags; any other
                type is JSON valid against its schema (what the parser converts it from).
  hermes        <tool_call>\\n{"name": "NAME", "arguments": <JSON valid against the schema>}\\n</tool_call>
"required" is one call or more (one only with parallel_tool_calls false) separated by "\\n", a
named function exactly one call of it: text around the calls is not allowed.
"""

from __future__ import annotations

import json
from typing import Any

from router.errors import OpenAIError
from router.schema_check import regex_lookaround, unsupported_keyword
from router.tool_parser_qwen3_coder import VALUE_ENDS, schema_types

REASONING_TAGS = {"qwen3": ["<think>", "</think>"]}  # per --reasoning-parser
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace")
VLLM_IGNORED = ("disable_fallback", "disable_additional_properties", "backend")  # no other backend here
JSON_WHITESPACE = 1  # in a call's JSON: `{"city": "Paris"}` as the models write it, no more


def response_format_spec(response_format: Any) -> dict[str, Any] | None:
    """The spec of OpenAI's `response_format` (None for text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(kind := response_format.get("type"), str):
        raise OpenAIError("response_format must be an object with a type", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        wrapper = response_format.get("json_schema")
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError(
                "response_format json_schema needs json_schema.schema, a JSON schema object",
                param="response_format.json_schema.schema",
            )
        return {"json": schema}
    if kind == "structural_tag":
        if not isinstance(response_format.get("format"), dict):
            raise OpenAIError(
                "response_format structural_tag needs format, an xgrammar structural tag format object",
                param="response_format.format",
            )
        return {"structural_tag": {"type": "structural_tag", "format": response_format["format"]}}
    raise OpenAIError(
        f'response_format type must be "text", "json_object", "json_schema" or "structural_tag", '
        f"got {kind!r}",
        param="response_format.type",
    )


def vllm_spec(structured_outputs: Any) -> dict[str, Any] | None:
    """The spec of vLLM's `structured_outputs` object."""
    if structured_outputs is None:
        return None
    if not isinstance(structured_outputs, dict):
        raise OpenAIError("structured_outputs must be an object", param="structured_outputs")
    spec = {}
    for key, value in structured_outputs.items():
        if key in VLLM_KEYS:
            spec[key] = value
        elif key not in VLLM_IGNORED and value not in (None, False, ""):
            raise OpenAIError(
                f"structured_outputs.{key} is not supported; supported: {', '.join(VLLM_KEYS)}",
                param=f"structured_outputs.{key}",
                code="unsupported_parameter",
            )
    return spec


def guided_specs(fields: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(field, spec) for each of vLLM's guided_* fields that is set."""
    return [(name, {kind: fields[name]}) for name, kind in GUIDED.items() if fields.get(name) is not None]


def one_spec(candidates: list[tuple[str, dict[str, Any] | None]]) -> dict[str, Any] | None:
    """The one spec asked for, or a 400 naming the fields when several are."""
    given = [(name, spec) for name, spec in candidates if spec is not None]
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise OpenAIError(f"only one kind of structured output at a time; got {names}", param=given[1][0])
    if not given:
        return None
    name, spec = given[0]
    schemas, patterns = [spec.get("json")], [spec.get("regex")]
    _inside_tag(spec.get("structural_tag"), schemas, patterns)
    for schema in schemas:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                continue  # the engine's compile names what is wrong with it
        if (where := unsupported_keyword(schema)) is not None:
            raise OpenAIError(
                f"{name}: the JSON schema keyword {where} is not supported yet: the answer would not "
                "be held to it",
                param=name,
                code="unsupported_parameter",
            )
    if any(map(regex_lookaround, patterns)):
        raise OpenAIError(
            f"{name}: a lookahead or lookbehind in the regex is not supported yet (xgrammar ignores a "
            "lookahead, so the answer would not be held to it)",
            param=name,
            code="unsupported_parameter",
        )
    return spec


def _inside_tag(tag: Any, schemas: list[Any], patterns: list[Any]) -> None:
    """The JSON schemas and regexes a structural tag holds (its `json_schema` and `regex` formats,
    and the older form's `structures[].schema`), appended to `schemas` and `patterns`."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError:
            return  # the engine's compile names what is wrong with it
    if isinstance(tag, list):
        for item in tag:
            _inside_tag(item, schemas, patterns)
    elif isinstance(tag, dict):
        if tag.get("type") == "json_schema":
            schemas.append(tag.get("json_schema"))
        elif tag.get("type") == "regex":
            patterns.append(tag.get("pattern"))
        elif "begin" in tag and "schema" in tag:
            schemas.append(tag["schema"])
        for key, value in tag.items():
            if key not in ("json_schema", "schema") and isinstance(value, dict | list):
                _inside_tag(value, schemas, patterns)


def with_reasoning(spec: dict[str, Any] | None, reasoning_parser: str | None) -> dict[str, Any] | None:
    if spec is None or reasoning_parser not in REASONING_TAGS:
        return spec
    return {**spec, "reasoning_tags": REASONING_TAGS[reasoning_parser]}


# ---- tool calls
def tool_call_spec(
    tools: list[dict[str, Any]], forced: str | None, tool_call_parser: str, parallel: bool
) -> dict[str, Any]:
    """The structural tag of `tool_choice` "required" (`forced` None) or a named function."""
    make = _hermes_call if tool_call_parser == "hermes" else _xml_call
    functions = [t["function"] for t in tools if forced is None or t["function"]["name"] == forced]
    for f in functions:
        if (where := unsupported_keyword(f.get("parameters"))) is not None:
            raise OpenAIError(
                f"tools: the parameters of {f['name']!r} have the JSON schema keyword {where}, which a "
                "forced call (tool_choice required or named) does not support yet: the grammar would "
                "not hold its arguments to it",
                param="tools",
                code="unsupported_parameter",
            )
    calls = [make(f["name"], f.get("parameters") or {}) for f in functions]
    if forced is not None:
        fmt = calls[0]
    else:
        fmt = {
            "type": "tags_with_separator",
            "tags": calls,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
    return {"structural_tag": {"type": "structural_tag", "format": fmt}}


def _hermes_call(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    schema = parameters or {"type": "object"}
    return {
        "type": "tag",
        "begin": '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ',
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": JSON_WHITESPACE},
        "end": "}\n</tool_call>",
    }


def _xml_call(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    blocks = []
    for prop, schema in properties.items():
        block = {
            "type": "tag",
            "begin": f"<parameter={prop}>\n",
            "content": _xml_value(schema if isinstance(schema, dict) else {}, defs),
            "end": "\n</parameter>\n",
        }
        blocks.append(block if prop in required else {"type": "optional", "content": block})
    content = {"type": "sequence", "elements": blocks} if blocks else {"type": "const_string", "value": ""}
    return {
        "type": "tag",
        "begin": f"<tool_call>\n<function={name}>\n",
        "content": content,
        "end": "</function>\n</tool_call>",
    }


def _xml_value(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A parameter's text between `<parameter=P>\\n` and `\\n</parameter>`, as the parser reads it."""
    values = schema["enum"] if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    if values:
        texts = [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values]
        return {"type": "or", "elements": [{"type": "const_string", "value": t} for t in texts]}
    types = schema_types(schema)
    if not types or "string" in types:  # the parser keeps the text as it is
        if isinstance(schema.get("pattern"), str):
            return {"type": "regex", "pattern": schema["pattern"]}
        low, high = schema.get("minLength"), schema.get("maxLength")
        if isinstance(low, int) or isinstance(high, int):
            low = low if isinstance(low, int) else 0
            return {"type": "regex", "pattern": f"[^<]{{{low},{high if isinstance(high, int) else ''}}}"}
        return {"type": "any_text", "excludes": list(VALUE_ENDS)}
    return {"type": "json_schema", "json_schema": {**schema, **defs}, "max_whitespace_cnt": JSON_WHITESPACE}
