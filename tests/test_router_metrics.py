"""The router's /metrics text: its own series labelled with the served model's name when it has
one (vLLM's `model_name`), none without; the deployment's KV-cache use beside the per-role gauges."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from pdserve.registry import InstanceInfo
from router.metrics import RouterMetrics
from router.scaling_metrics import RoleLoadCollector, deployment_kv_usage


def series(text: str) -> dict[str, float]:
    """{'name{labels}': value} of every sample in a Prometheus text exposition."""
    found = re.findall(r"^(pdserve:\S+) (\S+)$", text, flags=re.MULTILINE)
    return {name: float(value) for name, value in found}


def one_of_each(metrics: RouterMetrics) -> str:
    """A finished generation, one that failed, a refusal; then the exposition."""
    done = metrics.track(prompt_tokens=5, arrival=time.monotonic())
    done.on_tokens(1, None)
    done.on_tokens(2, "stop")
    failed = metrics.track(prompt_tokens=3, arrival=time.monotonic())
    failed.on_error()
    metrics.reject("queue_full")
    return metrics.render().decode()


def test_the_routers_series_carry_the_model_name() -> None:
    text = series(one_of_each(RouterMetrics(model_name="qwen")))
    label = '{model_name="qwen"}'
    assert text[f"pdserve:num_requests_running{label}"] == 0
    assert text[f"pdserve:num_requests_waiting{label}"] == 0
    assert text[f"pdserve:prompt_tokens_total{label}"] == 5
    assert text[f"pdserve:generation_tokens_total{label}"] == 3
    assert text[f"pdserve:request_errors_total{label}"] == 1
    assert text['pdserve:request_success_total{finished_reason="stop",model_name="qwen"}'] == 1
    assert text['pdserve:requests_rejected_total{model_name="qwen",reason="queue_full"}'] == 1
    assert text['pdserve:time_to_first_token_seconds_count{model_name="qwen"}'] == 1
    assert text['pdserve:request_preprocess_seconds_count{model_name="qwen"}'] == 2
    assert text['pdserve:inter_token_latency_seconds_count{model_name="qwen"}'] == 2
    assert text['pdserve:e2e_request_latency_seconds_bucket{le="+Inf",model_name="qwen"}'] == 1
    router_own = [name for name in text if not name.startswith("pdserve:local_")]
    assert all('model_name="qwen"' in name for name in router_own), router_own


def test_without_a_name_no_label() -> None:
    text = series(one_of_each(RouterMetrics()))
    assert text["pdserve:num_requests_running"] == 0
    assert text['pdserve:request_success_total{finished_reason="stop"}'] == 1
    assert text['pdserve:requests_rejected_total{reason="queue_full"}'] == 1
    assert not [name for name in text if "model_name" in name]


def test_aborted_generations_count_as_abort() -> None:
    """A generation that neither finished nor failed (its client gone, cancelled) counts under
    finished_reason="abort", as vLLM's aborted requests do; one that finished or failed is not
    counted again when it closes."""
    metrics = RouterMetrics(model_name="qwen")
    gone = metrics.track(prompt_tokens=4, arrival=time.monotonic())
    gone.on_tokens(1, None)
    gone.close()
    never_started = metrics.track(prompt_tokens=4, arrival=time.monotonic())
    never_started.close()
    finished = metrics.track(prompt_tokens=2, arrival=time.monotonic())
    finished.on_tokens(1, "length")
    failed = metrics.track(prompt_tokens=2, arrival=time.monotonic())
    failed.on_error()
    for tracker in (gone, never_started, finished, failed):
        tracker.close()  # closing again counts nothing more
    text = series(metrics.render().decode())
    assert text['pdserve:request_success_total{finished_reason="abort",model_name="qwen"}'] == 2
    assert text['pdserve:request_success_total{finished_reason="length",model_name="qwen"}'] == 1
    assert text['pdserve:request_errors_total{model_name="qwen"}'] == 1
    assert text['pdserve:num_requests_running{model_name="qwen"}'] == 0
    assert text['pdserve:num_requests_waiting{model_name="qwen"}'] == 0


def info(role: str, name: str, agent: str, **load: int) -> InstanceInfo:
    return InstanceInfo(role, name, f"{name}:1", load=load, extra={"agent": agent})


def test_kv_cache_usage_over_the_deployment() -> None:
    """An engine holding both roles is registered twice with one pool: counted once; an
    instance that reports no pages does not count; no instance: 0."""
    both = {"kv_pages": 100, "free_kv_pages": 25}
    live = {
        "prefill": {"engine-0": info("prefill", "engine-0", "engine-0#a", **both)},
        "decode": {
            "engine-0": info("decode", "engine-0", "engine-0#a", **both),
            "decode-1": info("decode", "decode-1", "decode-1#b", kv_pages=300, free_kv_pages=300),
            "decode-2": info("decode", "decode-2", "decode-2#c", running=3),
        },
    }
    assert deployment_kv_usage(live) == pytest.approx(75 / 400)
    assert deployment_kv_usage({"prefill": {}, "decode": {}}) == 0.0
    metrics = RouterMetrics(model_name="qwen")
    metrics.registry.register(RoleLoadCollector(SimpleNamespace(live=live), model_name="qwen"))
    text = series(metrics.render().decode())
    assert text['pdserve:kv_cache_usage_perc{model_name="qwen"}'] == pytest.approx(75 / 400)
    # the autoscalers' per-role series keep their one label (deploy/k8s, tests/test_k8s.py)
    assert text['pdserve:role_kv_cache_usage_perc{role="decode"}'] == pytest.approx((0.75 + 0.0) / 2)
    assert text['pdserve:role_num_requests_running{role="decode"}'] == 3


def test_preprocess_time_is_arrival_to_the_backend_asked() -> None:
    """The router's own share of TTFT: from the HTTP request's arrival to tracking its generation
    (when the backend is asked), here 0.25 s after an arrival in the past."""
    metrics = RouterMetrics()
    metrics.track(prompt_tokens=5, arrival=time.monotonic() - 0.25).on_error()
    text = series(metrics.render().decode())
    assert 0.25 <= text["pdserve:request_preprocess_seconds_sum"] < 5
    assert text['pdserve:request_preprocess_seconds_bucket{le="0.2"}'] == 0


def test_preprocess_counts_from_the_request_reaching_the_router(tiny_model_dir) -> None:
    """The router's histograms start when the request's headers reach it (the gate's stamp), not
    when the handler runs: a body that takes 0.3 s to arrive (or a burst queued on the event loop
    before validation) is the router's time in preprocess and TTFT."""
    import asyncio

    import httpx

    from pdserve.tokenizer import load_tokenizer
    from router.app import create_app
    from tests.live_server import serving
    from tests.scripted_chat import ScriptedBackend

    backend = ScriptedBackend()
    backend.text = "ok"
    metrics = RouterMetrics()
    app = create_app(backend, load_tokenizer(tiny_model_dir), "m", metrics=metrics)
    body = b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hello there"}]}'

    async def slow_body():
        for part in (body[:20], body[20:]):
            yield part
            await asyncio.sleep(0.3)

    async def post(url: str) -> int:
        async with httpx.AsyncClient(base_url=url) as client:
            headers = {"content-type": "application/json"}
            answer = await client.post("/v1/chat/completions", content=slow_body(), headers=headers)
            return answer.status_code

    with serving(app) as url:
        assert asyncio.run(post(url)) == 200
    text = series(metrics.render().decode())
    assert text["pdserve:request_preprocess_seconds_count"] == 1
    assert 0.3 <= text["pdserve:request_preprocess_seconds_sum"] < 5
    assert text["pdserve:time_to_first_token_seconds_sum"] >= text["pdserve:request_preprocess_seconds_sum"]
