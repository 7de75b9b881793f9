"""The served router's /metrics (router.server.build_router: what `pdserve router` and `pdserve up`
run) labels its request series and the KV-cache gauge with the first served model name, as vLLM
labels its series with its first `--served-model-name`, so that vLLM's dashboards' model filter
works; pdserve's own series (per role, per instance, transfers, prefix cache) keep their labels.
The stack tests read the same labels from real processes (test_disagg_stack, test_soak,
test_api_flags_cli, test_served_benchmarks)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.server import RouterConfig, build_router

# vLLM's series (its `vllm:` prefix as pdserve's) and the router's refusals: labelled
REQUEST_SERIES = {
    "pdserve:time_to_first_token_seconds_count",
    "pdserve:request_preprocess_seconds_count",
    "pdserve:inter_token_latency_seconds_count",
    "pdserve:e2e_request_latency_seconds_count",
    "pdserve:num_requests_waiting",
    "pdserve:num_requests_running",
    "pdserve:prompt_tokens_total",
    "pdserve:generation_tokens_total",
    "pdserve:request_errors_total",
    "pdserve:kv_cache_usage_perc",
}
LABELLED_FAMILIES = {
    "pdserve:time_to_first_token_seconds",
    "pdserve:request_preprocess_seconds",
    "pdserve:inter_token_latency_seconds",
    "pdserve:e2e_request_latency_seconds",
    "pdserve:num_requests_waiting",
    "pdserve:num_requests_running",
    "pdserve:prompt_tokens",
    "pdserve:generation_tokens",
    "pdserve:request_errors",
    "pdserve:request_success",
    "pdserve:requests_rejected",
    "pdserve:kv_cache_usage_perc",
}


def samples(text: str) -> list[tuple[str, str, dict[str, str], float]]:
    """(family, sample name, labels, value) of every `pdserve:` sample, but the `_created` ones."""
    return [
        (family.name, s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        if family.name.startswith("pdserve:")
        for s in family.samples
        if not s.name.endswith("_created")
    ]


async def one_request_then_metrics(config: RouterConfig) -> tuple[int, str]:
    """A completion to the router with no instance live (a backend error, counted), then /metrics."""
    router = build_router(config)
    try:
        transport = httpx.ASGITransport(app=router.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            model = (config.served_model_names or (config.model,))[-1]
            body = {"model": model, "prompt": "Hi", "max_tokens": 2}
            status = (await client.post("/v1/completions", json=body)).status_code
            return status, (await client.get("/metrics")).text
    finally:
        await router.registry.close()


def test_the_request_series_carry_the_first_served_name(tiny_model_dir: Path) -> None:
    config = RouterConfig(str(tiny_model_dir), "redis://127.0.0.1:1", served_model_names=("qwen-a", "qwen-b"))
    status, text = asyncio.run(one_request_then_metrics(config))
    assert status == 503  # no prefill instance: the generation ended by a backend error
    found = samples(text)
    labelled = {name: value for family, name, labels, value in found if labels == {"model_name": "qwen-a"}}
    assert REQUEST_SERIES <= set(labelled), REQUEST_SERIES - set(labelled)
    assert labelled["pdserve:request_errors_total"] == 1  # the request asked for the second name
    assert labelled["pdserve:num_requests_waiting"] == labelled["pdserve:num_requests_running"] == 0
    for family, name, labels, _ in found:
        if family in LABELLED_FAMILIES:
            assert labels.get("model_name") == "qwen-a", (name, labels)
        else:  # pdserve's own: labelled by role or instance, or not at all (deploy/k8s selects by role)
            assert "model_name" not in labels, (name, labels)
    role_gauges = {(name, labels["role"]) for _, name, labels, _ in found if name.startswith("pdserve:role_")}
    assert ("pdserve:role_instances", "decode") in role_gauges
    unlabelled = {name for _, name, labels, _ in found if not labels}
    assert {"pdserve:transfer_bytes_count", "pdserve:prefill_batch_size_sum"} <= unlabelled


def test_the_default_name_is_the_model_as_given(tiny_model_dir: Path) -> None:
    config = RouterConfig(str(tiny_model_dir), "redis://127.0.0.1:1")
    status, text = asyncio.run(one_request_then_metrics(config))
    assert status == 503
    found = samples(text)
    names = {labels.get("model_name") for family, _, labels, _ in found if family in LABELLED_FAMILIES}
    assert names == {str(tiny_model_dir)}
