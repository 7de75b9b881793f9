"""The Dockerfile's two targets, the build context (.dockerignore) and deploy/make-secrets.sh,
read as text (no Docker engine in CI): the engine target has a C compiler for Triton and the gpu
extra, the router target has no torch, both run as a non-root user; the context carries the
package and never secrets/, models/ or .env; the secrets script writes secrets pdserve accepts."""

from __future__ import annotations

import re
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest

from pdserve.internal_auth import check_secret
from tests.torch_blocked import ROOT

REQUIREMENTS = "deploy/router-requirements.txt"


def stages() -> dict[str, str]:
    """Dockerfile text per `FROM ... AS name` stage, in order."""
    text = (ROOT / "Dockerfile").read_text()
    parts = re.split(r"^FROM\s+(\S+)\s+AS\s+(\S+)\s*$", text, flags=re.MULTILINE)
    found = {}
    for base, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        found[name] = f"FROM {base}\n{body}"
    return found


def test_targets_and_base() -> None:
    found = stages()
    assert list(found) == ["base", "router", "engine"], "engine last: a plain `docker build` makes it"
    assert found["base"].startswith("FROM python:3.11-slim")
    assert found["router"].startswith("FROM base") and found["engine"].startswith("FROM base")


def test_engine_target_has_a_compiler_and_the_gpu_extra() -> None:
    engine = stages()["engine"]
    install = re.search(r"apt-get install -y --no-install-recommends ([^\n&]+)", engine)
    assert install and {"gcc", "libc6-dev"} <= set(install.group(1).split())
    assert "ENV CC=gcc" in engine
    assert "['optional-dependencies']['gpu']" in engine and "project['dependencies']" in engine
    assert 'pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"' in engine
    assert "pip install --no-deps ." in engine
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert gpu, "the gpu extra the image installs"


def test_router_target_installs_no_torch() -> None:
    router = stages()["router"]
    assert f"COPY {REQUIREMENTS} " in router and "pip install -r /tmp/router-requirements.txt" in router
    assert "pip install --no-deps ." in router
    installs = [line for line in router.splitlines() if "pip install" in line]
    assert len(installs) == 2
    assert not [line for line in installs if re.search(r"torch|TORCH|optional-dependencies|pyproject", line)]
    assert "assert 'torch' not in sys.modules" in router  # the build stops if the router needs it
    # the router target copies every package it installs (setuptools finds them all)
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for package in packages["find"]["include"]:
        name = package.rstrip("*")
        assert f"COPY {name} {name}" in router, name


@pytest.mark.parametrize("target", ["router", "engine"])
def test_runs_as_a_non_root_user(target: str) -> None:
    body = stages()[target]
    users = re.findall(r"^USER\s+(\S+)", body, flags=re.MULTILINE)
    assert users and users[-1] == "pdserve"
    assert re.search(r'useradd --create-home --uid "\$PDSERVE_UID" pdserve', stages()["base"])
    assert "ARG PDSERVE_UID=1000" in stages()["base"]


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def in_build_context(path: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent folder wins."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!"))
        if any(regex.match(c) for c in candidates):
            included = negated
    return included


@pytest.mark.parametrize(
    "path",
    ["pyproject.toml", "README.md", "pdserve/cli.py", "router/server.py", "prefill_svc/server.py",
     "decode_svc/colocated.py", "kvtransfer/agent.py", REQUIREMENTS],
)  # fmt: skip
def test_the_context_carries_the_package(path: str) -> None:
    assert (ROOT / path).exists(), path
    assert in_build_context(path)


@pytest.mark.parametrize(
    "path",
    ["secrets/internal-secret", "secrets/redis-password", "models/Qwen3.6-35B-A3B/model.safetensors",
     ".env", ".git/config", "tests/test_compose.py", "pdserve/__pycache__/cli.cpython-311.pyc",
     ".whl/torch.whl", "deploy/k8s/secrets.env"],
)  # fmt: skip
def test_the_context_leaves_out(path: str) -> None:
    assert not in_build_context(path)


def test_make_secrets(tmp_path: Path) -> None:
    target = tmp_path / "secrets"
    script = str(ROOT / "deploy" / "make-secrets.sh")
    done = subprocess.run(["sh", script, str(target)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    first = {}
    for name in ("internal-secret", "redis-password"):
        path = target / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # the containers' uid 1000 reads it
        first[name] = path.read_text()
        assert len(first[name]) == 64
        check_secret(first[name].encode(), name)  # printable, no spaces, long enough
    assert first["internal-secret"] != first["redis-password"]
    again = subprocess.run(["sh", script, str(target)], capture_output=True, text=True, timeout=30)
    assert again.returncode == 0 and again.stdout == ""
    assert {n: (target / n).read_text() for n in first} == first  # kept, not replaced
