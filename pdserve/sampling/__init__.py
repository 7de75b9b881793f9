"""Sampling: `SamplingParams` (validated), the batched `Sampler` (seeded per request), and the
per-request `StopChecker` (incremental detokenizer + stop strings / tokens / length)."""

from pdserve.sampling.params import SamplingParams
from pdserve.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingState,
    SamplingTensors,
    make_generator,
)
from pdserve.sampling.stop import IncrementalDetokenizer, StopChecker

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
