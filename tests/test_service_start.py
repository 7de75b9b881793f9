"""A service whose configuration cannot start stops at once with one line naming why (no
traceback); on the GPU, a model that does not fit names the numbers and the flags to change."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.model_runner import MemoryPlanError


@pytest.mark.parametrize("role", ["prefill", "decode", "engine"])
def test_a_configuration_that_cannot_start_says_so_in_one_line(tiny_model_dir, role: str) -> None:
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        role,
        "--model",
        str(tiny_model_dir),
        "--max-model-len",
        "99999999",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pdserve {role}: cannot start: max_model_len 99999999 exceeds"), last


@pytest.mark.gpu
def test_a_model_that_does_not_fit_names_the_numbers(tiny_model_dir) -> None:
    from pdserve import LLM

    with pytest.raises(MemoryPlanError) as failure:
        LLM(str(tiny_model_dir), device="cuda", gpu_memory_utilization=0.001)
    line = str(failure.value)
    assert "\n" not in line
    words_wanted = ("weights", "GDN states", "KV pages", "--max-num-seqs", "--num-prefix-checkpoints",
                    "--gpu-memory-utilization")  # fmt: skip
    for words in words_wanted:
        assert words in line, line
