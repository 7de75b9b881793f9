"""`ForwardBatch.build`'s layout of a packed pass, against the per-token rule: token p of a
sequence has position p and KV slot table[p // page] * page + p % page; `cu_seqlens`, `seq_lens`
and the logits rows follow the sequences' lengths. Prompt chunks start anywhere in a page (a
cache hit, a chunk after a chunk) and may lie inside one page; decode tokens are chunks of one."""

from __future__ import annotations

import random

import pytest

from pdserve.model.forward_batch import ForwardBatch


@pytest.mark.parametrize("page", [1, 16])
def test_positions_and_kv_slots_follow_the_per_token_rule(page: int) -> None:
    rng = random.Random(page)
    for _ in range(30):
        n = rng.randint(1, 6)
        starts = [rng.choice([0, rng.randint(0, 300)]) for _ in range(n)]
        lengths = [rng.choice([1, rng.randint(1, 40), rng.randint(1, 300)]) for _ in range(n)]
        tables = [
            rng.sample(range(5000), -(-(s + length) // page))
            for s, length in zip(starts, lengths, strict=True)
        ]
        tokens = [[rng.randrange(1000) for _ in range(length)] for length in lengths]
        batch = ForwardBatch.build(tokens, starts, tables, list(range(n)), page, "cpu")
        spans = [range(s, s + length) for s, length in zip(starts, lengths, strict=True)]
        assert batch.positions.tolist() == [p for span in spans for p in span]
        want = [t[p // page] * page + p % page for t, span in zip(tables, spans, strict=True) for p in span]
        assert batch.slot_mapping.tolist() == want
        assert batch.input_ids.tolist() == sum(tokens, [])
        ends = [sum(lengths[: i + 1]) for i in range(n)]
        assert batch.cu_seqlens.tolist() == [0, *ends]
        assert batch.logits_indices.tolist() == [e - 1 for e in ends]
        assert batch.seq_lens.tolist() == [s + length for s, length in zip(starts, lengths, strict=True)]
        assert batch.is_decode == all(length == 1 for length in lengths)
