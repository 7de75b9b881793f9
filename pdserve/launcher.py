"""`pdserve up`: the whole stack on one machine, as child processes.

Lifecycle:
  1. model    --model, or the embedded tiny model (made once, on the CPU)
  2. redis    --redis-url, or a private redis-server on a free loopback port
  3. services N prefill + M decode processes (`pdserve prefill|decode --port 0`), each on a
              free loopback port, registering in Redis as prefill-0.., decode-0..; on GPUs,
              process i gets CUDA_VISIBLE_DEVICES = GPU (i mod #GPUs), prefill first
  4. router   `pdserve router --port P`, then poll http://HOST:P/health until it answers 200
              with N prefill and M decode instances live (or a child dies, or time runs out)
  5. serve    print the URL; wait for SIGINT/SIGTERM (or a child dying)
  6. stop     router, then the services, then Redis: SIGTERM, wait, SIGKILL after a grace period

Children's output is echoed line by line with a "[name]" prefix; when one dies, the tail of
its output is printed. Children run in their own process group, so a terminal's Ctrl-C reaches
only the launcher, which stops them in order.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.cli_args import add_engine_arguments, engine_argv, engine_config_from_args, resolve_device
from pdserve.config import ModelConfig
from pdserve.registry import RedisServer

# the services import the engine flags from here
__all__ = ["add_arguments", "add_engine_arguments", "engine_config_from_args", "run"]

CLI = (sys.executable, "-m", "pdserve.cli")  # how a child pdserve command starts
GRACE_S = 10.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def say(msg: str) -> None:
    print(f"[pdserve up] {msg}", file=sys.stderr, flush=True)


class StartupError(RuntimeError):
    pass


class Child:
    """One child process; its output is echoed with a prefix and its last lines kept."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.proc = subprocess.Popen(
            argv,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
        self._reader = threading.Thread(target=self._echo, name=f"echo-{name}", daemon=True)
        self._reader.start()

    def _echo(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def failure(self) -> str | None:
        """None while it runs; otherwise how it ended and its last output."""
        code = self.proc.poll()
        if code is None:
            return None
        self._reader.join(1.0)
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        return f"{self.name} exited with status {code}; its last output:\n{lines}"

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait_or_kill(self, deadline: float) -> None:
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop in time: killing it")
            self.proc.kill()
            self.proc.wait()
        self._reader.join(1.0)


def stop_group(children: list[Child], grace: float = GRACE_S) -> None:
    """SIGTERM all of them, then SIGKILL the ones still running after `grace` seconds."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        child.wait_or_kill(deadline)


def visible_gpus() -> list[str]:
    """The GPU ids children may use: $CUDA_VISIBLE_DEVICES's entries, or 0..count-1."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_plan(num_processes: int, gpus: list[str]) -> list[str]:
    """Process i -> GPU gpus[i mod len(gpus)] (round-robin)."""
    if not gpus:
        raise StartupError("--device cuda but no GPU is visible")
    return [gpus[i % len(gpus)] for i in range(num_processes)]


def health(url: str) -> dict | None:
    """The router's /health JSON when it answers 200, else None."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return json.loads(response.read()) if response.status == 200 else None
    except (OSError, ValueError, urllib.error.URLError):
        return None


def local_host(host: str) -> str:
    """An address to reach a server listening on `host` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


class Stack:
    """The children of one `pdserve up`, stopped in order: router, services, Redis."""

    def __init__(self) -> None:
        self.redis: RedisServer | None = None
        self.services: list[Child] = []
        self.router: Child | None = None

    @property
    def children(self) -> list[Child]:
        return self.services + ([self.router] if self.router else [])

    def failure(self) -> str | None:
        return next((f for f in (c.failure() for c in self.children) if f), None)

    def stop(self) -> None:
        if self.router is not None:
            say("stopping the router")
            stop_group([self.router])
        if self.services:
            say(f"stopping {len(self.services)} service(s)")
            stop_group(self.services)
        if self.redis is not None:
            say("stopping redis")
            self.redis.stop()


def model_and_device(args: argparse.Namespace) -> tuple[str, str]:
    """Step 1: --model (checked) or the tiny default model on the CPU."""
    if args.model is None:
        from pdserve.tiny import default_model_dir

        model, device = str(default_model_dir(progress=say)), args.device or "cpu"
    else:
        model, device = str(Path(args.model).resolve()), resolve_device(args.device)
    try:
        ModelConfig.from_pretrained(model)  # a bad --model fails here, not in every child
    except ValueError as e:
        raise StartupError(f"--model {model}: {e}") from e
    return model, device


def spawn(args: argparse.Namespace, stack: Stack, model: str, device: str, redis_url: str) -> None:
    """Steps 3-4: start the services (GPUs round-robin), then the router."""
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    engine = engine_argv(args)
    gpus = gpu_plan(len(roles), visible_gpus()) if device == "cuda" else [None] * len(roles)
    if device == "cuda" and args.gpu_memory_utilization is None:
        share = math.ceil(len(roles) / len(set(gpus)))  # processes on the busiest GPU
        if share > 1:
            util = round(DEFAULT_GPU_MEMORY_UTILIZATION / share, 3)
            say(f"{share} processes share a GPU: --gpu-memory-utilization {util} each")
            engine += ["--gpu-memory-utilization", str(util)]
    model_args = ["--model", model, "--redis-url", redis_url]
    counts: dict[str, int] = collections.Counter()
    for role, gpu in zip(roles, gpus, strict=True):
        name = f"{role}-{counts[role]}"
        counts[role] += 1
        argv = [*CLI, role, *model_args, "--device", device, *engine, "--instance-id", name]
        argv += ["--host", "127.0.0.1", "--port", "0", "--advertise-host", "127.0.0.1"]
        env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None
        say(f"starting {name}" + (f" on GPU {gpu}" if gpu is not None else ""))
        stack.services.append(Child(name, argv, env))
    say(f"starting the router on {args.host}:{args.port}")
    argv = [*CLI, "router", *model_args, "--host", args.host, "--port", str(args.port)]
    if args.served_model_name is not None:
        argv += ["--served-model-name", args.served_model_name]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    # the key travels in the environment, not on the command line where `ps` shows it
    stack.router = Child("router", argv, {"PDSERVE_API_KEY": args.api_key} if args.api_key else None)


def wait_ready(args: argparse.Namespace, stack: Stack, stopping: threading.Event) -> str:
    """Step 4: poll the router's /health until every instance is live; returns the router URL."""
    url = f"http://{local_host(args.host)}:{args.port}"
    want = {"prefill": args.prefill, "decode": args.decode}
    deadline, last = time.monotonic() + args.startup_timeout, None
    while True:
        failure = stack.failure()
        if failure:
            raise StartupError(f"a process died during startup: {failure}")
        got = health(f"{url}/health")
        live = {role: int((got or {}).get(role, 0)) for role in want}
        if got is not None and all(live[role] >= n for role, n in want.items()):
            return url
        progress = "router not answering yet" if got is None else f"live {live}, want {want}"
        if progress != last:
            say(f"waiting: {progress}")
            last = progress
        if time.monotonic() > deadline:
            raise StartupError(f"not ready after {args.startup_timeout:.0f}s ({progress})")
        if stopping.wait(0.5):
            raise StartupError("interrupted during startup")


def start(args: argparse.Namespace, stack: Stack, stopping: threading.Event) -> str:
    """Steps 1-4 of the lifecycle; returns the router's URL. Raises StartupError."""
    t0 = time.monotonic()
    model, device = model_and_device(args)
    if args.redis_url:
        redis_url = args.redis_url
    else:
        try:
            stack.redis = RedisServer().start()
        except RuntimeError as e:
            raise StartupError(str(e)) from e
        redis_url = stack.redis.url
        say(f"redis at {redis_url}")
    if stopping.is_set():
        raise StartupError("interrupted during startup")
    spawn(args, stack, model, device, redis_url)
    url = wait_ready(args, stack, stopping)
    say(f"ready in {time.monotonic() - t0:.1f}s: {args.prefill} prefill, {args.decode} decode")
    return url


# ---- `pdserve up` (registered in pdserve/cli.py)
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, host="127.0.0.1", port=8000, model_required=False)
    parser.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill processes (default 1)")
    parser.add_argument("--decode", type=int, default=1, metavar="M", help="decode processes (default 1)")
    parser.add_argument("--redis-url", default=None, help="use this Redis (default: start a private one)")
    parser.add_argument("--api-key", default=None, help="the router requires it as a Bearer token on /v1/")
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for the stack (default 600)"
    )


def run(args: argparse.Namespace) -> int:
    if args.prefill < 1 or args.decode < 1:
        raise SystemExit("pdserve up: --prefill and --decode must be at least 1")
    stopping = threading.Event()
    signals = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}

    def on_signal(signum: int, _frame: object) -> None:
        if not stopping.is_set():
            say(f"{signals[signum]}: shutting down")
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in signals}
    stack = Stack()
    try:
        url = start(args, stack, stopping)
        print(f"pdserve is up: {url}/v1 (health {url}/health); Ctrl-C stops it", flush=True)
        while not stopping.wait(0.5):
            failure = stack.failure()
            if failure:
                say(f"shutting down: {failure}")
                return 1
        return 0
    except StartupError as e:
        say(str(e))
        return 130 if stopping.is_set() else 1
    finally:
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
