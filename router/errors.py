"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Everything the router answers with a non-2xx status goes through here, FastAPI's own answers
included: its 422 for a body that does not validate (and for malformed JSON) becomes a 400, and
its plain 404/405 for unknown routes become OpenAI errors (OpenAI says "Invalid URL (POST /x)").
An exception nobody expected becomes a 500 `server_error`; the server keeps serving.

Statuses and types:
  400 invalid_request_error  malformed JSON, wrong types, missing fields, bad values, prompt too long
  404 invalid_request_error  unknown route; unknown model (code "model_not_found", like OpenAI
                             and vLLM, which both answer 404 for a model they do not serve)
  405 invalid_request_error  known route, wrong method
  5xx server_error           a backend failure (`BackendError`, 503 when no instance can take it)
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("pdserve.router")


class OpenAIError(Exception):
    """A request the router refuses; rendered as an OpenAI error with `status`."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


class BackendError(Exception):
    """A backend could not (or can no longer) serve a request.

    `status` is the HTTP status the router answers with when nothing was streamed yet:
    400 for a request the engine refuses, 503 when no instance can take it, 500 otherwise.
    """

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object, also used as the payload of an SSE error event."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


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


class RequestGate:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would get in the way of streaming and of
    noticing client disconnects) answering in the OpenAI shape, before the body is read:
    413 when the declared body exceeds `max_bytes`, 401 when `/v1/` lacks the API key."""

    def __init__(self, app: ASGIApp, max_bytes: int, api_key: str | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.expected = None if not api_key else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            declared = headers.get(b"content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
                response = error_response(f"request body larger than {self.max_bytes} bytes", 413)
                return await response(scope, receive, send)
            if self.expected is not None and scope["path"].startswith("/v1/"):
                if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                    response = error_response("invalid or missing API key", 401, code="invalid_api_key")
                    return await response(scope, receive, send)
        await self.app(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI or the handlers raise to an OpenAI-shaped JSON answer."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.code)

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
        else:
            message = str(exc.detail)
        return error_response(message, exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)
