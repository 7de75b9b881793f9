"""`pdserve up` with no model: makes the embedded tiny model (byte for byte the tests' own), starts
Redis, router, prefill and decode, answers a chat request through the official client (with the
API key it was given, refusing a wrong one), and stops cleanly on SIGTERM; `--colocate` runs one
engine process holding both roles; a child that fails at start fails the start with its last
output."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve.layout import LayoutError, ServiceProcess, plan_services, role_counts
from tests.test_tokenizer_tiny import TINY_FILES
from tests.up_process import UpProcess


def chat_once(url: str, api_key: str = "none") -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=8,
        temperature=0,
    )


def test_pdserve_up_answers_a_chat_request(tmp_path, tiny_model_dir) -> None:
    up = UpProcess(tmp_path, env={"PDSERVE_API_KEY": "k3y"}).start()
    try:
        with pytest.raises(openai.AuthenticationError):
            chat_once(up.url, api_key="wrong")
        reply = chat_once(up.url, api_key="k3y")
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert 1 <= reply.usage.completion_tokens <= 8
        # /metrics (open without the key): the one request, labelled with the served name as vLLM's
        served = httpx.get(f"{up.url}/metrics", timeout=10).text
        finished = f'finished_reason="{reply.choices[0].finish_reason}",model_name="{reply.model}"'
        assert f"pdserve:request_success_total{{{finished}}} 1.0" in served, served
        # each serving process froze its start-up heap out of the collector's walk (pdserve.heap)
        for process in ("router", "prefill-0", "decode-0"):
            up.wait_for(rf"^\[{process}\] .* froze \d+ start-up objects", timeout=30)
    finally:
        assert up.stop() == 0, up.output()
    # made in that process, the tokenizer converted there: the session's seed-0 checkpoint, byte
    # for byte (tests/test_tokenizer_tiny.py makes one in the test process)
    embedded = tmp_path / "cache" / "tiny-qwen36"
    for name in TINY_FILES:
        assert (embedded / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_colocated_stack_runs_one_engine_process_holding_both_roles(tmp_path, tiny_model_dir) -> None:
    up = UpProcess(tmp_path, "--colocate", model=tiny_model_dir).start()
    try:
        assert set(up.children()) == {"redis", "router", "engine-0"}, up.children()
        health = httpx.get(f"{up.url}/health").json()
        assert (health["prefill"], health["decode"]) == (1, 1), health
        reply = chat_once(up.url)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert 1 <= reply.usage.completion_tokens <= 8
    finally:
        assert up.stop() == 0, up.output()


def test_a_child_failing_at_start_fails_the_start_with_its_output(tmp_path, tiny_model_dir) -> None:
    up = UpProcess(tmp_path, "--max-num-seqs", "0", model=tiny_model_dir)
    with pytest.raises(AssertionError, match="exited"):
        up.start(timeout=120)
    assert up.proc.wait(30) == 1
    output = up.output(200)
    assert "a process died during startup" in output
    assert "max_num_seqs must be positive" in output


def commands(plan: list[ServiceProcess]) -> list[tuple[str, str, str | None]]:
    return [(p.command, p.name, p.gpu) for p in plan]


def test_one_gpu_gets_one_engine_and_more_gpus_separate_roles() -> None:
    assert commands(plan_services(None, None, False, "cuda", gpus=["3"])) == [("engine", "engine-0", "3")]
    assert commands(plan_services(None, None, False, "cuda", gpus=["0", "1"])) == [
        ("prefill", "prefill-0", "0"),
        ("decode", "decode-0", "1"),
    ]
    # asked for separate processes on one GPU: as asked
    assert [p.command for p in plan_services(1, 1, False, "cuda", gpus=["0"])] == ["prefill", "decode"]
    assert commands(plan_services(None, None, False, "cpu")) == [
        ("prefill", "prefill-0", None),
        ("decode", "decode-0", None),
    ]
    assert [p.name for p in plan_services(2, None, False, "cpu")] == ["prefill-0", "prefill-1", "decode-0"]
    colocated = plan_services(None, None, True, "cpu")
    assert commands(colocated) == [("engine", "engine-0", None)]
    assert role_counts(colocated) == {"prefill": 1, "decode": 1}
    with pytest.raises(LayoutError, match="--colocate"):
        plan_services(1, None, True, "cpu")
    with pytest.raises(LayoutError, match="no GPU"):
        plan_services(None, None, False, "cuda", gpus=[])
