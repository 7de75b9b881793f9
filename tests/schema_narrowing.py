"""The router's OpenAPI document with its request bodies narrowed to what the router accepts, for
tests/test_schema_fuzz.py: the served document says "integer" or "string" where the router
checks a range, a role, a non-empty list (router.protocol, SamplingParams, validate_messages), so
requests generated from it are nearly all refused with a 400 and the answers of served requests
are never looked at. Generated from the narrowed document, most requests are served; a request
outside it must still be refused (schemathesis' negative cases), so every bound here is one the
router enforces. Only request schemas change: the responses are the served document's.

    narrowed = narrow_requests(app.openapi(), vocab_size=248_077, max_model_len=64)
"""

from __future__ import annotations

import copy
from typing import Any

from pdserve.sampling.params import INT64_MAX, MAX_LOGPROBS, MAX_STOP_STRINGS
from pdserve.tokenizer import CHAT_ROLES

MAX_CHOICES = 256  # router.app: n x prompts of one request


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _shared_fields(vocab_size: int, max_model_len: int) -> dict[str, dict]:
    """Fields of both generation requests -> the values the router accepts."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    stop_string = {"type": "string", "minLength": 1}
    return {
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
        "temperature": _nullable({"type": "number", "minimum": 0}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": vocab_size}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0}),
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
        "stop": {
            "anyOf": [
                stop_string,
                {"type": "array", "items": stop_string, "maxItems": MAX_STOP_STRINGS},
                {"type": "null"},
            ]
        },
        "stop_token_ids": _nullable({"type": "array", "items": token_id}),
    }


def _chat_fields(max_model_len: int) -> dict[str, dict]:
    # max_tokens stays as served: max_completion_tokens, when given, overrides it unchecked
    return {
        "messages": {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}, "minItems": 1},
        "max_completion_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": max_model_len - 1}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
    }


def _completion_fields(vocab_size: int, max_model_len: int) -> dict[str, dict]:
    token_ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
        "minItems": 1,
    }
    text = {"type": "string", "minLength": 1}
    return {
        "prompt": {
            "anyOf": [
                text,
                token_ids,
                {"type": "array", "items": text, "minItems": 1, "maxItems": MAX_CHOICES},
                {"type": "array", "items": token_ids, "minItems": 1, "maxItems": MAX_CHOICES},
            ]
        },
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": max_model_len - 1}),
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
    }


def _message_fields() -> dict[str, dict]:
    text_part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}, {"type": "null"}]}
    return {"role": {"enum": list(CHAT_ROLES)}, "content": content}


def narrow_requests(document: dict[str, Any], vocab_size: int, max_model_len: int) -> dict[str, Any]:
    """A copy of the router's OpenAPI `document` whose request schemas allow only accepted values."""
    narrowed = copy.deepcopy(document)
    schemas = narrowed["components"]["schemas"]
    shared = _shared_fields(vocab_size, max_model_len)
    changes = {
        "ChatCompletionRequest": shared | _chat_fields(max_model_len),
        "CompletionRequest": shared | _completion_fields(vocab_size, max_model_len),
        "ChatMessage": _message_fields(),
    }
    for name, fields in changes.items():
        properties = schemas[name]["properties"]
        unknown = set(fields) - set(properties)
        assert not unknown, f"{name} has no fields {unknown}: the served document changed"
        properties.update(fields)
    return narrowed
