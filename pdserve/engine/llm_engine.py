"""The engine loop: add requests, then `step()` = schedule -> execute -> sample -> postprocess."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from pdserve.config import EngineConfig
from pdserve.engine.background_pass import BackgroundLane, BackgroundPass
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.prefill_rate import PrefillRate
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.request_output import RequestOutput, output_of
from pdserve.engine.run_ahead import InFlight, may_run_ahead
from pdserve.engine.scheduler import ScheduledSeq, Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.memory import GdnCheckpointPool
from pdserve.pinned import HostCopy
from pdserve.sampling.params import SamplingParams
from pdserve.sampling.sampler import Sampler, SamplerOutput, SamplingState, make_generator, replay_draws
from pdserve.sampling.stop import StopChecker
from pdserve.tokenizer import Tokenizer, load_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.model_config = config.model_config
        if tokenizer is None and (Path(config.model) / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(config.model)
        self.tokenizer = tokenizer
        self.runner = ModelRunner(config)
        self.last_pass: list[ScheduledSeq] = []
        self.prefix_cache = None
        if config.enable_prefix_caching:
            checkpoints = GdnCheckpointPool(self.runner.state_pool, config.num_prefix_checkpoints)
            self.prefix_cache = PrefixCache(
                self.runner.kv_pool,
                checkpoints,
                config.prefix_block_size,
                config.model_config.identity(),
                host_tier_bytes=config.snapshot_pool_mb << 20,  # allocated now, not at the first eviction
            )
        runner = self.runner
        self.scheduler = Scheduler(runner.kv_pool, runner.state_pool, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.prefix_cache)  # fmt: skip
        # (services set scheduler.lease_ttl_s)
        self.sampler = Sampler()
        self.eos_token_ids = tuple(self.model_config.eos_token_ids) or (
            tokenizer.eos_token_ids if tokenizer is not None else ()
        )
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.run_ahead = True  # pdserve.engine.run_ahead; False: finish each step before the next
        self._ahead: InFlight | None = None
        self.background = BackgroundLane(self.runner, self.sampler, config)  # long prompts beside the steps
        self.prefill_rate = PrefillRate()  # measured per step, for the prefix cache's pulls
        self.decode_in_place = False  # one instance, both roles: a hand-over decodes on at once

    # ---- requests in
    def make_sequence(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        """Validate a request and build its sequence (not yet queued)."""
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        # `type(t) is int` leaves out bool; min and max run in C (a prompt has thousands of ids)
        if not all(type(t) is int for t in prompt_ids) or not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:
            bad = [t for t in prompt_ids if type(t) is not int or not 0 <= t < vocab]
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit + (params.max_tokens == 0):  # max_tokens 0: no output token
            lowered = limit < self.model_config.max_position_embeddings and self.config.fit_max_model_len
            why = " (the longest request the KV pool holds)" if lowered else ""
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; max_model_len {limit}{why} leaves no room "
                "for an output token"
            )
        if bad_stops := [t for t in params.stop_token_ids if t >= vocab]:
            raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab}): {bad_stops[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        seq = Sequence(request_id, prompt_ids, params, self.eos_token_ids)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs, seq.skip_prefix_cache = [None], True
        generator = None if params.seed is None else make_generator(params.seed, self.runner.device)
        seq.sampling = SamplingState(params, prompt_ids, seq.output_token_ids, self.eos_token_ids, generator)
        seq.stop_checker = StopChecker(params, self.tokenizer or _NO_TEXT, self.eos_token_ids)
        return seq

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        seq = self.make_sequence(prompt, params, request_id)
        self.enqueue(seq)
        return seq.request_id

    def enqueue(self, seq: Sequence) -> None:
        """Queue a sequence built by `make_sequence` (and perhaps marked for hand-over)."""
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (queued, running, receiving, held) and free its memory;
        False if there was none."""
        seq = self.requests.pop(request_id, None)
        background = self.background.abandon(seq) if seq is not None else None
        if background is not None:
            self.scheduler.abandon([background])  # the checkpoints its pass reserved
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq)
            return True
        return self.scheduler.release_lease(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._ahead is not None or self.background.busy()

    # ---- the loop
    def step(self) -> list[RequestOutput]:
        """One pass, and the outputs the host has seen since the last step. Running ahead
        (pdserve.engine.run_ahead), the step in flight is finished while the GPU runs the
        next one, so its outputs arrive one step later than without."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.reserve_tokens()
        scheduled_at = time.perf_counter()
        scheduled, background = self.background.split(self.scheduler.schedule())
        try:
            launched = self._launch(scheduled, ahead, scheduled_at) if scheduled else None
        except Exception:
            self.scheduler.abandon([background] if background else [])  # its reserved checkpoints
            raise
        self.background.beside(background, alone=launched is None and ahead is None)
        outputs = self._finish(ahead, pending=True) if ahead else []
        if launched is not None:
            if self.run_ahead and may_run_ahead(launched.seqs, self.decode_in_place):
                self._ahead = launched
            else:
                outputs += self._finish(launched)
        for done in self.background.take_done():
            outputs += self._end_background(done)
        return outputs

    def _end_background(self, done: BackgroundPass) -> list[RequestOutput]:
        """A background pass has run: its chunk counts as computed, its checkpoints commit,
        and the first token of a prompt it ended is taken."""
        began, item, seq = time.perf_counter(), done.item, done.seq
        seq.num_computed_tokens += item.num_new_tokens
        self.scheduler.reached_checkpoint(item)
        self._save_handed_over_end(item)
        self.prefill_rate.measured(item.num_new_tokens, done.started, began)
        outputs = [] if done.sampled is None else self.postprocess([seq], done.sampled, host=done.host)
        self.background.host.end = time.perf_counter() - began
        return outputs

    def _save_handed_over_end(self, item: ScheduledSeq) -> None:
        """The prompt-end checkpoint of a hand-over decoded in place, before a step run ahead."""
        if item.samples and item.seq.handoff and self.decode_in_place:
            self.scheduler.save_prompt_end(item.seq)

    def _launch(self, scheduled: list[ScheduledSeq], ahead: InFlight | None, scheduled_at: float) -> InFlight:
        self.last_pass = scheduled  # what a slow step ran (EngineThread's warning names it)
        try:
            logits = self.runner.execute(scheduled, ahead.patch_for(scheduled) if ahead else None)
        except Exception:
            self.scheduler.abandon(scheduled)  # the checkpoints it reserved, never filled
            raise
        sampling = [s.seq for s in scheduled if s.samples]
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.scheduler.reached_checkpoint(s)
            self._save_handed_over_end(s)
        prompt_tokens = sum(s.num_new_tokens for s in scheduled if s.num_new_tokens > 1)
        sampled = self.sampler.sample(logits, [seq.sampling for seq in sampling])
        return InFlight(sampling, sampled, scheduled_at, prompt_tokens)

    def _finish(self, step: InFlight, pending: bool = False) -> list[RequestOutput]:
        outputs = self.postprocess(step.seqs, step.sampled, pending=pending, host=step.host)
        self.prefill_rate.measured(step.prompt_tokens, step.scheduled_at, time.perf_counter())
        return outputs

    def postprocess(
        self,
        seqs: list[Sequence],
        sampled: SamplerOutput,
        pending: bool = False,
        host: HostCopy | None = None,
    ) -> list[RequestOutput]:
        """Take a step's sampled tokens to the host (`host`: copies already under way) and apply
        them; `pending`: each live sequence holds a PENDING token for it (a step that ran ahead)."""
        s = sampled
        rows = host.wait() if host is not None else (s.token_ids, s.logprobs, s.top_token_ids, s.top_logprobs)
        tokens, chosen, top_ids, top_values = rows
        token_ids = tokens.tolist()  # the one host synchronisation of a step
        logprobs = None if chosen is None else (chosen.tolist(), top_ids.tolist(), top_values.tolist())
        outputs = []
        for i, (seq, token) in enumerate(zip(seqs, token_ids, strict=True)):
            if seq.is_finished:  # aborted, or ended by the step before (this row ran ahead)
                continue
            if seq.params.max_tokens == 0:  # the prompt scored (prompt logprobs), no output token
                seq.finish_reason = "length"
                self.scheduler.finish(seq)
                self.requests.pop(seq.request_id, None)
                outputs.append(output_of(seq, [], ""))
                continue
            if pending:
                seq.output_token_ids[-1] = token
            else:
                seq.output_token_ids.append(token)
            if logprobs is not None and seq.params.logprobs is not None:
                chosen, top_ids, top_values = logprobs[0][i], logprobs[1][i], logprobs[2][i]
                n = seq.params.logprobs
                top = dict(zip(top_ids[:n], top_values[:n], strict=True))
                seq.logprobs.append({"token_id": token, "logprob": chosen, "top_logprobs": top})
            text_delta, finished = seq.stop_checker.append(token)
            if not finished and seq.num_tokens >= self.config.max_model_len:
                finished, seq.finish_reason = True, "length"
            lease_id = None
            if finished:
                seq.finish_reason = seq.finish_reason or seq.stop_checker.finish_reason
                seq.stop_reason = seq.stop_checker.stop_reason
                self.scheduler.finish(seq)
                self.requests.pop(seq.request_id, None)
            elif seq.handoff:
                if self.decode_in_place:
                    lease_id = self.scheduler.lease_decoding(seq).lease_id
                else:
                    lease_id = self.scheduler.hold(seq).lease_id
                self.requests.pop(seq.request_id, None)
            outputs.append(output_of(seq, [token], text_delta, lease_id))
        if self.scheduler.decoding:  # outputs of unclaimed leases wait in them
            outputs = [out for out in outputs if not self._kept_for_claim(out)]
        return outputs

    def _kept_for_claim(self, out: RequestOutput) -> bool:
        lease = self.scheduler.decoding.get(out.request_id)
        if lease is None or out.lease_id is not None:
            return False
        lease.outputs.append(out)
        return True

    # ---- hand-over: the decode side of a transfer, or both sides in one instance
    def reserve_transfer(self, seq: Sequence, num_pages: int) -> bool:
        """Memory for a sequence whose prompt state a transfer will fill (RECEIVING); False when
        it does not fit yet. Abort it to give the memory back."""
        if not self.scheduler.reserve(seq, num_pages):
            return False
        self.requests[seq.request_id] = seq
        return True

    def start_received(self, seq: Sequence, first_token: int, first_logprobs: list | None) -> None:
        """Its state has arrived: decode `seq` from `first_token`, sampled by the prefill side."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.prompt_logprobs = None  # the prefill side scored the prompt and returned them
        seq.output_token_ids.append(first_token)
        seq.stop_checker.append(first_token)  # replays the prefill side's detokenizer state
        replay_draws(seq.sampling, self.model_config.vocab_size, 1, self.runner.device)
        if first_logprobs:
            seq.logprobs.extend(first_logprobs)
        self.scheduler.start_received(seq)

    def resume_held(self, request_id: str, lease_id: str) -> list[RequestOutput] | None:
        """Decode here a sequence this engine handed over (one instance holding both roles,
        no copy): the outputs it made since its first token when it decoded on at once
        (`decode_in_place`), [] when it was HELD (it joins the batch now); None if its lease
        is gone."""
        decoding = self.scheduler.claim(request_id, lease_id)
        if decoding is not None:
            if not decoding.seq.is_finished:
                self.requests[request_id] = decoding.seq
            return decoding.outputs
        seq = self.scheduler.resume_held(request_id, lease_id)
        if seq is None:
            return None
        self.requests[request_id] = seq
        return []


class _NoText:
    """Decoder for engines without a tokenizer: token ids only, no text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


_NO_TEXT = _NoText()
