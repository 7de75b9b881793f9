"""Sampling as each request asks for it (CPU, no downloads): SamplingParams validation, and the
StopChecker's examples (stop strings held back then cut, stop ids, EOS, max_tokens, min_tokens,
characters split across tokens). The batched Sampler's maths is tests/test_sampler.py's."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models

from pdserve.sampling import SamplingParams, StopChecker

# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "bad",
    [
        {"n": 0},
        {"n": 1.5},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.1},
        {"top_k": -2},
        {"top_k": 2.0},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"seed": "7"},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.1},
        {"repetition_penalty": 0.0},
        {"max_tokens": -1},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"stop": ["ok", ""]},
        {"stop": [3]},
        {"stop_token_ids": [-1]},
        {"logprobs": -1},
        {"logprobs": 21},
        # past int64: msgpack and torch overflow (top_k 2**64 took a prefill out of rotation)
        {"n": 2**63},
        {"top_k": 2**63},
        {"top_k": 2**64},
        {"seed": 2**63},
        {"seed": -(2**63) - 1},
        {"max_tokens": 2**64},
        {"min_tokens": 2**63, "max_tokens": None},
        {"stop_token_ids": [5, 2**63]},
        # stop strings are bounded: 64 of them, 4,096 characters in all
        {"stop": ["s"] * 65},
        {"stop": ["x" * 4000, "y" * 97]},
    ],
)
def test_params_reject_bad_values(bad: dict) -> None:
    field = next(iter(bad)) if len(bad) == 1 or "max_tokens" not in bad else "min_tokens"
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**bad)


def test_params_accept_the_edges_of_their_ranges() -> None:
    p = SamplingParams(top_k=2**63 - 1, seed=-(2**63), stop_token_ids=[2**63 - 1], stop=["s"] * 64)
    assert p.top_k == 2**63 - 1 and SamplingParams(seed=2**63 - 1, max_tokens=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(stop=["x" * 4000, "y" * 96]).stop[1] == "y" * 96


def test_params_normalise() -> None:
    p = SamplingParams(stop="END", top_k=0, max_tokens=None, logprobs=0, temperature=0.0)
    assert p.stop == ["END"] and p.stop_token_ids == [] and p.top_k == -1 and p.greedy
    assert SamplingParams().stop == [] and not SamplingParams().greedy


# ---------------------------------------------------------------- StopChecker


def _byte_chars() -> list[str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to chr(256 + i)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    chars, extra = [], 0
    for b in range(256):
        chars.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    return chars


BYTES = _byte_chars()
EOS = "<eos>"


def tokenize(*pieces: str | bytes) -> tuple[Tokenizer, list[int]]:
    """A byte-level BPE tokenizer whose vocabulary holds every byte plus the given pieces, and
    the ids of the pieces; bytes pieces may be partial UTF-8 characters."""
    names = ["".join(BYTES[b] for b in (p if isinstance(p, bytes) else p.encode())) for p in pieces]
    vocab = {c: i for i, c in enumerate(BYTES)}
    for name in names:
        vocab.setdefault(name, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok, [vocab[n] for n in names]


def run(params: SamplingParams, *pieces: str | bytes) -> tuple[StopChecker, list[str]]:
    tok, ids = tokenize(*pieces)
    checker = StopChecker(params, tok, eos_token_ids=[tok.token_to_id(EOS)])
    deltas = []
    for i in ids + [tok.token_to_id(EOS)]:
        delta, finished = checker.append(i)
        deltas.append(delta)
        assert "".join(deltas) == checker.text and "\ufffd" not in delta
        if finished:
            break
    return checker, deltas


def test_stop_string_across_tokens_is_held_back_then_cut() -> None:
    checker, deltas = run(SamplingParams(stop=["STOP"]), "Hello", " wo", "rld S", "TO", "P!", " more")
    assert deltas == ["Hello", " wo", "rld ", "", ""]
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("Hello world ", "stop", "STOP")


def test_held_back_prefix_released_when_it_is_not_a_stop() -> None:
    checker, deltas = run(SamplingParams(stop=["STOP"]), "a", "ST", "x", "S")
    assert deltas == ["a", "", "STx", "", "S"]  # the last one: eos flushes the held "S"
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("aSTxS", "stop", None)


def test_include_stop_str_and_earliest_stop_wins() -> None:
    params = SamplingParams(stop=["cd", "b"], include_stop_str_in_output=True)
    checker, _ = run(params, "xabcde", "f")
    assert (checker.text, checker.stop_reason) == ("xab", "b")
    checker, _ = run(SamplingParams(stop=["cd", "b"]), "xabcde")
    assert checker.text == "xa"


def test_stop_token_ids_and_eos() -> None:
    tok, (hi, bang) = tokenize("hi", "!")
    checker = StopChecker(SamplingParams(stop_token_ids=[bang]), tok, [tok.token_to_id(EOS)])
    assert checker.append(hi) == ("hi", False) and checker.append(bang) == ("", True)
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("hi", "stop", bang)
    checker, _ = run(SamplingParams(), "hi")
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("hi", "stop", None)


def test_eos_that_is_also_a_stop_token_id_reports_no_stop_reason() -> None:
    """vLLM checks eos first: a token that is both eos and one of stop_token_ids ends the request
    with stop_reason None; with ignore_eos it is only a stop token id and names itself."""
    tok, (hi,) = tokenize("hi")
    eos = tok.token_to_id(EOS)
    for ignore_eos, reason in [(False, None), (True, eos)]:
        params = SamplingParams(stop_token_ids=[eos], ignore_eos=ignore_eos)
        checker = StopChecker(params, tok, [eos])
        assert checker.append(hi) == ("hi", False) and checker.append(eos) == ("", True)
        assert (checker.text, checker.finish_reason, checker.stop_reason) == ("hi", "stop", reason)


def test_ignore_eos_runs_to_max_tokens() -> None:
    checker, deltas = run(SamplingParams(ignore_eos=True, max_tokens=3), "a", "b")
    assert (checker.text, checker.finish_reason, checker.num_tokens) == ("ab", "length", 3)
    checker, _ = run(SamplingParams(max_tokens=2), "a", "b", "c")
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("ab", "length", None)
    with pytest.raises(RuntimeError):
        checker.append(1)


def test_min_tokens_defers_stops() -> None:
    checker, _ = run(SamplingParams(stop=["x"], min_tokens=2), "x", "y", "x", "z")
    assert (checker.text, checker.stop_reason) == ("xy", "x")


def test_multibyte_characters_split_across_tokens() -> None:
    e, smile = "é".encode(), "😀".encode()
    checker, deltas = run(SamplingParams(), "caf", e[:1], e[1:], " ", smile[:1], smile[1:3], smile[3:])
    assert deltas == ["caf", "", "é", " ", "", "", "😀", ""]
    assert checker.text == "café 😀"


def test_works_with_a_transformers_fast_tokenizer() -> None:
    from transformers import PreTrainedTokenizerFast

    tok, ids = tokenize("Hi", " th", "ere", "<|", "end")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    checker = StopChecker(SamplingParams(stop=["<|end"]), fast)
    deltas = [checker.append(i)[0] for i in ids]
    assert deltas == ["Hi", " th", "ere", "", ""] and checker.text == "Hi there"
