"""Shared test fixtures: the tiny checkpoint (made once per session), its transformers model,
and the `gpu` marker (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.tiny import make_tiny

TINY_SEED = 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3.6-class checkpoint (seed 0), written once per test session."""
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen36"), seed=TINY_SEED)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: Path):
    """The tiny checkpoint loaded by transformers: fp32, eval mode, CPU (the reference model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()
