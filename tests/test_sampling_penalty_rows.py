"""Penalties touch only the rows that ask for one, and only those rows' tokens are counted.

A batch of greedy rows running one step ahead (pdserve.engine.run_ahead) holds PENDING (-1)
output tokens; a penalised request in the same batch never does (its step does not run ahead).
Its histogram is built over its own tokens alone, so the PENDING rows never reach it.
"""

from __future__ import annotations

import torch

from pdserve.engine.run_ahead import PENDING
from pdserve.sampling import Sampler, SamplingParams, SamplingState, SamplingTensors
from pdserve.sampling.sampler import apply_penalties

VOCAB = 7


def state(params: SamplingParams, prompt: list[int], output: list[int]) -> SamplingState:
    s = SamplingState.create(params, prompt)
    s.output_token_ids.extend(output)
    return s


def test_mixed_batch_penalises_its_penalty_rows_as_alone() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    rep = SamplingParams(repetition_penalty=1.8, frequency_penalty=0.4)
    pres = SamplingParams(presence_penalty=1.1)
    batch = [
        state(SamplingParams(), [1, 2], [3, PENDING]),  # running ahead: its last token is on the device
        state(rep, [0, 5], [5, 5, 6]),
        state(SamplingParams(), [4], [PENDING]),
        state(pres, [2], [1, 1, 4]),
    ]
    t = SamplingTensors.from_requests(batch, VOCAB, logits.device)
    assert t.penalty_rows is not None and t.penalty_rows.tolist() == [1, 3]
    assert t.output_counts is not None and tuple(t.output_counts.shape) == (2, VOCAB)
    got = apply_penalties(logits.clone(), t)
    for row in (0, 2):  # untouched, bit for bit
        assert torch.equal(got[row], logits[row])
    for row in (1, 3):  # as the request alone in its own batch
        alone = SamplingTensors.from_requests([batch[row]], VOCAB, logits.device)
        assert torch.equal(got[row], apply_penalties(logits[row : row + 1].clone(), alone)[0])
    assert not torch.equal(got[1], logits[1]) and not torch.equal(got[3], logits[3])


def test_penalty_row_changes_its_pick_and_no_other() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0.0, 0.0, 0.0]]).repeat(3, 1)
    greedy = SamplingParams(temperature=0.0)
    batch = [
        state(greedy, [0], [PENDING]),
        state(SamplingParams(temperature=0.0, frequency_penalty=2.0), [0], [1, 1, 1]),  # 5 - 6 < 1
        state(greedy, [0], [1]),
    ]
    assert Sampler().sample(logits, batch).token_ids.tolist() == [1, 2, 1]


def test_no_penalty_no_histogram() -> None:
    batch = [state(SamplingParams(), [1], [PENDING]), state(SamplingParams(temperature=0.5), [2], [3])]
    t = SamplingTensors.from_requests(batch, VOCAB, torch.device("cpu"))
    assert t.penalty_rows is None and t.output_counts is None and t.prompt_mask is None
