"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Everything the router answers with a non-2xx status goes through here, FastAPI's own answers
included: its 422 for a body that does not validate (and for malformed JSON) becomes a 400, and
its plain 404/405 for unknown routes become OpenAI errors (OpenAI says "Invalid URL (POST /x)").
An exception nobody expected becomes a 500 `server_error`; the server keeps serving.

Statuses and types:
  400 invalid_request_error  malformed JSON, wrong types, missing fields, bad values, prompt too long
  401 invalid_request_error  /v1/ without a valid API key (router.gate)
  404 invalid_request_error  unknown route; unknown model (code "model_not_found", like OpenAI
                             and vLLM, which both answer 404 for a model they do not serve)
  405 invalid_request_error  known route, wrong method
  413 invalid_request_error  body larger than --max-request-bytes (router.gate)
  429 invalid_request_error  an API key at its concurrency limit (router.gate), with Retry-After
  5xx server_error           a backend failure (`BackendError`, 503 when no instance can take it);
                             503 also for a full queue or a queue timeout (router.admission)
A body sent with a Content-Type other than JSON is a 400 naming that header and what it should
be (`require_json`), not the body it left unread. Every 429 and 503 carries `Retry-After`
(seconds). The OpenAPI schema says so too: each generation route lists these statuses with the
error object, and FastAPI's 422 is gone.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("pdserve.router")
RETRY_AFTER_S = 1  # what a 429 or 503 tells the client to wait before trying again


class OpenAIError(Exception):
    """A request the router refuses; rendered as an OpenAI error with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers


class BackendError(Exception):
    """A backend could not (or can no longer) serve a request.

    `status` is the HTTP status the router answers with when nothing was streamed yet:
    400 for a request the engine refuses, 503 when no instance can take it, 500 otherwise.
    """

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def is_json_media_type(content_type: str) -> bool:
    """Does a Content-Type header say JSON (`application/json` or `application/*+json`, with any
    parameters)? The rule by which FastAPI parses a body as JSON."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media_type.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


async def require_json(request: Request) -> None:
    """A route dependency: a 400 naming the Content-Type header when it is not JSON (missing
    too), as vLLM refuses such a request, before FastAPI would report the unparsed body."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        raise OpenAIError("The Content-Type header is missing: expected 'application/json'")
    if not is_json_media_type(content_type):
        raise OpenAIError(f"The Content-Type header is {content_type!r}: expected 'application/json'")


def error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object, also used as the payload of an SSE error event."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(
    message: str,
    status: int,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The JSON error answer; a 429 or 503 gets `Retry-After` unless `headers` sets it."""
    if status in (429, 503):
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line (and the first offending parameter) from pydantic's error list."""
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "JSON decode error")
            return f"malformed JSON in the request body: {reason}", None
        where = ".".join(loc) or "request body"
        param = param or (".".join(loc) or None)
        parts.append(f"{where}: {err.get('msg', 'invalid').removeprefix('Value error, ')}")
    if len(errors) > 3:
        parts.append(f"(+{len(errors) - 3} more)")
    return "; ".join(parts) or "invalid request", param


UNPARSED_BODY = "There was an error parsing the body"


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI or the handlers raise to an OpenAI-shaped JSON answer."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.code, exc.headers)

    @app.exception_handler(BackendError)
    async def _backend_error(request: Request, exc: BackendError) -> JSONResponse:
        log.warning("backend error on %s: %s", request.url.path, exc.message)
        return error_response(exc.message, exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"Invalid URL ({where})"
        elif exc.status_code == 405:
            message = f"Method not allowed ({where})"
        elif exc.detail == UNPARSED_BODY:  # FastAPI's words for a body json.loads could not take
            message = "the request body is not JSON in UTF-8 (or is nested too deeply to read)"
        else:
            message = str(exc.detail)
        return error_response(message, exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error object, as the OpenAPI schema shows it."""

    error: ErrorDetail


GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request: malformed JSON, a wrong type or value, a prompt that cannot fit"),
        (401, "Missing or invalid API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "The API key is at its concurrency limit (see Retry-After)"),
        (500, "Internal or backend error"),
        (503, "No instance can take the request, the queue is full, or it timed out (see Retry-After)"),
    )
}
GENERATION_ERRORS[200] = {
    "description": "The answer; with `stream: true`, server-sent events (`data: {chunk}` ... `data: [DONE]`)",
    "content": {"text/event-stream": {"schema": {}}},  # chunk objects, then the text [DONE]
}


def install_openapi_schema(app: FastAPI) -> None:
    """The app's OpenAPI schema without FastAPI's 422 (the router answers 400 instead, per route
    as in `GENERATION_ERRORS`) and without the validation-error schemas only 422 used."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
