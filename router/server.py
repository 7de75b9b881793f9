"""`pdserve router`: the OpenAI-compatible front of a disaggregated deployment."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI

from pdserve.heap import freeze_startup_heap
from pdserve.model_config import ModelConfig
from pdserve.registry import InstanceRegistry
from pdserve.tokenizer import Tokenizer, load_tokenizer, read_chat_template
from router.admission import AdmissionConfig
from router.api_flags import (
    ApiOptions,
    access_log,
    add_api_arguments,
    add_model_argument,
    api_options_from_args,
    model_from_args,
    served_names,
)
from router.app import create_app
from router.chat_output import ChatParsingConfig
from router.disagg import BurstConfig, DisaggBackend
from router.drain import Drain, DrainingServer
from router.gate import ApiKey, read_api_key_file
from router.http_guard import connection_cap, guarded_protocol
from router.instances import InstanceSet
from router.metrics import RouterMetrics
from router.prompt_chars import max_chars_per_token_async
from router.scaling_metrics import RoleLoadCollector


@dataclass(slots=True)
class RouterConfig:
    """The one config object of a router process."""

    model: str  # folder with the tokenizer, chat template and config.json
    redis_url: str
    served_model_names: tuple[
        str, ...
    ] = ()  # accepted in `model`; answers carry the first (default: `model`)
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int | None = None  # default: the model's; the instances' own limits apply below it
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # keys, body size, queue
    burst: BurstConfig = field(default_factory=BurstConfig)
    shutdown_timeout_s: float = 30.0  # on SIGTERM: how long open requests may go on (router.drain)
    chat_parsing: ChatParsingConfig = field(default_factory=ChatParsingConfig)  # tool calls, reasoning
    api: ApiOptions = field(default_factory=ApiOptions)  # request defaults, --max-logprobs
    chat_template: str | None = None  # a template's source, replacing the model's
    access_log: bool = True  # uvicorn's line per request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--model", default=None, help="model folder (tokenizer, chat template, config)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require it as a Bearer token on /v1/; repeat for several keys (also: $PDSERVE_API_KEY, "
        "which `ps` does not show)",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="API keys, one a line, optionally `KEY max_concurrency` (its requests in flight; 429 beyond)",
    )
    defaults = AdmissionConfig()
    parser.add_argument(
        "--max-request-bytes", type=int, default=defaults.max_request_bytes, help="refuse larger bodies (413)"
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="generations waiting for a first token before new requests get 503 + Retry-After (0: no cap)",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=defaults.queue_timeout_s,
        help="seconds a request may wait for its first token before it ends with 503 (0: no limit)",
    )
    parser.add_argument("--burst-window-ms", type=float, default=5.0, help="gather a burst for this long")
    parser.add_argument(
        "--burst-max-tokens",
        type=int,
        default=16384,
        help="send a burst at this many tokens to compute (past the prefixes its instance caches)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, let open requests go on this long, then end them with an error (s)",
    )
    add_api_arguments(parser)


@dataclass(slots=True)
class Router:
    """A router's parts, built but not started: the ASGI app and what `serve` starts and closes."""

    app: FastAPI
    instances: InstanceSet
    registry: InstanceRegistry
    drain: Drain
    tokenizer: Tokenizer


def build_router(config: RouterConfig) -> Router:
    """The app over a `DisaggBackend`, with the per-role load gauges on its /metrics; the
    request series and the KV-cache gauge there carry the first served name as `model_name`."""
    model_config = ModelConfig.from_pretrained(config.model)
    # an upper bound: each request is held to the smallest limit the live instances publish
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    names = config.served_model_names or (config.model,)
    # vLLM labels its series with the (first) served name: its dashboards' model filter reads it
    metrics = RouterMetrics(model_name=names[0])
    registry = InstanceRegistry(config.redis_url)
    instances = InstanceSet(registry, metrics)
    metrics.registry.register(RoleLoadCollector(instances, names[0]))
    backend = DisaggBackend(instances, metrics, max_model_len, config.burst)
    api = config.api if config.api.model_root else dataclasses.replace(config.api, model_root=config.model)
    drain = Drain()
    tokenizer = load_tokenizer(config.model, config.chat_template)
    app = create_app(backend, tokenizer, names, metrics, config.admission, drain, config.chat_parsing, api)
    return Router(app, instances, registry, drain, tokenizer)


async def serve(config: RouterConfig) -> None:
    router = build_router(config)
    await router.instances.start()
    freeze_startup_heap()  # the app, the tokenizer, FastAPI's and pydantic's own: out of gc's walk
    # the prompt-length bound's vocabulary pass (~0.3 s) on a worker thread while the server
    # starts: the first long prompts need not wait for it (they had, ~70 ms on average over the
    # first served cell on the H200, session 16); readiness does not wait for it either
    vocabulary = asyncio.get_running_loop().create_task(max_chars_per_token_async(router.tokenizer))
    uvicorn_config = uvicorn.Config(
        router.app,
        host=config.host,
        port=config.port,
        http=guarded_protocol(max_connections=connection_cap()),  # a request timeout, a cap
        log_config=None,  # our logging's format (run() sets it up)
        log_level=None,
        access_log=config.access_log,
        timeout_graceful_shutdown=5,
    )
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.INFO if config.access_log else logging.WARNING)
    server = DrainingServer(uvicorn_config, router.drain, config.shutdown_timeout_s)
    try:
        await server.serve()
    finally:
        vocabulary.cancel()  # the pass itself goes on in its thread; nothing waits for it
        await router.instances.close()
        await router.registry.close()


def api_keys(args: argparse.Namespace) -> tuple[ApiKey, ...]:
    """--api-key (each), the lines of --api-key-file, then $PDSERVE_API_KEY: all of them work."""
    keys = [ApiKey(key) for key in args.api_key]
    if args.api_key_file is not None:
        keys += read_api_key_file(args.api_key_file)
    if (env := os.environ.get("PDSERVE_API_KEY")) and env not in {k.key for k in keys}:
        keys.append(ApiKey(env))
    return tuple(keys)


def run(args: argparse.Namespace) -> int:
    """Serve until a signal. A configuration that cannot start (no config.json or tokenizer.json,
    bad flags, an unreadable key or secret file) stops with one line and status 1."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        model = model_from_args(args)
        if model is None:
            raise ValueError("the model folder is needed: pdserve router MODEL (or --model MODEL)")
        config = RouterConfig(
            model=model,
            redis_url=args.redis_url,
            served_model_names=served_names(args, model),
            host=args.host,
            port=args.port,
            max_model_len=args.max_model_len,
            admission=AdmissionConfig(
                api_keys=api_keys(args),
                max_request_bytes=args.max_request_bytes,
                max_queued_requests=args.max_queued_requests,
                queue_timeout_s=args.queue_timeout,
            ),
            burst=BurstConfig(window_s=args.burst_window_ms / 1000, max_tokens=args.burst_max_tokens),
            shutdown_timeout_s=args.shutdown_timeout,
            chat_parsing=ChatParsingConfig.from_args(args),
            api=api_options_from_args(args, model),
            chat_template=None if args.chat_template is None else read_chat_template(args.chat_template),
            access_log=access_log(args),
        )
        asyncio.run(serve(config))
    except (ValueError, OSError) as e:
        print(f"pdserve router: cannot start: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
