"""`python -m pdserve.engine.step_log_summary`: a step log's decode steps, prefill passes by size,
cache traffic, background host time and the longest steps with decode rows, from a log written
here line by line."""

from __future__ import annotations

import json
import subprocess
import sys

from pdserve.engine.step_log_summary import bucket, summarize


def _line(t: float, ms: float, decode: int = 0, tokens: int = 0, **extra: object) -> dict:
    chunks = 1 if tokens else 0
    return {"t": t, "s": ms / 1000, "decode": decode, "chunks": chunks, "tokens": tokens, "saves": 0,
            "running": decode + chunks, "waiting": 0, **extra}  # fmt: skip


def test_buckets_are_upper_bounds() -> None:
    assert [bucket(n) for n in (1, 1024, 1025, 8192, 8193)] == [
        "<= 1024",
        "<= 1024",
        "<= 2048",
        "<= 8192",
        "> 8192",
    ]


def test_a_log_is_summarized_by_kind_of_step(tmp_path) -> None:
    lines = [_line(0.01 * i, 10.0 + i, decode=4) for i in range(10)]  # decode steps of 10-19 ms
    lines += [
        _line(1.0, 40.0, tokens=800, hits={"gpu": 3}),
        _line(1.1, 20.0, decode=4, evicted=5, to_host=2),
        _line(1.2, 150.0, decode=4, tokens=7000, saves=30, hits={"gpu": 28, "host": 2}),
        _line(1.4, 9.0, decode=4, bg_ms=6.5, gc_ms=1.5),
        _line(
            1.5, 30.0, decode=4, bg_ms=20.0, bg_start_ms=18.0, bg_layers=1, device_allocs=2, device_frees=1
        ),
    ]
    summary = summarize(lines)
    assert summary[0] == "15 steps over 1.5 s"
    assert summary[1].startswith("decode-only steps: 13, ms p50 15.0") and "max 30.0" in summary[1]
    assert "prefill <= 1024 tokens         :    1 passes, ms p50 40.0" in summary[2]
    assert "prefill <= 8192 tokens + decode:    1 passes, ms p50 150.0 / max 150.0, saves 30" in summary[3]
    assert "hits {'gpu': 31, 'host': 2}, evicted 5, to the host tier 2" in summary[4]
    assert "passes right after a move: 1, ms p50 150.0" in summary[4]
    assert summary[5] == (
        "background pass: 2 steps, host ms a step p50 20.0 / max 20.0; 1 starts, ms p50 18.0 / max 18.0"
    )
    assert summary[6] == "garbage collection: 2 ms in 1 steps (0 full), most in one step 1.5 ms"
    summary.pop(6)
    assert summary[6].startswith(  # the streams' largest gaps, each with what held it
        "longest steps with decode rows, ms: 150 (7000 prompt tokens, 4 rows); "
        "30 (background host 20 ms (1 layers), 4 rows); 20 (decode, 4 rows); 19 (decode, 4 rows); "
    )
    assert summary[6].count("rows)") == 8
    assert summary[7] == "CUDA allocator: 2 cudaMalloc, 1 cudaFree, 0 retries, in 1 steps"
    assert len(summarize(lines[:-1])) == 8  # no allocator line where the log has no events
    # --start / --end keep a window, in seconds from the first line
    assert summarize(lines, start=1.15)[0] == "3 steps over 0.3 s"
    assert summarize(lines, start=5) == ["no steps"]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.engine.step_log_summary", str(path), "--end", "0.5"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert run.stdout.splitlines()[0] == "10 steps over 0.1 s"


def test_background_passes_are_timed_from_start_to_end() -> None:
    """Two passes: the first started at 0.0 s and seen ended at 0.1 s (100 ms), its 3 steps between
    launching layers in 2 (one found 3 queued); the second started 12 ms after that end, ended
    188 ms later, with no step between."""
    lines = [
        _line(0.00, 10.0, decode=4, bg_ms=3.0, bg_start_ms=2.0, bg_layers=1),
        _line(0.02, 10.0, decode=4, bg_ms=5.0, bg_layers=2),
        _line(0.04, 10.0, decode=4, bg_ms=0.0),
        _line(0.06, 10.0, decode=4, bg_ms=5.0, bg_layers=2),
        _line(0.10, 10.0, decode=4, bg_ms=1.0, bg_end_ms=1.0),
        _line(0.112, 10.0, decode=4, bg_ms=3.0, bg_start_ms=2.0, bg_layers=1),
        _line(0.30, 10.0, decode=4, bg_ms=1.0, bg_end_ms=1.0),
    ]
    found = [line for line in summarize(lines) if line.startswith("background passes")]
    assert found == [
        "background passes: 2, ms p50 188 / max 188; 33% of their steps launched no layer; "
        "from one's end to the next's start ms p50 12.0"
    ]
