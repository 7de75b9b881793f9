"""A real disaggregated stack on loopback for end-to-end tests: redis-server (with a password),
prefill and decode processes (`python -m pdserve.cli ...`), and a router; logs go to files
under `workdir`.

    stack = Stack(model_dir, workdir, num_prefill=1, num_decode=2,
                  extra_flags={"decode": ["--max-num-seqs", "4"]}).start()
    stack.kill("decode-1")      # SIGKILL, as a crash
    stack.restart("decode-1")   # start it again under the same instance id (same flags)
    stack.log("decode-1")       # its output, every incarnation
    stack.metric("pdserve:decode_requests_total")   # the router's, summed over its labels
    stack.instance_loads()      # {instance_id: load}, as the instances publish it in Redis
    stack.stop()

A test module's stack, started once for the module: `stack = stack_fixture("name", 2, 2)`.

Like `pdserve up`, it closes the internal plane: a generated internal secret in a 0600 file
and a random Redis password, handed to every process in its environment (never on a command
line). While it runs, this test process has them too (`os.environ`, restored by `stop`), so
in-process clients (`InstanceRegistry(stack.redis.url)`, `RpcClient`) reach the stack as its
processes do; `stack.env` holds them for anything else. Children die with the test process.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.registry import InstanceInfo, InstanceRegistry, RedisServer
from pdserve.rpc import free_port
from pdserve.supervisor import die_with_parent_wrapper, popen_options

ROLES = ("prefill", "decode", "router")
ENGINE = ["--max-model-len", "512", "--dtype", "float32", "--max-num-seqs", "48"]


class Stack:
    def __init__(
        self,
        model_dir: Path,
        workdir: Path,
        num_prefill: int = 1,
        num_decode: int = 2,
        extra_flags: dict[str, list[str]] | None = None,
    ) -> None:
        """`extra_flags`: more flags per role ("prefill", "decode", "router"), after the defaults
        (a flag given again wins)."""
        unknown = set(extra_flags or {}) - set(ROLES)
        if unknown:
            raise ValueError(f"extra_flags roles must be among {ROLES}, got {sorted(unknown)}")
        self.model_dir = str(model_dir)
        self.workdir = workdir
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.extra_flags = extra_flags or {}
        self.redis: RedisServer | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}  # each process's pdserve arguments, for restart
        self._restarted: dict[str, float] = {}  # name -> when restart spawned it (time.time())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = self._make_secrets()
        self._saved_env: dict[str, str | None] = {}

    def _make_secrets(self) -> dict[str, str]:
        secret_file = self.workdir / "internal-secret"
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
        return {
            "PDSERVE_INTERNAL_SECRET_FILE": str(secret_file),
            "PDSERVE_REDIS_PASSWORD": secrets.token_hex(32),
        }

    def _spawn(self, name: str, *args: str) -> None:
        self.argv[name] = list(args)
        log = open(self.workdir / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "pdserve.cli", *args]
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, **popen_options()
        )
        log.close()  # the child has its own copy

    def _service(self, role: str, name: str) -> None:
        flags = ["--enable-prefix-caching"] if role == "prefill" else []
        assert self.redis is not None
        self._spawn(
            name,
            role,
            "--model",
            self.model_dir,
            *ENGINE,
            *flags,
            "--instance-id",
            name,
            "--port",
            "0",
            "--redis-url",
            self.redis.url,
            *self.extra_flags.get(role, []),
        )

    def start(self, timeout: float = 180.0) -> Stack:
        self._saved_env = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            binary = die_with_parent_wrapper("redis-server", self.workdir)
            self.redis = RedisServer(binary=binary, password=self.env["PDSERVE_REDIS_PASSWORD"]).start()
            for i in range(self.num_prefill):
                self._service("prefill", f"prefill-{i}")
            for i in range(self.num_decode):
                self._service("decode", f"decode-{i}")
            self._spawn(
                "router",
                "router",
                "--model",
                self.model_dir,
                "--served-model-name",
                "tiny",
                "--port",
                str(self.port),
                "--redis-url",
                self.redis.url,
                "--max-model-len",
                "512",
                *self.extra_flags.get("router", []),
            )
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()  # a failed start leaves no process behind
            raise
        return self

    def wait_healthy(self, timeout: float) -> dict:
        """Wait until the router counts every prefill and decode instance live and each restarted
        process has registered itself; the router's /health. (A killed instance's registry entry
        outlives it by up to a heartbeat TTL: the count alone can be the dead incarnation's.)"""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2.0).json()
                roles = (health.get("prefill"), health.get("decode"))
                if roles == (self.num_prefill, self.num_decode) and self._restarts_registered():
                    self._restarted.clear()
                    return health
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"stack not healthy after {timeout} s; router log:\n{self.log('router')[-3000:]}")

    def _restarts_registered(self) -> bool:
        """Every restarted process's registry entry is its new incarnation's (started after it)."""
        if not self._restarted:
            return True
        started = {i.instance_id: i.started_at for i in self._registered()}
        return all(started.get(name, 0.0) >= at for name, at in self._restarted.items())

    def _registered(self) -> list[InstanceInfo]:
        """Every instance's registry entry (read from Redis, outside any running event loop)."""

        async def read() -> list[InstanceInfo]:
            assert self.redis is not None
            async with InstanceRegistry(self.redis.url, password=self.redis.password) as registry:
                return [info for role in ("prefill", "decode") for info in await registry.instances(role)]

        return asyncio.run(read())

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text()

    def metric(self, name: str) -> float:
        """The router's metric `name` (/metrics), summed over all its label sets."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
        return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))

    def instance_loads(self) -> dict[str, dict]:
        """The load every live instance last published, by instance id (read from Redis; call it
        from a test, not from a running event loop)."""

        return {info.instance_id: info.load for info in self._registered()}

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def restart(self, name: str) -> None:
        """Start a killed (or exited) process again, under the same instance id and flags."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running: kill it first")
        self._restarted[name] = time.time()
        self._spawn(name, *self.argv[name])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.redis is not None:
            self.redis.stop()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}


def stack_fixture(
    workdir_name: str,
    num_prefill: int = 1,
    num_decode: int = 2,
    extra_flags: dict[str, list[str]] | None = None,
    name: str = "stack",
):
    """A module-scoped fixture `name` (assign it at module level: `stack = stack_fixture(...)`):
    one `Stack` of the tiny model for the module's tests, logs under a temporary `workdir_name`
    folder, stopped after the last of them."""

    @pytest.fixture(scope="module", name=name)
    def running_stack(tiny_model_dir, tmp_path_factory):
        workdir = tmp_path_factory.mktemp(workdir_name)
        stack = Stack(tiny_model_dir, workdir, num_prefill, num_decode, extra_flags).start()
        yield stack
        stack.stop()

    return running_stack
