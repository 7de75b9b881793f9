"""Profile one eager prefill pass at the full Qwen3.6-35B-A3B shape (random bf16 weights):
`python -m pdserve.ops.bench_prefill_step 1x1024 4x1024 8x1024 1x8192`.

Each argument `PxL[@S][+C][~D]` is a pass of `P` prompts of `L` new tokens, each saving a
checkpoint after `S` of them (a chat prompt's resume point) and each after `C` tokens of cached
context (the KV pages it attends to hold whatever the pool held), with `D` decoding sequences
(one token after DECODE_CONTEXT) beside them: a chat turn's pass is `30x271@267+2200`, so
`30x271 30x271@267 30x271+2200 30x271@267+2200` beside `4x2048` part its cost, and a c=32
wave's second pass `8x1024~7` against `8x1024` what its decode rows cost. After two
untimed runs (Triton compiles and autotunes there), prints the wall time of the pass (to its
logits on the host), the GPU kernel time inside it, the host-device syncs it makes, and
torch.profiler's kernels by time: the pass's wall minus its kernel time is what the GPU waited
for the host.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.bench import QWEN36_35B_A3B
from pdserve.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.prefill_graphs import MAX_TOKENS, PrefillGraphs, graphable, shape_for
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.mid_pass_saves import MidPassSaves
from pdserve.ops.bench_step import append_json_lines

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
DECODE_CONTEXT = 1100  # tokens before a decoding sequence's new one (a 1K-token cell's)


@dataclass(frozen=True)
class PassSpec:
    """`PxL[@S][+C][~D]`: P prompts of L new tokens, saving after S, after C cached tokens each,
    beside D decoding sequences."""

    prompts: int
    length: int
    save_at: int = 0  # 0: no checkpoint inside the pass
    context: int = 0
    decoding: int = 0

    @staticmethod
    def parse(text: str) -> PassSpec:
        text, _, decoding = text.partition("~")
        size, _, context = text.partition("+")
        size, _, save = size.partition("@")
        prompts, length = (int(x) for x in size.split("x"))
        spec = PassSpec(prompts, length, int(save or 0), int(context or 0), int(decoding or 0))
        if (
            not 0 <= spec.save_at < spec.length
            or min(prompts, length) < 1
            or min(spec.context, spec.decoding) < 0
        ):
            raise ValueError(f"{text}: want PxL[@S][+C][~D] with P, L >= 1, 0 < S < L, C, D >= 0")
        return spec

    @property
    def seqs(self) -> int:
        return self.prompts + self.decoding

    @property
    def tokens(self) -> int:
        return self.prompts * self.length + self.decoding

    def __str__(self) -> str:
        save = f", saving after {self.save_at}" if self.save_at else ""
        decoding = f" + {self.decoding} decoding" if self.decoding else ""
        cached = f", after {self.context} cached" if self.context else ""
        return f"{self.prompts} x {self.length}{save}{cached}{decoding}"


def prefill_batch(runner: ModelRunner, spec: PassSpec) -> tuple[ForwardBatch, list, list]:
    """A pass as `spec` says, and the KV pages and state slots (checkpoints too) it holds."""
    kv, states = runner.kv_pool, runner.state_pool
    prompts, length, context, decoding = spec.prompts, spec.length, spec.context, spec.decoding
    gen = torch.Generator().manual_seed(prompts * length)
    ids = torch.randint(0, 200_000, (prompts, length), generator=gen).tolist()
    ids += torch.randint(0, 200_000, (decoding, 1), generator=gen).tolist()
    starts = [context] * prompts + [DECODE_CONTEXT] * decoding
    tables = [kv.allocate(kv.pages_for(start + len(row))) for start, row in zip(starts, ids, strict=True)]
    slots = [states.allocate() for _ in range(spec.seqs)]
    checkpoints = [states.allocate() for _ in range(prompts)] if spec.save_at else []
    batch = ForwardBatch.build(ids, starts, tables, slots, runner.config.page_size, runner.device)
    saves = [[(spec.save_at, ck)] for ck in checkpoints] or [[]] * prompts
    history = runner.config.model_config.linear_conv_kernel_dim - 1  # the engine's scan plan
    lengths = [length] * prompts + [1] * decoding
    batch.saves = MidPassSaves.build(lengths, slots, saves + [[]] * decoding, history, runner.device)
    return batch, tables, slots + checkpoints


def sync_sites(runner: ModelRunner, batch: ForwardBatch) -> collections.Counter:
    """Where a pass makes the host wait for the device: torch's sync debug mode warns at every
    synchronizing call; the innermost frames outside torch name the caller."""
    sites: collections.Counter = collections.Counter()

    def record(*args: object, **kwargs: object) -> None:
        ours = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
        names = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in ours[-3:]]
        sites[" <- ".join(reversed(names))] += 1

    torch_mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on the way out
            warnings.simplefilter("always")
            warnings.showwarning = record
            run_pass(runner, batch)
    finally:
        torch.cuda.set_sync_debug_mode(torch_mode)
    return sites


def host_profile(runner: ModelRunner, batch: ForwardBatch, top: int = 22) -> str:
    """cProfile of one pass: where the host spends its time launching it (the GPU idles whenever
    the host is slower than the kernels it launches)."""
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    run_pass(runner, batch)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def run_pass(runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    graphs = runner.prefill_graphs
    hidden = graphs.run(batch) if graphs is not None and graphable(batch) else runner.model(batch)
    return runner.model.compute_logits(hidden[batch.logits_indices]).float().cpu()


def profile(runner: ModelRunner, spec: PassSpec, show_host: bool = False) -> dict:
    batch, tables, slots = prefill_batch(runner, spec)
    prompts, length = spec.prompts, spec.length
    for _ in range(2):
        run_pass(runner, batch)
    torch.cuda.synchronize()
    runs = 3
    start = time.perf_counter()
    for _ in range(runs):
        run_pass(runner, batch)
    wall_ms = (time.perf_counter() - start) / runs * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run_pass(runner, batch)
    kernels, syncs, launches = [], {}, 0
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if e.key.startswith(SYNC_OPS):
            syncs[e.key] = (e.count, e.cpu_time_total / 1e3)
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"):
            launches += e.count
        # device events only: a CPU op's self device time would count its kernels twice
        if device_us > 0 and e.device_type != torch.autograd.DeviceType.CPU:
            kernels.append((e.key, device_us / 1e3, e.count))
    kernels.sort(key=lambda r: -r[1])
    kernel_ms = sum(k[1] for k in kernels)
    tokens = spec.tokens
    rate = tokens / wall_ms * 1e3
    pieces = len(batch.saves.pieces) if batch.saves else "chunked"
    print(
        f"\n{spec} ({tokens} tokens, {pieces} scan pieces): wall {wall_ms:.1f} ms ({rate:,.0f} tok/s), "
        f"GPU kernels {kernel_ms:.1f} ms ({kernel_ms / wall_ms:.0%} busy), {launches} launches"
    )
    for key, (count, ms) in sorted(syncs.items()):
        print(f"  host sync {key}: {count}x, {ms:.1f} ms")
    for site, count in sync_sites(runner, batch).most_common(8):
        print(f"  {count:4d}x sync at {site}")
    if show_host:
        print(host_profile(runner, batch))
    for name, ms, count in kernels[:18]:
        print(f"  {ms:8.2f} ms {count:5d}x  {name[:96]}")
    for table in tables:
        runner.kv_pool.free(table)
    for slot in slots:
        runner.state_pool.free(slot)
    top = [(n[:120], t, c) for n, t, c in kernels[:30]]
    return {"prompts": prompts, "length": length, "save_at": spec.save_at, "context": spec.context,
            "decoding": spec.decoding,
            "wall_ms": wall_ms, "kernel_ms": kernel_ms,
            "launches": launches, "syncs": syncs, "top": top}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("passes", nargs="+", help="PxL[@S][+C]: P prompts of L tokens in one pass")
    parser.add_argument("--host", action="store_true", help="also cProfile the host side of each pass")
    parser.add_argument("--align-chunk", type=int, default=None, help="pairs a program aligns (prefill)")
    parser.add_argument("--out", type=Path, default=None, help="append the results as JSON lines here")
    parser.add_argument("--graphs", action="store_true", help="replay graphable passes from prefill graphs")
    args = parser.parse_args()
    specs = [PassSpec.parse(p) for p in args.passes]

    if args.align_chunk is not None:
        from pdserve.ops import cuda_route

        cuda_route.ALIGN_CHUNK = args.align_chunk
    longest = max(max(spec.context + spec.length, DECODE_CONTEXT + 1) for spec in specs)
    most = max(spec.seqs for spec in specs)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(QWEN36_35B_A3B))
        start = time.perf_counter()
        config = EngineConfig(model=tmp, device="cuda", load_format="dummy", max_num_seqs=most,
                              max_model_len=longest + 64, enforce_eager=True, num_state_slots=2 * most + 2,
                              num_kv_pages=most * (longest // 16 + 8) + 1,
                              max_num_batched_tokens=max(spec.tokens for spec in specs))  # fmt: skip
        runner = ModelRunner(config)
        if args.graphs:  # graphs of these passes' shapes only (the engine captures every shape)
            kv, states = runner.kv_pool, runner.state_pool
            graphs = PrefillGraphs(runner.model, kv.allocate(1)[0], states.allocate(), config.page_size,
                                   kv.pages_for(config.max_model_len))  # fmt: skip
            wanted = {shape_for(spec.tokens, spec.seqs) for spec in specs if spec.tokens <= MAX_TOKENS}
            graphs.capture(sorted(wanted))
            runner.prefill_graphs = graphs
        print(f"model and pools ready in {time.perf_counter() - start:.0f} s", flush=True)
        results = []
        for spec in specs:
            results.append(profile(runner, spec, args.host))
    append_json_lines(args.out, results)


if __name__ == "__main__":
    main()
