"""The CUDA ops' Triton kernels under Triton's CPU interpreter, against the reference ops
(tests/triton_interpreted.py): each check in a process of its own, since Triton reads
TRITON_INTERPRET when a kernel is defined. CI has no GPU: this is where it sees the kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "check",
    [
        "align",
        "route",
        "route_align",
        "conv",
        "skinny",
        "moe",
        "norms",
        "gdn_step",
        "gdn_prefill",
        "gdn_decode",
        "attention",
    ],
)
def test_kernel_matches_reference_under_the_interpreter(check: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.triton_interpreted", check],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"{check}: ok"
