"""What a request may constrain its output to: `structured_outputs`, checked without torch.

A spec is a plain dict (it crosses processes as msgpack and the router builds it without the
grammar library) with exactly one kind, vLLM's `StructuredOutputsParams` names:

  {"json": <JSON schema, a dict or its JSON text>}     JSON that validates against the schema
  {"json_object": true}                                any JSON object
  {"regex": "<pattern>"}                               text that the regular expression matches
  {"choice": ["yes", "no", ...]}                       exactly one of the strings
  {"grammar": "<EBNF>"}                                xgrammar's EBNF (GBNF-like, rule `root`)
  {"structural_tag": <xgrammar structural tag>}        e.g. tool calls (router.structured)

and options:
  "disable_any_whitespace": true   JSON without whitespace beyond ", " and ": " (vLLM's name)
  "reasoning_tags": ["<think>", "</think>"]
                                   when the prompt leaves a reasoning block open, the output is
                                   free until the end tag, and constrained after it (vLLM's
                                   reasoning-parser behaviour)

The grammar itself is compiled by the engine (pdserve.sampling.grammar); a spec that does not
compile is refused there, when the request is set up.
"""

from __future__ import annotations

import json
from typing import Any

SPEC_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
SPEC_OPTIONS = ("disable_any_whitespace", "reasoning_tags")
MAX_SPEC_CHARS = 256 * 1024  # its JSON text: compile time and memory grow with it
MAX_CHOICES = 1024


def _fail(message: str) -> None:
    raise ValueError(f"structured_outputs {message}")


def _check_kind(kind: str, value: Any) -> None:
    if kind in ("json", "structural_tag"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                _fail(f"{kind} is not valid JSON: {e}")
        if not isinstance(value, dict) and not (kind == "json" and isinstance(value, bool)):
            _fail(f"{kind} must be a JSON object (or its JSON text), got {type(value).__name__}")
    elif kind == "json_object":
        if value is not True:
            _fail(f"json_object must be true, got {value!r}")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            _fail(f"{kind} must be a non-empty string, got {value!r}")
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            _fail("choice must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            _fail(f"choice must have at most {MAX_CHOICES} strings, got {len(value)}")


def check_structured_outputs(spec: Any) -> dict[str, Any] | None:
    """The spec with its null entries dropped (None stays None); ValueError naming the problem."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        _fail(f"must be an object, got {type(spec).__name__}")
    spec = {k: v for k, v in spec.items() if v is not None}
    if unknown := sorted(set(spec) - set(SPEC_KINDS) - set(SPEC_OPTIONS), key=str):
        _fail(f"has unknown keys {unknown}; kinds: {', '.join(SPEC_KINDS)}")
    kinds = [k for k in SPEC_KINDS if k in spec and spec[k] is not False]
    if len(kinds) != 1:
        _fail(f"must name exactly one of {', '.join(SPEC_KINDS)}, got {kinds or 'none'}")
    _check_kind(kinds[0], spec[kinds[0]])
    if not isinstance(spec.get("disable_any_whitespace", False), bool):
        _fail("disable_any_whitespace must be a boolean")
    tags = spec.get("reasoning_tags")
    if tags is not None and not (
        isinstance(tags, list) and len(tags) == 2 and all(isinstance(t, str) and t for t in tags)
    ):
        _fail("reasoning_tags must be [start tag, end tag], two non-empty strings")
    try:
        size = len(json.dumps(spec))
    except (TypeError, ValueError) as e:
        _fail(f"must be plain JSON data: {e}")
    if size > MAX_SPEC_CHARS:
        _fail(f"must be at most {MAX_SPEC_CHARS} characters as JSON, got {size}")
    return spec


def spec_kind(spec: dict[str, Any]) -> str:
    """The one kind a checked spec names."""
    return next(k for k in SPEC_KINDS if k in spec and spec[k] is not False)


def grammar_key(spec: dict[str, Any]) -> str:
    """What identifies the compiled grammar of a spec (its options but reasoning_tags included)."""
    return json.dumps({k: v for k, v in spec.items() if k != "reasoning_tags"}, sort_keys=True)
