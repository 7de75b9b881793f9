"""Profile one graph-replayed decode step at the full Qwen3.6-35B-A3B shape (random bf16 weights):
`python -m pdserve.ops.bench_step --concurrency 4 32 [--save-logits DIR] [--trace DIR] [--tag NAME]
[--route-align-up-to N] [--gdn-fused-max-batch N] [--skinny-up-to N] [--skinny-splits S]
[--variants NAME:route=N,gdn=N,gsplit=N,gwarps=N,skinny=N,splits=S,router=N ... [--rounds R]]` (the
switches set the decode kernels' paths for the run, gsplit and gwarps the fused GDN mixer's program
shape, `pdserve.ops.bench_switches`; each variant, on the same weights and inputs, captures its
graphs again with its switches and has its logits compared with the first variant's; with --rounds
the variants are timed again in interleaved rounds, which a 1-2% difference needs).

For each batch size `c`: `c` sequences of `--context` tokens (random K/V and GDN states), one decode
token each, replayed from a CUDA graph. Prints the wall time per step (host input copies + replay),
the GPU time per step (CUDA events around back-to-back replays), and torch.profiler's kernel table
(kernels per step, time per step by kernel). Uses only the engine's stable pieces (ModelRunner,
DecodeGraphs, ForwardBatch), so the same file profiles an older checkout for a before/after.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench import QWEN36_35B_A3B
from pdserve.config import EngineConfig
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.forward_batch import ForwardBatch
from pdserve.ops.bench_switches import (
    VARIANT_KEYS,
    apply_variant,
    compare_logits,
    current_switches,
    interleaved_times,
    parse_variant,
    set_skinny,
    set_switches,
)

FLOOR_MS = {4: 2.8, 16: 7.4, 32: 11.6}  # the bandwidth floor of a step (shared/design.md)


def decode_batch(runner: ModelRunner, concurrency: int, context: int) -> ForwardBatch:
    kv, states, page = runner.kv_pool, runner.state_pool, runner.config.page_size
    gen = torch.Generator().manual_seed(concurrency)
    tokens = torch.randint(0, 200_000, (concurrency,), generator=gen).tolist()
    tables = [kv.allocate(kv.pages_for(context + 1)) for _ in range(concurrency)]
    slots = [states.allocate() for _ in range(concurrency)]
    inputs = [[t] for t in tokens]
    return ForwardBatch.build(inputs, [context] * concurrency, tables, slots, page, runner.device)


def kernel_table(prof: torch.profiler.profile, steps: int) -> tuple[float, float, list]:
    """(kernel ms per step, launches per step, [(kernel, us per step, launches per step)] by time)."""
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if device_us > 0 and e.count > 0:
            rows.append((e.key, device_us / steps, e.count / steps))
    rows.sort(key=lambda r: -r[1])
    return sum(r[1] for r in rows) / 1e3, sum(r[2] for r in rows), rows


def profile(
    graphs: DecodeGraphs,
    batch: ForwardBatch,
    concurrency: int,
    context: int,
    tag: str,
    trace: Path | None = None,
) -> dict:
    for _ in range(3):
        graphs.replay(batch)
    torch.cuda.synchronize()
    steps = 20
    start = time.perf_counter()
    for _ in range(steps):
        graphs.replay(batch)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    graph = graphs.graphs[concurrency]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    gpu_ms = begin.elapsed_time(end) / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    kernel_ms, kernels, rows = kernel_table(prof, 10)
    if trace is not None:  # every kernel of the ten steps in launch order (chrome://tracing, Perfetto)
        prof.export_chrome_trace(str(trace / f"step-{tag}-c{concurrency}.json"))
    floor = FLOOR_MS.get(concurrency)
    print(f"\n[{tag}] c={concurrency}: wall {wall_ms:.2f} ms/step, GPU {gpu_ms:.2f} ms/step "
          f"(kernels {kernel_ms:.2f} ms, {kernels:.0f} launches), floor {floor} ms")  # fmt: skip
    for name, per_step_us, count in rows[:14]:
        print(f"  {per_step_us / 1e3:7.3f} ms  {count:5.0f}x  {name[:90]}")
    return {"tag": tag, "concurrency": concurrency, "context": context, "wall_ms": wall_ms,
            "gpu_ms": gpu_ms, "kernel_ms": kernel_ms, "kernels": kernels, "floor_ms": floor,
            "kernels_by_time": [(n[:120], t, c) for n, t, c in rows]}  # fmt: skip


def append_json_lines(path: Path | None, rows: list[dict]) -> None:
    """Each result as a JSON line at the end of `path` (none: nothing written)."""
    if path is not None:
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def run_variants(runner: ModelRunner, variants: list, base: dict[str, int], args: argparse.Namespace,
                 start: float) -> list[dict]:  # fmt: skip
    """Each variant's graphs captured with its switches, profiled at every concurrency from the
    same GDN states; the logits compared with the first variant's; with --rounds R (> 1) the
    variants' graphs kept and timed again in R interleaved rounds. The results, in order."""
    max_c, results, logits, kept = max(args.concurrency), [], {}, {}
    batches = {c: decode_batch(runner, c, args.context) for c in args.concurrency}
    recurrent, conv = runner.state_pool.recurrent.clone(), runner.state_pool.conv.clone()
    for tag, values in variants:
        apply_variant(base, values)
        graphs = DecodeGraphs(runner.model, runner.kv_pool, runner.state_pool, max_c,
                              runner.kv_pool.pages_for(runner.config.max_model_len))  # fmt: skip
        graphs.sizes = sorted(args.concurrency)
        graphs.capture()
        print(f"[{tag}] model, pools and {len(graphs.sizes)} graphs ready in "
              f"{time.perf_counter() - start:.0f} s")  # fmt: skip
        for c in args.concurrency:
            runner.state_pool.recurrent.copy_(recurrent)  # every variant starts from the same states
            runner.state_pool.conv.copy_(conv)
            logits[tag, c] = graphs.replay(batches[c]).float().cpu()
            if args.save_logits is not None:
                torch.save(logits[tag, c], args.save_logits / f"logits_{tag}_c{c}.pt")
            results.append(profile(graphs, batches[c], c, args.context, tag, args.trace))
        if args.rounds > 1:
            kept[tag] = graphs
        del graphs
        torch.cuda.empty_cache()
    compare_logits(logits, [t for t, _ in variants], args.concurrency)
    if kept:
        results += interleaved_times(kept, sorted(args.concurrency), args.rounds)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--context", type=int, default=1100)
    parser.add_argument("--tag", default="pdserve")
    parser.add_argument("--save-logits", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="append the results as JSON lines here")
    parser.add_argument("--trace", type=Path, default=None, help="a folder for each step's kernel trace")
    parser.add_argument(
        "--route-align-up-to",
        type=int,
        default=None,
        help="cuda_moe.ROUTE_ALIGN_UP_TO for this run (0: off, 32: every decode step)",
    )
    parser.add_argument(
        "--gdn-fused-max-batch",
        type=int,
        default=None,
        help="gdn_decode.FUSED_MAX_BATCH for this run (0: the four unfused ops)",
    )
    parser.add_argument(
        "--skinny-up-to",
        type=int,
        default=None,
        help="linear.SKINNY_UP_TO for this run (0: cuBLAS; 32: Triton split-K at c <= 32)",
    )
    parser.add_argument("--skinny-splits", type=int, default=None, help="linear.SKINNY_SPLITS, this run")
    parser.add_argument(
        "--variants", nargs="+", default=[], help="NAME:" + ",".join(f"{key}=N" for key in VARIANT_KEYS)
    )
    parser.add_argument("--rounds", type=int, default=1, help="> 1: the variants timed again, interleaved")
    args = parser.parse_args()
    set_switches(args.route_align_up_to, args.gdn_fused_max_batch)
    set_skinny(args.skinny_up_to, args.skinny_splits)
    base = current_switches()
    max_c = max(args.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(QWEN36_35B_A3B))
        start = time.perf_counter()
        num_seqs = sum(args.concurrency) + len(args.variants) + 1  # + each capture's padding row
        config = EngineConfig(model=tmp, device="cuda", load_format="dummy", max_num_seqs=max_c,
                              max_model_len=args.context + 64, enforce_eager=True, num_state_slots=num_seqs,
                              num_kv_pages=num_seqs * (args.context // 16 + 8))  # fmt: skip
        runner = ModelRunner(config)
        gen = torch.Generator(device="cuda").manual_seed(1)
        runner.kv_pool.kv.normal_(0.0, 1.0, generator=gen)  # never time on zeros
        runner.state_pool.recurrent.normal_(0.0, 0.05, generator=gen)
        runner.state_pool.conv.normal_(0.0, 1.0, generator=gen)
        variants = [parse_variant(v) for v in args.variants] or [(args.tag, {})]
        results = run_variants(runner, variants, base, args, start)
    append_json_lines(args.out, results)


if __name__ == "__main__":
    main()
