"""What the schemathesis tests (tests/test_schema_fuzz.py in-process, tests/test_soak.py against a
real stack) check of each answer, and how they keep generated requests cheap.

    keep_short(case, max_model_len)               # before sending
    check_answer(case, response)                  # after: raises on any failure

Checks: schemathesis' no 5xx, status code, content type, headers and body as the document
declares, schema-invalid requests refused; every 429/503 with Retry-After; a 200 of a generation
route a valid OpenAI object (the `openai` package's models), a stream its chunks then [DONE].
"""

from __future__ import annotations

import json

import schemathesis
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from router.protocol import ChatCompletionRequest, CompletionRequest

ROUTES = "^/(v1/chat/completions|v1/completions|v1/models|health)$"
REQUESTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
OBJECTS = {  # route -> (answer model, stream chunk model)
    "/v1/chat/completions": (ChatCompletion, ChatCompletionChunk),
    "/v1/completions": (Completion, Completion),
}
SHORT = {"n": 2, "max_tokens": 3, "max_completion_tokens": 3}  # lowered to these from (these, limit]


def keep_short(case: schemathesis.Case, max_model_len: int, unset_max_tokens: int | None = None) -> None:
    """Make a generated request cheap to serve, in place, without making it valid or invalid: an
    n or max_tokens the router would accept lowered to a small one of the same JSON type (values
    out of range stay), and a schema-valid request's list of prompts cut to its first two. With
    `unset_max_tokens`, a request that leaves its output budget to the room in the context (no
    max_tokens, or null) gets that many instead: against a long context that room is costly."""
    body = case.body
    if not isinstance(body, dict):
        return
    limits = {"n": 256, "max_tokens": max_model_len - 1, "max_completion_tokens": max_model_len - 1}
    for field, small in SHORT.items():
        value = body.get(field)
        if type(value) in (int, float) and small < value <= limits[field]:
            body[field] = type(value)(small)
    positive = case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE
    prompt = body.get("prompt")
    if positive and isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        body["prompt"] = prompt[:2]
    if unset_max_tokens is not None:
        chat = case.operation.path == "/v1/chat/completions"
        if chat and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_completion_tokens"] = unset_max_tokens
        elif not chat and "max_tokens" in body and body["max_tokens"] is None:
            body["max_tokens"] = unset_max_tokens


def negative_data_refused(ctx: object, response: schemathesis.Response, case: schemathesis.Case) -> None:
    negative_data_rejection(ctx, response, case)


def is_stream(response: schemathesis.Response) -> bool:
    return response.headers.get("content-type", [""])[0].startswith("text/event-stream")


def openai_objects(ctx: object, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """A 200 of a generation route is an OpenAI object, or an SSE stream of chunks then [DONE]."""
    if response.status_code != 200 or case.operation.path not in OBJECTS:
        return
    answer, chunk = OBJECTS[case.operation.path]
    if not is_stream(response):
        answer.model_validate(response.json())
        return
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"stream does not end with [DONE]: {events[-2:]}"
    for event in events[:-1]:
        data = json.loads(event)
        assert "error" not in data, f"error event in a stream: {data}"
        if chunk is Completion:  # OpenAI streams finish_reason null until the last chunk; the model says str
            data["choices"] = [
                {**c, "finish_reason": c["finish_reason"] or "length"} for c in data["choices"]
            ]
        chunk.model_validate(data)


def retry_after(ctx: object, response: schemathesis.Response, case: schemathesis.Case) -> None:
    if response.status_code in (429, 503):
        assert "retry-after" in {k.lower() for k in response.headers}, response.headers


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_refused,
    openai_objects,
    retry_after,
]


def check_answer(case: schemathesis.Case, response: schemathesis.Response) -> None:
    case.validate_response(response, checks=CHECKS)
