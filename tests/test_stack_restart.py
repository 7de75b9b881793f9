"""The end-to-end test stack (tests/stack.py) closes the internal plane like `pdserve up` (no
secret on a command line) and restarts a killed service under its instance id, which then
serves again."""

from __future__ import annotations

import time

import openai

from tests.stack import Stack
from tests.up_process import cmdline, environ


def test_restarted_decode_serves_again_and_no_secret_is_on_a_command_line(tiny_model_dir, tmp_path) -> None:
    stack = Stack(
        tiny_model_dir, tmp_path, num_prefill=1, num_decode=1, extra_flags={"decode": ["--max-num-seqs", "4"]}
    )
    stack.start()
    try:
        secrets = {
            open(stack.env["PDSERVE_INTERNAL_SECRET_FILE"]).read().strip(),
            stack.env["PDSERVE_REDIS_PASSWORD"],
        }
        for name, proc in stack.procs.items():
            assert not any(s in cmdline(proc.pid) for s in secrets), name
            assert environ(proc.pid)["PDSERVE_REDIS_PASSWORD"] == stack.env["PDSERVE_REDIS_PASSWORD"], name
        assert stack.argv["decode-0"][-2:] == ["--max-num-seqs", "4"]
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=30)

        def complete() -> str:
            return (
                client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
                .choices[0]
                .text
            )

        before = complete()
        old = stack.procs["decode-0"].pid
        stack.kill("decode-0")
        stack.restart("decode-0")
        assert stack.procs["decode-0"].pid != old
        deadline = time.monotonic() + 60
        while True:  # until the router has the new incarnation's address
            try:
                assert complete() == before
                break
            except openai.APIError:
                assert time.monotonic() < deadline, stack.log("decode-0")[-3000:]
                time.sleep(0.5)
        assert stack.log("decode-0").count("serving on") == 2
    finally:
        stack.stop()
