"""The live router that test_router_api.py and test_router_errors.py share: the tiny model in an
LLMEngine behind a LocalBackend, served by uvicorn on a loopback port, and an `openai` client of it.
A pytest plugin (`pytest_plugins = ["tests.router_server"]` in each of those modules), so that one
engine and one server, session-scoped, serve every test of both; not imported by them directly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from router.app import create_app
from router.backend import LocalBackend
from router.metrics import RouterMetrics
from tests.live_server import serving
from tests.router_requests import MAX_MODEL_LEN, MODEL


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN
    )
    return LLMEngine(config)


@pytest.fixture(scope="session")
def server(engine: LLMEngine) -> Iterator[str]:
    metrics = RouterMetrics()
    backend = LocalBackend(engine, metrics)
    with serving(create_app(backend, engine.tokenizer, MODEL, metrics)) as url:
        yield url
    backend.close()


@pytest.fixture(scope="session")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
