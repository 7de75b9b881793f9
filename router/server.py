"""`pdserve router`: the OpenAI-compatible front of a disaggregated deployment."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import uvicorn

from pdserve.config import ModelConfig
from pdserve.registry import InstanceRegistry
from pdserve.tokenizer import load_tokenizer
from router.app import create_app
from router.disagg import BurstConfig, DisaggBackend
from router.instances import InstanceSet
from router.metrics import RouterMetrics


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
    parser.add_argument("--burst-window-ms", type=float, default=5.0, help="gather a burst for this long")
    parser.add_argument(
        "--burst-max-tokens", type=int, default=16384, help="send a burst at this many tokens"
    )


async def serve(args: argparse.Namespace) -> None:
    model_config = ModelConfig.from_pretrained(args.model)
    max_model_len = args.max_model_len or min(model_config.max_position_embeddings, 32_768)
    metrics = RouterMetrics()
    registry = InstanceRegistry(args.redis_url)
    instances = InstanceSet(registry, metrics)
    burst = BurstConfig(window_s=args.burst_window_ms / 1000, max_tokens=args.burst_max_tokens)
    backend = DisaggBackend(instances, metrics, max_model_len, burst)
    app = create_app(
        backend,
        load_tokenizer(args.model),
        args.served_model_name or args.model,
        metrics,
        api_key=args.api_key,
    )
    await instances.start()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    try:
        await server.serve()
    finally:
        await instances.close()
        await registry.close()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args))
    return 0
