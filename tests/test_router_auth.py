"""The request gate: with `--api-key`, /v1/ routes want the Bearer token (401 in the OpenAI
shape otherwise, which the official client raises as AuthenticationError) while /health and
/metrics stay open; a body declared larger than the limit is refused (413) before it is read."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from router.metrics import RouterMetrics


class IdleBackend:
    """Enough of a backend for the routes that do not generate."""

    async def health(self) -> dict:
        return {"backend": "idle"}

    def max_model_len(self) -> int:
        return 64

    async def generate(self, req):  # pragma: no cover - never called here
        raise AssertionError("no generation in these tests")
        yield


@pytest.fixture
def http() -> TestClient:
    return TestClient(create_app(IdleBackend(), None, "m", RouterMetrics(), api_key="s3cret"))


@pytest.mark.parametrize("header", [None, "Bearer wrong", "s3cret", "Bearer s3cret "])
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


def test_right_key_passes_and_probes_stay_open(http: TestClient) -> None:
    assert http.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["data"][0]["id"] == "m"
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200


def test_oversized_body_is_413_before_it_is_read() -> None:
    http = TestClient(create_app(IdleBackend(), None, "m", RouterMetrics(), max_request_bytes=1000))
    r = http.post(
        "/v1/completions", content=b"{" + b" " * 2000 + b"}", headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "larger than 1000 bytes" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=b"{}", headers={"content-length": "12abc"})
    assert r.status_code == 413
    assert http.get("/health").status_code == 200
