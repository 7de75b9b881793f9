"""The tool-call parsers on text (the tiny random model never writes a call): qwen3_coder (XML)
and hermes (JSON), one piece and split at every position, with the tools' schema types.

A split stream must join to exactly what the text in one piece gives: the content, and per call
its name (in the call's first delta, with its id) and arguments string."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.chat_output import TOOL_PARSERS
from router.tool_parser_qwen3_coder import coerce_value, schema_types
from router.tool_parsers import ToolParser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "detailed": {"type": "boolean"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "where": {"type": "object"},
                "scale": {"type": "number"},
                "note": {"type": ["string", "null"]},
                "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {"name": "search", "parameters": {"properties": {"q": {"type": "string"}}}},
}
TOOLS = [WEATHER, SEARCH]

Result = tuple[str, list[tuple[str, str]]]  # content, [(name, arguments)]


def run(name: str, pieces: list[str], tools: list[dict] = TOOLS, parallel: bool = True) -> Result:
    """Feed `pieces` in order and join the deltas as a client does (by call index)."""
    parser: ToolParser = TOOL_PARSERS[name](tools, parallel)
    content, calls, ids = "", [], []
    for out in [*(parser.feed(p) for p in pieces), parser.finish()]:
        content += out.content
        for delta in out.calls:
            if delta.index == len(calls):  # a call's first delta: id and name
                assert delta.id is not None and delta.id.startswith("call_") and delta.name
                calls.append([delta.name, delta.arguments])
                ids.append(delta.id)
            else:
                assert delta.index == len(calls) - 1 and delta.id is None and delta.name is None
                calls[-1][1] += delta.arguments
    assert len(set(ids)) == len(ids)
    assert [(c.id, c.name, c.arguments) for c in parser.calls] == [
        (i, n, a) for i, (n, a) in zip(ids, calls, strict=True)
    ]
    return content, [tuple(c) for c in calls]


def assert_any_split(name: str, text: str, expected: Result, **kwargs: object) -> None:
    assert run(name, [text], **kwargs) == expected
    for cut in range(len(text) + 1):
        assert run(name, [text[:cut], text[cut:]], **kwargs) == expected, cut
    assert run(name, list(text), **kwargs) == expected


def xml_call(function: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


# ---- qwen3_coder
def test_qwen3_coder_call_with_content() -> None:
    text = "Let me check.\n\n" + xml_call("get_weather", city="Paris", days="3")
    assert_any_split(
        "qwen3_coder", text, ("Let me check.", [("get_weather", '{"city": "Paris", "days": 3}')])
    )


@pytest.mark.parametrize(
    "text",
    [
        "Sure.\n<tool_call>\n<fu", "Sure.\n<tool_call>\n<function=get_wea", "Sure.\n<tool_call>",
        "<tool_call>\n<function=", "Hi <function=search",
    ],
)  # fmt: skip
def test_qwen3_coder_block_cut_off_before_its_name_is_content(text: str) -> None:
    """A text that ends (max_tokens) inside a call block before the function is named keeps the
    block as content, as written (before: dropped, the answer's text lost): vLLM's qwen3_coder
    parser returns a text without a whole `<function=NAME>` as content."""
    assert_any_split("qwen3_coder", text, (text, []))


def test_qwen3_coder_values_follow_the_schema_types() -> None:
    params = {
        "city": "São Paulo\n\"centre\"",  # a string keeps its text (inner newline, quotes) exactly
        "days": "3", "unit": "celsius", "detailed": "True", "hours": "[6, 12]",
        "where": '{"lat": 1.5}', "scale": "2.5", "note": "null", "limit": "null",
        "extra": "42",  # not in the schema: a string
    }  # fmt: skip
    content, [(name, arguments)] = run("qwen3_coder", [xml_call("get_weather", **params)])
    assert (content, name) == ("", "get_weather")
    assert json.loads(arguments) == {
        "city": 'São Paulo\n"centre"', "days": 3, "unit": "celsius", "detailed": True, "hours": [6, 12],
        "where": {"lat": 1.5}, "scale": 2.5, "note": None, "limit": None, "extra": "42",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("7", {"type": "integer"}, 7), ("seven", {"type": "integer"}, "seven"), ("4", {"type": "number"}, 4),
        ("1e3", {"type": "number"}, 1000.0), ("nan", {"type": "number"}, "nan"),
        ("false", {"type": "boolean"}, False),
        ("null", {"type": "string"}, "null"), ("None", {"type": ["integer", "null"]}, None),
        ("[1, 2]", {"type": "array"}, [1, 2]), ("[1, 2", {"type": "array"}, "[1, 2"),
        ("3", {"enum": [1, 2, 3]}, 3), ("x", {"const": "x"}, "x"), ('{"a": 1}', {}, '{"a": 1}'),
    ],
)  # fmt: skip
def test_qwen3_coder_coercion(text: str, schema: dict, value: object) -> None:
    types = schema_types(schema)
    got = text if not types or types == {"string"} else coerce_value(text, types)
    assert got == value and type(got) is type(value)


def test_qwen3_coder_every_split() -> None:
    text = (
        "Checking <b> & a < b.\n"
        + xml_call("get_weather", city="Zürich\n</para", days="2", detailed="false")
        + "\n"
        + xml_call("search", q='a\\b "q" </tool')
    )
    first = '{"city": "Zürich\\n</para", "days": 2, "detailed": false}'
    expected = (
        "Checking <b> & a < b.",
        [("get_weather", first), ("search", '{"q": "a\\\\b \\"q\\" </tool"}')],
    )
    assert_any_split("qwen3_coder", text, expected)
    assert json.loads(first)["city"] == "Zürich\n</para"


def test_qwen3_coder_streams_the_name_and_string_values_as_they_form() -> None:
    parser = TOOL_PARSERS["qwen3_coder"](TOOLS)
    head = parser.feed("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert head.content == "Sure." and [(d.index, d.name) for d in head.calls] == [(0, "get_weather")]
    assert "".join(d.arguments for d in head.calls) == '{"city": "Par'
    more = parser.feed("is\n</parameter>\n<parameter=days>\n1")
    assert "".join(d.arguments for d in more.calls) == 'is", "days": '  # an integer waits for its end
    rest = parser.feed("0\n</parameter>\n</function>\n</tool_call>")
    assert "".join(d.arguments for d in rest.calls) == "10}" and parser.calls[0].arguments == (
        '{"city": "Paris", "days": 10}'
    )


def test_qwen3_coder_lenient_forms() -> None:
    # no </parameter>, no </function>, no </tool_call> (the text ended); a bare <function=...>
    cases = [
        ("<tool_call>\n<function=search>\n<parameter=q>\ncats\n</tool_call>", [("search", '{"q": "cats"}')]),
        ("<tool_call>\n<function=search>\n<parameter=q>\ncats", [("search", '{"q": "cats"}')]),
        ("<function=search>\n<parameter=q>\ndogs\n</parameter>\n</function>", [("search", '{"q": "dogs"}')]),
        ("<tool_call>\n<function=search>\n</function>\n</tool_call>", [("search", "{}")]),
        ("<tool_call>\nnot a call\n</tool_call>", []),  # dropped
        ("<tool_call>\n<function=>\n</tool_call>", []),
    ]
    for text, calls in cases:
        assert_any_split("qwen3_coder", text, ("", calls))


def test_qwen3_coder_text_without_calls_is_unchanged() -> None:
    for text in ["Plain answer.\n\n", "a <tool b </function> <function c", "  x  ", "", "<tool_cal"]:
        assert_any_split("qwen3_coder", text, (text, []))


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    text = xml_call("search", q="a") + "\n" + xml_call("search", q="b")
    assert run("qwen3_coder", [text]) == ("", [("search", '{"q": "a"}'), ("search", '{"q": "b"}')])
    assert_any_split("qwen3_coder", text, ("", [("search", '{"q": "a"}')]), parallel=False)


# ---- hermes
def hermes_call(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


def test_hermes_call_every_split() -> None:
    text = "I will look.\n\n" + hermes_call(
        '{"name": "get_weather", "arguments": {"city": "P}a\\"r", "days": [3]}}'
    )
    text += "\n" + hermes_call('{"arguments": {}, "name": "search"}')  # the name after the arguments
    expected = ("I will look.\n\n", [("get_weather", '{"city": "P}a\\"r", "days": [3]}'), ("search", "{}")])
    assert_any_split("hermes", text, expected)


def test_hermes_keeps_the_text_before_a_call_as_written() -> None:
    """vLLM's hermes parser: the content is the text before `<tool_call>` as generated, its
    trailing whitespace included (streamed: the same deltas joined). qwen3_coder still trims it
    (test_qwen3_coder_call_with_content)."""
    call = hermes_call('{"name": "search", "arguments": {"q": "x"}}')
    for before in ("Sure. ", "Sure.\n\n", "\n"):
        assert_any_split("hermes", before + call, (before, [("search", '{"q": "x"}')]))


@pytest.mark.parametrize(
    ("payload", "calls"),
    [
        (
            '{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}',
            [("search", '{"q": "x"}')],
        ),  # a JSON string
        ('{"name": "search", "parameters": {"q": 1}}', [("search", '{"q": 1}')]),
        ('{"name": "search"}', [("search", "{}")]),
        ('{"name": "search", "arguments": null}', [("search", "{}")]),
        # not a call (vLLM's hermes parser answers these as content too): the block's text stays
        ('{"arguments": {"q": 1}}', None),  # no name
        ("not json", None),
        ('{"name": 5, "arguments": {}}', None),
        ('{"name": "get_weather", "arguments": {"city": }}', None),  # broken JSON arguments
        ('{"name": "search", "arguments": [1, 2]}', None),  # arguments not an object
    ],
)
def test_hermes_forms(payload: str, calls: list[tuple[str, str]] | None) -> None:
    expected = ("", calls) if calls is not None else (hermes_call(payload), [])
    assert_any_split("hermes", hermes_call(payload), expected)


def test_hermes_reports_a_call_when_its_block_ends() -> None:
    """Name and arguments together once the block closes and its JSON checks; a block cut off
    (max_tokens) is content as written."""
    parser = TOOL_PARSERS["hermes"](TOOLS)
    head = parser.feed('<tool_call>\n{"name": "search", "arguments": {"q": "ca')
    assert head.calls == [] and head.content == ""
    rest = parser.feed('ts"}}\n</tool_call>')
    assert [(d.name, d.arguments) for d in rest.calls] == [("search", '{"q": "cats"}')]
    cut = 'Sure.<tool_call>\n{"name": "search", "arguments": {"q": "do'
    assert run("hermes", [cut]) == (cut, [])


# ---- any text: no exception, any split gives the same, arguments always a JSON object
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">", "\n", " ",
    "get_weather", "search", "city", "days", "q", "3", "x", '"', "{", "}", "[", "]", ":", ",", "\\", "<", "/",
    '{"name": "search", "arguments": {"q": ', '"name"', '"arguments"', "null",
]  # fmt: skip
CALL_PARTS = [
    "<tool_call>\n<function=get_weather>\n", "<tool_call>\n<function=search>\n", "<function=search>",
    "<parameter=city>\n", "<parameter=days>\n", "<parameter=hours>\n", "<parameter=q>\n", "\n</parameter>\n",
    "</function>\n</tool_call>", '<tool_call>\n{"name": "search", "arguments": ', "}\n</tool_call>",
]  # fmt: skip
TEXTS = st.lists(st.sampled_from(FRAGMENTS) | st.sampled_from(CALL_PARTS), max_size=30).map("".join)


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(
    text=TEXTS, cuts=st.lists(st.integers(0, 400), max_size=4), parser=st.sampled_from(sorted(TOOL_PARSERS))
)
def test_any_text_any_split(text: str, cuts: list[int], parser: str) -> None:
    whole = run(parser, [text])
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    assert run(parser, pieces) == whole
    assert all(isinstance(json.loads(arguments), dict) for _, arguments in whole[1])
