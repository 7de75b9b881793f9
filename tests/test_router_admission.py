"""Admission at the router (router.admission), with fake backends on a live server: a full queue
is a 503 with Retry-After at once; a request still without its first token after the queue
timeout ends with 503 + Retry-After (an SSE error event then [DONE] once its stream is under way)
and its backend generations are cancelled; the queue empties however requests end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.tokenizer import Tokenizer, load_tokenizer
from router.admission import Admission, AdmissionConfig
from router.app import create_app
from router.backend import GenerateRequest, TokenEvent
from router.metrics import RouterMetrics
from tests.live_server import serving


class GatedBackend:
    """Choices whose request id ends in one of `prompt_first` send a token at once; every other
    one waits for `first` before its first token. Each then finishes once `finish` is set.
    Counts the generations started and the ones closed before finishing (cancelled)."""

    def __init__(self, prompt_first: tuple[str, ...] = ()) -> None:
        self.first, self.finish = threading.Event(), threading.Event()
        self.prompt_first = prompt_first
        self.started = self.cancelled = 0

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        self.started += 1
        done = False
        try:
            while not (self.first.is_set() or req.request_id.endswith(self.prompt_first)):
                await asyncio.sleep(0.01)
            yield TokenEvent([7], "x", None, False, None)
            while not self.finish.is_set():
                await asyncio.sleep(0.01)
            done = True
            yield TokenEvent([8], "y", None, True, "length")
        finally:
            self.cancelled += not done

    async def health(self) -> dict:
        return {}

    def max_model_len(self) -> int:
        return 64


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


@contextlib.contextmanager
def live(tokenizer: Tokenizer, backend: GatedBackend, **admission: float) -> Iterator[tuple[str, Admission]]:
    """A live router over `backend` with these AdmissionConfig fields: (its URL, its Admission)."""
    app = create_app(backend, tokenizer, "m", RouterMetrics(), AdmissionConfig(**admission))
    with serving(app) as url:
        yield url, app.state.router.admission


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


BODY = {"prompt": "hi", "max_tokens": 4}


def assert_503(response: httpx.Response, code: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert (error["code"], error["type"]) == (code, "server_error")


def test_a_full_queue_refuses_at_once_with_503(tokenizer: Tokenizer) -> None:
    """Three generations may wait for a first token: two requests (n=2, n=1) fill the queue, the
    next one is refused at once; once first tokens come, the queue has room again."""
    backend = GatedBackend()
    with live(tokenizer, backend, max_queued_requests=3) as (url, admission):
        with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=url, timeout=30) as http:
            waiting = [pool.submit(http.post, "/v1/completions", json={**BODY, "n": n}) for n in (2, 1)]
            wait_for(lambda: admission.queued == 3)
            start = time.monotonic()
            assert_503(http.post("/v1/completions", json=BODY), "queue_full")
            assert time.monotonic() - start < 2 and backend.started == 3
            backend.first.set()
            wait_for(lambda: admission.queued == 0)
            with http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as admitted:
                assert admitted.status_code == 200  # then it leaves
            backend.finish.set()
            assert [f.result().status_code for f in waiting] == [200, 200]
            assert 'pdserve:requests_rejected_total{reason="queue_full"} 1.0' in http.get("/metrics").text
        assert admission.queued == 0


def test_one_request_larger_than_the_cap_runs_alone(tokenizer: Tokenizer) -> None:
    backend = GatedBackend()
    backend.first.set()
    backend.finish.set()
    with live(tokenizer, backend, max_queued_requests=2) as (url, admission):
        r = httpx.post(f"{url}/v1/completions", json={**BODY, "n": 5}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 5 and admission.queued == 0


@pytest.mark.parametrize("stream", [False, True])
def test_no_first_token_within_the_queue_timeout_is_503_and_cancels(
    tokenizer: Tokenizer, stream: bool
) -> None:
    """Nothing sent yet: the status, streamed or not (the openai client raises it), within the
    timeout, and both generations of the n=2 request are cancelled."""
    backend = GatedBackend()
    with live(tokenizer, backend, queue_timeout_s=0.5) as (url, admission):
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={**BODY, "n": 2, "stream": stream}, timeout=30)
        assert_503(r, "queue_timeout")
        assert 0.5 <= time.monotonic() - start < 3
        wait_for(lambda: backend.cancelled == 2)
        assert admission.queued == 0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="m", prompt="hi", max_tokens=2)
        assert (
            'pdserve:requests_rejected_total{reason="queue_timeout"} 2.0' in httpx.get(f"{url}/metrics").text
        )


def test_queue_timeout_mid_stream_is_an_error_event_then_done(tokenizer: Tokenizer) -> None:
    """Choice 0 streams, choice 1 never gets a first token: its timeout ends the stream with an
    SSE error event and [DONE] (what the openai client raises as APIError), both cancelled."""
    backend = GatedBackend(prompt_first=("-0",))
    with live(tokenizer, backend, queue_timeout_s=0.5) as (url, admission):
        with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "n": 2, "stream": True}) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
        assert r.status_code == 200
        assert json.loads(events[0])["choices"][0]["text"] == "x"
        error = json.loads(events[-2])["error"]
        assert (error["code"], error["type"], events[-1]) == ("queue_timeout", "server_error", "[DONE]")
        wait_for(lambda: backend.cancelled == 2)
        assert admission.queued == 0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="queue timeout"):
            list(client.completions.create(model="m", prompt="hi", max_tokens=2, n=2, stream=True))


def test_a_started_request_has_no_timeout(tokenizer: Tokenizer) -> None:
    """Once every choice has its first token, the request runs as long as it takes."""
    backend = GatedBackend(prompt_first=("-0", "-1"))
    with live(tokenizer, backend, queue_timeout_s=0.3) as (url, admission):
        threading.Timer(1.0, backend.finish.set).start()
        r = httpx.post(f"{url}/v1/completions", json={**BODY, "n": 2}, timeout=30)
        assert r.status_code == 200 and [c["text"] for c in r.json()["choices"]] == ["xy", "xy"]
        assert backend.cancelled == 0 and admission.queued == 0


def test_clients_that_leave_take_their_place_in_the_queue_with_them(tokenizer: Tokenizer) -> None:
    backend = GatedBackend()
    with live(tokenizer, backend, max_queued_requests=8) as (url, admission):
        for stream in (False, True):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json={**BODY, "n": 3, "stream": stream}, timeout=0.3)
        wait_for(lambda: admission.queued == 0 and backend.cancelled == 6)
