"""Warm-up before an engine takes traffic: one pass of every shape class it will meet, so that
Triton compiles and autotunes its kernels now, not under the first requests (a first-seen shape
cost 8 s of TTFT on the H200, docs/benchmarks.md).

Shape classes: prefill passes of 16, 32, ... up to `max_num_batched_tokens` tokens (one prompt,
one prompt a token shorter, then the same tokens as many short prompts packed together), each
followed by a few decode steps; decode batch sizes are compiled when their CUDA graphs are
captured; and the structured-output view of the vocabulary is built (a first constrained
request would otherwise pay ~3 s). The shorter prompt is there because Triton compiles a
kernel again for integer arguments that are not multiples of 16 (a token count of 1,031 is
not): on the H200 those variants were compiled under traffic before it (py-spy,
docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling.params import SamplingParams

log = logging.getLogger(__name__)
SHORT_PROMPT = 32  # tokens of each prompt in a packed warm-up pass


def warm_up_passes(engine: LLMEngine) -> list[list[int]]:
    """Prompt lengths of each warm-up pass: one long prompt, or several short ones packed."""
    c = engine.config
    longest = min(c.max_num_batched_tokens, c.max_model_len - 4)
    passes, n = [], 16
    while n <= longest:
        passes.append([n])
        passes.append([n - 1])
        if n >= 2 * SHORT_PROMPT:
            passes.append([SHORT_PROMPT] * min(n // SHORT_PROMPT, c.max_num_seqs))
        n *= 2
    return passes


def warm_up(engine: LLMEngine, progress: Callable[[str], None] = log.info) -> None:
    """Run every warm-up pass to completion (a few output tokens each), leaving the pools empty."""
    passes = warm_up_passes(engine)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    start = time.monotonic()
    for i, lengths in enumerate(passes, 1):
        for j, n in enumerate(lengths):
            engine.add_request([(7 * j + t) % vocab for t in range(n)], params, f"warm-up-{i}-{j}")
        while engine.has_unfinished():
            engine.step()
        took = time.monotonic() - start
        progress(f"warm-up {i}/{len(passes)}: {len(lengths)} x {lengths[0]} tokens ({took:.0f} s)")
    cache = engine.prefix_cache
    while cache is not None and cache.evict_one():  # warm-up prompts are nobody's prefix
        pass
    if engine.tokenizer is not None:  # structured outputs' view of the vocabulary (~3 s, once)
        from pdserve.sampling.grammar import tokenizer_grammars  # xgrammar (and transformers): 0.9 s

        tokenizer_grammars(engine.tokenizer)
        progress(f"warm-up: grammar tokenizer ready ({time.monotonic() - start:.0f} s)")
