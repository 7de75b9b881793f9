"""The request gate (router.gate): with API keys, /v1/ routes want one as a Bearer token, the
scheme in any case (401 in the OpenAI shape otherwise, which the official client raises as
AuthenticationError) while /health and /metrics stay open; several keys (flag repeated, a key
file, $PDSERVE_API_KEY), each with an optional concurrency limit (429 + Retry-After beyond it);
a body larger than the limit is refused (413), declared or chunked, before it is all read."""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from router.admission import AdmissionConfig
from router.app import create_app
from router.backend import GenerateRequest, TokenEvent
from router.gate import ApiKey, parse_api_keys
from router.metrics import RouterMetrics
from router.server import add_arguments, api_keys
from tests.live_server import serving


class IdleBackend:
    """Enough of a backend for the routes that do not generate."""

    async def health(self) -> dict:
        return {"backend": "idle"}

    def max_model_len(self) -> int:
        return 64

    async def generate(self, req):  # pragma: no cover - never called here
        raise AssertionError("no generation in these tests")
        yield


def app_with(*keys: ApiKey, backend: object = None, max_request_bytes: int = 32 << 20, tokenizer=None):
    admission = AdmissionConfig(api_keys=keys, max_request_bytes=max_request_bytes)
    return create_app(backend or IdleBackend(), tokenizer, "m", RouterMetrics(), admission)


@pytest.fixture
def http() -> TestClient:
    return TestClient(app_with(ApiKey("s3cret"), ApiKey("other")))


@pytest.mark.parametrize(
    "header", [None, "Bearer wrong", "s3cret", "Bearer s3cret ", "Basic s3cret", "Bearer"]
)
def test_missing_or_wrong_key_is_401(http: TestClient, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
    ):
        r = http.request(method, path, headers=headers, json={})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "header", ["Bearer s3cret", "bearer s3cret", "BEARER s3cret", "Bearer  s3cret", "bEaReR other"]
)
def test_right_key_passes_any_case_and_probes_stay_open(http: TestClient, header: str) -> None:
    """The scheme is case-insensitive (RFC 9110); lower case was refused."""
    assert http.get("/v1/models", headers={"Authorization": header}).json()["data"][0]["id"] == "m"
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200


def test_keys_from_flags_file_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keys"
    path.write_text("# clients\nteam-a 2\n\n  team-b\t16  \nteam-c\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    flags = ["--api-key", "k1", "--api-key", "k2", "--api-key-file", str(path)]
    args = parser.parse_args(["--model", "m", "--redis-url", "r", *flags])
    assert api_keys(args) == (
        *(ApiKey("k1"), ApiKey("k2"), ApiKey("team-a", 2), ApiKey("team-b", 16)),
        *(ApiKey("team-c"), ApiKey("from-env")),
    )
    http = TestClient(app_with(*api_keys(args)))
    for key in ("k1", "k2", "team-a", "team-b", "team-c", "from-env"):
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    for bad in (["k 2 3"], ["k x"], ["k 0"]):
        with pytest.raises(ValueError):
            parse_api_keys(bad, "keys")
    with pytest.raises(ValueError, match="twice"):
        AdmissionConfig(api_keys=(ApiKey("k"), ApiKey("k", 3)))


# ---- per-key concurrency, against a live server (the limit spans whole streams)
class HeldBackend:
    """Each generation yields one token, then holds until `release` is set, then finishes."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        yield TokenEvent([7], "x", None, False, None)
        self.started.release()
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        yield TokenEvent([8], "y", None, True, "length")

    async def health(self) -> dict:
        return {}

    def max_model_len(self) -> int:
        return 64


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from pdserve.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def test_a_key_at_its_concurrency_limit_gets_429(tokenizer) -> None:
    backend = HeldBackend()
    app = app_with(ApiKey("limited", 1), ApiKey("free"), backend=backend, tokenizer=tokenizer)
    body = {"prompt": "hi", "max_tokens": 4, "stream": True}
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        limited, free = ({"Authorization": f"Bearer {k}"} for k in ("limited", "free"))
        with client.stream("POST", "/v1/completions", json=body, headers=limited) as first:
            assert first.status_code == 200 and backend.started.acquire(timeout=10)
            refused = client.post("/v1/completions", json=body, headers=limited)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert client.get("/v1/models", headers=limited).status_code == 200  # only generations count
            with client.stream("POST", "/v1/completions", json=body, headers=free) as other:
                assert other.status_code == 200  # another key is not limited by it
                backend.release.set()
                assert list(other.iter_lines())[-2:] == ["data: [DONE]", ""]
            assert list(first.iter_lines())[-2:] == ["data: [DONE]", ""]
        assert client.post("/v1/completions", json=body, headers=limited).status_code == 200
        assert 'pdserve:requests_rejected_total{reason="key_concurrency"} 1.0' in client.get("/metrics").text


# ---- body size
def test_oversized_declared_body_is_413_before_it_is_read() -> None:
    http = TestClient(app_with(max_request_bytes=1000))
    r = http.post(
        "/v1/completions", content=b"{" + b" " * 2000 + b"}", headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "larger than 1000 bytes" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=b"{}", headers={"content-length": "12abc"})
    assert r.status_code == 413
    assert http.get("/health").status_code == 200


@pytest.fixture(scope="module")
def small_limit(tokenizer) -> Iterator[str]:
    with serving(app_with(max_request_bytes=1000, tokenizer=tokenizer)) as url:
        yield url


def test_chunked_body_over_the_limit_is_413(small_limit: str) -> None:
    """No Content-Length (a generator body is sent chunked): it used to bypass the limit."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"x" * 1000
        yield b'", "max_tokens": 1}'

    r = httpx.post(
        f"{small_limit}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "larger than 1000 bytes" in r.json()["error"]["message"]
    small = httpx.post(f"{small_limit}/v1/completions", content=iter([b'{"prompt": ', b"5}"]))
    assert small.status_code == 400  # under the limit, chunked: read and validated as usual


def test_chunked_body_is_refused_while_it_is_still_arriving(small_limit: str) -> None:
    """The 413 comes once the limit is passed, while the client is still sending: the router
    counts as it reads instead of waiting for (and holding) the whole body."""
    host, port = small_limit.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        conn.sendall(head.encode() + b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):  # 1,500 bytes, and the body never ends
            conn.sendall(b"1f4\r\n" + b" " * 500 + b"\r\n")
        answer = conn.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


PREFLIGHT = {
    "Origin": "http://chat.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


def test_cors_preflight_is_answered_before_the_key_is_asked(http: TestClient) -> None:
    """vLLM's defaults (any origin, method, header): a browser's preflight gets its answer, with
    no key (a browser sends none there), and answers carry the allowed origin."""
    preflight = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    answer = http.get(
        "/v1/models", headers={"Origin": "http://chat.example", "Authorization": "Bearer s3cret"}
    )
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    refused = http.get("/v1/models", headers={"Origin": "http://chat.example"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_cors_origins_from_the_flags() -> None:
    from router.api_flags import add_api_arguments, api_argv, api_options_from_args

    parser = argparse.ArgumentParser()
    add_api_arguments(parser)
    args = parser.parse_args(["--allowed-origins", '["https://ui.example"]', "--allow-credentials"])
    api = api_options_from_args(args, "m")
    assert api.allowed_origins == ("https://ui.example",) and api.allow_credentials
    assert '--allowed-origins=["https://ui.example"]' in api_argv(args) and "--allow-credentials" in api_argv(
        args
    )
    http = TestClient(create_app(IdleBackend(), None, "m", api=api))
    mine = http.options("/v1/models", headers={**PREFLIGHT, "Origin": "https://ui.example"})
    assert mine.status_code == 200 and mine.headers["access-control-allow-origin"] == "https://ui.example"
    other = http.options("/v1/models", headers=PREFLIGHT)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with pytest.raises(SystemExit):
        parser.parse_args(["--allowed-origins", "https://ui.example"])  # not a JSON list
