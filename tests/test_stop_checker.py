"""StopChecker beyond its examples (test_sampling.py): equal to the plain definition (the whole
text searched again every token) on random token streams, and a cost per token that grows with
neither the text nor the stop strings (issues 6 and 7); the detokenizer's window stays bounded."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pdserve.sampling import IncrementalDetokenizer, SamplingParams, StopChecker
from tests.test_sampling import EOS, tokenize


class ReferenceStopChecker:
    """The plain definition StopChecker must equal: the whole text searched again every token."""

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer, eos_token_ids: list[int]) -> None:
        self.params, self.eos = params, set(eos_token_ids)
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.num_tokens, self.decoded, self.emitted = 0, "", 0
        self.finish_reason = self.stop_reason = None

    def append(self, token_id: int) -> tuple[str, bool]:
        p = self.params
        self.num_tokens += 1
        can_stop = self.num_tokens > p.min_tokens
        if can_stop and (token_id in self.eos or token_id in p.stop_token_ids):
            self.stop_reason = None if token_id in self.eos else token_id
            if p.include_stop_str_in_output:
                self.decoded += self.detokenizer.append(token_id)
            return self.finish("stop", self.decoded + self.detokenizer.flush())
        old_len = len(self.decoded)
        self.decoded += self.detokenizer.append(token_id)
        found = [
            (at, i, stop)
            for i, stop in enumerate(p.stop)
            if can_stop and (at := self.decoded.find(stop, max(0, old_len - len(stop) + 1))) != -1
        ]
        if found:
            at, _, self.stop_reason = min(found)
            return self.finish(
                "stop", self.decoded[: at + len(self.stop_reason) * p.include_stop_str_in_output]
            )
        if p.max_tokens is not None and self.num_tokens >= p.max_tokens:
            return self.finish("length", self.decoded + self.detokenizer.flush())
        held = max(
            (k for stop in p.stop for k in range(1, len(stop)) if self.decoded.endswith(stop[:k])), default=0
        )
        stable = max(self.emitted, len(self.decoded) - held)
        delta, self.emitted = self.decoded[self.emitted : stable], stable
        return delta, False

    def finish(self, reason: str, text: str) -> tuple[str, bool]:
        self.finish_reason, delta = reason, text[self.emitted :]
        self.decoded, self.emitted = text, len(text)
        return delta, True


PIECES = ["a", "b", "ab", "ba", "aab", "c", "é", "é".encode()[:1], "é".encode()[1:], "bca"]


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    pieces=st.lists(st.sampled_from(range(len(PIECES))), min_size=1, max_size=24),
    stops=st.lists(st.text("abcé", min_size=1, max_size=5), max_size=4),
    include=st.booleans(),
    min_tokens=st.integers(0, 3),
    eos_at=st.integers(0, 30),
)
def test_stop_checker_equals_the_plain_definition(
    pieces: list[int], stops: list[str], include: bool, min_tokens: int, eos_at: int
) -> None:
    """Deltas, text, finish and stop reasons equal the whole-text search, token by token."""
    tok, ids = tokenize(*PIECES)
    eos = tok.token_to_id(EOS)
    params = SamplingParams(
        stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens, max_tokens=20
    )
    checker, reference = StopChecker(params, tok, [eos]), ReferenceStopChecker(params, tok, [eos])
    tokens = [ids[i] for i in pieces]
    for token in tokens[:eos_at] + [eos] + tokens[eos_at:]:
        assert checker.append(token) == reference.append(token)
        assert checker.text == reference.decoded[: reference.emitted]
        assert (checker.finish_reason, checker.stop_reason) == (
            reference.finish_reason,
            reference.stop_reason,
        )
        if checker.finished:
            break


def per_token_seconds(checker: StopChecker, tokens: list[int], blocks: list[range]) -> list[float]:
    """The time `append` takes on the tokens of each block (the blocks in order, all of them fed)."""
    out, fed = [], 0
    for block in blocks:
        for t in tokens[fed : block.start]:
            checker.append(t)
        start = time.perf_counter()
        for t in tokens[block.start : block.stop]:
            checker.append(t)
        out.append(time.perf_counter() - start)
        fed = block.stop
    return out


PIECES_40 = ["ab" * 20, "abc" + "x" * 37, "xyz" * 13 + "a"]  # 40 characters a token


def best_of_3(params: SamplingParams, tokens: list[int], blocks: list[range]) -> list[float]:
    tok, _ = tokenize(*PIECES_40)
    runs = [per_token_seconds(StopChecker(params, tok), tokens, blocks) for _ in range(3)]
    return [min(times) for times in zip(*runs, strict=True)]


def test_stop_check_cost_per_token_does_not_grow_with_the_text() -> None:
    """A 20,000-token generation (800,000 characters): its last 2,000 tokens cost what its first
    2,000 cost. Before, every token copied the whole text (`_decoded +=`): 5x slower at the end."""
    ids = tokenize(*PIECES_40)[1]
    tokens = [ids[i % 3] for i in range(20_000)]
    params = SamplingParams(stop=["ab" * 5 + "Q", "xyzQ"], max_tokens=None, ignore_eos=True)
    early, late = best_of_3(params, tokens, [range(1_000, 3_000), range(18_000, 20_000)])
    assert late < 2.5 * early, f"early {early * 1e3:.1f} ms, late {late * 1e3:.1f} ms per 2,000 tokens"


def test_stop_check_cost_per_token_does_not_grow_with_the_stop_strings() -> None:
    """64 stop strings of 4,096 characters in all, some half-matched all along, cost a token about
    what one short stop string does. Before: every stop string's every prefix was tried, every token."""
    ids = tokenize(*PIECES_40)[1]
    tokens, block = [ids[i % 3] for i in range(2_000)], [range(500, 2_000)]
    many = ["ab" * 31 + "Q", "abcx" + "y" * 60, "xyzQ", *(f"never{i:02d}" * 9 + "." for i in range(61))]
    many[-1] += "z" * (4096 - sum(map(len, many)))
    (one,) = best_of_3(SamplingParams(stop=["xyzQ"], max_tokens=None), tokens, block)
    (all_64,) = best_of_3(SamplingParams(stop=many, max_tokens=None), tokens, block)
    assert all_64 < 3 * one, f"1 stop string {one * 1e3:.1f} ms, 64: {all_64 * 1e3:.1f} ms per 1,500 tokens"


def test_detokenizer_window_stays_bounded_on_bytes_that_are_no_character() -> None:
    """Continuation bytes that never form a character (or skipped special tokens) used to be held
    forever: the window, and each token's decode, grew with the output."""
    tok, (lone, a) = tokenize(b"\x80", "a")
    detokenizer = IncrementalDetokenizer(tok)
    deltas = [detokenizer.append(lone) for _ in range(1_000)]
    assert len(detokenizer.token_ids) - detokenizer.prefix_offset <= 16
    assert "".join(deltas) + detokenizer.append(a) + detokenizer.flush() == "\ufffd" * 1_000 + "a"
    special = tok.token_to_id(EOS)
    detokenizer = IncrementalDetokenizer(tok)
    assert [detokenizer.append(special) for _ in range(100)] == [""] * 100
    assert len(detokenizer.token_ids) - detokenizer.prefix_offset <= 16 and detokenizer.append(a) == "a"
