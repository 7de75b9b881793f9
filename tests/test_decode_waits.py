"""Requests handed over to a decode instance whose sequence slots are all taken wait there, their
state held on the prefill instance by lease renewals, for as long as the running sequences take
to free a slot. Before, each failed with 503 once it had waited `admission_timeout_s` (30 s),
even on an idle server asked for `n: 200` with outputs longer than 30 s in all (robustness audit).

Here a slot frees only every ~1-2 s (2 slots, 360 tokens each) against an admission timeout of
1 s and a lease of 2.5 s: without renewals the last requests would fail or find their state
freed; with them every output equals the offline engine's."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from pdserve import LLM, SamplingParams
from tests.stack import Stack

pytestmark = pytest.mark.timeout(300)
PROMPTS = [
    f"Waiting request {i} is about {w}" for i, w in enumerate(["owls", "tea", "maps", "rain", "salt", "ink"])
]
MAX_TOKENS = 360


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    flags = {
        "prefill": ["--handoff-timeout", "2.5"],
        "decode": ["--max-num-seqs", "2", "--admission-timeout", "1"],
    }
    s = Stack(
        tiny_model_dir, tmp_path_factory.mktemp("waits"), num_prefill=1, num_decode=1, extra_flags=flags
    )
    s.start()
    yield s
    s.stop()


def test_requests_wait_for_a_slot_past_the_admission_timeout(stack: Stack, tiny_model_dir) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=240)

    def complete(prompt: str) -> tuple[str, str, float]:
        started = time.monotonic()
        reply = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].text, reply.choices[0].finish_reason, time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(complete, PROMPTS))
    offline = LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [out.text for out in offline.generate(PROMPTS, params)]
    assert [text for text, _, _ in answers] == expected
    assert {finish for _, finish, _ in answers} == {"length"}
    # the test means something only if some request waited past both timeouts
    assert max(seconds for _, _, seconds in answers) > 2.5 + 1.0, answers


def test_a_renewal_without_an_answer_ends_nothing_a_lost_lease_does() -> None:
    """`_renewed` on the engine thread: no answer (a slow or older holder) retries the renewal in
    RENEW_RETRY_S; an answer that the lease is gone ends the request ABORTED."""
    from types import SimpleNamespace

    from decode_svc.service import RENEW_RETRY_S, DecodeService, Incoming

    failed: list[str] = []
    service = object.__new__(DecodeService)  # its engine, host and peers are not needed here
    service.config = SimpleNamespace(admission_timeout_s=30.0)
    service._fail = lambda rid, message, code="ABORTED": failed.append(f"{code}: {message}")
    inc = Incoming(start=None, seq=None, peer="p", renewed=100.0)
    service.incoming = {"r": inc}
    service._renewed("r", inc, None, "DEADLINE_EXCEEDED")
    assert failed == [] and inc.renewed == 100.0 - 15.0 + RENEW_RETRY_S  # due again in RENEW_RETRY_S
    service._renewed("r", inc, {"held": True}, "")
    assert failed == []
    service._renewed("r", inc, {"held": False}, "")
    assert failed == ["ABORTED: the state of r is no longer held: its lease expired"]
