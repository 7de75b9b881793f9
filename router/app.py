"""The router's OpenAI app: `create_app(backend, tokenizer, served_model_name, metrics, admission)`.

Routes: /v1/chat/completions and /v1/completions (router.handlers: the request lifecycle),
/v1/models (a card per served name) and /v1/models/{model}, /tokenize and /detokenize
(router.tokenize), and as vLLM answers them: /version (`{"version"}`), /ping (GET or POST:
/health's status, no body), /health, /metrics.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Sequence

from fastapi import Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from pdserve.tokenizer import Tokenizer
from router.admission import Admission, AdmissionConfig
from router.api_flags import ApiOptions
from router.backend import Backend
from router.chat_output import ChatParsingConfig
from router.drain import SHUTDOWN_MESSAGE, Drain
from router.errors import (
    GENERATION_ERRORS,
    BackendError,
    error_response,
    install_error_handlers,
    install_openapi_schema,
    require_json,
)
from router.gate import RequestGate
from router.handlers import OpenAIRouter
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)

ERRORS = {status: GENERATION_ERRORS[status] for status in (400, 404, 500)}  # of /tokenize, /detokenize
JSON_BODY = [Depends(require_json)]  # a body sent as anything but JSON: a 400 naming the Content-Type


def pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def create_app(
    backend: Backend,
    tokenizer: Tokenizer,
    served_model_name: str | Sequence[str],
    metrics: RouterMetrics | None = None,
    admission: AdmissionConfig | None = None,
    drain: Drain | None = None,
    chat_parsing: ChatParsingConfig | None = None,
    api: ApiOptions | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `backend`; pass the `metrics` the backend registered into
    (default: a fresh set labelled with the first served name).
    `served_model_name`: one name or several (each accepted in `model`; answers carry the first).
    `admission` (router.admission): the API keys (when any, every `/v1/` route wants one as
    `Authorization: Bearer <key>`, as vLLM's `--api-key`; /health and /metrics stay open), the
    body limit, the queue cap and the queue timeout. `chat_parsing` (router.chat_output): the
    --tool-call-parser, --reasoning-parser and --enable-auto-tool-choice flags. `api`
    (router.api_flags): request defaults, --max-logprobs, the model's root path."""
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    if not names:
        raise ValueError("at least one served model name is needed")
    metrics = metrics or RouterMetrics(model_name=names[0])  # labelled as `pdserve router` labels it
    admission = admission or AdmissionConfig()
    drain = drain or Drain()
    chat_parsing = chat_parsing or ChatParsingConfig()
    api = api or ApiOptions()
    router = OpenAIRouter(
        backend, tokenizer, names, metrics, Admission(admission, metrics), drain, chat_parsing, api
    )
    created = int(time.time())
    app = FastAPI(title="pdserve router")
    app.state.router = router
    install_error_handlers(app)
    install_openapi_schema(app)
    app.add_middleware(
        RequestGate, max_bytes=admission.max_request_bytes, api_keys=admission.api_keys, metrics=metrics
    )
    app.add_middleware(  # added last, so outermost: a preflight is answered before the gate
        CORSMiddleware,
        allow_origins=list(api.allowed_origins),
        allow_methods=list(api.allowed_methods),
        allow_headers=list(api.allowed_headers),
        allow_credentials=api.allow_credentials,
    )

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS, dependencies=JSON_BODY)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await router.chat(body, request)

    @app.post("/v1/completions", responses=GENERATION_ERRORS, dependencies=JSON_BODY)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await router.completions(body, request)

    def card(name: str) -> dict:
        root = api.model_root or names[0]
        return {"id": name, "object": "model", "created": created, "owned_by": "pdserve", "root": root,
                "max_model_len": backend.max_model_len()}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card(name) for name in names]}

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (client.models.retrieve)
    async def model(model: str) -> dict:
        router.check_model(model)
        return card(model)

    @app.post("/tokenize", responses=ERRORS, dependencies=JSON_BODY)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(router, body)

    @app.post("/detokenize", responses=ERRORS, dependencies=JSON_BODY)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(router, body)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pdserve_version()}

    @app.get("/health")
    async def health() -> Response:
        if drain.draining:
            return error_response(SHUTDOWN_MESSAGE, 503)
        try:
            return JSONResponse({"status": "ok", **(await backend.health())})
        except BackendError as e:
            return error_response(e.message, 503)

    async def ping() -> Response:
        answer = await health()  # a 503 keeps its error body and Retry-After
        return Response(status_code=200) if answer.status_code == 200 else answer

    for method in ("GET", "POST"):  # one operation id each (OpenAPI wants them distinct)
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
