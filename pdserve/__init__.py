"""pdserve: disaggregated prefill/decode serving for Qwen3.6 hybrid-MoE models.

`LLM` and `SamplingParams` are imported on first use: `import pdserve.rpc` (the healthcheck)
and the router import this package without loading torch or the engine.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# gRPC's fork handlers (grpcio >= 1.81, grpc/grpc#43055) restart its poller in a child that
# subprocess.Popen is about to exec, after close_fds closed the poller's epoll fd: the child
# aborts (SIGABRT) before exec, ~6% of Popen calls with a preexec_fn from a process with a live
# channel (a supervisor, the tests' stacks). Our children always exec: turn them off, before
# pdserve.rpc imports grpc. A user's own setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

if TYPE_CHECKING:
    from pdserve.llm import LLM
    from pdserve.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
_HOMES = {"LLM": "pdserve.llm", "SamplingParams": "pdserve.sampling.params"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain module attribute
    return value
