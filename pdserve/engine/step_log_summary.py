"""What a step log says at a glance: `python -m pdserve.engine.step_log_summary steps.jsonl`.

The step log (`pdserve.engine.step_log`, `PDSERVE_STEP_LOG`) has a line a pass; a served benchmark
writes thousands. Reading where a first token's time went meant the same throwaway script every
session (docs/benchmarks.md, sessions 15-24), so this prints it:
  - decode-only steps: how many, and their wall time p50 / p90 / p99 / max;
  - prefill passes by their new tokens (up to 1K, 2K, 4K, 8K, more), alone or beside decode
    rows: how many, wall time p50 / max, checkpoints saved;
  - the prefix cache's traffic: hits by source, entries evicted and moved to the host tier, and
    the passes that ran right after a step that moved some (their copies share the compute stream);
  - a background pass's host time a step (`bg_ms`), where there was one, and its starts' and
    ends' (`bg_start_ms`, `bg_end_ms`); each pass from its start to its end: its wall time, the
    share of its steps that launched none of its layers (3 already queued: the GPU sets its
    pace; in the others the GPU may wait on the launches, `--background-launch-ms`), and the
    time from one pass's end to the next one's start;
  - the garbage collector's pauses (`gc_ms`, `gc_full`), where the log has them;
  - the longest steps that carried decode rows (the streams' largest gaps) and what held each;
  - the CUDA allocator's cudaMalloc / cudaFree calls and retries, where there were any.
`--start` / `--end` (seconds from the first line) keep one part of a run, e.g. one benchmark cell.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from collections.abc import Iterable

BUCKETS = (1024, 2048, 4096, 8192)  # upper bounds of the prefill pass classes, in new tokens
LONGEST = 8  # the longest steps with decode rows named, with what held them


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def bucket(tokens: int) -> str:
    return LABELS[_bucket_index(tokens)]


def _bucket_index(tokens: int) -> int:
    return next((i for i, upper in enumerate(BUCKETS) if tokens <= upper), len(BUCKETS))


LABELS = [f"<= {upper}" for upper in BUCKETS] + [f"> {BUCKETS[-1]}"]


def summarize(lines: Iterable[dict], start: float = 0.0, end: float = float("inf")) -> list[str]:
    """The summary of step-log lines between `start` and `end` seconds after the first one."""
    rows = list(lines)
    t0 = rows[0]["t"] if rows else 0.0
    rows = [r for r in rows if start <= r["t"] - t0 <= end]
    if not rows:
        return ["no steps"]
    out = [f"{len(rows)} steps over {rows[-1]['t'] + rows[-1]['s'] - rows[0]['t']:.1f} s"]
    decode = [1000 * r["s"] for r in rows if not r["tokens"]]
    if decode:
        q = [quantile(decode, p) for p in (0.5, 0.9, 0.99)]
        out.append(
            f"decode-only steps: {len(decode)}, ms p50 {q[0]:.1f} / p90 {q[1]:.1f} / p99 {q[2]:.1f} "
            f"/ max {max(decode):.1f}"
        )
    passes: defaultdict[tuple[int, bool], list[dict]] = defaultdict(list)
    for r in rows:
        if r["tokens"]:
            passes[(_bucket_index(r["tokens"]), r["decode"] > 0)].append(r)
    for (size, mixed), group in sorted(passes.items()):
        ms, beside = [1000 * r["s"] for r in group], " + decode" if mixed else " " * 9
        out.append(
            f"prefill {LABELS[size]:>7} tokens{beside}: {len(group):4d} passes, "
            f"ms p50 {quantile(ms, 0.5):.1f} / max {max(ms):.1f}, saves {sum(r['saves'] for r in group)}"
        )
    hits: Counter[str] = Counter()
    for r in rows:
        hits.update(r.get("hits", {}))
    evicted, to_host = sum(r.get("evicted", 0) for r in rows), sum(r.get("to_host", 0) for r in rows)
    if hits or evicted:
        after = [
            1000 * b["s"] for a, b in zip(rows, rows[1:], strict=False) if a.get("to_host") and b["tokens"]
        ]
        tail = (
            f"; passes right after a move: {len(after)}, ms p50 {quantile(after, 0.5):.1f}" if after else ""
        )
        out.append(f"prefix cache: hits {dict(hits)}, evicted {evicted}, to the host tier {to_host}{tail}")
    background = [r["bg_ms"] for r in rows if "bg_ms" in r]
    if background:
        line = (
            f"background pass: {len(background)} steps, host ms a step p50 {quantile(background, 0.5):.1f} "
            f"/ max {max(background):.1f}"
        )
        for part in ("start", "end"):  # each pass's, where the log has them
            ms = [r[f"bg_{part}_ms"] for r in rows if f"bg_{part}_ms" in r]
            if ms:
                line += f"; {len(ms)} {part}s, ms p50 {quantile(ms, 0.5):.1f} / max {max(ms):.1f}"
        out.append(line)
        out += background_passes(rows)
    paused = [r["gc_ms"] for r in rows if "gc_ms" in r]
    if paused:  # the collector's pauses: no token left the process meanwhile
        full = sum(r.get("gc_full", 0) for r in rows)
        out.append(
            f"garbage collection: {sum(paused):.0f} ms in {len(paused)} steps ({full} full), "
            f"most in one step {max(paused):.1f} ms"
        )
    out += longest_decode_gaps(rows)
    events = {k: sum(r.get(k, 0) for r in rows) for k in ("device_allocs", "device_frees", "alloc_retries")}
    if any(events.values()):  # host time that waited for the GPU in the allocator
        steps = sum(any(r.get(k) for k in events) for r in rows)
        out.append(
            f"CUDA allocator: {events['device_allocs']} cudaMalloc, {events['device_frees']} cudaFree, "
            f"{events['alloc_retries']} retries, in {steps} steps"
        )
    return out


def background_passes(rows: list[dict]) -> list[str]:
    """Each background pass from the step that started it to the one that saw it end: wall ms,
    the share of its steps that launched no layer, and the gaps between one's end and the next's start."""
    walls, idle_steps, steps, gaps = [], 0, 0, []
    begun: int | None = None
    ended: float | None = None
    for i, r in enumerate(rows):
        if "bg_start_ms" in r and begun is None:
            begun = i
            if ended is not None:
                gaps.append(1000 * (r["t"] - ended))
        if "bg_end_ms" in r and begun is not None and i > begun:
            walls.append(1000 * (r["t"] - rows[begun]["t"]))
            span = rows[begun + 1 : i]  # the steps between: the pass's layers launched in them
            steps += len(span)
            idle_steps += sum(not x.get("bg_layers") for x in span)
            begun, ended = None, r["t"]
    if not walls:
        return []
    line = (
        f"background passes: {len(walls)}, ms p50 {quantile(walls, 0.5):.0f} / max {max(walls):.0f}; "
        f"{idle_steps / max(1, steps):.0%} of their steps launched no layer"
    )
    if gaps:
        line += f"; from one's end to the next's start ms p50 {quantile(gaps, 0.5):.1f}"
    return [line]


def longest_decode_gaps(rows: list[dict], count: int = LONGEST) -> list[str]:
    """The `count` longest steps that carried decode rows (each a gap in every stream), with what
    held them: the host launching a background pass's layers (most of the step), a prompt chunk
    in the step, or neither (the decode step itself, or a stall the log does not name)."""
    steps = sorted((r for r in rows if r["decode"]), key=lambda r: -r["s"])[:count]
    if not steps:
        return []
    parts = []
    for r in steps:
        ms = 1000 * r["s"]
        if r.get("gc_ms", 0.0) > ms / 2:
            why = f"garbage collection {r['gc_ms']:.0f} ms"
        elif r.get("bg_ms", 0.0) > ms / 2:
            why = f"background host {r['bg_ms']:.0f} ms ({r.get('bg_layers', 0)} layers)"
        elif r["tokens"]:
            why = f"{r['tokens']} prompt tokens"
        else:
            why = "decode"
        parts.append(f"{ms:.0f} ({why}, {r['decode']} rows)")
    return [f"longest steps with decode rows, ms: {'; '.join(parts)}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a step log (JSON lines)")
    parser.add_argument("--start", type=float, default=0.0, help="seconds from its first line")
    parser.add_argument("--end", type=float, default=float("inf"), help="seconds from its first line")
    args = parser.parse_args()
    with open(args.path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    print("\n".join(summarize(lines, args.start, args.end)))


if __name__ == "__main__":
    main()
