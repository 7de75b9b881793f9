"""A request inside the engine: its tokens, its memory and where it is in its life."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.sampling.params import SamplingParams
from pdserve.sampling.sampler import SamplingState

if TYPE_CHECKING:
    from pdserve.engine.prefix_index import CacheEntry


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; owns no memory
    RUNNING = "running"  # owns KV pages and a GDN state slot
    HELD = "held"  # prefill side: first token out, memory kept under a lease until pulled
    RECEIVING = "receiving"  # decode side: memory reserved, its state being READ from a peer
    FINISHED = "finished"  # memory returned


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV and GDN state are in the pools
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    last_checkpoint: int = 0  # prefix cache: tokens of the latest entry made from this sequence
    last_entry: CacheEntry | None = None  # prefix cache: that entry (`PrefixCache._made`)
    # prefix cache: the entry it started from, until it makes one further along (then that one
    # stands for it: `PrefixCache.supersede`)
    restored_from: CacheEntry | None = None
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sampling: SamplingState | None = None  # shares `output_token_ids`
    stop_checker: object | None = None  # pdserve.sampling.stop.StopChecker when text is tracked
    logprobs: list[dict] = field(default_factory=list)
    # params.prompt_logprobs set: [None, then one entry per prompt token] (engine.prompt_logprobs),
    # filled as the prefill passes run; such a sequence computes every prompt position, so the
    # prefix cache must not restore any of them for it
    prompt_logprobs: list[dict | None] | None = None
    skip_prefix_cache: bool = False
    # a chunk of its prompt runs as a background pass (pdserve.engine.background_pass): the
    # scheduler leaves it out of its batches and out of preemption until the engine ends the pass
    in_background: bool = False
    waited_for_sibling: bool = False  # held back one pass for a shared prefix (engine.burst_sharing)
    # Hand-over (prefill service): after its first token the sequence is HELD, its pages and
    # slot kept under a lease until a decode instance has pulled them, instead of decoding on.
    handoff: bool = False
    # `time.monotonic()` when it was built, and when a step first scheduled it (the request's
    # queue time and prefill time, vLLM's request_queue_time / request_prefill_time)
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:  # a decode step: its one new token, without copying the prompt
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
