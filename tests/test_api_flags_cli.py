"""The OpenAI front's flags on real processes: `pdserve router MODEL` (positional) serves the model
under its name as typed, a relative symlink included; --served-model-name takes several names;
--chat-template replaces the model's; uvicorn's access line per request, gone with
--disable-uvicorn-access-log or --disable-log-requests; `pdserve up MODEL` with a relative,
symlinked path answers a chat for that name through the official client, and passes the API
flags to its router. The router-only cases need no engine: /v1/models and /tokenize answer
without one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.cli import build_parser
from pdserve.launcher import router_argv
from pdserve.registry import RedisServer
from pdserve.rpc import free_port
from pdserve.supervisor import popen_options
from router.api_flags import access_log, api_argv
from tests.up_process import UpProcess, cmdline

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "p" * 32
ACCESS_LINE = '"POST /tokenize HTTP/1.1" 200'


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    server = RedisServer(password=PASSWORD).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def linked_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A symlink to the tiny model, as a path relative to the repository (the children's cwd)."""
    link = tmp_path_factory.mktemp("links") / "my-model"
    link.symlink_to(tiny_model_dir)
    return os.path.relpath(link, ROOT)


def run_router(tmp_path: Path, redis: RedisServer, *args: str) -> tuple[str, subprocess.Popen, Path]:
    port, log = free_port(), tmp_path / f"router-{time.monotonic_ns()}.log"
    env = {**os.environ, "PDSERVE_REDIS_PASSWORD": PASSWORD, "PYTHONUNBUFFERED": "1"}
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "router",
        *args,
        "--port",
        str(port),
        "--redis-url",
        redis.url,
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, **popen_options()
        )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            httpx.get(f"{url}/health", timeout=1.0)
            return url, proc, log
        except httpx.HTTPError:
            time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def log_shows(log: Path, text: str, wait_s: float = 2.0) -> bool:
    deadline = time.monotonic() + wait_s
    while text not in log.read_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_model_is_served_as_typed_with_an_access_line(
    tmp_path: Path, redis: RedisServer, linked_model: str
) -> None:
    url, proc, log = run_router(tmp_path, redis, linked_model)
    try:
        ids = [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]]
        assert ids == [linked_model] and not linked_model.startswith("/")
        answer = httpx.post(f"{url}/tokenize", json={"model": linked_model, "prompt": "Hello"})
        assert answer.status_code == 200 and answer.json()["count"] == 1
        assert log_shows(log, ACCESS_LINE), log.read_text()[-2000:]
    finally:
        stop(proc)


def test_several_names_a_chat_template_and_no_access_line(
    tmp_path: Path, redis: RedisServer, tiny_model_dir: Path
) -> None:
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    args = [
        "--model",
        str(tiny_model_dir),
        "--served-model-name",
        "first",
        "second",
        "--disable-uvicorn-access-log",
    ]
    url, proc, log = run_router(tmp_path, redis, *args, "--chat-template", str(template))
    try:
        assert [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]] == ["first", "second"]
        body = {"model": "second", "messages": [{"role": "user", "content": "hi"}]}
        tokens = httpx.post(f"{url}/tokenize", json=body).json()["tokens"]
        assert httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json()["prompt"] == "[user] hi\n"
        assert httpx.post(f"{url}/tokenize", json={**body, "model": str(tiny_model_dir)}).status_code == 404
        time.sleep(0.3)
        assert ACCESS_LINE not in log.read_text()
    finally:
        stop(proc)


def test_flags_that_cannot_start_stop_with_one_line(
    tmp_path: Path, redis: RedisServer, tiny_model_dir: Path
) -> None:
    for args, fragment in (
        ([str(tiny_model_dir), "--model", str(tmp_path)], "given twice"),
        (["--chat-template", "no-such-file.jinja", str(tiny_model_dir)], "no such file"),
        ([str(tiny_model_dir), "--generation-config", str(tmp_path)], "no generation_config.json"),
        ([str(tiny_model_dir), "--max-logprobs", "50"], "--max-logprobs"),
    ):
        env = {**os.environ, "PDSERVE_REDIS_PASSWORD": PASSWORD}
        argv = [sys.executable, "-m", "pdserve.cli", "router", *args, "--redis-url", redis.url, "--port", "0"]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
        assert done.returncode == 1 and fragment in done.stderr, (args, done.stderr[-2000:])


def test_up_passes_the_api_flags_to_its_router() -> None:
    argv = ["up", "m", "--served-model-name", "a", "b", "--seed", "7", "--max-logprobs", "5"]
    argv += ["--chat-template", "{{ messages }}", "--disable-log-requests", "--tool-call-parser", "hermes"]
    args = build_parser(argv).parse_args(argv)
    assert args.model_tag == "m" and args.seed == 7 and args.dummy_weight_seed is None
    assert access_log(args) is False  # --disable-log-requests quiets it as --disable-uvicorn-access-log does
    passed = api_argv(args)
    assert passed == [
        "--served-model-name", "a", "b", "--seed=7", "--max-logprobs=5", "--chat-template={{ messages }}",
        "--tool-call-parser=hermes", "--disable-log-requests",
    ]  # fmt: skip
    again = build_parser(["router", "m", "--redis-url", "r", *passed]).parse_args(
        ["router", "m", "--redis-url", "r", *passed]
    )
    assert (again.served_model_name, again.seed, again.chat_template) == (["a", "b"], 7, "{{ messages }}")


def test_up_passes_the_burst_flags_to_its_router_only_when_given() -> None:
    parse = lambda *flags: build_parser(["up", "m", *flags]).parse_args(["up", "m", *flags])  # noqa: E731
    plain = router_argv(parse(), ["--model", "m"], "m")
    assert not [a for a in plain if a.startswith("--burst")]
    given = router_argv(parse("--burst-window-ms", "20", "--burst-max-tokens", "4096"), ["--model", "m"], "m")
    i = given.index("--burst-window-ms")
    assert given[i : i + 4] == ["--burst-window-ms", "20.0", "--burst-max-tokens", "4096"]
    child = [*given[given.index("router") :], "--redis-url", "r"]  # the stack adds its Redis
    router = build_parser(child).parse_args(child)
    assert (router.burst_window_ms, router.burst_max_tokens) == (20.0, 4096)


def test_pdserve_up_serves_a_relative_symlinked_model_as_typed(tmp_path: Path, linked_model: str) -> None:
    up = UpProcess(tmp_path, "--colocate", "--max-model-len", "256", linked_model, "--seed", "7").start()
    try:
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="x", max_retries=0, timeout=60)
        assert [card.id for card in client.models.list().data] == [linked_model]
        reply = client.chat.completions.create(
            model=linked_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert reply.model == linked_model and reply.usage.completion_tokens >= 1
        # the router's request series carry the name as typed too (vLLM's model_name label)
        served = httpx.get(f"{up.url}/metrics", timeout=10).text
        assert f'pdserve:generation_tokens_total{{model_name="{linked_model}"}} ' in served
        assert "--seed=7" in cmdline(up.children()["router"])
        up.wait_for(r'"POST /v1/chat/completions HTTP/1.1" 200', 10)  # the router's access line
    finally:
        assert up.stop() == 0, up.output()
