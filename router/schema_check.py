"""Which JSON-schema keywords the grammar would not hold an answer to: a schema with one is a 400,
never an answer that need not validate.

xgrammar's converter (0.2.x) reads a schema node by the FIRST of these it holds and ignores
every other keyword there without an error: `$ref`, `const`, `enum`, `anyOf`, `oneOf`, `allOf`,
`type`, then object keywords (`properties`, `additionalProperties`) or array keywords (`items`,
`prefixItems`), else anything is accepted. So `{"type": "integer", "anyOf": [...]}` loses its
type, `{"$ref": ..., "maximum": 1}` its bound and `{"minimum": 3}` everything. Within a kind it
also drops, at most with a log line: `multipleOf` beside a range or on a non-integer, a string's
length beside `pattern` or `format`, a lookahead in a pattern, `contains`, `uniqueItems`, a
`required` name with no property, `allOf` of several schemas (anything goes), a `$ref` to another
document (anything goes), and `oneOf`'s exclusivity (read as `anyOf`). `unsupported_keyword`
mirrors that dispatch; tests/test_schema_check.py holds it to xgrammar's grammar and `jsonschema`.
"""

from __future__ import annotations

import json
import re
from typing import Any

NUMBER_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
STRING_LENGTH = ("minLength", "maxLength")
ARRAY = ("items", "prefixItems", "minItems", "maxItems", "unevaluatedItems")
OBJECT = ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
          "minProperties", "maxProperties", "unevaluatedProperties")  # fmt: skip
BY_TYPE = {
    "integer": (*NUMBER_RANGE, "multipleOf"),
    "number": NUMBER_RANGE,
    "string": (*STRING_LENGTH, "pattern", "format"),
    "boolean": (),
    "null": (),
    "array": ARRAY,
    "object": OBJECT,
}
# the keywords that constrain an instance (JSON Schema 2020-12 and draft 7's `dependencies`);
# any other key (title, description, default, $defs, discriminator, ...) constrains nothing, and
# `format` asserts only where the converter reads it, on a string (elsewhere an annotation)
VALIDATION = {"type", "enum", "const", "multipleOf", "uniqueItems", "contains", "minContains",
              "maxContains", "additionalItems", "dependentRequired", "dependentSchemas",
              "dependencies", "allOf", "anyOf", "oneOf", "not", "if", "$ref", *NUMBER_RANGE,
              *STRING_LENGTH, "pattern", *ARRAY, *OBJECT}  # fmt: skip
NO_OPS = {("uniqueItems", False), ("unevaluatedItems", True), ("unevaluatedProperties", True),
          ("additionalProperties", True), ("items", True)}  # fmt: skip
# the formats xgrammar turns into a regex, dropping a length beside them (others: annotations)
FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
           "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}  # fmt: skip
LOOKAROUND = re.compile(r"(?<!\\)(?:\\\\)*\(\?<?[=!]")  # after an even number of backslashes
JSON_TYPES = {"integer": (int,), "number": (int, float), "string": (str,), "boolean": (bool,),
              "null": (type(None),), "array": (list,), "object": (dict,)}  # fmt: skip
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")  # items: draft 4-7 tuples
SUBSCHEMAS = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
              "unevaluatedItems")  # fmt: skip


def unsupported_keyword(schema: Any) -> str | None:
    """`'KEYWORD' at PATH (why)` for the first keyword of `schema`, its subschemas or the targets of
    its local `$ref`s (wherever they are: `#/components/schemas/X` too) that the grammar would
    not hold an answer to, else None. Names of properties, and enum and const values, are data."""
    if not isinstance(schema, dict):
        return None
    refs: list[str] = []
    if (where := _walk(schema, schema, "#", refs)) is not None:
        return where
    seen: set[str] = set()
    while refs:
        ref = refs.pop()
        if ref not in seen and (target := _resolve({"$ref": ref}, schema)) is not None:
            seen.add(ref)
            if (where := _walk(target, schema, ref, refs)) is not None:
                return where
    return None


def _walk(schema: Any, root: dict[str, Any], path: str, refs: list[str]) -> str | None:
    """The node check over `schema` and its subschemas; the local `$ref`s met go to `refs`."""
    if not isinstance(schema, dict):
        return None
    if isinstance(schema.get("$ref"), str):
        refs.append(schema["$ref"])
    if (where := _node(schema, root, path)) is not None:
        return where
    for child_path, child in _children(schema, path):
        if (where := _walk(child, root, child_path, refs)) is not None:
            return where
    return None


def regex_lookaround(pattern: Any) -> bool:
    """Does a regular expression hold a lookahead or lookbehind (xgrammar ignores a lookahead)?"""
    return isinstance(pattern, str) and LOOKAROUND.search(pattern) is not None


def _node(schema: dict[str, Any], root: Any, path: str) -> str | None:
    kind, used = _read_as(schema)
    for key in schema:
        if key in VALIDATION and key not in used and not _no_op(key, schema[key]):
            beside = f"beside {kind!r}" if kind else "with no 'type'"
            return f"{key!r} at {path} (xgrammar ignores it {beside})"
    if kind in ("const", "enum") and "type" in schema:
        values = [schema["const"]] if kind == "const" else schema["enum"]
        if not isinstance(values, list) or not all(_of_type(v, schema["type"]) for v in values):
            return f"'type' at {path} (xgrammar ignores it beside {kind!r}, and a value is not of it)"
    if kind == "$ref" and not (schema["$ref"] == "#" or str(schema["$ref"]).startswith("#/")):
        return f"'$ref' at {path} (only references within the schema are followed)"
    if kind == "allOf" and len(schema["allOf"]) != 1:
        return f"'allOf' at {path} (of several schemas: xgrammar lets anything through)"
    if kind == "oneOf" and not _disjoint(schema["oneOf"], root):
        return f"'oneOf' at {path} (its schemas may overlap, and xgrammar reads it as anyOf)"
    types = {"type": schema.get("type"), "properties": "object", "items": "array"}.get(kind or "")
    return _within(schema, types if isinstance(types, list) else [types], path) if types else None


def _read_as(schema: dict[str, Any]) -> tuple[str | None, set[str]]:
    """The keyword xgrammar reads the node by, and the keywords it enforces there."""
    for key in ("$ref", "const", "enum", "anyOf", "oneOf", "allOf"):
        if key in schema:
            return key, {key, "type"} if key in ("const", "enum") else {key}
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return "type", {"type"}.union(*(BY_TYPE.get(t, ()) for t in types if isinstance(t, str)))
    if any(key in schema for key in ("properties", "additionalProperties", "unevaluatedProperties")):
        return "properties", set(OBJECT)
    if any(key in schema for key in ("items", "prefixItems", "unevaluatedItems")):
        return "items", set(ARRAY)
    return None, set()


def _within(schema: dict[str, Any], types: list[Any], path: str) -> str | None:
    """What the converter drops within the kinds it reads `schema` as."""
    multiple = schema.get("multipleOf")
    if "integer" in types and multiple is not None:
        if not isinstance(multiple, int) or isinstance(multiple, bool):
            return f"'multipleOf' at {path} (not an integer)"
        if any(key in schema for key in NUMBER_RANGE):
            return f"'multipleOf' at {path} (beside a range: xgrammar keeps the range only)"
    if "string" in types and any(key in schema for key in STRING_LENGTH):
        if "pattern" in schema or schema.get("format") in FORMATS:
            return f"'minLength'/'maxLength' at {path} (beside a pattern or format: xgrammar ignores them)"
    if "string" in types and regex_lookaround(schema.get("pattern")):
        return f"'pattern' at {path} (a lookahead or lookbehind)"
    if "object" in types and isinstance(schema.get("required"), list):
        declared = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        if missing := [name for name in schema["required"] if name not in declared]:
            return f"'required' at {path} ({missing[0]!r} is not among the properties)"
    return None


def _disjoint(options: Any, root: Any) -> bool:
    """Can no instance match two of `options`? Shown when each has its own JSON type, or when
    each is a const or enum of values the others lack, or when each is an object whose one
    required property is const or enum, the values all different (a discriminated union:
    pydantic's, OpenAPI's)."""
    if not isinstance(options, list):
        return False
    options = [_resolve(option, root) for option in options]
    values = [_values(option) for option in options]
    if options and None not in values:
        flat = [_same(v) for vs in values for v in vs]
        if len(set(flat)) == len(flat):
            return True
    groups = [_type_group(option) for option in options]
    if None not in groups and len(set(groups)) == len(groups):
        return True
    tags = [_tag_values(option, root) for option in options]
    if not tags or any(t is None for t in tags):
        return False
    for name in set.intersection(*(set(t) for t in tags)):
        values = [_same(v) for t in tags for v in t[name]]
        if len(set(values)) == len(values):
            return True
    return False


def _same(value: Any) -> str:
    """A key equal for values JSON Schema counts equal (1 and 1.0; objects by content)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(float(value))
    return json.dumps(value, sort_keys=True)


def _values(schema: dict[str, Any] | None) -> list[Any] | None:
    if schema is None or not ("const" in schema or isinstance(schema.get("enum"), list)):
        return None
    return [schema["const"]] if "const" in schema else schema["enum"]


def _tag_values(option: dict[str, Any] | None, root: Any) -> dict[str, list[Any]] | None:
    if option is None or not isinstance(option.get("properties"), dict):
        return None
    tags = {}
    for name in option.get("required") or ():
        if (values := _values(_resolve(option["properties"].get(name), root))) is not None:
            tags[name] = values
    return tags


def _resolve(schema: Any, root: Any, depth: int = 0) -> dict[str, Any] | None:
    """`schema` with its local `$ref`s followed (None where one cannot be)."""
    if not isinstance(schema, dict):
        return None
    ref = schema.get("$ref")
    if ref is None:
        return schema
    if depth > 32 or not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in filter(None, ref[2:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return _resolve(node, root, depth + 1)


def _type_group(schema: dict[str, Any] | None) -> str | None:
    kind = schema.get("type") if schema is not None else None
    return ("number" if kind == "integer" else kind) if isinstance(kind, str) else None


def _of_type(value: Any, types: Any) -> bool:
    types = types if isinstance(types, list) else [types]
    for t in types:
        python = JSON_TYPES.get(t, ())
        if isinstance(value, bool) and t not in ("boolean",):
            continue
        if isinstance(value, python) or (t == "integer" and isinstance(value, float) and value.is_integer()):
            return True
    return False


def _no_op(key: str, value: Any) -> bool:
    return (key, value) in NO_OPS if isinstance(value, bool) else False


def _children(schema: dict[str, Any], path: str) -> list[tuple[str, Any]]:
    children = [(f"{path}/{key}", schema[key]) for key in SUBSCHEMAS if isinstance(schema.get(key), dict)]
    names = schema.get("propertyNames")
    if isinstance(names, dict) and "type" not in names:  # read as strings (pydantic, zod leave type out)
        children = [(p, {**names, "type": "string"} if c is names else c) for p, c in children]
    for key in SUBSCHEMA_MAPS:
        if isinstance(sub := schema.get(key), dict):
            children += [(f"{path}/{key}/{name}", value) for name, value in sub.items()]
    for key in SUBSCHEMA_LISTS:
        if isinstance(sub := schema.get(key), list):
            children += [(f"{path}/{key}/{i}", value) for i, value in enumerate(sub)]
    return children
