"""Which Triton kernels compile, and when: a kernel compiled while the server serves stalls
every request of that step (a first-seen shape or specialisation), which warm-up exists to
prevent. `install()` hooks Triton's JIT (`triton.knobs.runtime`: a hook before each compile of a
new specialisation, one after); `take()` hands over what compiled since the last call, each as
its kernel's name with its specialised signature and the seconds it took (the compile, or the
load from Triton's disk cache). The engine thread takes them after each step and names them in
its log line (`pdserve.engine.engine_thread`); warm-up takes them to say how many it compiled.

Without Triton (CPU machines without it) or with a Triton whose knobs lack the hooks, install()
does nothing and take() stays empty.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
SIGNATURES = 3  # builds whose whole signature a log line names, the slowest first


@dataclass(frozen=True, slots=True)
class Compiled:
    """One kernel specialisation Triton built (or loaded from its disk cache)."""

    kernel: str  # e.g. "fused_moe_kernel[num_warps=4, ...](a_ptr: *bf16, M: i32, ...)"
    seconds: float

    def __str__(self) -> str:
        return f"{self.kernel} ({self.seconds:.2f} s)"


class CompileWatch:
    """The compiles seen since the last `take()` (Triton may compile on any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: dict[str, float] = {}
        self._done: list[Compiled] = []
        self.installed = False

    def before(self, **kw: Any) -> bool:
        """Triton's jit_cache_hook: note the start; False lets the compile go ahead."""
        with self._lock:
            self._started[str(kw.get("key"))] = time.perf_counter()
        return False

    def after(self, **kw: Any) -> None:
        """Triton's jit_post_compile_hook: the specialisation is built."""
        now = time.perf_counter()
        with self._lock:
            started = self._started.pop(str(kw.get("key")), now)
            self._done.append(Compiled(specialisation(kw), now - started))

    def take(self) -> list[Compiled]:
        with self._lock:
            done, self._done = self._done, []
        return done


WATCH = CompileWatch()


def install() -> bool:
    """Hook `WATCH` into Triton's JIT (once, beside any hooks already set); True when hooked."""
    if WATCH.installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        log.debug("this Triton has no JIT hooks: compiles are not watched")
        return False
    runtime.jit_cache_hook = _chained(runtime.jit_cache_hook, WATCH.before)
    runtime.jit_post_compile_hook = _chained(runtime.jit_post_compile_hook, WATCH.after)
    WATCH.installed = True
    return True


def take() -> list[Compiled]:
    """What compiled since the last call (empty when not installed)."""
    return WATCH.take()


def describe(compiled: list[Compiled], limit: int = 4) -> str:
    """A log fragment naming every kernel that compiled, the costliest first, as its name, how
    many specialisations of it and their seconds, then the SIGNATURES slowest builds' full
    signatures (an autotuner trying its configs shows as one name with many specialisations)."""
    by_name: dict[str, list[Compiled]] = {}
    for c in compiled:
        by_name.setdefault(c.kernel.split("[", 1)[0].split("(", 1)[0], []).append(c)
    groups = sorted(by_name.items(), key=lambda item: -sum(c.seconds for c in item[1]))
    parts = [f"{name} x{len(cs)} ({sum(c.seconds for c in cs):.2f} s)" for name, cs in groups[:limit]]
    more = f", and {len(groups) - limit} more kernels" if len(groups) > limit else ""
    slowest = sorted(compiled, key=lambda c: -c.seconds)[:SIGNATURES]
    return "; ".join(parts) + more + (f"; slowest: {', '.join(map(str, slowest))}" if slowest else "")


def specialisation(hook_kw: dict[str, Any]) -> str:
    """A compile hook's kernel as `name[num_warps=W, num_stages=S](x_ptr: *bf16 %16, n: i32,
    BLOCK=128)`: each argument's type, `%16` where Triton specialised it as a multiple of 16
    (pointers aligned to 16 bytes, ints divisible by 16), and each constexpr's value (an int
    argument equal to 1 shows as `=1`: Triton builds it as a constant). What tells two builds of
    one kernel apart. From the hook's `compile` record; its `repr` when that has no signature."""
    record = hook_kw.get("compile") or {}
    signature: dict[str, str] = record.get("signature") or {}
    fn = hook_kw.get("fn")
    if not signature or fn is None:
        return str(hook_kw.get("repr") or hook_kw.get("key"))
    constants = record.get("constants") or {}
    attrs = (record.get("configs") or [{}])[0] or {}
    args = []
    for i, (arg, kind) in enumerate(signature.items()):
        if kind == "constexpr":
            args.append(f"{arg}={constants.get((i,), constants.get(arg))}")
            continue
        multiple = any(attr[0] == "tt.divisibility" for attr in attrs.get((i,), []))
        args.append(f"{arg}: {kind}{' %16' if multiple else ''}")
    options = f"num_warps={record.get('num_warps')}, num_stages={record.get('num_stages')}"
    return f"{getattr(fn, 'name', fn)}[{options}]({', '.join(args)})"


def _chained(previous: Any, hook: Any) -> Any:
    """`hook`, then any hook that was set before (its answer kept: a cache hook may skip)."""
    if previous is None:
        return hook

    def both(**kw: Any) -> Any:
        hook(**kw)
        return previous(**kw)

    return both
