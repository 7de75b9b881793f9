"""A real disaggregated stack on loopback for end-to-end tests: redis-server, prefill and decode
processes (`python -m pdserve.cli ...`), and a router; logs go to files under `workdir`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.registry import RedisServer
from pdserve.rpc import free_port


class Stack:
    def __init__(self, model_dir: Path, workdir: Path, num_prefill: int = 1, num_decode: int = 2) -> None:
        self.model_dir = str(model_dir)
        self.workdir = workdir
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.redis: RedisServer | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.workdir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "pdserve.cli", *args]
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start(self, timeout: float = 180.0) -> Stack:
        self.redis = RedisServer().start()
        engine = [
            "--model",
            self.model_dir,
            "--max-model-len",
            "512",
            "--dtype",
            "float32",
            "--max-num-seqs",
            "48",
        ]
        for i in range(self.num_prefill):
            self._spawn(
                f"prefill-{i}",
                "prefill",
                *engine,
                "--instance-id",
                f"prefill-{i}",
                "--enable-prefix-caching",
                "--port",
                "0",
                "--redis-url",
                self.redis.url,
            )
        for i in range(self.num_decode):
            self._spawn(
                f"decode-{i}",
                "decode",
                *engine,
                "--instance-id",
                f"decode-{i}",
                "--port",
                "0",
                "--redis-url",
                self.redis.url,
            )
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
        )
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()  # a failed start leaves no process behind
            raise
        return self

    def wait_healthy(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2.0).json()
                if health.get("prefill") == self.num_prefill and health.get("decode") == self.num_decode:
                    return health
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"stack not healthy after {timeout} s; router log:\n{self.log('router')[-3000:]}")

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text()

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.redis is not None:
            self.redis.stop()
