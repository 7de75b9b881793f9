"""Child processes that die with their parent, and restart with exponential backoff.

    child = Child("decode-0", argv, env)   # started at once, output echoed as "[decode-0] ..."
    child.poll_restart(now)                # in the supervising loop: a dead child is logged
                                           # with its last output and started again after
                                           # 1 s, 2 s, 4 s ... 30 s (back to 1 s once it ran
                                           # HEALTHY_RUN_S before dying)
    child.kill_hung(why, now)              # alive but not working (pdserve.hang_watch says
                                           # so): SIGKILL, one line, restarted as a dead one
    stop_children([router], grace_s=30)    # SIGTERM, then SIGKILL after the grace period

Every child runs in its own process group (a terminal's Ctrl-C reaches only the supervisor,
which stops the children in order) and, on Linux, gets SIGKILL when the thread that started it
ends (prctl PR_SET_PDEATHSIG): a supervisor killed with SIGKILL leaves no child behind. The
signal follows the starting *thread*, so start and restart children from the main thread.

`die_with_parent_wrapper(binary, folder)` writes an executable that does the same for a
program whose Popen call is not ours (redis-server started by `RedisServer`).
"""

from __future__ import annotations

import collections
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pdserve.private_dirs import process_start_time

PR_SET_PDEATHSIG = 1
HEALTHY_RUN_S = 60.0  # a child that ran this long before dying restarts after first_s again
KILL_WAIT_S = 5.0  # how long kill_hung waits for the child to be gone
_libc_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn`: SIGKILL this child when its parent (thread) ends; exit at once when the
    parent is already gone (it died between fork and prctl)."""

    def preexec() -> None:
        if _libc_prctl is not None:
            _libc_prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def popen_options() -> dict:
    """Popen keyword arguments for a child in its own process group that dies with us."""
    return {"process_group": 0, "preexec_fn": die_with_parent(os.getpid())}


_WRAPPER = """#!{python}
import ctypes, os, sys
os.setpgid(0, 0)
ctypes.CDLL(None, use_errno=True).prctl({pdeathsig}, {sigkill})
if os.getppid() != {parent}:
    sys.exit(1)
os.execv({binary!r}, [{binary!r}, *sys.argv[1:]])
"""


def die_with_parent_wrapper(binary: str, folder: Path) -> str:
    """An executable in `folder` that runs `binary` (its arguments passed on) in a process group
    of its own, killed when the process that started it ends. The caller must start it from
    this process (the wrapper checks its parent's pid). RuntimeError when `binary` is not found."""
    target = shutil.which(binary)
    if target is None:
        raise RuntimeError(f"{binary} not found on the PATH")
    path = folder / f"{Path(binary).name}-die-with-parent"
    path.write_text(
        _WRAPPER.format(
            python=sys.executable,
            pdeathsig=PR_SET_PDEATHSIG,
            sigkill=int(signal.SIGKILL),
            parent=os.getpid(),
            binary=target,
        )
    )
    path.chmod(0o700)
    return str(path)


def is_running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (Linux: /proc/PID/stat)."""
    return process_start_time(pid) is not None


@dataclass(slots=True)
class Backoff:
    """Delays between restarts: first_s, doubling up to max_s; back to first_s after a run of
    at least healthy_s."""

    first_s: float = 1.0
    max_s: float = 30.0
    healthy_s: float = HEALTHY_RUN_S
    _next_s: float = 0.0

    def after_exit(self, uptime_s: float) -> float:
        """The delay before restarting a child that ran `uptime_s` seconds."""
        if self._next_s == 0.0 or uptime_s >= self.healthy_s:
            self._next_s = self.first_s
        delay = self._next_s
        self._next_s = min(self.max_s, delay * 2)
        return delay


def say(msg: str) -> None:
    print(f"[pdserve up] {msg}", file=sys.stderr, flush=True)


class Child:
    """One supervised child process: output echoed with a "[name]" prefix, its last lines kept."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], backoff: Backoff | None = None
    ) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.backoff = backoff or Backoff()
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.restarts = 0
        self.restart_at: float | None = None  # when a dead child is due to start again
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        self.started_at = time.monotonic()
        self.tail.clear()
        proc = subprocess.Popen(
            self.argv,
            env={**self.env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            **popen_options(),
        )
        self._reader = threading.Thread(
            target=self._echo, args=(proc,), name=f"echo-{self.name}", daemon=True
        )
        self._reader.start()
        return proc

    def _echo(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def failure(self) -> str | None:
        """None while it runs; otherwise how it ended and its last output."""
        code = self.proc.poll()
        if code is None:
            return None
        self._reader.join(1.0)
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        return f"{self.name} exited with status {code}; its last output:\n{lines}"

    def poll_restart(self, now: float) -> None:
        """Supervise: schedule a restart of a child found dead, start one that is due."""
        if self.restart_at is None:
            failure = self.failure()
            if failure is None:
                return
            delay = self.backoff.after_exit(now - self.started_at)
            self.restart_at = now + delay
            say(f"{failure}\n  restarting {self.name} in {delay:g}s")
        elif now >= self.restart_at and self.proc.poll() is not None:
            self.restarts += 1
            self.restart_at = None
            self.proc = self._spawn()
            say(f"restarted {self.name} (pid {self.pid}, restart {self.restarts})")

    def kill_hung(self, why: str, now: float) -> None:
        """Kill a child that runs but does not work (`why`: what shows it), its process group with
        it, and schedule its restart as for a dead one (after its backoff)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # stuck in the kernel (a driver): started again once gone
            say(f"{self.name} (pid {self.pid}) outlived SIGKILL for {KILL_WAIT_S:g}s; waiting for it to go")
        delay = self.backoff.after_exit(now - self.started_at)
        self.restart_at = now + delay
        say(f"{self.name} (pid {self.pid}) is hung: {why}; killed it (SIGKILL), restarting it in {delay:g}s")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait_or_kill(self, deadline: float, hurry: threading.Event | None = None) -> None:
        """Wait for it to exit until `deadline` (or until `hurry` is set), then SIGKILL it."""
        while self.proc.poll() is None and time.monotonic() < deadline:
            if hurry is not None and hurry.is_set():
                break
            try:
                self.proc.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            say(f"{self.name} did not stop in time: killing it")
            self.proc.kill()
            self.proc.wait()
        self._reader.join(1.0)


def stop_children(children: Iterable[Child], grace_s: float, hurry: threading.Event | None = None) -> None:
    """SIGTERM all of them, then SIGKILL the ones still running after `grace_s` seconds."""
    children = list(children)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.wait_or_kill(deadline, hurry)
