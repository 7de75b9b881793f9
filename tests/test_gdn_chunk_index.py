"""The chunked GDN scan's chunk index, made on the host (`ops.gdn_chunk_index`): what a pass and
each chunked piece of a saving pass hand the scan, so that fla need not read cu_seqlens on the
host (a sync that waits for the step in flight). The CUDA side, that a pass then never waits for
the device, is tests/test_gpu.py's `test_cuda_prefill_pass_never_waits_for_the_device`."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from pdserve import ops
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.mid_pass_saves import MidPassSaves
from tests.ops_helpers import DK, DV, POOL_SLOTS, cu_seqlens, gdn_inputs


def chunks_by_token(lengths: list[int], chunk: int) -> list[tuple[int, int]]:
    """Each token's (sequence, chunk within it), in packed order, repeats dropped: the index
    another way, token by token."""
    pairs = [(n, t // chunk) for n, length in enumerate(lengths) for t in range(length)]
    return [p for i, p in enumerate(pairs) if i == 0 or p != pairs[i - 1]]


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_index_lists_every_chunk_of_every_sequence(chunk: int) -> None:
    lengths = [1, 63, 64, 65, 200, 3]
    flat = ops.gdn_chunk_index(lengths, chunk)
    assert list(zip(flat[::2], flat[1::2], strict=True)) == chunks_by_token(lengths, chunk)


def test_a_prefill_batch_carries_its_chunk_index_and_a_decode_batch_none() -> None:
    tables, slots = [[0, 1, 2, 3, 4, 5, 6, 7, 8], [9]], [3, 5]
    prefill = ForwardBatch.build([[7] * 130, [8] * 5], [0, 2], tables, slots, 16, "cpu")
    assert prefill.gdn_chunks.dtype == torch.int64
    assert [tuple(p) for p in prefill.gdn_chunks.tolist()] == chunks_by_token([130, 5], ops.GDN_CHUNK)
    decode = ForwardBatch.build([[7], [8]], [130, 7], tables, slots, 16, "cpu")
    assert decode.is_decode and decode.gdn_chunks is None


def test_each_chunked_piece_of_a_saving_pass_carries_the_index_of_its_own_segments() -> None:
    """Two saves in one sequence: pieces gathered per round; one save with a long tail (over the
    CPU's RECURRENT_MAX): the cut scan. A recurrent piece needs no index."""
    for chunk_lens, saves in (([150, 90], [[(20, 9), (100, 10)], [(50, 11)]]), ([150, 90], [[(20, 9)], []])):
        plan = MidPassSaves.build(chunk_lens, [3, 4], saves, 3, "cpu")
        chunked = [p for p in plan.pieces if not p.recurrent]
        assert chunked, "no chunked piece: the case tests nothing"
        for piece in plan.pieces:
            if piece.recurrent:
                assert piece.chunks is None
                continue
            segments = [b - a for a, b in pairwise(piece.cu_seqlens.tolist())]
            assert [tuple(p) for p in piece.chunks.tolist()] == chunks_by_token(segments, ops.GDN_CHUNK)


def test_the_scan_checks_the_index_it_is_given() -> None:
    lengths = [70, 9]
    x, pool = gdn_inputs(sum(lengths), 4), torch.zeros(POOL_SLOTS, 4, DK, DV)
    cu, ids = cu_seqlens(lengths), torch.tensor([0, 1])
    chunks = torch.tensor(ops.gdn_chunk_index(lengths)).view(-1, 2)
    with pytest.raises(ValueError, match="chunks must be"):
        ops.gdn_chunk_prefill(**x, cu_seqlens=cu, recurrent_pool=pool, slot_ids=ids, chunks=chunks.view(-1))
    with pytest.raises(ValueError, match="chunks must be torch.int64"):
        ops.gdn_chunk_prefill(**x, cu_seqlens=cu, recurrent_pool=pool, slot_ids=ids, chunks=chunks.int())
