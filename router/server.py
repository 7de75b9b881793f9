"""`pdserve router`: the OpenAI-compatible front of a disaggregated deployment."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass, field

import uvicorn

from pdserve.config import ModelConfig
from pdserve.registry import InstanceRegistry
from pdserve.tokenizer import load_tokenizer
from router.app import create_app
from router.disagg import BurstConfig, DisaggBackend
from router.instances import InstanceSet
from router.metrics import RouterMetrics


@dataclass(slots=True)
class RouterConfig:
    """The one config object of a router process."""

    model: str  # folder with the tokenizer, chat template and config.json
    redis_url: str
    served_model_name: str | None = None  # default: `model`
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int | None = None  # default: the model's, capped at 32,768
    api_key: str | None = None
    max_request_bytes: int = 32 << 20  # a larger declared body is refused (413) before it is read
    burst: BurstConfig = field(default_factory=BurstConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder (tokenizer, chat template, config)")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--api-key", default=os.environ.get("PDSERVE_API_KEY"), help="require it as a Bearer token on /v1/"
    )
    parser.add_argument("--max-request-bytes", type=int, default=32 << 20, help="refuse larger bodies (413)")
    parser.add_argument("--burst-window-ms", type=float, default=5.0, help="gather a burst for this long")
    parser.add_argument(
        "--burst-max-tokens", type=int, default=16384, help="send a burst at this many tokens"
    )


async def serve(config: RouterConfig) -> None:
    model_config = ModelConfig.from_pretrained(config.model)
    max_model_len = config.max_model_len or min(model_config.max_position_embeddings, 32_768)
    metrics = RouterMetrics()
    registry = InstanceRegistry(config.redis_url)
    instances = InstanceSet(registry, metrics)
    backend = DisaggBackend(instances, metrics, max_model_len, config.burst)
    name = config.served_model_name or config.model
    app = create_app(
        backend,
        load_tokenizer(config.model),
        name,
        metrics,
        api_key=config.api_key,
        max_request_bytes=config.max_request_bytes,
    )
    await instances.start()
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning"))
    try:
        await server.serve()
    finally:
        await instances.close()
        await registry.close()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = RouterConfig(
        model=args.model,
        redis_url=args.redis_url,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        burst=BurstConfig(window_s=args.burst_window_ms / 1000, max_tokens=args.burst_max_tokens),
    )
    asyncio.run(serve(config))
    return 0
