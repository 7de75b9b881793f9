"""The prefill-pass benchmark's passes (`pdserve.ops.bench_prefill_step`): `PxL[@S][+C]` builds P
prompts of L new tokens after C cached tokens each, saving a checkpoint after S, as the engine
lays out a chat turn's pass; on the CPU with the tiny model (the benchmark itself runs on CUDA)."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM
from pdserve.ops import bench_prefill_step
from pdserve.ops.bench_prefill_step import PassSpec, prefill_batch


def test_pass_specs_parse_and_refuse() -> None:
    assert PassSpec.parse("30x271@267+2200") == PassSpec(30, 271, 267, 2200)
    assert PassSpec.parse("4x2048") == PassSpec(4, 2048)
    assert PassSpec.parse("8x1024~7") == PassSpec(8, 1024, decoding=7)
    assert str(PassSpec(8, 1024, decoding=7)) == "8 x 1024 + 7 decoding"
    assert str(PassSpec(2, 9, 5, 20)) == "2 x 9, saving after 5, after 20 cached"
    for bad in ("4x8@8", "0x8", "4x8+-1", "4", "4x8~-1"):
        with pytest.raises(ValueError):
            PassSpec.parse(bad)


def test_a_chat_turns_pass_saves_its_checkpoints_after_its_context(plain_llm: LLM) -> None:
    runner = plain_llm.engine.runner
    free = runner.state_pool.num_free
    batch, tables, slots = prefill_batch(runner, PassSpec(3, 9, 5, 20))
    assert batch.positions.tolist() == list(range(20, 29)) * 3
    assert len(slots) == 6 and runner.state_pool.num_free == free - 6
    checkpoints = torch.tensor(slots[3:])
    assert not runner.state_pool.recurrent[:, checkpoints].any()
    with torch.inference_mode():
        hidden = runner.model(batch)
    assert torch.isfinite(hidden).all()
    assert runner.state_pool.recurrent[:, checkpoints].abs().sum(dim=(0, 2, 3, 4)).gt(0).all()
    for table in tables:
        runner.kv_pool.free(table)
    for slot in slots:
        runner.state_pool.free(slot)


def test_decoding_sequences_ride_beside_the_prompts(plain_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """`~D`: D sequences of one new token each after DECODE_CONTEXT, after the prompts (a c=32
    wave's mixed pass), each in a state slot and pages of its own."""
    monkeypatch.setattr(bench_prefill_step, "DECODE_CONTEXT", 30)
    runner = plain_llm.engine.runner
    batch, tables, slots = prefill_batch(runner, PassSpec(2, 9, decoding=3))
    assert batch.positions.tolist() == list(range(9)) * 2 + [30] * 3
    assert batch.cu_seqlens.tolist() == [0, 9, 18, 19, 20, 21] and len(set(slots)) == 5
    with torch.inference_mode():
        assert torch.isfinite(runner.model(batch)).all()
    for table in tables:
        runner.kv_pool.free(table)
    for slot in slots:
        runner.state_pool.free(slot)
