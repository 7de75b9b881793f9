"""The router's OpenAI app: `create_app(backend, tokenizer, served_model_name, metrics, admission)`.

Routes: /v1/chat/completions and /v1/completions (router.handlers: the request lifecycle),
/v1/models, /health, /metrics.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from pdserve.tokenizer import Tokenizer
from router.admission import Admission, AdmissionConfig
from router.backend import Backend
from router.chat_output import ChatParsingConfig
from router.drain import SHUTDOWN_MESSAGE, Drain
from router.errors import (
    GENERATION_ERRORS,
    BackendError,
    error_response,
    install_error_handlers,
    install_openapi_schema,
)
from router.gate import RequestGate
from router.handlers import OpenAIRouter
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.protocol import ChatCompletionRequest, CompletionRequest


def create_app(
    backend: Backend,
    tokenizer: Tokenizer,
    served_model_name: str,
    metrics: RouterMetrics | None = None,
    admission: AdmissionConfig | None = None,
    drain: Drain | None = None,
    chat_parsing: ChatParsingConfig | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `backend`; pass the `metrics` the backend registered into.
    `admission` (router.admission): the API keys (when any, every `/v1/` route wants one as
    `Authorization: Bearer <key>`, as vLLM's `--api-key`; /health and /metrics stay open), the
    body limit, the queue cap and the queue timeout. `chat_parsing` (router.chat_output): the
    --tool-call-parser, --reasoning-parser and --enable-auto-tool-choice flags."""
    metrics = metrics or RouterMetrics()
    admission = admission or AdmissionConfig()
    drain = drain or Drain()
    chat_parsing = chat_parsing or ChatParsingConfig()
    router = OpenAIRouter(
        backend, tokenizer, served_model_name, metrics, Admission(admission, metrics), drain, chat_parsing
    )
    created = int(time.time())
    app = FastAPI(title="pdserve router")
    app.state.router = router
    install_error_handlers(app)
    install_openapi_schema(app)
    app.add_middleware(
        RequestGate, max_bytes=admission.max_request_bytes, api_keys=admission.api_keys, metrics=metrics
    )

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await router.chat(body, request)

    @app.post("/v1/completions", responses=GENERATION_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await router.completions(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "pdserve"}
        return {
            "object": "list",
            "data": [{**card, "root": served_model_name, "max_model_len": backend.max_model_len()}],
        }

    @app.get("/health")
    async def health() -> Response:
        if drain.draining:
            return error_response(SHUTDOWN_MESSAGE, 503)
        try:
            return JSONResponse({"status": "ok", **(await backend.health())})
        except BackendError as e:
            return error_response(e.message, 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
