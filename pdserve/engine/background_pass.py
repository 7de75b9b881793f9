"""A long prompt's chunk computed beside the decode steps (issue 12: short streams keep their
inter-token latency while a 262K-token prompt prefills).

In a mixed step the decode rows wait for the step's prompt chunk, whose attention grows with the
context already cached (~100 ms a 1K-token chunk at 262K). So when a step would carry other rows
(decoding, or short prompts admitted beside it) and a chunk of a sequence of at least
`EngineConfig.background_prefill_tokens` tokens, the engine takes that chunk out of the step and
runs it as a BACKGROUND PASS (every chunk of a long prompt, its first ones too: session 24's
131K-token prompt ran its first four 8K chunks in mixed steps of 115-183 ms, the decode rows'
worst gaps, when the trigger was a chunk ending past the threshold):
  - its layers are launched a few at a time between the foreground steps, from the one engine
    thread (`Qwen3MoeHybrid.forward_layers`), on a stream of its own: on a GPU a stream of a CUDA
    green context holding `background_prefill_sms` SMs, so the decode steps (the default stream,
    the whole device) always have the other SMs (measured by `pdserve.ops.bench_overlap`); on a
    CPU the layers simply run in turn between the steps;
  - the stream first waits for everything the default stream queued before the pass (the slot's
    zeroing, a cache restore, the previous chunk's checkpoint copy);
  - the sequence stays RUNNING but out of the scheduler's batches (`Sequence.in_background`) and
    out of its preemption; it is finished by the engine once the pass's done event has fired:
    then its computed tokens advance, its checkpoints commit and, for the prompt's last chunk,
    its first token is taken (sampled on the background stream);
  - an abort waits for the pass (its pages and slot are in use on the GPU until then).
Outputs are those of the same chunks run in the foreground, token for token: a pass reads and
writes only its own sequence's pages and slot.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence
from pdserve.pinned import HostCopy
from pdserve.sampling.sampler import Sampler, SamplerOutput

QUEUED_LAYERS = 3  # on a GPU: keep this many layers launched ahead of the background stream
LAYERS_PER_STEP = 4  # at most this many launched between two foreground steps (their host time)
# the host time a step may spend starting the pass and launching its layers once the step is
# launched is `EngineConfig.background_launch_ms`: an 8K-token chunk's layer takes 2-3 ms to
# launch (GDN), 5-6 ms (attention), so at 5 ms a step launches ~2 and a 131K prompt's first
# chunks waited for their launches (220-274 ms for ~170 ms of GPU work, H100, session 32)
DECODE_SMS = 32  # SMs a green context leaves to the decode steps by default
# an express pass (a short prompt beside a long one's) launches layers until the step's host
# budget is spent, however many wait: its TTFT is the pacing (a 128-token layer is ~0.5 ms)
EXPRESS_LAYERS = 1000


def background_stream(device: torch.device, sms: int | None) -> torch.cuda.Stream | None:
    """The stream background passes run on: a CUDA green context's of `sms` SMs (None: all but
    `DECODE_SMS`; 0, or no green contexts in this torch: a low-priority stream of the whole
    device); None on a CPU."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).multi_processor_count
    sms = max(8, total - DECODE_SMS) if sms is None else sms
    green = getattr(torch.cuda, "green_contexts", None)
    if sms and sms < total and green is not None and green.SUPPORTED:
        context = torch.cuda.GreenContext.create(num_sms=sms, device_id=device.index or 0)
        stream = context.Stream()
        stream.green_context = context  # the context lives as long as its stream
        return stream
    return torch.cuda.Stream(device, priority=0)


class BackgroundPass:
    """One prompt chunk's pass on the background stream, launched a few layers at a time."""

    def __init__(
        self, runner: ModelRunner, sampler: Sampler, item: ScheduledSeq, stream: torch.cuda.Stream | None
    ) -> None:
        self.item = item
        self.stream = stream
        self.started = time.perf_counter()
        self.sampled: SamplerOutput | None = None
        self.host: HostCopy | None = None
        self._runner, self._sampler = runner, sampler
        self._layer_done: list[torch.cuda.Event] = []
        self._done: torch.cuda.Event | None = None
        self._finished_on_host = False
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(runner.device))
        with self._on_stream():
            self._batch = runner.build_batch([item])
            self._layers = runner.model.forward_layers(self._batch)
        item.seq.in_background = True

    @property
    def seq(self) -> Sequence:
        return self.item.seq

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _queued(self) -> int:
        """Layers launched that the GPU has not finished."""
        while self._layer_done and self._layer_done[0].query():
            self._layer_done.pop(0)
        return len(self._layer_done)

    def advance(self, until: float, layers: int = LAYERS_PER_STEP, queue: int = QUEUED_LAYERS) -> int:
        """Launch the next layers: up to `layers`, on a GPU only while fewer than `queue` wait
        there (the queue stays short, so the host time goes where it pays), and past the host
        clock's `until` only while none waits (the stream never idles for it). Returns how many
        it launched."""
        for launched in range(layers):
            if self.launched_all():
                return launched
            if self.stream is not None:
                queued = self._queued()
                if queued >= queue or (queued and time.perf_counter() >= until):
                    return launched
            self._launch_one()
        return layers

    def run_to_end(self) -> None:
        """Launch what is left and wait for it (nothing else to run beside it, or an abort)."""
        while not self.launched_all():
            self._launch_one()
        if self._done is not None:
            self._done.synchronize()

    def launched_all(self) -> bool:
        return self._done is not None or self._finished_on_host

    def _launch_one(self) -> None:
        with self._on_stream(), torch.inference_mode():
            try:
                next(self._layers)
            except StopIteration as end:
                self._end(end.value)
                return
            if self.stream is not None:
                self._layer_done.append(self.stream.record_event())

    def _end(self, hidden: torch.Tensor) -> None:
        """The last layer is launched: logits and the first token if the prompt ends here."""
        if self.item.samples:
            logits = self._runner.model.compute_logits(hidden[self._batch.logits_indices])
            self.sampled = self._sampler.sample(logits, [self.seq.sampling])
            s = self.sampled
            self.host = HostCopy(s.token_ids, s.logprobs, s.top_token_ids, s.top_logprobs)
        if self.stream is not None:
            self._done = self.stream.record_event()
        else:
            self._finished_on_host = True
        self._batch = None  # its tensors are freed on the background stream, its own blocks

    def done(self) -> bool:
        """The GPU has run the whole pass."""
        if self._done is not None:
            return self._done.query()
        return self._finished_on_host


@dataclass(slots=True)
class BackgroundHostTime:
    """The host time one step spent on the background pass, by part (seconds): starting it (its
    batch built and copied, the stream's wait queued), launching its layers (`layers` of them),
    ending it (its chunk committed: checkpoints, evictions, the first token taken)."""

    start: float = 0.0
    launch: float = 0.0
    end: float = 0.0
    layers: int = 0

    @property
    def total(self) -> float:
        return self.start + self.launch + self.end


class BackgroundLane:
    """The engine's background passes: a long prompt's chunk (`current`), and beside it at most
    one other prompt chunk (`express`, see `split`); which chunk of a step goes there (`split`),
    starting and pacing them while the rest of the step runs (`beside`), the passes the GPU has
    finished (`take_done`), and an abort's wait (`abandon`)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, config: EngineConfig) -> None:
        self.runner, self.sampler = runner, sampler
        # a chunk of a sequence of at least this many tokens goes to the background (0: never)
        self.threshold = config.background_prefill_tokens
        self.sms = config.background_prefill_sms
        self.takes_express = config.express_prefill
        self.launch_s = config.background_launch_ms / 1000
        self.current: BackgroundPass | None = None
        self.express: BackgroundPass | None = None
        self.host = BackgroundHostTime()  # the last step's host time on the passes
        self._stream: torch.cuda.Stream | None = None  # made at the first pass

    def stream(self) -> torch.cuda.Stream | None:
        """The passes' stream (made at the first call; None on a CPU or with the lane off).
        Warm-up runs the long-prompt attention on it too: a green context is a CUDA context of
        its own, into which kernels load at their first launch there."""
        if self._stream is None and self.threshold:
            self._stream = background_stream(self.runner.device, self.sms)
        return self._stream

    def busy(self) -> bool:
        return self.current is not None or self.express is not None

    def split(self, scheduled: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], ScheduledSeq | None]:
        """(the step, a prompt chunk taken out of it for a background pass), in a step that also
        runs other sequences (decoding, or other prompts):
          - while no pass runs: a chunk of a sequence of at least the threshold's tokens;
          - while a long prompt's pass runs, with `express`: any prompt chunk, as the EXPRESS
            pass. On the decode steps' SMs beside the long pass, a short prompt's chunk (128
            tokens read nearly every expert's weights) made a step of 27-70 ms, a gap in every
            stream (H200, session 28); on the background stream it delays none of them.
        Prompts scored in their passes (prompt logprobs) stay in the foreground."""
        if not self.threshold or len(scheduled) < 2:
            return scheduled, None
        express = self.takes_express and self.current is not None and self.express is None
        for item in scheduled:
            seq = item.seq
            if item.num_new_tokens < 2 or seq.prompt_logprobs is not None:
                continue
            if express or (self.current is None and seq.num_tokens >= self.threshold):
                return [s for s in scheduled if s is not item], item
        return scheduled, None

    def beside(self, item: ScheduledSeq | None, alone: bool) -> None:
        """While the GPU runs the step just launched: start `item`'s pass (its batch built now,
        not before the step's launch) and launch the next layers: the express pass's first, as
        many as the step's host budget allows, then the long pass's; all of them when the step
        launched nothing (`alone`)."""
        began, self.host = time.perf_counter(), BackgroundHostTime()
        if item is not None:
            started = BackgroundPass(self.runner, self.sampler, item, self.stream())
            if self.current is None:
                self.current = started
            else:
                self.express = started
            self.host.start = time.perf_counter() - began
        if not self.busy():
            return
        launching = time.perf_counter()
        until = began + self.launch_s
        if alone:  # nothing else to run: they may take the whole step
            for running in (self.express, self.current):
                if running is not None:
                    running.run_to_end()
        elif self.express is not None and not self.express.launched_all():
            self.host.layers = self.express.advance(until, layers=EXPRESS_LAYERS, queue=EXPRESS_LAYERS)
        elif self.current is not None:
            self.host.layers = self.current.advance(until)
        self.host.launch = time.perf_counter() - launching

    def take_done(self) -> list[BackgroundPass]:
        """The passes the GPU has run all of (no longer the lane's then)."""
        done = []
        if self.express is not None and self.express.done():
            done.append(self.express)
            self.express = None
        if self.current is not None and self.current.done():
            done.append(self.current)
            self.current = None
        for finished in done:
            finished.seq.in_background = False
        return done

    def abandon(self, seq: Sequence) -> ScheduledSeq | None:
        """`seq`'s pass, waited for (its pages and slot are in use on the GPU until it ends) and
        dropped: its chunk, whose reserved checkpoints the caller frees; None if it has none."""
        for running in (self.express, self.current):
            if running is not None and running.seq is seq:
                running.run_to_end()
                if running is self.express:
                    self.express = None
                else:
                    self.current = None
                seq.in_background = False
                return running.item
        return None
