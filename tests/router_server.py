"""The live router that test_router_api.py and test_router_errors.py share: the tiny model in an
LLMEngine behind a LocalBackend, served by uvicorn on a loopback port, and an `openai` client of it.
A pytest plugin (`pytest_plugins = ["tests.router_server"]` in each of those modules), so that one
engine and one server, session-scoped, serve every test of both.

`tiny_engine` and `local_app` build the same engine and app for a test that needs its own (another
`max_model_len`, the app in-process: tests/test_schema_fuzz.py); import those two, not the fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from fastapi import FastAPI

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from router.app import create_app
from router.metrics import RouterMetrics
from tests.live_server import serving
from tests.local_backend import LocalBackend
from tests.router_requests import MAX_MODEL_LEN, MODEL


def tiny_engine(model_dir: Path, max_model_len: int) -> LLMEngine:
    """The tiny checkpoint in an fp32 CPU engine."""
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=max_model_len)
    return LLMEngine(config)


@contextmanager
def local_app(engine: LLMEngine, model: str) -> Iterator[FastAPI]:
    """The router app serving `model` from `engine` through a LocalBackend, closed afterwards."""
    metrics = RouterMetrics()
    backend = LocalBackend(engine, metrics)
    try:
        yield create_app(backend, engine.tokenizer, model, metrics)
    finally:
        backend.close()


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return tiny_engine(tiny_model_dir, MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def server(engine: LLMEngine) -> Iterator[str]:
    with local_app(engine, MODEL) as app, serving(app) as url:
        yield url


@pytest.fixture(scope="session")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
