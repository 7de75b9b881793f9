"""Which GDN prefill costs less for short sequences: fla's chunked scan or the recurrence a token at
a time (`ops.gdn_recurrent_prefill`)? `python -m pdserve.ops.bench_gdn_prefill [--lengths 2 16 64
128 271 512 1024] [--sequences 1 8 26] [--calls 30]` on the GPU, at one Qwen3.6-35B-A3B GDN
layer's shape (16 key heads, 32 value heads, 128 x 128 state, bf16 inputs, fp32 states).

Each op is called `--calls` times back to back while the GPU is held busy (`torch.cuda._sleep`),
so the host's time to launch a call and the GPU's time to run it are measured apart: a prefill
pass is host-bound when the first is the larger. Prints both for each op and (sequences, length),
and the longest length at which the recurrent op's larger of the two is still the smaller:
`pdserve.model.mid_pass_saves.RECURRENT_MAX_CUDA`. `--other-prefetch`: beside it, the recurrent op
with each token's inputs loaded the other way than `cuda_gdn_recurrent.RECURRENT_PREFETCH` says (on:
a step ahead).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pdserve import ops

HK, HV, D = 16, 32, 128


def timed(call: Callable[[], object], calls: int) -> tuple[float, float]:
    """(host ms a call, GPU ms a call) of `calls` back-to-back calls."""
    call()  # compiled, autotuned, cached
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9))  # ~1 s: the host launches everything while the GPU sleeps
    start.record()
    began = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - began) / calls
    end.record()
    torch.cuda.synchronize()
    return host * 1e3, start.elapsed_time(end) / calls


def inputs(num_seqs: int, length: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    tokens = num_seqs * length
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda")

    q, k, v = rand(tokens, HK, D).bfloat16(), rand(tokens, HK, D).bfloat16(), rand(tokens, HV, D).bfloat16()
    gate = -torch.nn.functional.softplus(rand(tokens, HV))
    beta = torch.sigmoid(rand(tokens, HV)).bfloat16()
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32, device="cuda")
    pool = torch.zeros(num_seqs + 1, HV, D, D, device="cuda")
    slots = torch.arange(num_seqs, dtype=torch.int64, device="cuda")
    return [q, k, v, gate, beta, cu, pool, slots], pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2, 16, 64, 128, 271, 512, 1024])
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 8, 26])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument(
        "--other-prefetch", action="store_true", help="also the recurrent op with RECURRENT_PREFETCH flipped"
    )
    args = parser.parse_args()
    from pdserve.ops.cuda_gdn_recurrent import RECURRENT_PREFETCH, gdn_recurrent_prefill

    other = not RECURRENT_PREFETCH
    ahead = f" | prefetch={other} host / GPU ms" if args.other_prefetch else ""
    print(f"sequences x length: chunked host / GPU ms | recurrent host / GPU ms | cost ratio{ahead}")
    for num_seqs in args.sequences:
        longest = 0
        for length in args.lengths:
            tensors, _ = inputs(num_seqs, length)
            chunked = timed(lambda t=tensors: ops.gdn_chunk_prefill(*t), args.calls)
            recurrent = timed(lambda t=tensors: ops.gdn_recurrent_prefill(*t), args.calls)
            ratio = max(recurrent) / max(chunked)
            longest = length if ratio < 1 else longest
            if args.other_prefetch:
                fetched = timed(lambda t=tensors: gdn_recurrent_prefill(*t, prefetch=other), args.calls)
                ahead = f" | {fetched[0]:.3f} / {fetched[1]:.3f}"
            print(
                f"{num_seqs:3d} x {length:5d}: {chunked[0]:.3f} / {chunked[1]:.3f} | "
                f"{recurrent[0]:.3f} / {recurrent[1]:.3f} | {ratio:.2f}{ahead}",
                flush=True,
            )
        print(f"{num_seqs} sequences: the recurrent op costs less up to {longest} tokens a sequence")


if __name__ == "__main__":
    main()
