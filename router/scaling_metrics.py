"""Per-role load on the router's `/metrics`, for autoscaling prefill and decode apart.

The router already reads every live instance's load from the registry (`InstanceSet.live`, each
instance's `load`: running, waiting, free and total KV pages; refreshed every 0.5 s). This
collector sums it per role at each scrape, so one query answers "how busy is the prefill tier":

  pdserve:role_num_requests_waiting{role}   gauge  requests queued on the role's instances
  pdserve:role_num_requests_running{role}   gauge  requests running there (decode: sequences)
  pdserve:role_kv_cache_usage_perc{role}    gauge  KV pages in use / KV pages, mean over the
                                                   role's instances (0..1, vLLM's unit)
  pdserve:role_instances{role}              gauge  live instances of the role

Prefill scales on its queue (deploy/k8s: requests waiting per prefill pod), decode on running
sequences and KV use. Every router of a deployment reads the same registry, so each reports the
same values: aggregate over routers with `max`, not `sum`.

Beside them, vLLM's KV gauge for dashboards, over the whole deployment:

  pdserve:kv_cache_usage_perc{model_name}   gauge  KV pages in use / KV pages, summed over the live
                                                   instances (one holding both roles counted once)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.registry import ROLES, InstanceInfo
from router.instances import InstanceSet
from router.metrics import PREFIX

METRICS = {  # name (without the prefix) -> help text
    "role_num_requests_waiting": "Requests queued on the live instances of a role.",
    "role_num_requests_running": "Requests running on the live instances of a role.",
    "role_kv_cache_usage_perc": "KV pages in use over KV pages, mean over the live instances of a role.",
    "role_instances": "Live instances of a role.",
}


def kv_usage(instance: InstanceInfo) -> float | None:
    """The fraction of the instance's KV pages in use, or None when it does not report pages."""
    total, free = instance.load.get("kv_pages"), instance.load.get("free_kv_pages")
    if not total or free is None:
        return None
    return min(1.0, max(0.0, 1.0 - free / total))


def role_load(instances: list[InstanceInfo]) -> dict[str, float]:
    """The four gauges' values for one role's live instances."""
    usage = [u for u in map(kv_usage, instances) if u is not None]
    return {
        "role_num_requests_waiting": float(sum(i.load.get("waiting", 0) for i in instances)),
        "role_num_requests_running": float(sum(i.load.get("running", 0) for i in instances)),
        "role_kv_cache_usage_perc": sum(usage) / len(usage) if usage else 0.0,
        "role_instances": float(len(instances)),
    }


def deployment_kv_usage(live: dict[str, dict[str, InstanceInfo]]) -> float:
    """KV pages in use over KV pages of every live instance that reports them (0 when none does);
    an engine holding both roles is registered under both with one pool: counted once."""
    pools = {}
    for instances in live.values():
        for i in instances.values():
            total, free = i.load.get("kv_pages"), i.load.get("free_kv_pages")
            if total and free is not None:
                pools[i.extra.get("agent") or f"{i.role}/{i.instance_id}"] = (total, min(free, total))
    total = sum(pages for pages, _ in pools.values())
    return 1.0 - sum(free for _, free in pools.values()) / total if total else 0.0


class RoleLoadCollector(Collector):
    """Reads `InstanceSet.live` at scrape time (on the event loop that serves /metrics)."""

    def __init__(self, instances: InstanceSet, model_name: str | None = None) -> None:
        self.instances = instances
        self.model_labels = {"model_name": model_name} if model_name else {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        live = self.instances.live
        per_role = {role: role_load(list(live.get(role, {}).values())) for role in ROLES}
        for name, documentation in METRICS.items():
            family = GaugeMetricFamily(PREFIX + name, documentation, labels=["role"])
            for role in ROLES:
                family.add_metric([role], per_role[role][name])
            yield family
        family = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "KV pages in use over KV pages of the live instances (0..1).",
            labels=list(self.model_labels),
        )
        family.add_metric(list(self.model_labels.values()), deployment_kv_usage(live))
        yield family
