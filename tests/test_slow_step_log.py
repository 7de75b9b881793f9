"""A slow engine step is logged with the shape of the pass it ran (to find what compiled under
traffic); a fast one is not."""

from __future__ import annotations

import gc
import json
import logging
import threading
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine import engine_thread, step_log
from pdserve.engine.engine_thread import EngineThread
from tests.helpers import random_prompts


def test_slow_step_warning_names_the_pass(
    plain_llm: LLM, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = plain_llm.engine
    thread = EngineThread(engine, on_outputs=lambda outputs: None, on_error=lambda ids, why: None)
    (prompt,) = random_prompts((37,), seed=51)
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    caplog.set_level(logging.WARNING, logger=engine_thread.__name__)
    thread._safe_step()  # well under a second on the tiny model
    assert "engine step took" not in caplog.text
    monkeypatch.setattr(engine_thread, "SLOW_STEP_S", 0.0)
    while engine.has_unfinished():
        thread._safe_step()
    assert "engine step took" in caplog.text and "1 decoding, 0 prefill chunks" in caplog.text
    caplog.clear()
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        thread._safe_step()
    assert "0 decoding, 1 prefill chunks of 37 tokens (longest 37)" in caplog.text


def test_step_log_has_a_line_per_pass(plain_llm: LLM, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """PDSERVE_STEP_LOG: one JSON line for each step that launched a pass, with its shape."""
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_log.ENV, str(path))
    engine = plain_llm.engine
    thread = EngineThread(engine, on_outputs=lambda outputs: None, on_error=lambda ids, why: None)
    prompts = random_prompts((37, 20), seed=52)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        thread._safe_step()
        steps += 1
    thread.step_log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert 2 <= len(lines) <= steps
    assert (lines[0]["decode"], lines[0]["chunks"], lines[0]["tokens"]) == (0, 2, 57)
    assert all(line["decode"] == 2 and line["chunks"] == 0 for line in lines[1:])
    assert all(line["s"] >= 0 and line["t"] > 0 for line in lines)
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)


def test_step_log_counts_prefix_hits_by_source(
    cached_llm: LLM, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """With the prefix cache, the line of the pass that reused a cached prefix says so (`hits` by
    source since the line before); the lines of passes that reused nothing have no `hits`."""
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_log.ENV, str(path))
    engine = cached_llm.engine
    thread = EngineThread(engine, on_outputs=lambda outputs: None, on_error=lambda ids, why: None)
    (prompt,) = random_prompts((300,), seed=54)
    for follow_up in ([], [7] * 20):  # the second prompt begins with the first, whose end is cached
        engine.add_request(prompt + follow_up, SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            thread._safe_step()
    thread.step_log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    passes = [line for line in lines if line["chunks"]]
    assert len(passes) == 2 and "hits" not in passes[0] and passes[1]["hits"] == {"gpu": 1}
    assert sum("hits" in line for line in lines) == 1


def test_a_step_held_past_the_limit_is_reported_stuck(
    plain_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`EngineThread.stuck`: the reason a service stops its heartbeat while its engine thread is
    held in one step (the event loop still runs); None again once the step returns."""
    engine = plain_llm.engine
    release, real_step = threading.Event(), engine.step

    def held_step() -> list:
        release.wait(10)
        return real_step()

    monkeypatch.setattr(engine, "step", held_step)
    thread = EngineThread(engine, on_outputs=lambda outputs: None, on_error=lambda ids, why: None)
    (prompt,) = random_prompts((9,), seed=53)
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    thread.start()
    try:
        time.sleep(0.4)
        reason = thread.stuck(0.2)
        assert reason is not None and "in one turn" in reason
        assert thread.stuck(0) is None  # 0: never judged
        release.set()
        deadline = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # back to waiting for work
        assert not engine.has_unfinished() and thread.stuck(0.2) is None
    finally:
        release.set()
        thread.stop()


def test_step_log_gives_the_background_pass_host_time(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A step beside a background pass logs `bg_ms`, the host time it spent on the pass, and its
    parts: each pass's start and end once (`bg_start_ms`, `bg_end_ms`), the layers launched
    (`bg_layers`); the steps before the long prompt's chunks reach the threshold log none."""
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_log.ENV, str(path))
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=128, background_prefill_tokens=200)
    engine = llm.engine
    thread = EngineThread(engine, on_outputs=lambda outputs: None, on_error=lambda ids, why: None)
    short, long_prompt = random_prompts((12, 480), seed=53, vocab=1000)
    engine.add_request(short, SamplingParams(max_tokens=30, ignore_eos=True))
    thread._safe_step()
    engine.add_request(long_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        thread._safe_step()
    thread.step_log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert "bg_ms" not in lines[0] and any(line.get("bg_ms", 0) > 0 for line in lines)
    starts, ends = (sum(part in line for line in lines) for part in ("bg_start_ms", "bg_end_ms"))
    assert starts == ends >= 2, (starts, ends)  # each of the chunks past 200 tokens: a pass of its own
    for line in lines:
        parts = line.get("bg_start_ms", 0) + line.get("bg_end_ms", 0)
        assert parts <= line.get("bg_ms", 0) + 1e-3, line
    assert all(line.get("bg_layers", 0) > 0 for line in lines if "bg_start_ms" in line)


def test_step_log_gives_the_allocator_events_of_each_step(plain_llm: LLM, tmp_path) -> None:
    """Each line carries the CUDA allocator's events since the line before (cudaMalloc / cudaFree
    calls, retries, syncs: host time that waits for the GPU), those that did not happen left out;
    on a CPU there are none (`allocator_events` is {} where CUDA is not in use)."""
    counts = {"device_allocs": 3, "device_frees": 0, "alloc_retries": 0, "allocator_syncs": 0}

    def fake_allocator() -> dict[str, int]:  # cudaMalloc twice a call, cudaFree once every other
        counts["device_allocs"] += 2
        counts["device_frees"] += counts["device_allocs"] % 4 == 1
        return dict(counts)

    log = step_log.StepLog(str(tmp_path / "steps.jsonl"), allocator=fake_allocator)
    seen_at_start = dict(counts)  # what the log read when it opened
    engine = plain_llm.engine
    engine.add_request(random_prompts((21,), seed=55)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        log.record(started, time.perf_counter() - started, engine.last_pass, engine.scheduler)
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert lines and all(line["device_allocs"] == 2 for line in lines)
    assert "alloc_retries" not in lines[0] and "allocator_syncs" not in lines[0]
    assert (
        sum(line.get("device_frees", 0) for line in lines)
        == counts["device_frees"] - seen_at_start["device_frees"]
    )
    assert any("device_frees" not in line for line in lines)
    assert step_log.allocator_events() == {}  # this CPU machine: no CUDA


def test_step_log_gives_the_collectors_pauses_since_the_line_before(plain_llm: LLM, tmp_path) -> None:
    """`gc_ms` (every generation's pauses) and `gc_full` (full collections) since the line
    before, left out where there were none: here one full collection forced after the first step
    (the automatic ones off meanwhile)."""
    from pdserve.heap import GcPauses

    pauses = GcPauses()
    log = step_log.StepLog(str(tmp_path / "steps.jsonl"), gc_pauses=pauses)
    engine = plain_llm.engine
    engine.add_request(random_prompts((21,), seed=56)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    gc.callbacks.append(pauses)
    gc.disable()
    try:
        steps = 0
        while engine.has_unfinished():
            if steps == 1:
                gc.collect()
            started = time.perf_counter()
            engine.step()
            log.record(started, time.perf_counter() - started, engine.last_pass, engine.scheduler)
            steps += 1
    finally:
        gc.enable()
        gc.callbacks.remove(pauses)
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(lines) >= 2 and "gc_ms" not in lines[0] and "gc_full" not in lines[0]
    assert [line.get("gc_full", 0) for line in lines[1:]].count(1) == 1
    assert sum(line.get("gc_full", 0) for line in lines) == 1
    assert all(line["gc_ms"] > 0 for line in lines if "gc_full" in line)
