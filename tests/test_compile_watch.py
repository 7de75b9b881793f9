"""The compile watch: what Triton built in an engine step is named in the engine's log."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from pdserve.engine.engine_thread import EngineThread
from pdserve.ops import compile_watch
from pdserve.ops.compile_watch import CompileWatch, _chained


def test_watch_pairs_each_compile_with_its_start() -> None:
    watch = CompileWatch()
    assert watch.before(key="k1", repr="kernel_a[num_warps=4](x: *bf16)") is False
    watch.before(key="k2", repr="kernel_b()")
    watch.after(key="k2", repr="kernel_b()")
    watch.after(key="k1", repr="kernel_a[num_warps=4](x: *bf16)")
    done = watch.take()
    assert [c.kernel for c in done] == ["kernel_b()", "kernel_a[num_warps=4](x: *bf16)"]
    assert done[1].seconds >= done[0].seconds >= 0
    assert watch.take() == []  # handed over once


def test_chained_hook_keeps_the_earlier_hooks_answer() -> None:
    calls = []
    earlier = lambda **kw: calls.append(("earlier", kw["key"])) or True  # noqa: E731 - a cache hit
    both = _chained(earlier, lambda **kw: calls.append(("ours", kw["key"])) or False)
    assert both(key="k") is True
    assert calls == [("ours", "k"), ("earlier", "k")]
    assert _chained(None, print) is print


def test_specialisation_names_what_tells_two_builds_apart() -> None:
    """Triton 3.6's compile record (its own `repr` reads the cache key as a tuple and names no
    types): types, the multiple-of-16 mark, constexprs and an int equal to 1 (a constant)."""
    record = {
        "signature": {
            "x_ptr": "*bf16",
            "n": "i32",
            "rows": "constexpr",
            "ids_ptr": "*i32",
            "BLOCK": "constexpr",
        },
        "constants": {(2,): 1, (4,): 128},
        "configs": [{(0,): [["tt.divisibility", 16]], (1,): [], (3,): []}],
        "num_warps": 8,
        "num_stages": 3,
    }
    fn = types.SimpleNamespace(name="scale_kernel")
    text = compile_watch.specialisation(
        {"key": "k", "repr": "scale_kernel[...](x_ptr: ())", "fn": fn, "compile": record}
    )
    assert text.startswith("scale_kernel[num_warps=8, num_stages=3](")
    assert text.endswith("(x_ptr: *bf16 %16, n: i32, rows=1, ids_ptr: *i32, BLOCK=128)")
    assert compile_watch.specialisation({"key": "k", "repr": "older triton"}) == "older triton"


def test_describe_groups_by_kernel_costliest_first() -> None:
    compiled = [compile_watch.Compiled(f"l2norm[num_warps={w}](x: *bf16)", 0.5) for w in (1, 2, 4)]
    compiled += [compile_watch.Compiled("moe[num_warps=8](a: *bf16)", 1.25)]
    compiled += [compile_watch.Compiled(f"k{i}(x: i32)", 0.01 * i) for i in range(1, 4)]
    text = compile_watch.describe(compiled, limit=3)
    assert text.startswith("l2norm x3 (1.50 s); moe x1 (1.25 s); k3 x1 (0.03 s), and 2 more kernels")
    slowest = (
        "moe[num_warps=8](a: *bf16) (1.25 s), l2norm[num_warps=1](x: *bf16) (0.50 s), l2norm[num_warps=2]"
    )
    assert text.endswith(f"; slowest: {slowest}(x: *bf16) (0.50 s)")
    assert compile_watch.describe([]) == ""


class _Engine:
    """An engine whose one step 'compiles' a kernel, as a first-seen shape would."""

    def __init__(self) -> None:
        self.scheduler = types.SimpleNamespace(running=[], waiting=[])
        self.last_pass = []
        self.requests = {}

    def step(self) -> list:
        compile_watch.WATCH.before(key="fresh", repr="gdn_chunk_kernel[num_warps=8](T: i32)")
        compile_watch.WATCH.after(key="fresh", repr="gdn_chunk_kernel[num_warps=8](T: i32)")
        return []


def test_engine_thread_logs_a_compile_in_a_step(caplog: pytest.LogCaptureFixture) -> None:
    compile_watch.take()
    thread = EngineThread(_Engine(), on_outputs=lambda outputs: None, on_error=lambda ids, msg: None)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.engine_thread"):
        thread._safe_step()
        thread._safe_step()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("1 Triton kernels compiled in it: gdn_chunk_kernel" in x for x in lines)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_install_sees_a_real_triton_compile() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def scale_kernel(x_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * FACTOR, mask=offs < n)

    assert compile_watch.install()
    compile_watch.take()
    x = torch.ones(100, device="cuda")
    scale_kernel[(1,)](x, 100, FACTOR=3, BLOCK=128)
    scale_kernel[(1,)](x, 100, FACTOR=3, BLOCK=128)  # built already: not seen again
    torch.cuda.synchronize()
    seen = compile_watch.take()
    assert len(seen) == 1 and seen[0].seconds > 0
    assert (
        "scale_kernel[num_warps=4" in seen[0].kernel
        and "x_ptr: *fp32 %16, n: i32, FACTOR=3, BLOCK=128" in seen[0].kernel
    )
    scale_kernel[(1,)](x, 96, FACTOR=3, BLOCK=128)  # n a multiple of 16: a second build
    torch.cuda.synchronize()
    assert "n: i32 %16" in compile_watch.take()[0].kernel
    # three launches scaled the first 96 elements three times, the last four twice
    assert x[0].item() == 27.0 and x[99].item() == 9.0
