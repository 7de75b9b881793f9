"""Run Python code as the slim router image would: torch, the engine and the GPU packages absent.

    python tests/torch_blocked.py -m pdserve.cli router --model DIR ...   # like `python -m`
    python tests/torch_blocked.py -c "import router.server"               # like `python -c`

An import of a blocked name fails with `ModuleNotFoundError`, as it does where the package is not
installed (code that tries an optional import goes on without it). The repository root goes first
on `sys.path`, so this checkout is what runs.
"""

from __future__ import annotations

import importlib.abc
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# third-party packages the router image does not install, and pdserve's modules that need them
BLOCKED_PACKAGES = ("torch", "triton", "nixl", "nixl_cu12", "transformers", "safetensors", "numpy", "fla")
BLOCKED_MODULES = (
    "pdserve.config",
    "pdserve.engine",
    "pdserve.model",
    "pdserve.ops",
    "pdserve.llm",
    "pdserve.sampling.sampler",
    "kvtransfer.agent",
)


def is_blocked(name: str) -> bool:
    top = name.split(".", 1)[0]
    return top in BLOCKED_PACKAGES or any(name == m or name.startswith(m + ".") for m in BLOCKED_MODULES)


class Blocker(importlib.abc.MetaPathFinder):
    """Refuses to find a blocked module, before any other finder looks."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if is_blocked(name):
            raise ModuleNotFoundError(
                f"No module named {name!r} (blocked: not in the router image)", name=name
            )
        return None


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("-m", "-c"):
        sys.exit("usage: python tests/torch_blocked.py -m MODULE [ARG ...] | -c CODE [ARG ...]")
    sys.path.insert(0, str(ROOT))
    sys.meta_path.insert(0, Blocker())
    mode, target, rest = argv[0], argv[1], argv[2:]
    if mode == "-m":
        sys.argv = [target, *rest]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *rest]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    main(sys.argv[1:])
