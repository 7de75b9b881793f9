"""`Sequence.token_ids(start, end)` is the slice [start, end) of prompt + output, for every range."""

from __future__ import annotations

from pdserve.engine.sequence import Sequence
from pdserve.sampling.params import SamplingParams


def test_token_ids_equal_the_concatenation_for_every_range() -> None:
    seq = Sequence("r", [10, 11, 12, 13], SamplingParams())
    seq.output_token_ids.extend([20, 21, 22])
    whole = seq.prompt_token_ids + seq.output_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert seq.token_ids(start, end) == whole[start:end], (start, end)


def test_decode_slice_is_a_copy_not_a_view() -> None:
    seq = Sequence("r", [1, 2], SamplingParams())
    seq.output_token_ids.append(3)
    got = seq.token_ids(2, 3)
    got.append(99)
    assert seq.output_token_ids == [3] and seq.token_ids(0, 3) == [1, 2, 3]
