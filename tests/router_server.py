"""The live router that test_router_api.py and test_router_errors.py share: the tiny model in an
LLMEngine behind a LocalBackend, served by uvicorn on a loopback port, and an `openai` client of it.
A pytest plugin (`pytest_plugins = ["tests.router_server"]` in each of those modules), so that one
engine and one server, session-scoped, serve every test of both; not imported by them directly."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import uvicorn

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from router.app import create_app
from router.backend import LocalBackend
from router.metrics import RouterMetrics
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
    app = create_app(backend, engine.tokenizer, MODEL, metrics)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)
    backend.close()


@pytest.fixture(scope="session")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
