"""Which service processes `pdserve up` starts, and on which GPUs.

plan = plan_services(prefill, decode, colocate, device)
  - one `pdserve engine` process holding both roles (the weights once): with --colocate,
    or with --device cuda, exactly one visible GPU and neither --prefill nor --decode
  - else N `pdserve prefill` + M `pdserve decode` processes (N, M default 1); on GPUs,
    process i gets GPU i mod #GPUs (round-robin), prefill first
role_counts(plan)                    instances of each role it registers (an engine: both)
shared_gpu_memory_utilization(plan)  each process's share when several share a GPU
"""

from __future__ import annotations

import collections
import math
import os
from dataclasses import dataclass

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
ENGINE = "engine"  # `pdserve engine`: one process registered as prefill and as decode


class LayoutError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ServiceProcess:
    command: str  # the pdserve subcommand: "prefill", "decode" or "engine"
    name: str  # its instance id: prefill-0, decode-1, engine-0, ...
    gpu: str | None  # its CUDA_VISIBLE_DEVICES; None on the CPU


def visible_gpus() -> list[str]:
    """The GPU ids children may use: $CUDA_VISIBLE_DEVICES's entries, or 0..count-1."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_services(
    prefill: int | None, decode: int | None, colocate: bool, device: str, gpus: list[str] | None = None
) -> list[ServiceProcess]:
    """The service processes to start, in order (see the module docstring). `gpus`: the
    visible GPUs (default `visible_gpus()`), used with device "cuda" only."""
    counts_given = prefill is not None or decode is not None
    if any(n is not None and n < 1 for n in (prefill, decode)):
        raise LayoutError("--prefill and --decode must be at least 1")
    if colocate and counts_given:
        raise LayoutError("--colocate runs one engine holding both roles: drop --prefill/--decode")
    if device == "cuda":
        gpus = visible_gpus() if gpus is None else gpus
        if not gpus:
            raise LayoutError("--device cuda but no GPU is visible")
    if colocate or (device == "cuda" and not counts_given and len(gpus) == 1):
        commands = [ENGINE]
    else:
        commands = ["prefill"] * (prefill or 1) + ["decode"] * (decode or 1)
    numbers: dict[str, int] = collections.Counter()
    plan = []
    for i, command in enumerate(commands):
        gpu = gpus[i % len(gpus)] if device == "cuda" else None
        plan.append(ServiceProcess(command, f"{command}-{numbers[command]}", gpu))
        numbers[command] += 1
    return plan


def role_counts(plan: list[ServiceProcess]) -> dict[str, int]:
    """How many instances of each role the plan registers (an engine counts as both)."""
    return {role: sum(p.command in (role, ENGINE) for p in plan) for role in ("prefill", "decode")}


def describe(plan: list[ServiceProcess]) -> str:
    if [p.command for p in plan] == [ENGINE]:
        return "1 engine (prefill + decode in one process)"
    counts = role_counts(plan)
    return f"{counts['prefill']} prefill, {counts['decode']} decode"


def shared_gpu_memory_utilization(plan: list[ServiceProcess]) -> float | None:
    """Each process's --gpu-memory-utilization when several processes share a GPU (the default
    split evenly over the busiest GPU's processes), else None."""
    gpus = [p.gpu for p in plan if p.gpu is not None]
    share = math.ceil(len(gpus) / len(set(gpus))) if gpus else 1
    return round(DEFAULT_GPU_MEMORY_UTILIZATION / share, 3) if share > 1 else None
