"""Can decode steps keep their ITL while a long prompt prefills beside them? (issue 12, point 2):
`python -m pdserve.ops.bench_overlap [--context 131072] [--chunk 8192] [--decode 4]
[--layers-per-step 1 2 4 8] [--steps 200] [--attention-programs 0 100] [--prefill-sms 100]`.

At the full Qwen3.6-35B-A3B shape (random bf16 weights): `--decode` sequences of 1,100 tokens decode
by CUDA-graph replay while one long prompt's chunk of `--chunk` tokens after `--context` tokens
already in its KV pages (random) is prefilled, again and again. Timed, each over `--steps` decode
steps (a step = a replay and the wait for its tokens on the host, as a served step):
  alone:        decode steps only: the baseline ITL;
  chunk alone:  the chunk's pass only: its prefill tokens/s;
  k layers:     the background pass of docs/architecture.md: decode graphs replay on a
                high-priority stream, and between two steps the chunk's next `k` layers are
                launched on a low-priority stream (one thread, no sync between the streams).
Prints each way's ITL p50 / p99 (and p99 over the baseline's p50: issue 12 asks <= 3x) and the
chunk's tokens/s beside the decode steps (the long prompt's TTFT scales with its inverse), for
each of `--attention-programs` P: the chunk's prefill attention as P persistent programs, the
other SMs left to the decode stream (0: its usual grid, one program a query tile; session 16
measured a decode step beside that grid at 131K waiting out the whole layer, ~44 ms), and for
each of `--prefill-sms` N: the chunk's stream in a CUDA green context of N SMs (the decode stream
keeps the whole device, so at least the other SMs are never held by the chunk).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import torch

from pdserve.bench import QWEN36_35B_A3B
from pdserve.config import EngineConfig
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.forward_batch import ForwardBatch
from pdserve.ops.bench_step import decode_batch

DECODE_CONTEXT = 1100


def layer_by_layer(runner: ModelRunner, batch: ForwardBatch) -> Generator[None, None, torch.Tensor]:
    """The model's forward launched one decoder layer at a time (`forward_layers`): yields after
    each layer, returns the last token's logits."""
    hidden = yield from runner.model.forward_layers(batch)
    return runner.model.compute_logits(hidden[-1:])


def percentiles(seconds: list[float]) -> tuple[float, float]:
    ms = sorted(s * 1e3 for s in seconds)
    return statistics.median(ms), ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]


class Overlap:
    def __init__(self, args: argparse.Namespace, model_dir: str) -> None:
        self.args = args
        total = args.context + args.chunk
        pages = total // 16 + 8 + args.decode * (DECODE_CONTEXT // 16 + 8)
        config = EngineConfig(model=model_dir, device="cuda", load_format="dummy", max_num_seqs=args.decode,
                              max_model_len=total + 64, enforce_eager=True, num_state_slots=args.decode + 4,
                              num_kv_pages=pages + 8)  # fmt: skip
        self.runner = runner = ModelRunner(config)
        gen = torch.Generator(device="cuda").manual_seed(3)
        runner.kv_pool.kv.normal_(0.0, 1.0, generator=gen)
        runner.state_pool.recurrent.normal_(0.0, 0.05, generator=gen)
        self.graphs = DecodeGraphs(runner.model, runner.kv_pool, runner.state_pool, args.decode,
                                   runner.kv_pool.pages_for(config.max_model_len))  # fmt: skip
        self.graphs.sizes = [args.decode]
        self.graphs.capture()
        self.decode = decode_batch(runner, args.decode, DECODE_CONTEXT)
        kv, page = runner.kv_pool, config.page_size
        self.long_table = kv.allocate(kv.pages_for(total))
        self.long_slot = runner.state_pool.allocate()
        ids = torch.randint(0, 200_000, (args.chunk,), generator=torch.Generator().manual_seed(4)).tolist()
        self.chunk_inputs = ([ids], [args.context], [self.long_table], [self.long_slot], page)
        self.programs: int | None = None  # the chunk's attention programs (None: the usual grid)
        self.high = torch.cuda.Stream(priority=-100)  # mapped to the device's highest priority
        self.low = self.whole_device = torch.cuda.Stream(priority=0)

    def confine_chunk(self, sms: int) -> None:
        """The chunk's stream in a green context of `sms` SMs (0: a stream of the whole device)."""
        if not sms:
            self.low = self.whole_device
            return
        green = torch.cuda.GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
        if hasattr(green, "Stream"):
            self.low = green.Stream()
        else:  # torch before the green context's own stream: a stream made while it is current
            green.set_context()
            self.low = torch.cuda.Stream(priority=0)
            green.pop_context()
        self.green = green  # kept alive with its stream

    def step(self) -> None:
        """One decode step on the high-priority stream, to its tokens on the host."""
        with torch.cuda.stream(self.high):
            self.graphs.replay(self.decode).argmax(-1).cpu()

    def chunk_pass(self) -> Iterator[None]:
        """The chunk's pass, a layer a `next()`; the caller makes the low stream current around
        each (a stream context inside a generator would stay entered across its yields)."""
        batch = ForwardBatch.build(*self.chunk_inputs, self.runner.device)
        batch.attention_programs = self.programs
        yield from layer_by_layer(self.runner, batch)

    def alone(self) -> list[float]:
        times = []
        for _ in range(self.args.steps):
            start = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - start)
        return times

    def chunk_alone(self, passes: int = 3) -> float:
        """Seconds a chunk's pass takes with nothing beside it."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(self.low):
            for _ in range(passes):
                for _ in self.chunk_pass():
                    pass
        self.low.synchronize()
        return (time.perf_counter() - start) / passes

    def beside(self, k: int) -> tuple[list[float], float]:
        """Decode steps with a chunk's layers launched k at a time between them; (ITLs, chunk tokens/s)."""
        times, passes, layers = [], 0, None
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(self.args.steps):
            start = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - start)
            for _ in range(k):
                layers = layers or self.chunk_pass()
                with torch.cuda.stream(self.low):
                    if next(layers, StopIteration) is StopIteration:
                        passes, layers = passes + 1, None
        self.low.synchronize()
        return times, passes * self.args.chunk / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131_072)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--layers-per-step", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--attention-programs", type=int, nargs="+", default=[0],
        help="the chunk's attention as this many persistent programs (0: one a tile)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-sms", type=int, nargs="*", default=[],
        help="also the chunk's stream in a CUDA green context of this many SMs (usual attention grid)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="the results as one JSON line here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        Path(tmp, "config.json").write_text(json.dumps(QWEN36_35B_A3B))
        bench = Overlap(args, tmp)
        bench.chunk_alone(passes=1)  # compiles and autotunes the chunk's shapes
        bench.alone()
        base = percentiles(bench.alone())
        rows: dict[str, dict] = {"alone": {"itl_ms": base}}
        print(f"decode x{args.decode} alone: ITL p50 {base[0]:.2f} ms, p99 {base[1]:.2f} ms")
        variants = [(p, 0) for p in args.attention_programs] + [(0, n) for n in args.prefill_sms]
        for programs, sms in variants:
            bench.programs = programs or None
            bench.confine_chunk(sms)
            bench.chunk_alone(passes=1)  # the persistent kernel's build
            chunk_s = bench.chunk_alone()
            label = f"{programs} attention programs" if programs else "attention one program a tile"
            label += f", chunk on {sms} SMs" if sms else ""
            rows[f"{label}: chunk alone"] = {"tok_s": args.chunk / chunk_s}
            print(f"{label}: chunk of {args.chunk} after {args.context}: {chunk_s * 1e3:.0f} ms alone, "
                  f"{args.chunk / chunk_s:,.0f} tok/s")  # fmt: skip
            for k in args.layers_per_step:
                times, rate = bench.beside(k)
                p50, p99 = percentiles(times)
                rows[f"{label}: {k} layers"] = {"itl_ms": (p50, p99), "tok_s": rate}
                share = rate * chunk_s / args.chunk
                print(f"  {k} layers a step: ITL p50 {p50:.2f} ms, p99 {p99:.2f} ms ({p99 / base[0]:.1f}x "
                      f"the baseline p50), chunk {rate:,.0f} tok/s ({share:.0%} of alone)")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": None}, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
