"""The router holds requests to the instances' own max_model_len (issue 12): each engine
publishes the limit its memory plan settled on, and the router takes the smallest of the live
instances', never above its own flag; with none registered yet, its own flag or the model's."""

from __future__ import annotations

from pdserve.config import EngineConfig
from pdserve.registry import InstanceInfo
from pdserve.serving import EngineHost, ServiceConfig
from router.disagg import DisaggBackend
from router.instances import InstanceSet
from router.metrics import RouterMetrics


def _backend(own_limit: int, published: dict[str, list[int | None]]) -> DisaggBackend:
    metrics = RouterMetrics()
    instances = InstanceSet(registry=None, metrics=metrics)  # no Redis: live set filled by hand
    for role, limits in published.items():
        for i, limit in enumerate(limits):
            extra = {} if limit is None else {"max_model_len": limit}
            instances.live[role][f"{role}-{i}"] = InstanceInfo(role, f"{role}-{i}", f"h:{i}", extra=extra)
    return DisaggBackend(instances, metrics, own_limit)


def test_the_smallest_published_limit_wins() -> None:
    assert _backend(262_144, {}).max_model_len() == 262_144  # nobody registered yet
    assert _backend(262_144, {"prefill": [131_072], "decode": [200_000, 262_144]}).max_model_len() == 131_072
    assert _backend(8_192, {"prefill": [131_072], "decode": [131_072]}).max_model_len() == 8_192  # flag caps
    assert _backend(4_096, {"prefill": [None], "decode": [2_048]}).max_model_len() == 2_048  # an old instance


def test_an_engine_publishes_its_limit(tiny_model_dir) -> None:
    engine = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=320)
    host = EngineHost(ServiceConfig(engine=engine, instance_id="both"), nixl=False)
    try:
        assert host.extra()["max_model_len"] == 320
    finally:
        host.agent.close()
