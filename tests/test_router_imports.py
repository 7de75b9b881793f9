"""The router and the healthcheck run without torch (issue 10: the slim router image has none).

Each check runs in a fresh interpreter through `tests/torch_blocked.py`, where importing torch,
transformers, numpy, NIXL or pdserve's engine modules fails as it does in the router image:
- `import router.server` and the healthcheck module `pdserve.rpc` load none of them;
- `pdserve router` starts in under 2 s (first HTTP answer; on a slower machine, within 0.5 s of
  what its imports and tokenizer alone take there) and serves a completion through a
  `pdserve engine` (torch allowed there) with them blocked;
- `python -m pdserve.rpc HOST:PORT` answers 0 for a live gRPC server, 1 for a dead port;
- every package the router imports is in deploy/router-requirements.txt (what the image installs).
"""

from __future__ import annotations

import ast
import asyncio
import compileall
import importlib.metadata
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from pdserve.registry import RedisServer
from pdserve.rpc import RpcServer, free_port
from pdserve.supervisor import popen_options
from tests.torch_blocked import ROOT, is_blocked

RUNNER = [sys.executable, str(ROOT / "tests" / "torch_blocked.py")]
REQUIREMENTS = ROOT / "deploy" / "router-requirements.txt"
# issue 10: under 2 s on the 2-core CI machine, spawn to the first /health answer, best of 5. Nearly
# all of it is work the router cannot skip, one core's worth: Python + imports (fastapi, pydantic,
# redis, grpc, uvicorn) ~0.55 s and `tokenizers` parsing the tiny model's tokenizer.json (Qwen3.6's:
# 15 MB, 248k tokens, 500k merges; the GIL held) ~0.9 s on the machine of issue 10's day (CPU
# median 1.58 s over 6 starts); building the app, connecting to Redis and listening ~0.2 s. CI
# machines differ: on 2026-12-01's later runs the same code took 2.2-2.9 s (CPU 2.2-2.7 s), the
# imports and the parse alone 2.3-2.6 s. So the test also times that floor (a fresh interpreter
# under the blocker importing the router's modules and loading the tokenizer, best of 5, interleaved
# with the router's starts) and the bound is 2 s or, on a slower machine, the floor plus
# STARTUP_OVERHEAD_S for what the router itself adds: FastAPI building its routes (0.15 s, most of
# it FastAPI importing pydantic.v1 to rule out v1 models), uvicorn, Redis, the first answer. The
# modules' bytecode must be there, as `pip install .` leaves it in the image (.ci/install compiles it):
# compiling pdserve and the router from source adds ~0.3 s to every start where
# PYTHONDONTWRITEBYTECODE is set.
STARTUP_LIMIT_S = 2.0
STARTUP_OVERHEAD_S = 0.5
ROUTER_MODULES = ("router.server", "pdserve.cli", "pdserve.rpc")


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}


def run_blocked(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*RUNNER, *args], capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=ROOT
    )


def loaded_modules(*modules: str) -> set[str]:
    """Top-level names in sys.modules after importing `modules` in a fresh, unblocked interpreter."""
    code = f"import sys; [__import__(m) for m in {list(modules)!r}]; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=child_env(), cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_blocker_blocks() -> None:
    """The runner itself: an engine import under it fails (else the tests below prove nothing)."""
    done = run_blocked("-c", "import pdserve.config")
    assert done.returncode == 1
    assert "blocked: not in the router image" in done.stderr


@pytest.mark.parametrize("module", ["router.server", "pdserve.cli", "pdserve.rpc"])
def test_module_imports_without_torch(module: str) -> None:
    done = run_blocked("-c", f"import {module}")
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = loaded_modules(module)
    assert not {m for m in loaded if is_blocked(m)}, "imported without the blocker, still loaded"


def module_level_imports(path: Path) -> set[str]:
    """Top-level package names a source file imports when it is loaded (not under TYPE_CHECKING,
    not inside functions: those run only when called)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node) if isinstance(node, ast.Try | ast.If) else [node]:
            if isinstance(inner, ast.Import):
                found |= {alias.name.split(".")[0] for alias in inner.names}
            elif isinstance(inner, ast.ImportFrom) and inner.level == 0 and inner.module:
                found.add(inner.module.split(".")[0])
    return found


def test_router_requirements_cover_its_imports() -> None:
    """The slim image installs deploy/router-requirements.txt and pdserve with --no-deps: every
    distribution that a router module imports must be listed there, and none of the blocked."""
    listed = {
        re.split(r"[<>=!~\[ ;]", line, maxsplit=1)[0].lower().replace("_", "-")
        for line in REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert not {name for name in listed if is_blocked(name.replace("-", "_"))}
    code = f"import sys; [__import__(m) for m in {list(ROUTER_MODULES)!r}]; "
    code += "print('\\n'.join(sorted({getattr(m, '__file__', None) or '' for m in sys.modules.values()})))"
    done = subprocess.run(
        [*RUNNER, "-c", code], capture_output=True, text=True, timeout=60, env=child_env(), cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ours = [Path(f) for f in done.stdout.split("\n") if f.startswith(str(ROOT))]
    assert any(f.name == "server.py" and f.parent.name == "router" for f in ours)
    owners = importlib.metadata.packages_distributions()
    needed = {}
    for path in ours:
        for top in module_level_imports(path) - set(sys.stdlib_module_names) - {"pdserve", "router"}:
            for dist in owners.get(top, [top]):
                needed.setdefault(dist.lower().replace("_", "-"), path.relative_to(ROOT))
    missing = {dist: str(path) for dist, path in needed.items() if dist not in listed}
    assert not missing, f"imported by the router, absent from {REQUIREMENTS.name}: {missing}"


def test_healthcheck_pings_without_torch() -> None:
    async def scenario() -> tuple[int, int]:
        server = RpcServer("pdserve.Decode", secret=b"s" * 32)  # Ping stays open without it
        port = await server.start("127.0.0.1", 0)
        try:
            live = await asyncio.create_subprocess_exec(
                *RUNNER, "-m", "pdserve.rpc", f"127.0.0.1:{port}", env=child_env(), cwd=ROOT
            )
            live_rc = await live.wait()
        finally:
            await server.stop()
        dead = await asyncio.create_subprocess_exec(
            *RUNNER, "-m", "pdserve.rpc", f"127.0.0.1:{free_port()}", env=child_env(), cwd=ROOT
        )
        return live_rc, await dead.wait()

    assert asyncio.run(scenario()) == (0, 1)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(password="p" * 32).start()
    yield server
    server.stop()


def spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, **popen_options()
        )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_router(
    argv: list[str], url: str, log: Path, env: dict[str, str]
) -> tuple[subprocess.Popen, float, float]:
    """`pdserve router` under the blocker; the seconds until its /health answered with JSON, and
    the CPU seconds it had used by then."""
    started = time.monotonic()
    router = spawn([*RUNNER, "-m", "pdserve.cli", *argv], log, env)
    while time.monotonic() - started < 60:
        if router.poll() is not None:
            raise AssertionError(f"the router exited {router.returncode}:\n{log.read_text()[-3000:]}")
        try:
            httpx.get(f"{url}/health", timeout=1.0).json()
            seconds, cpu = time.monotonic() - started, psutil.Process(router.pid).cpu_times()
            return router, seconds, cpu.user + cpu.system
        except (httpx.HTTPError, ValueError):
            time.sleep(0.02)
    stop(router)
    raise AssertionError(f"no answer from the router in 60 s:\n{log.read_text()[-3000:]}")


FLOOR_CODE = (
    "import sys, router.server, pdserve.cli; from pdserve.tokenizer import load_tokenizer; "
    "load_tokenizer(sys.argv[1]); print('loaded', flush=True)"
)


def floor_seconds(model_dir: Path, env: dict[str, str]) -> float:
    """Seconds from spawn until a fresh interpreter under the blocker has imported the router's
    modules and loaded `model_dir`'s tokenizer: what any start of the router costs on this machine."""
    started = time.monotonic()
    child = subprocess.Popen(
        [*RUNNER, "-c", FLOOR_CODE, str(model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    line = child.stdout.readline()  # the tokenizer is loaded: the interpreter's exit is not counted
    seconds = time.monotonic() - started
    _, errors = child.communicate(timeout=60)
    assert line.startswith("loaded"), errors[-3000:]
    return seconds


def limit(floors: list[float]) -> float:
    return max(STARTUP_LIMIT_S, min(floors) + STARTUP_OVERHEAD_S)


@pytest.mark.serial  # wall-clock start-up: alone on the machine
def test_router_starts_fast_and_serves_without_torch(
    tiny_model_dir: Path, redis: RedisServer, tmp_path: Path
) -> None:
    """Start-up: the best of up to 5 starts (other processes share the CI machine's 2 cores: once,
    on 2026-12-08, three starts in a row ran 1 s over, CPU time too, and the run after passed)."""
    for package in ("pdserve", "router"):  # the bytecode an installed package has
        assert compileall.compile_dir(ROOT / package, quiet=1, workers=0), f"{package} did not compile"
    secret = tmp_path / "internal-secret"
    secret.write_text("x" * 32)
    secret.chmod(0o600)
    env = child_env(PDSERVE_INTERNAL_SECRET_FILE=str(secret), PDSERVE_REDIS_PASSWORD="p" * 32)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["router", "--model", str(tiny_model_dir), "--served-model-name", "tiny"]
    argv += ["--port", str(port), "--redis-url", redis.url, "--max-model-len", "256"]
    log = tmp_path / "router.log"
    times: list[float] = []
    cpu_times: list[float] = []
    floors: list[float] = []
    router = None
    while not times or (min(times) >= limit(floors) and len(times) < 5):
        if router is not None:
            stop(router)
        floors.append(floor_seconds(tiny_model_dir, env))
        router, seconds, cpu = start_router(argv, url, log, env)
        times.append(seconds)
        cpu_times.append(cpu)
    engine = None
    try:
        assert min(times) < limit(floors), (
            f"start-up took {[round(t, 2) for t in times]} s (CPU {[round(t, 2) for t in cpu_times]} s); "
            f"the imports and the tokenizer alone {[round(t, 2) for t in floors]} s"
        )
        engine_argv = ["engine", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-model-len"]
        engine_argv += ["256", "--port", "0", "--redis-url", redis.url, "--instance-id", "engine-0"]
        engine = spawn([sys.executable, "-m", "pdserve.cli", *engine_argv], tmp_path / "engine.log", env)
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/health", timeout=2.0).json().get("status") != "ok":
            assert engine.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the engine never registered"
            time.sleep(0.3)
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
        assert router.poll() is None
    finally:
        for proc in (router, engine):
            if proc is not None:
                stop(proc)
    assert "blocked" not in log.read_text()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([], "no config.json in"),
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    ],
)
def test_a_router_that_cannot_start_says_why_in_one_line(tmp_path: Path, extra: list[str], says: str) -> None:
    argv = ["router", "--model", str(tmp_path), "--redis-url", "redis://127.0.0.1:1", *extra]
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=ROOT,
    )
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("pdserve router: cannot start: ") and says in line
