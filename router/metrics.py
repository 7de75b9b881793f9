"""Prometheus metrics of the router, in one `CollectorRegistry` per app (tests build many apps).

Names follow vLLM's (`vllm:` -> `pdserve:`) so its dashboards carry over. A "request" here is
one backend generation: a chat request with n=2 counts twice.

  pdserve:time_to_first_token_seconds   histogram  arrival at the router (its headers read:
                                                   router.gate) -> first token event
  pdserve:request_preprocess_seconds    histogram  arrival -> handed to the backend (the body read
                                                   and validated, templating, tokenizing, admission)
  pdserve:inter_token_latency_seconds   histogram  gap between token events, per token
  pdserve:e2e_request_latency_seconds   histogram  arrival -> finished event
  pdserve:num_requests_waiting          gauge      handed to the backend, no token yet
  pdserve:num_requests_running          gauge      streaming tokens
  pdserve:prompt_tokens_total           counter    prompt tokens of requests that got a token
  pdserve:generation_tokens_total       counter    generated tokens
  pdserve:request_success_total         counter    finished requests, label finished_reason (stop,
                                                   length; abort: ended early, by a client gone, a
                                                   sibling choice failing, a timeout or a drain)
  pdserve:request_errors_total          counter    generations ended by a backend error
  pdserve:requests_rejected_total       counter    HTTP requests refused or ended by admission, label
                                                   reason: queue_full, queue_timeout, key_concurrency

  pdserve:kv_cache_usage_perc           gauge      KV pages in use over KV pages of the live
                                                   instances (0..1; router.scaling_metrics)

Given the served model's name (`RouterMetrics(model_name=...)`), each of these carries it as the
label `model_name`, as vLLM's do, so that its dashboards' model filter works. The served router
(router.server.build_router, so `pdserve router` and `pdserve up`) gives it the first served
name, as vLLM labels with its first `--served-model-name`; an app built without one (tests, the
local backend) has no label.

A backend adds its own (prefill batch sizes, transfer bytes and time, per-instance load, the
per-role gauges, the prefix-cache breakdown) with `metrics.histogram(...)`, `metrics.counter(...)`,
`metrics.gauge(...)`: same registry, same prefix, shown by the app's `/metrics`, without
`model_name`. Those have no vLLM counterpart a dashboard filters; they are labelled by role or
instance instead, and the autoscaling rules (deploy/k8s) select them by `role` alone. The engine
instances serve no `/metrics` of their own: what they publish with their load reaches Prometheus
through these.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TypeVar

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "pdserve:"
# seconds; wide on the slow end: a CPU engine or a long prompt burst takes seconds per token
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 40, 80)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5, 10)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 240, 480, 960)

__all__ = ["CONTENT_TYPE", "RequestTracker", "RouterMetrics"]
MetricT = TypeVar("MetricT", Counter, Gauge, Histogram)


class RouterMetrics:
    """The router's metrics plus a factory for a backend's own."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_labels = {"model_name": model_name} if model_name else {}
        model = tuple(self.model_labels)
        own = self._with_model_name
        self.ttft = own(
            self.histogram(
                "time_to_first_token_seconds",
                "Arrival at the router to the first token.",
                TTFT_BUCKETS,
                model,
            )
        )
        self.preprocess = own(
            self.histogram(
                "request_preprocess_seconds",
                "Arrival at the router to the request handed to its backend (template, tokenize, admit).",
                TTFT_BUCKETS,
                model,
            )
        )
        self.itl = own(
            self.histogram(
                "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS, model
            )
        )
        self.e2e = own(
            self.histogram(
                "e2e_request_latency_seconds", "Arrival at the router to the last token.", E2E_BUCKETS, model
            )
        )
        self.waiting = own(
            self.gauge("num_requests_waiting", "Requests handed to the backend, no token yet.", model)
        )
        self.running = own(self.gauge("num_requests_running", "Requests streaming tokens.", model))
        self.prompt_tokens = own(
            self.counter("prompt_tokens", "Prompt tokens of requests that started.", model)
        )
        self.generation_tokens = own(self.counter("generation_tokens", "Generated tokens.", model))
        self.errors = own(self.counter("request_errors", "Generations ended by a backend error.", model))
        self._success = self.counter(
            "request_success", "Finished requests by finish reason.", (*model, "finished_reason")
        )
        self._rejected = self.counter(
            "requests_rejected", "Requests refused or ended by admission control.", (*model, "reason")
        )

    def _with_model_name(self, metric: MetricT) -> MetricT:
        """One of the router's own series, its child of this model's name when there is one."""
        return metric.labels(**self.model_labels) if self.model_labels else metric

    def finished(self, finish_reason: str) -> None:
        """A generation finished (request_success_total, by finish reason)."""
        self._success.labels(**self.model_labels, finished_reason=finish_reason).inc()

    def reject(self, reason: str) -> None:
        """Admission refused or ended a request: queue_full, queue_timeout, key_concurrency."""
        self._rejected.labels(**self.model_labels, reason=reason).inc()

    # ---- factories: the router's metrics above, and whatever a backend registers
    def histogram(
        self, name: str, documentation: str, buckets: Sequence[float], labelnames: Sequence[str] = ()
    ) -> Histogram:
        return Histogram(
            PREFIX + name, documentation, labelnames, registry=self.registry, buckets=tuple(buckets)
        )

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        return Counter(PREFIX + name, documentation, labelnames, registry=self.registry)

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        return Gauge(PREFIX + name, documentation, labelnames, registry=self.registry)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric in the registry."""
        return generate_latest(self.registry)

    def track(self, prompt_tokens: int, arrival: float) -> RequestTracker:
        """Start following one generation; `arrival` is `time.monotonic()` when the HTTP request came."""
        return RequestTracker(self, prompt_tokens, arrival)


class RequestTracker:
    """One generation's path through the gauges: waiting -> running -> gone (exactly once)."""

    def __init__(self, metrics: RouterMetrics, prompt_tokens: int, arrival: float) -> None:
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        self.last: float | None = None  # time of the previous token event
        self.gauge: Gauge | None = metrics.waiting
        self.ended = False  # finished or failed: counted once, in request_success or request_errors
        metrics.waiting.inc()
        metrics.preprocess.observe(time.monotonic() - arrival)  # the backend is asked now

    def on_tokens(self, num_tokens: int, finish_reason: str | None) -> None:
        """A token event arrived with `num_tokens` tokens; `finish_reason` set when it is the last."""
        m, now = self.metrics, time.monotonic()
        if self.last is None:
            m.ttft.observe(now - self.arrival)
            m.prompt_tokens.inc(self.prompt_tokens)
            self._move(m.running)
        elif num_tokens:
            gap = (now - self.last) / num_tokens
            for _ in range(num_tokens):
                m.itl.observe(gap)
        m.generation_tokens.inc(num_tokens)
        self.last = now
        if finish_reason is not None:
            self.ended = True
            m.finished(finish_reason)
            m.e2e.observe(now - self.arrival)
            self._move(None)

    def on_error(self) -> None:
        self.ended = True
        self.metrics.errors.inc()
        self._move(None)

    def close(self) -> None:
        """The generation is over whatever happened (finished, failed, cancelled): leave the gauges.
        One that neither finished nor failed was aborted: counted as finished_reason "abort", as
        vLLM counts its aborted requests."""
        if not self.ended:
            self.ended = True
            self.metrics.finished("abort")
        self._move(None)

    def _move(self, gauge: Gauge | None) -> None:
        if self.gauge is not None:
            self.gauge.dec()
        if gauge is not None:
            gauge.inc()
        self.gauge = gauge
