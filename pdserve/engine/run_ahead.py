"""Running one step ahead: step N+1 goes to the GPU before step N's tokens reach the host.

Without it every step is launch -> wait for the sampled tokens -> host bookkeeping (stop
checks, detokenising, outputs) -> schedule and build the next step, and the GPU idles through
the host part. With it, the engine keeps the last step IN FLIGHT (its sampled tokens still on
the device) and its next `step()`:
  1. gives every in-flight sequence a PENDING token (so the scheduler sees the one token it
     will decode), schedules and launches step N+1, whose input reads those tokens on the
     device (`InFlight.patch_for`: a gather from the sampled-token tensor into the input ids);
  2. then finishes step N on the host (the sync waits for step N, not N+1), replacing each
     PENDING token by the sampled one; a sequence that step N ended (EOS, stop string, length)
     was computed once more by step N+1: that row's token is dropped;
  3. keeps step N+1 in flight if every sequence of it may run ahead, else finishes it too.
A sequence may run ahead unless its next step depends on the host seeing its token: a
hand-over (it becomes HELD after its first token; not in one instance holding both roles, which
decodes it on at once: its prompt-end checkpoint is copied when its last chunk is launched),
penalties (token counts), a grammar (the matcher advances by the token), or a prompt-only
request (max_tokens 0). Served from one instance, every prefill pass carries hand-overs: before,
none ran ahead, and the GPU idled through the host's work after each one and before the next.

Outputs are the same as without it, token for token: the same passes run in the same order
on one stream; only when the host learns of them moves (one step later).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence
from pdserve.pinned import HostCopy, to_device
from pdserve.sampling.sampler import SamplerOutput

PENDING = -1  # an output token sampled on the device, not yet seen by the host
# where a pass's input ids hold PENDING tokens: (flat input positions, rows of the in-flight
# step's sampled tokens, those tokens on the device)
TokenPatch = tuple[list[int], list[int], torch.Tensor]


@dataclass(slots=True)
class InFlight:
    """A launched step: its sampling sequences (row order) and their tokens, on the device,
    already on their way to pinned host memory (`host`), so that finishing this step waits for
    this step only, not for the one launched after it."""

    seqs: list[Sequence]
    sampled: SamplerOutput
    scheduled_at: float = 0.0  # perf_counter() when the step was scheduled
    prompt_tokens: int = 0  # prompt tokens computed in it (pdserve.engine.prefill_rate)
    host: HostCopy = field(init=False)

    def __post_init__(self) -> None:
        s = self.sampled
        self.host = HostCopy(s.token_ids, s.logprobs, s.top_token_ids, s.top_logprobs)

    def reserve_tokens(self) -> None:
        """Give each live sequence its PENDING token before the next step is scheduled."""
        for seq in self.seqs:
            if not seq.is_finished:
                seq.output_token_ids.append(PENDING)

    def patch_for(self, scheduled: list[ScheduledSeq]) -> TokenPatch | None:
        """Where the next pass's input holds a PENDING token; None when it holds none."""
        row_of = {seq: row for row, seq in enumerate(self.seqs)}
        positions, rows, offset = [], [], 0
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            row = row_of.get(seq)
            pending = seq.num_tokens - 1
            waits = row is not None and seq.output_token_ids[-1:] == [PENDING]
            if waits and start <= pending < start + s.num_new_tokens:
                positions.append(offset + pending - start)
                rows.append(row)
            offset += s.num_new_tokens
        return (positions, rows, self.sampled.token_ids) if positions else None


def may_run_ahead(seqs: list[Sequence], decode_in_place: bool = False) -> bool:
    """True when none of `seqs` needs the host to see its token before its next step. A hand-over
    does, unless the engine decodes it in place (`LLMEngine.decode_in_place`)."""
    for seq in seqs:
        p = seq.params
        if seq.handoff and not decode_in_place:
            return False
        if p.max_tokens == 0 or getattr(p, "structured_outputs", None) is not None:
            return False
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            return False
    return True


def apply_patch(input_ids: torch.Tensor, patch: TokenPatch | None) -> None:
    """Write the in-flight step's sampled tokens into a pass's input ids, on the device."""
    if patch is None:
        return
    positions, rows, tokens = patch
    device = input_ids.device
    index, where = to_device(rows, torch.int64, device), to_device(positions, torch.int64, device)
    input_ids.index_copy_(0, where, tokens.index_select(0, index).to(input_ids.dtype))
