"""`pdserve up` with no model: makes the embedded tiny model, starts Redis, router, prefill and
decode, answers a chat request through the official client (with the API key it was given,
refusing a wrong one), and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest

from pdserve.rpc import free_port


def test_pdserve_up_answers_a_chat_request(tmp_path) -> None:
    port = free_port()
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--api-key",
            "k3y",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    lines = []
    try:
        deadline = time.monotonic() + 240
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "pdserve up exited:\n" + "".join(lines[-40:])
            lines.append(line)
            found = re.search(r"pdserve is up: (\S+)/v1", line)
            url = found.group(1) if found else None
            assert time.monotonic() < deadline, "pdserve up never became ready:\n" + "".join(lines[-40:])
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert 1 <= reply.usage.completion_tokens <= 8
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0, "".join(lines[-40:])
