"""A hung service (alive, but sending no heartbeat) is killed and restarted: the watch's verdicts
against a real Redis (a start grace before the first beat; an old incarnation's key not counted;
nobody judged while Redis is away), `Child.kill_hung` on a stopped child, and `pdserve up` with a
SIGSTOPped prefill service: the router drops it, the supervisor kills and restarts it, a request
caught by the hang ends, and the stack serves again."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from pdserve.hang_watch import HeartbeatWatch
from pdserve.launcher import heartbeat_timeout
from pdserve.registry import InstanceInfo, InstanceRegistry, RedisServer, instance_key
from pdserve.supervisor import Backoff, Child, is_running
from tests.up_process import UpProcess, chat, no_leftover_children, serves_within

pytestmark = pytest.mark.timeout(300)
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
TTL_S, TIMEOUT_S, GRACE_S = 0.5, 0.6, 1.0  # the watch's, scaled down from 3, 10 and 600 s


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    with no_leftover_children():
        yield


def beat(client: redis.Redis, name: str) -> None:
    client.set(instance_key("decode", name), "entry", px=round(TTL_S * 1000))


def verdicts(watch: HeartbeatWatch, child: Child) -> list[str]:
    return [why for _child, why in watch.hung([child], time.monotonic())]


def test_the_watch_waits_for_a_first_beat_then_for_each_next_one(capsys) -> None:
    with RedisServer() as server:
        client = redis.Redis(host=server.host, port=server.port)
        watch = HeartbeatWatch(server.url, None, TIMEOUT_S, GRACE_S, ttl_s=TTL_S)
        beat(client, "decode-7")  # the last beat of an incarnation killed just now
        starting = Child("decode-7", SLEEPER, dict(os.environ))
        assert verdicts(watch, starting) == []  # loading: within its start grace
        time.sleep(GRACE_S + 0.1)
        [why] = verdicts(watch, starting)  # the old key did not count as its first beat
        assert why.startswith("no heartbeat in the 1.")
        assert why.endswith(" since it started (--startup-timeout 1)")
        starting.proc.kill()

        serving = Child("decode-7", SLEEPER, dict(os.environ))
        until = time.monotonic() + GRACE_S + 0.5  # beating past its start grace: never hung
        while time.monotonic() < until:
            beat(client, "decode-7")
            assert verdicts(watch, serving) == []
            time.sleep(0.2)
        time.sleep(TIMEOUT_S + 0.1)  # its last beat: TIMEOUT_S + 0.1 ago
        [why] = verdicts(watch, serving)
        assert why.startswith("no heartbeat for 0.") and why.endswith(f"(--heartbeat-timeout {TIMEOUT_S:g})")

        port = server.port
        server.stop()  # Redis away: nobody judged, however long
        assert verdicts(watch, serving) == []
        assert "none is judged hung meanwhile" in capsys.readouterr().err
        with RedisServer(port=port):  # back, empty: TIMEOUT_S more for the beats to come back
            assert verdicts(watch, serving) == []
            time.sleep(TIMEOUT_S / 2)
            assert verdicts(watch, serving) == []
            time.sleep(TIMEOUT_S / 2 + 0.1)
            assert [why.split(" for ")[0] for why in verdicts(watch, serving)] == ["no heartbeat"]
        serving.proc.kill()
        watch.close()


def test_kill_hung_kills_a_stopped_child_and_restarts_it_after_its_backoff(capsys) -> None:
    child = Child("stuck", SLEEPER, dict(os.environ), Backoff(first_s=0.3, max_s=30.0))
    first = child.pid
    os.kill(first, signal.SIGSTOP)
    child.kill_hung("no heartbeat for 12.0s (--heartbeat-timeout 10)", time.monotonic())
    assert not is_running(first) and child.proc.returncode == -signal.SIGKILL
    err = capsys.readouterr().err
    assert err == (
        f"[pdserve up] stuck (pid {first}) is hung: no heartbeat for 12.0s (--heartbeat-timeout 10); "
        "killed it (SIGKILL), restarting it in 0.3s\n"
    )
    child.poll_restart(time.monotonic())  # not due yet; not found dead a second time
    assert child.pid == first and capsys.readouterr().err == ""
    time.sleep(0.35)
    child.poll_restart(time.monotonic())
    assert child.pid != first and child.restarts == 1 and is_running(child.pid)
    child.terminate()
    child.wait_or_kill(time.monotonic() + 10)


def test_a_stopped_service_is_dropped_killed_and_restarted_and_the_stack_serves_again(
    tmp_path, tiny_model_dir
) -> None:
    """--heartbeat-timeout 5: the router drops the stopped instance when its key expires (3 s),
    the supervisor kills it at 5 s; a request sent into the hang ends (an answer or an error)."""
    up = UpProcess(tmp_path, "--heartbeat-timeout", "5", model=tiny_model_dir).start()
    try:
        assert chat(up.url) in ("stop", "length")
        old = up.children()["prefill-0"]
        mark = len(up.lines)
        os.kill(old, signal.SIGSTOP)
        stopped_at = time.monotonic()
        caught: list[object] = []  # a request routed to the stopped instance, before it was dropped
        request = threading.Thread(target=lambda: caught.append(outcome(up.url)))
        request.start()
        while httpx.get(f"{up.url}/health", timeout=5).json()["prefill"] != 0:
            assert time.monotonic() - stopped_at < 5, "the router still routes to the stopped instance"
            time.sleep(0.1)
        up.wait_for(rf"prefill-0 \(pid {old}\) is hung: no heartbeat for [\d.]+s", 10, after=mark)
        assert time.monotonic() - stopped_at > 4  # not before its timeout (its last beat: < 1 s before)
        assert not is_running(old)
        new = int(up.wait_for(r"restarted prefill-0 \(pid (\d+)", 10, after=mark).group(1))
        assert new != old and up.children()["prefill-0"] == new
        assert serves_within(up.url, 60, up) in ("stop", "length")
        request.join(60)
        assert not request.is_alive() and caught and not isinstance(caught[0], openai.APITimeoutError)
        hung = [line for line in up.lines[mark:] if " is hung: " in line]
        assert len(hung) == 1, hung  # the new one, loading for seconds, was given its start grace
        assert up.proc.poll() is None, "the launcher stopped the stack"
    finally:
        assert up.stop() == 0, up.output()


def outcome(url: str) -> object:
    """A chat request's finish reason, or the error it ended with (never left hanging: 90 s)."""
    try:
        return chat(url, timeout=90)
    except openai.APIError as e:
        return e


def test_a_heartbeat_timeout_below_the_ttl_is_refused() -> None:
    """Below 3 s (the key's TTL) the supervisor would kill services the routers still use."""
    assert [heartbeat_timeout(s) for s in ("0", "3", "10.5")] == [0.0, 3.0, 10.5]
    for bad in ("2.9", "-1", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="at least 3"):
            heartbeat_timeout(bad)


def test_heartbeat_stops_while_the_service_is_stuck() -> None:
    """No beat while `stuck()` gives a reason: the key expires (routers stop sending work,
    `pdserve up` restarts the service); beats resume when it gives None."""
    reason: list[str | None] = ["the engine thread has been in one turn for 61 s"]

    async def main(url: str) -> None:
        async with InstanceRegistry(url, "t4") as registry:
            current = lambda: InstanceInfo("prefill", "p-9", "127.0.0.1:1")  # noqa: E731
            beats = registry.heartbeat_forever(current, 0.1, 0.4, stuck=lambda: reason[0])
            task = asyncio.create_task(beats)
            await asyncio.sleep(0.5)
            assert await registry.instances("prefill") == []
            reason[0] = None
            await asyncio.sleep(0.3)
            assert len(await registry.instances("prefill")) == 1
            reason[0] = "held again"
            await asyncio.sleep(0.7)
            assert await registry.instances("prefill") == []
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    with RedisServer() as server:
        asyncio.run(main(server.url))
