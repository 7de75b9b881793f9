"""Benchmark clients against `pdserve up --api-key K` on the tiny model (issue 8, acceptance 5):
- `pdserve bench-serve` streams chat with the key from $OPENAI_API_KEY: every request completes;
  without the key every one is a counted 401, the run goes on and exits 1;
- AIPerf (PyPI `aiperf`) streaming chat with `--api-key K` completes with 0 errors. AIPerf is
  found as $AIPERF or `aiperf` on PATH; it lives in a venv of its own (it pins its own
  dependencies), so the test is skipped where it is not installed. About 30 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.torch_blocked import ROOT
from tests.up_process import UpProcess

KEY = "sk-bench-0123456789"
MODEL = "tiny"
AIPERF = os.environ.get("AIPERF") or shutil.which("aiperf")
AIPERF_MISSING = (
    "AIPerf not found: install it in a venv of its own (python3 -m venv V && V/bin/pip install aiperf), "
    "then put V/bin on PATH or set AIPERF=V/bin/aiperf"
)


@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("up")
    stack = UpProcess(tmp, "--api-key", KEY, "--served-model-name", MODEL, model=tiny_model_dir).start()
    try:
        yield stack
    finally:
        stack.stop()


def bench_serve(url: str, out: Path, key: str | None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pdserve.cli", "bench-serve", "--base-url", url, "--model", MODEL]
    argv += ["--backend", "openai-chat", "--max-concurrency", "3", "--num-prompts", "6"]
    argv += ["--random-input-len", "24", "--random-output-len", "6", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if key is not None:
        env["OPENAI_API_KEY"] = key
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_bench_serve_uses_the_key(up: UpProcess, tmp_path: Path) -> None:
    done = bench_serve(up.url, tmp_path / "with-key.json", KEY)
    assert done.returncode == 0, done.stdout + done.stderr
    (level,) = json.loads((tmp_path / "with-key.json").read_text())
    assert (level["completed"], level["failed"], level["mean_output_tokens"]) == (6, 0, 6)
    assert level["endpoint"] == "/v1/chat/completions" and level["ttft_ms"] > 0

    done = bench_serve(up.url, tmp_path / "no-key.json", None)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (level,) = json.loads((tmp_path / "no-key.json").read_text())
    assert (level["completed"], level["failed"]) == (0, 6)
    assert [error.split(":")[0] for error in level["errors"]] == ["HTTP 401"]


def aiperf_command(url: str, model_dir: Path, out: Path) -> list[str]:
    """Streaming chat, 8 requests 2 at a time, 16 prompt tokens, 8 output tokens; token counts
    from the server's usage (the chat template adds tokens client-side counting does not see)."""
    argv = [AIPERF, "profile", "--model", MODEL, "--url", url, "--endpoint-type", "chat", "--streaming"]
    argv += ["--api-key", KEY, "--tokenizer", str(model_dir), "--use-server-token-count"]
    argv += ["--extra-inputs", "ignore_eos:true", "--request-count", "8", "--concurrency", "2"]
    argv += ["--isl", "16", "--isl-stddev", "0", "--osl", "8", "--osl-stddev", "0", "--random-seed", "0"]
    argv += ["--ui", "none", "--no-gpu-telemetry", "--workers-max", "1", "--output-artifact-dir", str(out)]
    return argv


@pytest.mark.skipif(AIPERF is None, reason=AIPERF_MISSING)
def test_aiperf_streaming_chat_with_the_key(up: UpProcess, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "aiperf"
    # its scratch files (ZMQ sockets: a path of at most 107 bytes, so not under tmp_path) and caches
    with tempfile.TemporaryDirectory(prefix="aiperf-", dir="/tmp") as scratch:
        env = {**os.environ, "TMPDIR": scratch, "HF_HOME": str(tmp_path / "hf")}
        command = aiperf_command(up.url, tiny_model_dir, out)
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    said = (done.stdout + done.stderr)[-4000:]
    # AIPerf can exit 0 when its services failed to start: the report must be there too
    assert done.returncode == 0 and (out / "profile_export_aiperf.json").is_file(), said
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    assert report["error_summary"] == [] and "error_request_count" not in report, report["error_summary"]
    assert report["request_count"]["avg"] == 8 and report["was_cancelled"] is False
    assert report["output_sequence_length"]["avg"] == 8  # ignore_eos reached the engine
    assert report["time_to_first_token"]["avg"] > 0 and report["inter_token_latency"]["avg"] > 0
    served = httpx.get(f"{up.url}/metrics", timeout=10).text  # the router served them, streamed
    assert f'pdserve:request_success_total{{finished_reason="length",model_name="{MODEL}"}} ' in served
    assert httpx.post(f"{up.url}/v1/chat/completions", json={}, timeout=10).status_code == 401
