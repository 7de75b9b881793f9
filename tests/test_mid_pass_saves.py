"""Checkpoints taken inside a pass (pdserve.model.mid_pass_saves) equal the states of chunks that
stop there, op by op and through the engine; a chat prompt's resume point costs no pass."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams, ops
from pdserve.check import read_checkpoint
from pdserve.model import mid_pass_saves
from pdserve.model.mid_pass_saves import MidPassSaves
from tests.helpers import random_prompts

C, HISTORY, HK, HV, DK, DV = 64, 3, 2, 4, 32, 32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
CPU_RECURRENT_MAX = mid_pass_saves.RECURRENT_MAX


def _inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, C, generator=g)
    q = torch.randn(num_tokens, HK, DK, generator=g)
    k = torch.randn(num_tokens, HK, DK, generator=g)
    v = torch.randn(num_tokens, HV, DV, generator=g)
    gate = -F.softplus(torch.randn(num_tokens, HV, generator=g))
    beta = torch.rand(num_tokens, HV, generator=g)
    return x, q, k, v, gate, beta


def _stopping_chunks(x, q, k, v, gate, beta, weight, conv, recurrent, lengths, slots, saves):
    """The reference: each piece of each sequence a pass of its own, the slot copied after it."""
    conv_out, out, start = [], [], 0
    for length, slot, points in zip(lengths, slots, saves, strict=True):
        bounds = [0, *(o for o, _ in points), length]
        for r in range(len(bounds) - 1):
            s = slice(start + bounds[r], start + bounds[r + 1])
            one = torch.tensor([0, s.stop - s.start], dtype=torch.int32)
            ids = torch.tensor([slot])
            conv_out.append(ops.causal_conv1d_prefill(x[s], weight, one, conv, ids))
            out.append(ops.gdn_chunk_prefill(q[s], k[s], v[s], gate[s], beta[s], one, recurrent, ids))
            if r < len(points):
                ck = points[r][1]
                conv[ck], recurrent[ck] = conv[slot], recurrent[slot]
        start += length
    return torch.cat(conv_out), torch.cat(out)


# (chunk lengths, save points (offset, checkpoint) of each, which pieces run as recurrent steps)
CASES = {
    # 1, 0, 0 and 2 save points, one within the first W-1 tokens (the conv state still holds
    # history from before the pass), one past a 64-token scan chunk: every piece a chunked scan
    "long pieces": ([5, 7, 1, 90], [[(2, 4)], [], [], [(1, 5), (70, 6)]], [False, False, False]),
    # chat prompts' resume points: the whole pass chunked in order, each saving sequence cut at
    # its save point (no gathers), then the two- and three-token tails again from the slots
    "short tails": ([6, 3, 40, 9], [[(4, 4)], [(1, 5)], [(37, 6)], []], [False, True]),
    # one save each, a tail too long for recurrent steps: gathered pieces, the conv op saving
    "long tails": ([5, 90, 2, 3], [[(2, 4)], [(10, 5)], [], [(1, 6)]], [False, False]),
    # every chunk short, one save each at most: one recurrent piece whose scan saves on its way
    "all short": ([3, 2, 4, 1], [[(1, 4)], [(1, 5)], [(2, 6)], []], [True]),
    # every chunk short, one with two saves: a piece a round, each of recurrent steps
    "all short, two saves": ([3, 2, 4, 1], [[(1, 4)], [], [(1, 5), (3, 6)], []], [True, True, True]),
    # no save, every chunk short (cache hits' tails): one piece of recurrent steps
    "short, no saves": ([3, 1, 2, 4], [[], [], [], []], [True]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_saves_inside_a_pass_equal_chunks_that_stop_there(
    device: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four sequences packed with the save points of `case`: outputs and every state equal running
    each piece as a pass of its own and copying the slot after it (the CPU reference; on CUDA
    within fla's tf32 rounding), whether a piece runs as a chunked scan or recurrent steps."""
    monkeypatch.setattr(mid_pass_saves, "RECURRENT_MAX_CUDA", mid_pass_saves.RECURRENT_MAX)
    lengths, saves, recurrent_pieces = CASES[case]
    slots = [0, 1, 2, 3]
    inputs = _inputs(sum(lengths), seed=1)
    weight = torch.randn(C, HISTORY + 1, generator=torch.Generator().manual_seed(2))
    conv = torch.randn(7, C, HISTORY)
    recurrent = torch.randn(7, HV, DK, DV) * 0.1
    ref_conv, ref_recurrent = conv.clone(), recurrent.clone()
    ref_conv_out, ref_out = _stopping_chunks(*inputs, weight, ref_conv, ref_recurrent, lengths, slots, saves)

    x, q, k, v, gate, beta = (t.to(device) for t in inputs)
    conv, recurrent, weight = conv.to(device), recurrent.to(device), weight.to(device)
    saved = MidPassSaves.build(lengths, slots, saves, HISTORY, device)
    assert [piece.recurrent for piece in saved.pieces] == recurrent_pieces
    one_saving_piece = len(saved.pieces) == 1 and any(saves)  # the ops write the checkpoints
    assert [piece.save_at is not None for piece in saved.pieces] == [one_saving_piece] * len(saved.pieces)
    saves_once = max(map(len, saves)) == 1  # the conv op writes the conv checkpoints: no rows
    assert saved.num_saves == (0 if saves_once else sum(map(len, saves)))
    assert (saved.conv_save_at is not None) == saves_once
    cut = case == "short tails"  # the first piece is the whole pass in order, cut at the saves
    assert (saved.pieces[0].tokens is None) == (cut or len(saved.pieces) == 1)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    conv_out = saved.conv(x, weight, cu, conv, torch.tensor(slots, device=device))
    out = saved.scan(q, k, v, gate, beta, recurrent)

    tol = {"rtol": 1e-5, "atol": 1e-5} if device == "cpu" else {"rtol": 5e-3, "atol": 5e-3}
    torch.testing.assert_close(conv_out.cpu(), ref_conv_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv.cpu(), ref_conv, rtol=0, atol=0)
    torch.testing.assert_close(out.cpu(), ref_out, **tol)
    torch.testing.assert_close(recurrent.cpu(), ref_recurrent, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_recurrent_prefill_equals_the_chunked_scan(device: str) -> None:
    """`ops.gdn_recurrent_prefill` (a token at a time, one launch on CUDA) gives the chunked
    scan's outputs and final states: sequences of 1 to 300 tokens packed, grouped value heads,
    slots out of order; on CUDA against the CPU reference, within fla's tf32 rounding."""
    lengths, slots = [1, 7, 64, 130, 300], [5, 0, 3, 6, 2]
    x, q, k, v, gate, beta = _inputs(sum(lengths), seed=3)
    pool = torch.randn(7, HV, DK, DV, generator=torch.Generator().manual_seed(4)) * 0.1
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    ref_pool = pool.clone()
    ref = ops.gdn_chunk_prefill(q, k, v, gate, beta, cu, ref_pool, torch.tensor(slots))
    on = [t.to(device) for t in (q, k, v, gate, beta, cu, pool, torch.tensor(slots))]
    out = ops.gdn_recurrent_prefill(*on)
    tol = {"rtol": 1e-4, "atol": 1e-4} if device == "cpu" else {"rtol": 5e-3, "atol": 5e-3}
    torch.testing.assert_close(out.cpu(), ref, **tol)
    torch.testing.assert_close(on[6].cpu(), ref_pool, **tol)
    untouched = [s for s in range(7) if s not in slots]
    torch.testing.assert_close(on[6][untouched].cpu(), pool[untouched], rtol=0, atol=0)


def test_no_saves_build_a_plan_only_for_short_chunks_and_bad_offsets_are_refused() -> None:
    assert MidPassSaves.build([5, 1], [0, 1], [[], []], HISTORY, "cpu") is None  # a chunk too long
    short = MidPassSaves.build([4, 1], [0, 1], [[], []], HISTORY, "cpu")  # no save, all short
    assert short is not None and short.num_saves == 0
    assert [piece.recurrent for piece in short.pieces] == [True]
    assert short.pieces[0].tokens is None  # the whole pass in order: scanned without a gather
    for bad in ([(0, 3)], [(4, 3)], [(2, 3), (2, 5)], [(3, 3), (1, 5)]):
        with pytest.raises(ValueError, match="inside a chunk"):
            MidPassSaves.build([4, 1], [0, 1], [bad, []], HISTORY, "cpu")


def _prefill_passes(llm: LLM) -> list[int]:
    """Record the tokens of every pass the engine runs from now on."""
    runner, passes = llm.engine.runner, []
    execute = runner.execute

    def counted(scheduled: list, *args: object) -> torch.Tensor:
        passes.append(sum(s.num_new_tokens for s in scheduled))
        return execute(scheduled, *args)

    runner.execute = counted
    return passes


@pytest.mark.parametrize("recurrent_max", [CPU_RECURRENT_MAX, 512])
def test_resume_point_is_saved_in_the_prompts_one_pass(
    cached_llm: LLM, recurrent_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt ending with a resume suffix runs as one pass (packed with another), and its
    resume checkpoint holds the state of the body alone: a prompt that stops there. Whether the
    GDN layers scan the pass in two pieces (chunked, then the tails) or, every chunk short, in one
    recurrent scan saving on its way (CUDA's path for chat prompts, `RECURRENT_MAX_CUDA`)."""
    monkeypatch.setattr(mid_pass_saves, "RECURRENT_MAX", recurrent_max)
    engine, cache = cached_llm.engine, cached_llm.engine.prefix_cache
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    body, suffix, other = random_prompts((100, 3, 57), seed=41)
    cached_llm.generate(body, one)
    (alone,) = [read_checkpoint(engine, e) for e in cache.entries.values() if e.kind == "end"]
    cache.clear()
    cache.resume_suffixes = [tuple(suffix)]
    passes = _prefill_passes(cached_llm)
    try:
        cached_llm.generate([body + suffix, other], one)
    finally:
        del engine.runner.execute
    # one prefill pass (then, running a step ahead, perhaps a decode step of one token each)
    assert passes[0] == len(body) + len(suffix) + len(other) and all(p <= 2 for p in passes[1:])
    (resume,) = [e for e in cache.entries.values() if e.kind == "resume"]
    assert resume.num_tokens == len(body)
    inside = read_checkpoint(engine, resume)
    # the recurrent steps batch the live sequences: packed with another prompt, they round apart
    # from the body alone at fp32's last bits, and so do the later layers' conv inputs
    exact = {"rtol": 0, "atol": 0} if recurrent_max == CPU_RECURRENT_MAX else {}
    torch.testing.assert_close(inside.conv, alone.conv, **exact)
    torch.testing.assert_close(inside.recurrent, alone.recurrent)
