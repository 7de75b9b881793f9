"""Offline LLMs over the tiny checkpoint, for the prefix-cache tests: `tiny_llm` builds one (CPU,
fp32, 512 tokens unless told otherwise); `reset_prefix_cache` gives a shared one back its fresh
cache. tests/conftest.py's `plain_llm` and `cached_llm` share one LLM of each kind per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve import LLM
from pdserve.prefix_stats import PrefixStats

TINY_LLM_ARGS: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_model_len": 512}


def tiny_llm(model_dir: Path, **engine_args: Any) -> LLM:
    """An LLM over `model_dir` with TINY_LLM_ARGS, `engine_args` overriding them."""
    return LLM(str(model_dir), **{**TINY_LLM_ARGS, **engine_args})


def reset_prefix_cache(llm: LLM) -> None:
    """Empties `llm`'s prefix cache, zeroes its counters and drops its resume suffixes (the tiny
    tokenizer has no chat template, so a fresh engine has none): as a fresh engine's cache."""
    cache = llm.engine.prefix_cache
    cache.clear()
    cache.stats = PrefixStats()
    cache.resume_suffixes = []
