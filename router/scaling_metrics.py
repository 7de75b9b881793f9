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


class RoleLoadCollector(Collector):
    """Reads `InstanceSet.live` at scrape time (on the event loop that serves /metrics)."""

    def __init__(self, instances: InstanceSet) -> None:
        self.instances = instances

    def collect(self) -> Iterator[GaugeMetricFamily]:
        per_role = {role: role_load(list(self.instances.live.get(role, {}).values())) for role in ROLES}
        for name, documentation in METRICS.items():
            family = GaugeMetricFamily(PREFIX + name, documentation, labels=["role"])
            for role in ROLES:
                family.add_metric([role], per_role[role][name])
            yield family
