"""`pdserve up`: the whole stack on one machine, as supervised child processes.

Lifecycle:
  1. model    MODEL or --model (served under the name as typed unless --served-model-name
              says otherwise; the children get its resolved path), or the embedded tiny model
              (made once, on the CPU)
  2. secrets  an internal secret (a 0600 file in a private temp folder) and, for the private
              Redis, a random password; children get them in their environment only
              (PDSERVE_INTERNAL_SECRET_FILE, PDSERVE_REDIS_PASSWORD), never on a command line
  3. redis    --redis-url, or a private redis-server on a free loopback port
  4. services N prefill + M decode processes (`pdserve prefill|decode --port 0`), each on a
              free loopback port, registering in Redis as prefill-0.., decode-0..; on GPUs,
              process i gets CUDA_VISIBLE_DEVICES = GPU (i mod #GPUs), prefill first. One GPU
              (or --colocate): ONE `pdserve engine` process holding both roles (weights once)
  5. router   `pdserve router --port P` with the API flags (router.api_flags), then poll
              http://HOST:P/health until it answers 200 with the prefill and decode instances
              live (a child dying here fails the start)
  6. serve    print the URL; a child that dies is restarted with backoff (pdserve.supervisor),
              the private Redis on its port; a service alive but hung (no heartbeat in Redis
              for --heartbeat-timeout, 10 s; for --startup-timeout after a restart, while it
              loads) is SIGKILLed and restarted the same way (pdserve.hang_watch)
  7. stop     on SIGINT/SIGTERM: the router (SIGTERM; it drains for --shutdown-timeout, then
              ends open streams with an error event), then the services, then Redis; SIGKILL
              for those that outstay their time

Children run in their own process groups (a terminal's Ctrl-C reaches only the launcher) and
die with the launcher, even when it is SIGKILLed (pdserve.supervisor); pdserve.up_stack holds
and stops them. The folders a SIGKILLed launcher leaves in the temp folder (its own, its
Redis's) are removed by the next one (pdserve.private_dirs).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from pdserve import layout
from pdserve.cli_args import add_engine_arguments, engine_argv, engine_config_from_args, resolve_device
from pdserve.hang_watch import TTL_S
from pdserve.model_config import ModelConfig
from pdserve.supervisor import Child, say
from pdserve.up_stack import Stack, StartupError, health
from router.api_flags import add_api_arguments, add_model_argument, api_argv, model_from_args

# the services import the engine flags from here
__all__ = ["add_arguments", "add_engine_arguments", "engine_config_from_args", "run"]

CLI = (sys.executable, "-m", "pdserve.cli")  # how a child pdserve command starts


def model_and_device(args: argparse.Namespace) -> tuple[str, str, str]:
    """Step 1: MODEL or --model (checked) or the tiny default model on the CPU: (its resolved
    path, for the children; the name it is served as: as typed; the device)."""
    try:
        typed = model_from_args(args)
    except ValueError as e:
        raise StartupError(str(e)) from e
    if typed is None:
        from pdserve.tiny import default_model_dir

        typed = model = str(default_model_dir(progress=say))
        device = args.device or "cpu"
    else:
        model, device = str(Path(typed).resolve()), resolve_device(args.device)
    try:
        ModelConfig.from_pretrained(model)  # a bad --model fails here, not in every child
    except ValueError as e:
        raise StartupError(f"--model {typed}: {e}") from e
    return model, typed, device


def router_key_options(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The router's (flags, environment) for the API keys: --api-key-file's path on its command
    line (the keys stay in the file), --api-key or $PDSERVE_API_KEY in its environment."""
    flags = [] if args.api_key_file is None else ["--api-key-file", str(Path(args.api_key_file).resolve())]
    if args.api_key is not None:
        say("--api-key shows in `ps`: prefer --api-key-file PATH or $PDSERVE_API_KEY")
    key = args.api_key or os.environ.get("PDSERVE_API_KEY")
    return flags, ({"PDSERVE_API_KEY": key} if key else {})


def spawn(
    args: argparse.Namespace, stack: Stack, plan: list[layout.ServiceProcess], model: str, typed: str
) -> None:
    """Steps 4-5: start the services, then the router (`typed`: the model as the user gave it, its
    default served name). Secrets go in the environment; the API key reaches the router only."""
    base_env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"} | stack.env
    engine = engine_argv(args)
    util = layout.shared_gpu_memory_utilization(plan)
    if util is not None and args.gpu_memory_utilization is None:
        say(f"processes share a GPU: --gpu-memory-utilization {util} each")
        engine += ["--gpu-memory-utilization", str(util)]
    device = "cpu" if plan[0].gpu is None else "cuda"
    model_args = ["--model", model, "--redis-url", stack.redis_url]
    for p in plan:
        argv = [*CLI, p.command, *model_args, "--device", device, *engine, "--instance-id", p.name]
        argv += ["--host", "127.0.0.1", "--port", "0", "--advertise-host", "127.0.0.1"]
        env = base_env | ({"CUDA_VISIBLE_DEVICES": p.gpu} if p.gpu is not None else {})
        stack.services.append(Child(p.name, argv, env))
        say(f"started {p.name} (pid {stack.services[-1].pid})" + (f" on GPU {p.gpu}" if p.gpu else ""))
    key_flags, key_env = router_key_options(args)
    stack.router = Child("router", router_argv(args, model_args, typed) + key_flags, base_env | key_env)
    say(f"started the router on {args.host}:{args.port} (pid {stack.router.pid})")


def wait_ready(args: argparse.Namespace, stack: Stack, want: dict[str, int], stop: threading.Event) -> str:
    """Step 5: poll the router's /health until every instance is live; returns the router URL."""
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(args.host, args.host)
    url = f"http://{host}:{args.port}"
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
        if stop.wait(0.5):
            raise StartupError("interrupted during startup")


def start(args: argparse.Namespace, stack: Stack, stopping: threading.Event) -> str:
    """Steps 1-5 of the lifecycle; returns the router's URL. Raises StartupError."""
    t0 = time.monotonic()
    model, typed, device = model_and_device(args)
    try:
        plan = layout.plan_services(args.prefill, args.decode, args.colocate, device)
    except layout.LayoutError as e:
        raise StartupError(str(e)) from e
    if device == "cuda" and len(plan) == 1 and not args.colocate:
        say("one GPU: one engine process holds both roles (--prefill 1 --decode 1 splits them)")
    stack.make_secrets(args.redis_url)
    if stopping.is_set():
        raise StartupError("interrupted during startup")
    spawn(args, stack, plan, model, typed)
    url = wait_ready(args, stack, layout.role_counts(plan), stopping)
    say(f"ready in {time.monotonic() - t0:.1f}s: {layout.describe(plan)}")
    return url


def router_argv(args: argparse.Namespace, model_args: list[str], typed: str) -> list[str]:
    """The router's command line: the API flags, and the burst flags when given."""
    argv = [*CLI, "router", *model_args, "--host", args.host, "--port", str(args.port)]
    argv += ["--shutdown-timeout", str(args.shutdown_timeout), *api_argv(args)]
    if not args.served_model_name:
        argv += [f"--served-model-name={typed}"]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    for flag, value in (
        ("--burst-window-ms", args.burst_window_ms),
        ("--burst-max-tokens", args.burst_max_tokens),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return argv


# ---- `pdserve up` (registered in pdserve/cli.py)
def heartbeat_timeout(text: str) -> float:
    """--heartbeat-timeout: 0 (never), or at least the heartbeat's TTL, after which routers have
    dropped the service already (a shorter one would kill a service they still send work to)."""
    seconds = float(text)
    if seconds != 0 and not seconds >= TTL_S:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or at least {TTL_S:g} (the heartbeat TTL)")
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_engine_arguments(parser, host="127.0.0.1", port=8000, model_required=False)
    add_api_arguments(parser)
    parser.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill processes (1)")
    parser.add_argument("--decode", type=int, default=None, metavar="M", help="decode processes (1)")
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="one engine process holding both roles (the default with --device cuda and one GPU)",
    )
    parser.add_argument("--redis-url", default=None, help="use this Redis (default: start a private one)")
    parser.add_argument(
        "--api-key-file", metavar="PATH", help="the router's API keys, one a line (`KEY max_concurrency`)"
    )
    parser.add_argument("--api-key", help="one API key; `ps` shows it: prefer $PDSERVE_API_KEY")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait for the stack; also what a restarted service has for its first "
        "heartbeat (loading, warm-up) before it counts as hung (default 600)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=heartbeat_timeout,
        default=10.0,
        metavar="S",
        help="kill (SIGKILL) and restart a service that runs but has sent no heartbeat for S "
        f"seconds (stopped, deadlocked); at least {TTL_S:g}, 0: never (default 10)",
    )
    parser.add_argument(
        "--burst-window-ms",
        type=float,
        default=None,
        metavar="MS",
        help="the router gathers prompts into one burst to a prefill instance for this long (5)",
    )
    parser.add_argument(
        "--burst-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the router sends a burst at once at this many tokens to compute (16384)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGINT/SIGTERM, seconds the router may take to finish open streams (default 30)",
    )


def run(args: argparse.Namespace) -> int:
    stopping, hurry = threading.Event(), threading.Event()
    signals = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}

    def on_signal(signum: int, _frame: object) -> None:
        if stopping.is_set():
            say(f"{signals[signum]} again: killing what is left")
            hurry.set()
        else:
            say(f"{signals[signum]}: shutting down")
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in signals}
    stack = Stack()
    try:
        url = start(args, stack, stopping)
        stack.watch_heartbeats(args.heartbeat_timeout, args.startup_timeout)
        print(f"pdserve is up: {url}/v1 (health {url}/health); Ctrl-C stops it", flush=True)
        while not stopping.wait(0.5):
            fatal = stack.supervise()
            if fatal:
                say(fatal)
                return 1
        return 0
    except StartupError as e:
        say(str(e))
        return 130 if stopping.is_set() else 1
    finally:
        stack.stop(args.shutdown_timeout, hurry)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
