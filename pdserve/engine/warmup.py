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

With the prefix cache on, chat traffic takes two more paths, warmed too: a prompt that ends
with the chat template's generation prompt saves a checkpoint inside its pass (the GDN scan run
in pieces, `pdserve.model.mid_pass_saves`: an 8.25 s step under traffic on the H200 before this,
4 chat prompts of ~1,034 tokens), and the next turn restores that checkpoint and prefills on top
of the cached context. So each size also gets a pass of chat prompts (one, and four packed), then
a pass of their follow-ups.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.resume_points import resume_suffix
from pdserve.engine.scheduler import longest_chunk
from pdserve.ops import long_attention
from pdserve.prefix_stats import PrefixStats
from pdserve.sampling.params import SamplingParams

log = logging.getLogger(__name__)
SHORT_PROMPT = 32  # tokens of each prompt in a packed warm-up pass
PACKED_CHATS = 4  # chat prompts in a packed chat pass
FOLLOW_UP = 32  # new tokens of a follow-up turn (then the generation prompt again)


def _prompt(length: int, seed: int, vocab: int, suffix: tuple[int, ...] = ()) -> list[int]:
    body = [(7 * seed + 13 * t + 1) % vocab for t in range(length - len(suffix))]
    return body + list(suffix)


def warm_up_passes(engine: LLMEngine, suffix: tuple[int, ...] | None = None) -> list[list[list[int]]]:
    """The prompts of each warm-up pass. `suffix`: the chat template's generation prompt, for the
    chat passes (none without it or without the prefix cache). Every prompt has a seed of its own,
    so none starts with another's first block: with the prefix cache on, a prompt that repeated
    an earlier one's start would prefill only the rest (a pass of 8,192 tokens ran 4,096, and a
    served chat turn of 8,192 tokens then built the MoE alignment for its size under traffic,
    4.2 s, H100). A follow-up turn alone repeats its turn: that hit is what it warms."""
    c = engine.config
    vocab = engine.model_config.vocab_size
    longest = min(c.max_num_batched_tokens, c.max_model_len - 4)
    chats = suffix is not None and engine.prefix_cache is not None
    seeds = itertools.count()
    passes: list[list[list[int]]] = []
    n = 16
    while n <= longest:
        passes.append([_prompt(n, next(seeds), vocab)])
        passes.append([_prompt(n - 1, next(seeds), vocab)])
        if n >= 2 * SHORT_PROMPT:
            count = min(n // SHORT_PROMPT, c.max_num_seqs)
            passes.append([_prompt(SHORT_PROMPT, next(seeds), vocab) for _ in range(count)])
        if chats:
            passes += _chat_passes(n, suffix, vocab, c.max_model_len, seeds)
        n *= 2
    return passes


def _chat_passes(
    n: int, suffix: tuple[int, ...], vocab: int, max_model_len: int, seeds: Iterator[int]
) -> list[list[list[int]]]:
    """The chat passes of size `n` (`suffix`: the generation prompt): one chat prompt of n - 1
    tokens, then `PACKED_CHATS` of n // PACKED_CHATS - 1 packed, each only where n // count is
    at least 4 times `suffix`; each pass followed by a pass of those prompts' next turns (FOLLOW_UP
    tokens, then `suffix` again) where they fit in `max_model_len` with their output."""
    passes: list[list[list[int]]] = []
    for count in (1, PACKED_CHATS):
        if n // count < 4 * len(suffix):
            break  # and shorter still with more packed
        turn = [_prompt(n // count - 1, next(seeds), vocab, suffix) for _ in range(count)]
        passes.append(turn)
        if n // count + FOLLOW_UP + len(suffix) < max_model_len - 4:
            passes.append([p + _prompt(FOLLOW_UP + len(suffix), next(seeds), vocab, suffix) for p in turn])
    return passes


def warm_up(engine: LLMEngine, progress: Callable[[str], None] = log.info) -> None:
    """Run every warm-up pass to completion (a few output tokens each), leaving the pools empty."""
    cache = engine.prefix_cache
    suffix = resume_suffix(engine.tokenizer) if engine.tokenizer is not None and cache is not None else None
    passes = warm_up_passes(engine, suffix)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    # warm-up's chat prompts end with the generation prompt: their resume points are checkpointed
    resuming = cache.using_resume_suffixes([suffix]) if cache is not None and suffix else nullcontext()
    start = time.monotonic()
    try:
        with resuming:
            for i, prompts in enumerate(passes, 1):
                for j, prompt in enumerate(prompts):
                    engine.add_request(prompt, params, f"warm-up-{i}-{j}")
                while engine.has_unfinished():
                    engine.step()
                size, took = f"{len(prompts)} x {len(prompts[0])} tokens", time.monotonic() - start
                progress(f"warm-up {i}/{len(passes)}: {size} ({took:.0f} s)")
    finally:
        if cache is not None:
            cache.clear()  # warm-up prompts are nobody's prefix, and their hits nobody's figures
            cache.stats = PrefixStats()


def warm_up_long_attention(engine: LLMEngine) -> None:
    """The long-chunk attention's plans and kernels (`ops.long_attention`, when on), for chunks of
    every padded length up to the budget's (and a short tail past it): warm-up's prompts are too
    short to take that path. Call it on the thread that runs the steps: torch caches cuDNN's
    attention plans per thread (warmed on the main thread, the engine thread built its own at the
    first long chunk: an 84-92 ms stall, H200, session 28); on the default stream and on the
    background passes' stream, where those chunks run."""
    split_from = engine.config.long_attention_from
    if not split_from or engine.config.max_model_len <= split_from:
        return  # no prompt can take that path
    layers = engine.runner.model.model.layers
    attn = next(layer.self_attn for layer in layers if layer.layer_type != "linear_attention")
    background = engine.background.stream()  # a long prompt's chunks run there beside the steps
    longest = longest_chunk(engine.config.max_num_batched_tokens)
    for stream in (None, background) if background is not None else (None,):
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            long_attention.warm_up(attn.kv_layer, attn.num_heads, longest)


def warm_up_grammars(engine: LLMEngine, progress: Callable[[str], None] = log.info) -> None:
    """Structured outputs' view of the vocabulary (xgrammar's TokenizerInfo), made before a
    service takes requests, on every device: built, ~3.7 s on a 2-core machine, most of it native
    code that holds the GIL (the service's event loop stalled ~1 s at a time), or read back from
    pdserve.sampling.vocab_cache's disk cache in ~0.7 s. Built by the first structured
    request instead, on the engine thread, it stalled the loop long enough (7.7 s, CPU) for the
    instance's heartbeat to expire: the router dropped it and answered 503."""
    if engine.tokenizer is None:
        return
    start = time.monotonic()
    from pdserve.sampling.grammar import tokenizer_grammars  # xgrammar (and transformers): ~1 s

    tokenizer_grammars(engine.tokenizer)
    progress(f"warm-up: grammar tokenizer ready ({time.monotonic() - start:.1f} s)")
