"""Shared test fixtures: the tiny checkpoint (made once per session), its transformers model,
offline LLMs over it with the prefix cache off and on (one each per session), and the `gpu`
marker (skipped without CUDA). On a CPU machine every test process, and every process a test
starts, runs torch on one thread (see below)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from pdserve.tiny import make_tiny

if TYPE_CHECKING:
    from pdserve import LLM

TINY_SEED = 0

# One intra-op thread per process without CUDA (unless OMP_NUM_THREADS says otherwise), in the
# test workers and, through the environment, in every process a test starts (stacks, `pdserve up`):
# their ops are on tiny tensors, where a second OpenMP thread gains nothing, and with more torch
# processes than cores each op's fork/join waits for a descheduled thread. A tiny engine's
# generation on the 2-core machine: 9.5 s on one thread or two when alone, 52 s on two beside one
# busy process, 9.5 s on one.
if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def session_plain_llm(tiny_model_dir: Path) -> LLM:
    """One LLM with the prefix cache off for the session: tests take it as `plain_llm`."""
    from tests.offline_llms import tiny_llm

    return tiny_llm(tiny_model_dir, enable_prefix_caching=False)


@pytest.fixture(scope="session")
def session_cached_llm(tiny_model_dir: Path) -> LLM:
    """One LLM with the prefix cache on for the session: tests take it as `cached_llm`."""
    from tests.offline_llms import tiny_llm

    return tiny_llm(tiny_model_dir, enable_prefix_caching=True)


@pytest.fixture
def plain_llm(session_plain_llm: LLM) -> Iterator[LLM]:
    """The tiny checkpoint offline with the prefix cache off (the reference a cached run must
    equal), shared by the session; after the test, nothing leaked."""
    from tests.helpers import assert_no_leaks

    yield session_plain_llm
    assert_no_leaks(session_plain_llm.engine)


@pytest.fixture
def cached_llm(session_cached_llm: LLM) -> Iterator[LLM]:
    """The tiny checkpoint offline with the prefix cache on, shared by the session: each test
    gets it with an empty cache, zeroed counters and no resume suffixes; after the test, nothing
    leaked once the cache is cleared."""
    from tests.helpers import assert_no_leaks
    from tests.offline_llms import reset_prefix_cache

    reset_prefix_cache(session_cached_llm)
    yield session_cached_llm
    assert_no_leaks(session_cached_llm.engine)
