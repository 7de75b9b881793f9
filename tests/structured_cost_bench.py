"""What a constrained row costs a batch: Sampler.sample on 32 rows of Qwen3.6-sized logits with 0, 1
and 4 rows under a JSON-schema grammar (in a string, where most tokens are allowed), and the
constraint stage alone. Not a test (pytest does not collect it); issue 8's measurement:

    python tests/structured_cost_bench.py MODEL_DIR [cpu|cuda] [THREADS] [REPEATS]
"""

from __future__ import annotations

import sys
import time

import torch

from pdserve.sampling.constraints import apply_constraints
from pdserve.sampling.grammar import tokenizer_grammars
from pdserve.sampling.params import SamplingParams
from pdserve.sampling.sampler import Sampler, SamplingState
from pdserve.sampling.stop import StopChecker
from pdserve.tokenizer import Tokenizer, load_tokenizer

VOCAB, BATCH = 248_320, 32
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 64}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def batch(tokenizer: Tokenizer, constrained: int, temperature: float, top_p: float, device: str) -> list:
    rows = []
    for i in range(BATCH):
        spec = {"json": SCHEMA} if i < constrained else None
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=100, structured_outputs=spec)
        StopChecker(params, tokenizer, tokenizer.eos_token_ids)  # compiles the grammar, as the engine does
        row = SamplingState.create(params, [1, 2, 3], tokenizer.eos_token_ids, device)
        row.output_token_ids.extend(tokenizer.encode('{"name": "ab') if spec else [5, 6])
        rows.append(row)
    return rows


def median_ms(fn, repeats: int, sync) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    model_dir, device = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu"
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    tokenizer = load_tokenizer(model_dir)
    start = time.perf_counter()
    tokenizer_grammars(tokenizer)
    print(f"xgrammar's tokenizer info: {time.perf_counter() - start:.2f} s (once per process)")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sampler, logits = Sampler(), torch.randn(BATCH, VOCAB, device=device)
    for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (1.0, 0.9)):
        ms = {}
        for n in (0, 1, 4):
            rows = batch(tokenizer, n, temperature, top_p, device)
            ms[n] = median_ms(lambda rows=rows: sampler.sample(logits, rows), repeats, sync)
        print(
            f"Sampler.sample, temperature {temperature} top_p {top_p}: {ms[0]:.2f} ms; one constrained row "
            f"{ms[1] - ms[0]:+.2f} ms ({100 * (ms[1] / ms[0] - 1):+.1f}%), four {ms[4] - ms[0]:+.2f} ms"
        )
    for n in (0, 1, 4):
        rows, times = batch(tokenizer, n, 1.0, 1.0, device), []
        for _ in range(repeats):
            copy = logits.clone()  # the stage works in place on the sampler's copy
            sync()
            start = time.perf_counter()
            apply_constraints(copy, rows)
            sync()
            times.append(time.perf_counter() - start)
        stage = sorted(times)[len(times) // 2] * 1e3
        print(f"the constraint stage alone, {n} of {BATCH} rows constrained: {stage:.3f} ms")


if __name__ == "__main__":
    main()
