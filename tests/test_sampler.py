"""The batched Sampler (CPU, no downloads): greedy is the argmax, top-k / top-p / min-p mask what
they should and sample what they keep, seeded rows reproduce whatever the batch, samples follow
the softmax of the scaled logits; penalties and min_tokens computed by hand; logprobs raw and
sorted. SamplingParams and the StopChecker are tests/test_sampling.py's."""

from __future__ import annotations

import pytest
import torch

from pdserve.sampling import Sampler, SamplingParams, SamplingState, SamplingTensors
from pdserve.sampling.sampler import apply_min_p, apply_penalties, apply_top_k_top_p


def states(*params: SamplingParams, prompt=(1, 2), output=(), eos=(0,)) -> list[SamplingState]:
    out = []
    for p in params:
        s = SamplingState.create(p, list(prompt), eos)
        s.output_token_ids.extend(output)
        out.append(s)
    return out


def sample(logits: torch.Tensor, *params: SamplingParams, **kw) -> torch.Tensor:
    return Sampler().sample(logits, states(*params, **kw)).token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = sample(logits, *[SamplingParams(temperature=0.0)] * 8)
    assert got.dtype == torch.int64 and torch.equal(got, logits.float().argmax(-1))


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(1)) * 0.5
    assert torch.equal(sample(logits, *[SamplingParams(top_k=1)] * 64), logits.argmax(-1))
    assert torch.equal(sample(logits, *[SamplingParams(top_p=1e-9)] * 64), logits.argmax(-1))
    # without the filters the same flat logits do not sample the argmax every time
    assert not torch.equal(sample(logits, *[SamplingParams()] * 64), logits.argmax(-1))


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    vocab, steps = 1000, 12
    # bf16 logits: many ties, which a sort and a top-k may order differently
    rows = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(2)).bfloat16()
    seeded = SamplingParams(seed=7, top_k=20, top_p=0.9)
    alone = states(seeded)
    crowded = states(SamplingParams(), SamplingParams(temperature=0.0), seeded, SamplingParams(seed=8))
    got_alone, got_crowded = [], []
    for step in range(steps):
        noise = torch.randn(4, vocab).bfloat16()
        noise[2] = rows[step]
        got_alone.append(Sampler().sample(rows[step : step + 1], alone).token_ids.item())
        out = Sampler().sample(noise, crowded).token_ids
        got_crowded.append(out[2].item())
    other = states(SamplingParams(seed=8, top_k=20, top_p=0.9))
    got_other_seed = [Sampler().sample(rows[s : s + 1], other).token_ids.item() for s in range(steps)]
    assert got_alone == got_crowded
    assert got_alone != got_other_seed


def test_samples_follow_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20_000, 1)
    torch.manual_seed(0)
    got = sample(logits, *[SamplingParams(temperature=2.0)] * 20_000)
    freq = torch.bincount(got, minlength=4).float() / got.numel()
    assert torch.allclose(freq, (logits[0] / 2.0).softmax(-1), atol=0.015)


def test_filters_mask_what_they_should() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3, 1)
    kept = apply_top_k_top_p(logits, torch.tensor([2, 4, 1]), None).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.75, 0.85, 1.0])).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True, True, True, False], [True] * 4]
    # top-p sees the distribution renormalised over the top-k: [.5, .3] -> [.625, .375]
    kept = apply_top_k_top_p(logits[:1], torch.tensor([2]), torch.tensor([0.6])).isfinite()
    assert kept.tolist() == [[True, False, False, False]]
    kept = apply_min_p(logits, torch.tensor([0.2, 0.5, 0.0])).isfinite()  # thresholds .1, .25, 0
    assert kept.tolist() == [[True, True, True, False], [True, True, False, False], [True] * 4]


def test_top_k_fast_path_matches_full_sort() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 1000, generator=gen)
    top_k = torch.randint(1, 60, (16,), generator=gen)
    top_p = torch.rand(16, generator=gen).clamp(min=0.05)
    fast = apply_top_k_top_p(logits, top_k, top_p, max_top_k=int(top_k.max()))
    full = apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(fast, full)
    assert ((fast.isfinite().sum(-1) <= top_k) & (fast.isfinite().sum(-1) >= 1)).all()
    assert torch.equal(fast.argmax(-1), logits.argmax(-1))
    ties = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])  # ties with the k-th value stay, whatever the path
    for max_top_k in (2, None):
        kept = apply_top_k_top_p(ties, torch.tensor([2]), torch.tensor([0.9]), max_top_k).isfinite()
        assert kept.tolist() == [[True, True, True, True, False]]


def test_min_p_never_samples_below_threshold() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(5000, 1)
    got = sample(logits, *[SamplingParams(min_p=0.2)] * 5000)
    assert set(got.tolist()) == {0, 1, 2}


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    reqs = states(p, prompt=[0], output=[1, 3, 3])
    got = apply_penalties(logits.clone(), SamplingTensors.from_requests(reqs, 5, logits.device))
    # token 0 (prompt): 2/2; 1: -1*2 - 0.5 - 0.25; 2: untouched; 3: 3/2 - 2*0.5 - 0.25; 4: untouched
    assert torch.allclose(got, torch.tensor([[1.0, -2.75, 0.5, 0.25, -2.0]]))
    assert Sampler().sample(logits, reqs).token_ids.item() == 0 != logits.argmax().item()  # greedy, penalised
    only_rep = states(SamplingParams(repetition_penalty=0.5), prompt=[4], output=[2])
    got = apply_penalties(logits.clone(), SamplingTensors.from_requests(only_rep, 5, logits.device))
    assert torch.allclose(got, torch.tensor([[2.0, -1.0, 1.0, 3.0, -1.0]]))


def test_logprobs_are_raw_and_sorted() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(logprobs=3, temperature=0.3, repetition_penalty=1.7),
        SamplingParams(),
        SamplingParams(logprobs=5, presence_penalty=2.0),
    ]
    out = Sampler().sample(logits, states(*params, output=[5, 6, 7]))
    raw = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == out.top_token_ids.shape == (3, 5)
    assert torch.allclose(out.top_logprobs, raw.gather(1, out.top_token_ids))
    assert torch.equal(out.top_token_ids, raw.argsort(-1, descending=True)[:, :5])
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert Sampler().sample(logits, states(*[SamplingParams()] * 3)).logprobs is None


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 0] = logits[:, 9] = 50.0  # eos (0) and a stop token (9) dominate
    for temperature in (0.0, 1.0):
        p = SamplingParams(min_tokens=2, stop_token_ids=[9], temperature=temperature)
        assert not set(sample(logits, p, p, output=[4]).tolist()) & {0, 9}
        assert set(sample(logits, p, p, output=[4, 4]).tolist()) <= {0, 9}
    ignore = SamplingParams(min_tokens=2, ignore_eos=True, temperature=0.0)
    assert sample(logits, ignore, ignore, output=[4]).tolist() == [0, 0]


def test_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(3, 10), SamplingParams())
