"""Running one step ahead (pdserve.engine.run_ahead) changes when the host sees tokens, never
which tokens: the same requests give the same tokens, logprobs and finish reasons with it and
without it, through every way a sequence ends (EOS, stop string, stop token, length), aborts
while a step is in flight, preemption and prompts admitted beside running decodes."""

from __future__ import annotations

import random

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.run_ahead import PENDING
from pdserve.sampling.params import SamplingParams
from tests.helpers import assert_no_leaks


def _requests(vocab: int, n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
        kind = i % 5
        params = SamplingParams(
            temperature=0.0 if kind in (0, 3) else 0.9,
            seed=None if kind in (0, 3) else 100 + i,
            max_tokens=rng.randrange(1, 24),
            logprobs=2 if kind == 1 else None,
            presence_penalty=0.5 if i == 2 else 0.0,  # penalties: its steps do not run ahead
            stop_token_ids=list(range(0, vocab, 5)) if kind == 4 else None,  # stops within a few
        )
        out.append((prompt, params))
    return out


def _run(config: EngineConfig, requests, run_ahead: bool, abort_at: dict[int, str] | None = None):
    engine = LLMEngine(config)
    engine.run_ahead = run_ahead
    finished, ran_ahead, step = {}, 0, 0
    pending = list(enumerate(requests))
    while pending or engine.has_unfinished():
        for _ in range(min(len(pending), 3)):  # a few arrive every step: prefills join decodes
            i, (prompt, params) = pending.pop(0)
            engine.add_request(prompt, params, f"r{i}")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (list(out.token_ids), out.finish_reason, out.logprobs)
        ran_ahead += engine._ahead is not None
        step += 1
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
    assert_no_leaks(engine)
    for token_ids, _, _ in finished.values():
        assert PENDING not in token_ids
    return finished, ran_ahead


def _assert_same(ahead: dict, plain: dict) -> None:
    """Equal tokens and finish reasons; logprobs equal up to float rounding (a sequence ended by
    a step is computed once more by the step that ran ahead: the packing differs there)."""
    assert ahead.keys() == plain.keys()
    for rid, (tokens, reason, logprobs) in ahead.items():
        assert (tokens, reason) == plain[rid][:2], rid
        for got, want in zip(logprobs or [], plain[rid][2] or [], strict=True):
            assert (
                got["token_id"] == want["token_id"]
                and got["top_logprobs"].keys() == want["top_logprobs"].keys()
            )
            assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)


@pytest.mark.parametrize("num_kv_pages", [None, 6])  # 6 pages of 16 tokens: preemption
def test_same_outputs_with_and_without_running_ahead(tiny_model_dir, num_kv_pages) -> None:
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_model_len=96,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        num_kv_pages=num_kv_pages,
    )
    requests = _requests(config.model_config.vocab_size, 14, seed=num_kv_pages or 0)
    ahead, steps_ahead = _run(config, requests, run_ahead=True)
    plain, steps_plain = _run(config, requests, run_ahead=False)
    assert steps_plain == 0 and steps_ahead > 10  # it did run ahead, and only when asked
    _assert_same(ahead, plain)
    assert {reason for _, reason, _ in ahead.values()} >= {"length", "stop"}


def test_abort_while_a_step_is_in_flight(tiny_model_dir) -> None:
    config = EngineConfig(
        model=str(tiny_model_dir), max_model_len=96, max_num_seqs=6, max_num_batched_tokens=64
    )
    requests = [
        ([5 + i, 9, 11, 13], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        for i in range(4)
    ]
    ahead, _ = _run(config, requests, run_ahead=True, abort_at={4: "r1", 7: "r2"})
    plain, _ = _run(config, requests, run_ahead=False)
    assert set(ahead) == {"r0", "r3"}  # aborted requests end without a finished output
    _assert_same(ahead, {k: v for k, v in plain.items() if k in ahead})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_same_batches_same_outputs(tiny_model_dir, device: str) -> None:
    """On CUDA the step in flight really overlaps (pinned copies, an event per step, decode
    graphs): tokens equal those of finishing each step before the next. Every request arrives
    at once and runs to the same length, so both runs pack the same batches (a GPU kernel's
    rounding depends on the batch size, and a sequence that ends is computed once more when
    running ahead: that would change the batches, not the method)."""
    config = EngineConfig(
        model=str(tiny_model_dir), device=device, dtype="float32", max_model_len=96, max_num_seqs=8,
        max_num_batched_tokens=256, num_kv_pages=64,
    )  # fmt: skip
    vocab, rng = config.model_config.vocab_size, random.Random(3)
    params = [
        SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=24, ignore_eos=True, logprobs=1)
        for i in range(8)
    ]
    requests = [([rng.randrange(vocab) for _ in range(5 + 7 * i)], p) for i, p in enumerate(params)]
    engines = {}
    for run_ahead in (True, False):
        engine = engines[run_ahead] = LLMEngine(config)
        engine.run_ahead = run_ahead
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(prompt, params, f"r{i}")
    done, ahead_steps = {True: {}, False: {}}, 0
    for run_ahead, engine in engines.items():
        while engine.has_unfinished():
            done[run_ahead].update({o.request_id: o for o in engine.step() if o.finished})
            ahead_steps += engine._ahead is not None
        assert_no_leaks(engine)
    assert ahead_steps > 20
    for rid, want in done[False].items():
        got = done[True][rid]
        assert got.token_ids == want.token_ids, (rid, got.token_ids, want.token_ids)
        logprobs = [e["logprob"] for e in got.logprobs]
        assert logprobs == pytest.approx([e["logprob"] for e in want.logprobs], abs=1e-4)
