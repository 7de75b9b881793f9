"""Sampling: `SamplingParams` (validated), the batched `Sampler` (seeded per request), and the
per-request `StopChecker` (incremental detokenizer + stop strings / tokens / length).

Names are imported on first use: the router needs `SamplingParams` (pure Python) and must not
load torch with the sampler.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.sampling.params import SamplingParams
    from pdserve.sampling.sampler import (
        Sampler,
        SamplerOutput,
        SamplingState,
        SamplingTensors,
        make_generator,
    )
    from pdserve.sampling.stop import IncrementalDetokenizer, StopChecker

_HOMES = {
    "SamplingParams": "pdserve.sampling.params",
    "Sampler": "pdserve.sampling.sampler",
    "SamplerOutput": "pdserve.sampling.sampler",
    "SamplingState": "pdserve.sampling.sampler",
    "SamplingTensors": "pdserve.sampling.sampler",
    "make_generator": "pdserve.sampling.sampler",
    "IncrementalDetokenizer": "pdserve.sampling.stop",
    "StopChecker": "pdserve.sampling.stop",
}

__all__ = [
    "IncrementalDetokenizer",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingState",
    "SamplingTensors",
    "StopChecker",
    "make_generator",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'pdserve.sampling' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
