"""`pdserve up` supervises its children: a dead child is restarted with backoff and serves
again; SIGKILL of the launcher leaves no child alive, and the folders it leaves (its own, its
Redis's) are removed by the next `pdserve up`; Ctrl-C (SIGINT to the terminal's process group)
stops the router first and Redis last; no secret is on any command line. (A hung child:
tests/test_hang_watch.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.private_dirs import process_start_time
from pdserve.supervisor import Backoff, Child, is_running
from tests.up_process import (
    UpProcess,
    chat,
    cmdline,
    descendants,
    environ,
    no_leftover_children,
    serves_within,
    wait_gone,
)


def test_backoff_doubles_up_to_its_cap_and_resets_after_a_healthy_run() -> None:
    backoff = Backoff(first_s=1.0, max_s=30.0, healthy_s=60.0)
    assert [backoff.after_exit(uptime_s=2.0) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.after_exit(uptime_s=61.0) == 1.0
    assert backoff.after_exit(uptime_s=2.0) == 2.0


def test_a_crashing_child_is_restarted_after_its_backoff_with_its_output_logged(capsys) -> None:
    argv = [sys.executable, "-c", "import sys; print('boom at start'); sys.exit(3)"]
    child = Child("crasher", argv, dict(os.environ), Backoff(first_s=0.3, max_s=30.0))
    first = child.pid
    child.proc.wait()
    child.poll_restart(time.monotonic())  # found dead: logged, restart scheduled
    err = capsys.readouterr().err
    assert "crasher exited with status 3" in err and "boom at start" in err
    assert "restarting crasher in 0.3s" in err
    child.poll_restart(time.monotonic())  # not due yet
    assert child.pid == first
    time.sleep(0.35)
    child.poll_restart(time.monotonic())
    assert child.pid != first and child.restarts == 1
    child.wait_or_kill(time.monotonic() + 10)


def test_a_killed_decode_child_and_redis_are_restarted_and_serve_again(tmp_path, tiny_model_dir) -> None:
    """Then a clean stop, which removes the internal secret's file."""
    up = UpProcess(tmp_path, model=tiny_model_dir).start()
    secret_file = environ(up.children()["router"])["PDSERVE_INTERNAL_SECRET_FILE"]
    try:
        assert chat(up.url) in ("stop", "length")
        old = up.children()["decode-0"]
        os.kill(old, signal.SIGKILL)
        mark = len(up.lines)
        up.wait_for(r"decode-0 exited with status -9", 10, after=mark)
        up.wait_for(r"restarted decode-0 \(pid \d+", 10, after=mark)
        new = up.children()["decode-0"]
        assert new != old and is_running(new)
        # the only decode instance: served means the new one registered under decode-0
        assert serves_within(up.url, 60, up) in ("stop", "length")
        os.kill(up.children()["redis"], signal.SIGKILL)  # the private Redis comes back on its port
        up.wait_for(r"restarted redis \(pid \d+", 20, after=mark)
        time.sleep(1.0)  # the router's next refresh sees the empty Redis
        assert serves_within(up.url, 30, up) in ("stop", "length")
        assert up.proc.poll() is None, "the launcher stopped the stack"
    finally:
        assert up.stop() == 0, up.output()
    assert not os.path.exists(secret_file)


FILE_KEY, ENV_KEY = "s3cret-file-key", "s3cret-env-key"


@pytest.fixture(scope="module")
def keyed_up(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[UpProcess]:
    """`pdserve up` with an API key file and a key in its environment (and a temp folder of its
    own: $TMPDIR), started once for the two tests below: the first looks at its processes, the
    second SIGKILLs it."""
    tmp_path = tmp_path_factory.mktemp("keyed-up")
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{FILE_KEY} 4\n")
    (tmp_path / "temp").mkdir()
    env = {"PDSERVE_API_KEY": ENV_KEY, "TMPDIR": str(tmp_path / "temp")}
    up = UpProcess(tmp_path, "--api-key-file", str(key_file), model=tiny_model_dir, env=env)
    up.start()
    try:
        yield up
    finally:
        if up.proc.poll() is None:  # the SIGKILL test did not run, or failed before its kill
            up.stop()


def test_no_secret_or_password_is_on_any_command_line(keyed_up: UpProcess) -> None:
    """(The clean stop that removes the secret's file: the killed-decode test above.)"""
    up = keyed_up
    children = up.children()
    assert set(children) == {"redis", "router", "prefill-0", "decode-0"}, children
    router_env = environ(children["router"])
    secret_file = router_env["PDSERVE_INTERNAL_SECRET_FILE"]
    assert os.stat(secret_file).st_mode & 0o777 == 0o600
    secrets = {
        open(secret_file).read().strip(),
        router_env["PDSERVE_REDIS_PASSWORD"],
        FILE_KEY,
        ENV_KEY,
    }
    for name, pid in children.items():
        line = cmdline(pid)
        assert not any(s in line for s in secrets), f"{name} has a secret on its command line: {line}"
        if name != "redis":  # redis-server rewrites its environment area (its process title)
            env = environ(pid)
            assert env["PDSERVE_INTERNAL_SECRET_FILE"] == secret_file, name
            assert env["PDSERVE_REDIS_PASSWORD"] == router_env["PDSERVE_REDIS_PASSWORD"], name
            assert ("PDSERVE_API_KEY" in env) == (name == "router"), name
    assert not any(s in " ".join(up.argv) for s in secrets)
    for key, status in ((FILE_KEY, 200), (ENV_KEY, 200), ("wrong", 401)):
        got = httpx.get(f"{up.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert got.status_code == status, key


def test_sigkill_of_pdserve_up_leaves_no_child_alive_and_the_next_removes_its_folders(
    keyed_up: UpProcess, tmp_path
) -> None:
    """Ends the module's `keyed_up` (after the test above). The next `pdserve up` (one that fails
    at once: no model) removes the dead one's folders, not those of a live owner or of none."""
    up = keyed_up
    children = up.children()
    assert set(children) == {"redis", "router", "prefill-0", "decode-0"}, children
    below = descendants(up.proc.pid)
    up.proc.kill()
    up.proc.wait()
    alive = wait_gone(below, timeout=5)
    for pid in alive:  # do not leave them behind for the next test
        os.kill(pid, signal.SIGKILL)
    assert not alive, {pid: cmdline(pid) for pid in alive}

    temp = Path(up.env["TMPDIR"])
    left = sorted(p.name.rpartition("-")[0] for p in temp.glob("pdserve-*"))
    assert left == ["pdserve-redis", "pdserve-up"], left  # SIGKILL: nobody cleaned up
    live, unowned = temp / "pdserve-up-live", temp / "pdserve-redis-unowned"
    live.mkdir()
    (live / "owner").write_text(f"{os.getpid()} {process_start_time(os.getpid())}\n")
    unowned.mkdir()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--device", "cpu", "--model", str(tmp_path / "none")]
    done = subprocess.run(argv, env=up.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert sorted(temp.glob("pdserve-*")) == [unowned, live], done.stderr
    assert done.stderr.count("left behind by a process that is gone") == 2, done.stderr


def test_ctrl_c_drains_the_router_first_and_stops_redis_last(tmp_path, tiny_model_dir) -> None:
    up = UpProcess(tmp_path, "--shutdown-timeout", "1", model=tiny_model_dir).start()
    children = up.children()
    assert set(children) == {"redis", "router", "prefill-0", "decode-0"}, children
    lines: list[str] = []
    streaming = threading.Event()

    model = httpx.get(f"{up.url}/v1/models").json()["data"][0]["id"]

    def long_stream() -> None:  # ~3,000 tokens: still open when the drain times out
        body = {"model": model, "prompt": "Hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{up.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    streaming.set()

    reader = threading.Thread(target=long_stream)
    reader.start()
    assert streaming.wait(30), lines
    os.killpg(up.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    gone_at: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while len(gone_at) < len(children) and time.monotonic() < deadline:
        for name, pid in children.items():
            if name not in gone_at and not is_running(pid):
                gone_at[name] = time.monotonic()
        time.sleep(0.01)
    assert up.proc.wait(30) == 0, up.output()
    reader.join(30)
    assert set(gone_at) == set(children), up.output()
    services = [gone_at[name] for name in ("prefill-0", "decode-0")]
    assert gone_at["router"] <= min(services), gone_at
    assert max(services) <= gone_at["redis"], gone_at
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "shutting down" in events[-2], events[-3:]


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    with no_leftover_children():
        yield
