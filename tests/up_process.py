"""`pdserve up` as a test runs it: a process in a session of its own (as a terminal's job),
its output gathered, and its descendants found through /proc; a chat request through the
official client; the children a failed test left, killed."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai

from pdserve.rpc import free_port
from pdserve.sampling.vocab_cache import cache_dir
from pdserve.supervisor import is_running


def process_table() -> dict[int, int]:
    """{pid: parent pid} of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            table[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    return table


def descendants(pid: int) -> list[int]:
    """The running processes below `pid` (children, their children, ...)."""
    table, found, frontier = process_table(), [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, ppid in table.items() if ppid == parent and is_running(p)]
        found += kids
        frontier += kids
    return found


@contextlib.contextmanager
def no_leftover_children() -> Iterator[None]:
    """Kill (SIGKILL) the processes started below this one in the block that still run after it:
    a failed test must not leave children serving (they would slow every later test)."""
    before = set(descendants(os.getpid()))
    try:
        yield
    finally:
        for pid in set(descendants(os.getpid())) - before:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Those of `pids` still running after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(is_running(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if is_running(p)]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").partition("=")[::2] for p in pairs if b"=" in p)


def seed_vocab_cache(cache: Path) -> None:
    """Copy the vocabulary views the run's engines already built (pdserve.sampling.vocab_cache,
    in the user's cache) into a `PDSERVE_CACHE` of a test's own: its engines read them (~0.7 s)
    instead of building them again (~4 s each)."""
    built = cache_dir()  # this process's: the user's cache
    target = cache / "xgrammar"
    if built.is_dir() and not target.exists():
        target.mkdir(mode=0o700, parents=True)
        for entry in built.glob("*.json"):
            with contextlib.suppress(FileNotFoundError):  # pruned by an engine meanwhile
                shutil.copyfile(entry, target / entry.name)


class UpProcess:
    """`pdserve up --device cpu --port P ARGS...` with `model` (default: the embedded tiny
    model, made in `tmp_path`); `start()` waits until it prints its URL. Its output lines are in
    `lines` (a reader thread keeps gathering them)."""

    def __init__(
        self, tmp_path: Path, *args: str, model: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.argv = [sys.executable, "-m", "pdserve.cli", "up", "--device", "cpu", "--port", str(self.port)]
        self.argv += (["--model", str(model)] if model else []) + list(args)
        self.env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache"), **(env or {})}
        seed_vocab_cache(tmp_path / "cache")
        self.lines: list[str] = []
        self.url = ""
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240.0) -> UpProcess:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**self.env, "PYTHONUNBUFFERED": "1"},
            text=True,
            start_new_session=True,  # its own process group, as a shell gives a job
        )
        self._reader = threading.Thread(target=self._gather, daemon=True)
        self._reader.start()
        found = self.wait_for(r"pdserve is up: (\S+)/v1", timeout)
        self.url = found.group(1)
        return self

    def _gather(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self, last: int = 60) -> str:
        if self.proc is not None and self.proc.poll() is not None:
            self._reader.join(5.0)  # the rest of its output
        return "".join(self.lines[-last:])

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match:
        """The first output line from index `after` on that matches `pattern`."""
        assert self.proc is not None
        deadline, seen = time.monotonic() + timeout, after
        while True:
            for line in self.lines[seen:]:
                found = re.search(pattern, line)
                if found:
                    return found
                seen += 1
            if self.proc.poll() is not None and not self._reader.is_alive() and seen >= len(self.lines):
                raise AssertionError(
                    f"pdserve up exited ({self.proc.returncode}) before {pattern!r}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} after {timeout:.0f}s:\n{self.output()}")
            time.sleep(0.05)

    def children(self) -> dict[str, int]:
        """{role: pid} of its running children: "redis", "router", and services by instance id."""
        assert self.proc is not None
        found = {}
        for pid in descendants(self.proc.pid):
            try:
                line = cmdline(pid)
            except OSError:
                continue
            instance = re.search(r"--instance-id (\S+)", line)
            if instance:
                found[instance.group(1)] = pid
            elif "pdserve.cli router" in line:
                found["router"] = pid
            elif "redis-server" in line:
                found["redis"] = pid
        return found

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM it (if it runs) and wait; its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            raise AssertionError(f"pdserve up did not stop in {timeout:.0f}s:\n{self.output()}") from None


def chat(url: str, timeout: float = 30.0) -> str:
    """The finish reason of a 4-token greedy chat request (openai.APIError when it fails)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=4,
        temperature=0,
    )
    return reply.choices[0].finish_reason


def serves_within(url: str, seconds: float, log: UpProcess) -> str:
    """The finish reason of the first chat request that succeeds within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return chat(url)
        except openai.APIError:
            assert time.monotonic() < deadline, log.output()
            time.sleep(0.5)
