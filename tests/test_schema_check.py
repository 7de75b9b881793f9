"""The router's schema check (router.schema_check) against what it stands for: xgrammar's grammar
of the schema, and `jsonschema`'s verdict on the answer.

A schema the check lets through: the grammar accepts none of its listed instances that are
invalid. A schema it refuses: the grammar accepts one of its listed instances that is invalid
(the witness that the refusal is needed). So the check can neither let an unenforced keyword
through nor refuse a schema the grammar holds answers to, for every schema below."""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any, Literal

import jsonschema
import pydantic
import pytest
from xgrammar.testing import _is_grammar_accept_string

from pdserve.sampling.grammar import json_schema_grammar
from router.errors import OpenAIError
from router.schema_check import regex_lookaround, unsupported_keyword
from router.structured import one_spec

DEFS = {"$defs": {"n": {"type": "integer", "maximum": 2}}}
CASES: list[tuple[dict[str, Any], list[Any]]] = [
    # what the grammar holds answers to
    ({"type": "integer", "minimum": -3, "maximum": 9}, [10, -4, 0]),
    ({"type": "integer", "multipleOf": 3}, [4, 6]),
    ({"type": "number", "exclusiveMinimum": 0.5}, [0.5, 0.6]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ["a", "abcd", "ab"]),
    ({"type": "string", "pattern": "^[a-z]+$"}, ["a1", "ab"]),
    ({"type": "string", "format": "date"}, ["2020-13-45", "2020-01-02"]),
    ({"type": "integer", "format": "int32"}, [1, "x"]),  # an annotation on a number
    ({"type": ["integer", "null"], "maximum": 3}, [4, None, "x"]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [[1], [1, 2, 3, 4]]),
    ({"items": {"type": "integer"}, "maxItems": 1}, [[1, 2], ["x"], [1]]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, [[1, 2], [1]]),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, [[1, 1]]),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, [{}, {"a": "x"}, {"a": 1}]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, [{"a": "x"}, {"a": 1}]),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1}, [{"a": 1, "b": 1}]),
    ({"enum": [1, "a", None]}, [2, "a"]),
    ({"type": "string", "enum": ["x", "y"]}, ["z", "x"]),
    ({"const": {"a": 1}}, [{"a": 2}]),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "X"}, ["x", None]),
    ({**DEFS, "anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}, [3, 1]),
    ({**DEFS, "type": "object", "properties": {"a": {"$ref": "#/$defs/n", "description": "d"}}}, [{"a": 3}]),
    ({**DEFS, "type": "object", "properties": {"a": {"allOf": [{"$ref": "#/$defs/n"}]}}}, [{"a": 3}]),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, [None, 1]),
    ({"oneOf": [{"const": 1}, {"enum": [2, 3]}]}, [4, 3]),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, [{"a": {"a": 1}}]),
    ({"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "integer"}},
     [{"abc": 1}, {"ab": 1}]),  # names are strings: pydantic and zod leave the type out
    ({"type": "string", "format": "password", "minLength": 8}, ["abc", "abcdefgh"]),  # not a regex format
    # what it does not: each with an instance it lets through that is not valid
    ({"type": "integer", "minimum": 0, "multipleOf": 3}, [4]),
    ({"type": "integer", "exclusiveMaximum": 100, "multipleOf": 5}, [7]),
    ({"type": "integer", "multipleOf": 1.5}, [1]),
    ({"type": "number", "multipleOf": 0.5}, [0.3]),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, ["abcd"]),
    ({"type": "string", "format": "date", "minLength": 11}, ["2020-01-02"]),
    ({"type": "string", "pattern": "^(?!a)[a-z]+$"}, ["ab"]),
    ({"type": "array", "contains": {"const": 7}}, [[]]),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}, "maxContains": 1}, [[7, 7]]),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [[1, 1]]),
    ({"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 3}]}, [4]),
    ({"type": "integer", "allOf": [{"maximum": 3}]}, [4]),
    ({"type": "integer", "anyOf": [{"maximum": 3}, {"minimum": 10}]}, [5]),
    ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]}, [3]),
    ({**DEFS, "type": "object", "properties": {"a": {"$ref": "#/$defs/n", "maximum": 1}}}, [{"a": 2}]),
    ({"$ref": "https://example.com/s.json"}, ["anything"]),
    ({"type": "object", "unevaluatedProperties": {"minimum": 3}}, [{"a": 1}]),
    ({"type": "object", "properties": {"a": {"$ref": "#/components/schemas/U"}},
      "components": {"schemas": {"U": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     [{"a": [1, 1]}]),  # a $ref target outside $defs
    ({"oneOf": [{"const": 1}, {"const": 1.0}]}, [1]),  # equal in JSON Schema: 1 matches both
    ({"minimum": 3}, [2]),
    ({"maxLength": 1}, ["ab"]),
    ({"required": ["a"]}, [{}]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, [{"a": 1}]),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "required": ["a"]}, [{}]),
    ({"type": "integer", "enum": [1, 5], "maximum": 3}, [5]),
    ({"type": "integer", "enum": [1, "a"]}, ["a"]),
    ({"type": "integer", "not": {"const": 1}}, [1]),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}}, [1]),
    ({"type": "object", "dependentRequired": {"a": ["b"]}, "properties": {"a": {}, "b": {}}}, [{"a": 1}]),
]  # fmt: skip


def grammar_accepts(schema: dict[str, Any], instance: Any) -> bool:
    grammar = json_schema_grammar(json.dumps(schema), True, any_whitespace=True)
    return _is_grammar_accept_string(grammar, json.dumps(instance))


def valid(schema: dict[str, Any], instance: Any) -> bool:
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return checker.is_valid(instance)


def let_through(schema: dict[str, Any], instances: list[Any]) -> list[Any]:
    """The instances the grammar accepts that are not valid against `schema`."""
    remote = "$ref" in schema and not schema["$ref"].startswith("#")  # jsonschema would fetch it
    return [i for i in instances if grammar_accepts(schema, i) and (remote or not valid(schema, i))]


@pytest.mark.parametrize(("schema", "instances"), CASES, ids=lambda v: json.dumps(v)[:60])
def test_the_check_refuses_exactly_what_the_grammar_lets_through(schema: dict, instances: list) -> None:
    where = unsupported_keyword(schema)
    unchecked = let_through(schema, instances)
    if where is None:
        assert not unchecked, f"the check let {schema} through; the grammar accepts {unchecked}"
    else:
        assert unchecked, f"the check refused {schema} ({where}); the grammar holds every instance listed"


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: Annotated[int, pydantic.Field(ge=1, le=9)]


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    name: Annotated[str, pydantic.Field(max_length=8)]


class Owner(pydantic.BaseModel):
    pet: Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]
    colour: Colour | None = None
    tags: list[str] = []
    scores: dict[str, float] = {}
    where: tuple[int, int]


def test_pydantic_models_pass_and_are_held_to() -> None:
    """What pydantic writes (a discriminated union as oneOf with $refs, Optional as anyOf, enums,
    bounds, tuples, maps) passes the check, and the grammar holds answers to it."""
    schema = Owner.model_json_schema()
    assert unsupported_keyword(schema) is None
    good = {"pet": {"kind": "cat", "lives": 3}, "colour": "red", "tags": ["a"], "scores": {}, "where": [1, 2]}
    bad = [
        {**good, "pet": {"kind": "cat", "lives": 10}},
        {**good, "pet": {"kind": "dog", "name": "abcdefghi"}},
        {**good, "pet": {"kind": "cow", "lives": 3}},
        {**good, "colour": "green"},
        {**good, "where": [1]},
    ]
    assert grammar_accepts(schema, good) and valid(schema, good)
    assert not let_through(schema, bad)


def test_a_refusal_names_the_keyword_and_where() -> None:
    schema = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    assert unsupported_keyword(schema).startswith("'uniqueItems' at #/properties/xs")
    nested = {"$defs": {"D": {"type": "integer", "minimum": 1, "multipleOf": 2}}, "$ref": "#/$defs/D"}
    assert unsupported_keyword(nested).startswith("'multipleOf' at #/$defs/D")
    # a property named like a keyword, or a value that holds one, is data
    assert unsupported_keyword({"type": "object", "properties": {"not": {"enum": [{"if": 1}]}}}) is None


@pytest.mark.parametrize(
    ("pattern", "lookaround"),
    [("^(?=a)b", True), ("(?!x)y", True), ("(?<=a)b", True), (r"\(?=a", False), ("(?:ab)+", False)],
)
def test_a_regex_lookaround_is_found(pattern: str, lookaround: bool) -> None:
    assert regex_lookaround(pattern) is lookaround


def test_schemas_and_regexes_inside_a_structural_tag_are_checked() -> None:
    """A structural tag's `json_schema` and `regex` formats (and the older `structures[].schema`)
    meet the same check as `structured_outputs.json` and `.regex`."""
    unique = {"type": "array", "uniqueItems": True}
    tags = [
        {"type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "const_string", "value": "x"}, {"type": "json_schema", "json_schema": unique}]}},
        json.dumps({"type": "structural_tag", "format": {"type": "regex", "pattern": "(?=a)b"}}),
        {"structures": [{"begin": "<f>", "schema": unique, "end": "</f>"}], "triggers": ["<f>"]},
    ]  # fmt: skip
    for tag in tags:
        with pytest.raises(OpenAIError) as refused:
            one_spec([("response_format", {"structural_tag": tag})])
        assert refused.value.param == "response_format"
    fine = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": "integer"}}}
    assert one_spec([("response_format", {"structural_tag": fine})]) == {"structural_tag": fine}
    with pytest.raises(OpenAIError, match="lookahead"):
        one_spec([("structured_outputs", {"regex": "^(?!a).*"})])
