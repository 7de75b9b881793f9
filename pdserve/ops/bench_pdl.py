"""Does Programmatic Dependent Launch pay for decode's small kernels? `python -m pdserve.ops.bench_pdl`

A decode step at c=4 is 565 launches, most of them 2-5 us (docs/benchmarks.md, session 13): the GPU
time between dependent kernels (the next grid's launch and ramp-up after the last one drains)
is a large share of it. With PDL (Hopper; Triton's `launch_pdl=True` and `gdc_wait` /
`gdc_launch_dependents`), a kernel's grid is launched while its predecessor still runs and waits
(`gdc_wait`) only before it reads what the predecessor wrote. This times a chain of dependent
elementwise kernels of a decode row's size (4 x 2,048 bf16, and 32 x 2,048), replayed from a CUDA
graph, with and without PDL, checks both give the same values, and prints the GPU time a kernel.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

HIDDEN, CHAIN = 2048, 400


@triton.jit
def _step_kernel(x_ptr, y_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """y = x * 0.999 + 0.001 over one block: the smallest dependent kernel a layer has."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if PDL:
        tl.extra.cuda.gdc_wait()  # the predecessor's writes are visible from here on
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next grid may start its launch now
    tl.store(y_ptr + offs, (x * 0.999 + 0.001).to(y_ptr.dtype.element_ty), mask=mask)


def chain(a: torch.Tensor, b: torch.Tensor, pdl: bool, block: int) -> None:
    grid = (triton.cdiv(a.numel(), block),)
    for i in range(CHAIN):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        kwargs = {"launch_pdl": True} if pdl else {}
        _step_kernel[grid](src, dst, a.numel(), PDL=pdl, BLOCK=block, **kwargs)


def time_chain(rows: int, pdl: bool, block: int = 1024) -> tuple[float, torch.Tensor]:
    """(GPU us a kernel, the chain's result) over graph replays."""
    a = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    b = torch.empty_like(a)
    start = a.clone()
    chain(a, b, pdl, block)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(a, b, pdl, block)
    a.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    result = a.clone()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 20
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / replays / CHAIN * 1e3, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 32])
    args = parser.parse_args()
    for rows in args.rows:
        plain_us, plain = time_chain(rows, pdl=False)
        try:
            pdl_us, with_pdl = time_chain(rows, pdl=True)
        except Exception as e:  # noqa: BLE001 - this Triton or driver has no PDL: say so
            print(f"{rows} x {HIDDEN}: plain {plain_us:.2f} us a kernel; PDL failed: {type(e).__name__}: {e}")
            continue
        same = torch.equal(plain, with_pdl)
        print(f"{rows} x {HIDDEN}: plain {plain_us:.2f} us a kernel, PDL {pdl_us:.2f} us "
              f"({plain_us - pdl_us:+.2f} us saved a boundary); same values: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
