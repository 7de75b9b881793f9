"""`SamplingParams`: what one request asks of the sampler and the stop checker.

Names and meanings follow vLLM's `SamplingParams` (and so the OpenAI API): a temperature of 0
means greedy, `top_k` of -1 or 0 and `top_p` of 1 switch those filters off, and `logprobs` is the
number of top alternatives returned beside the chosen token's own log-probability. Every field
is checked when the object is built; a bad value raises `ValueError` naming the field.

Every integer must fit an int64 (requests cross processes as msgpack, and the sampler builds
int64 tensors): seed in [-2**63, 2**63) (OpenAI's range), top_k, max_tokens, min_tokens and
stop_token_ids below 2**63. Stop strings are bounded: at most `MAX_STOP_STRINGS` strings of at
most `MAX_STOP_CHARS` characters in all. The stop checker builds an automaton of their
characters per request (pdserve.sampling.stop): their total length is its set-up time on the
engine thread (about 0.5 us a character) and its memory.

Constraints on the next token: `logit_bias` (OpenAI's: token id -> a bias in [-100, 100] added
to its logit), `allowed_token_ids` (vLLM's) and `structured_outputs` (a grammar the output must
follow: pdserve.sampling.spec). A grammar decides where the output ends, so it cannot be
combined with `ignore_eos` or `min_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve.sampling.spec import check_structured_outputs

# Temperatures below this are greedy (vLLM's threshold): dividing by them would overflow.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 64  # OpenAI allows 4, TGI 4 by default, vLLM any number
MAX_STOP_CHARS = 4096  # all stop strings of a request together
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a bias
MAX_BIASED_TOKENS = 4096


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_in(value: object, low: int, high: int = INT64_MAX) -> bool:
    return _is_int(value) and low <= value <= high


def _is_number(value: object) -> bool:
    """A finite int or float (JSON's 1e999 reads as inf: a temperature of inf made -inf logits NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range (10**400): no float holds it
        return False


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token of a request and when to stop.

    After construction `stop` is always a list of strings and `stop_token_ids` a list of ints
    (never None, never a bare string), and `top_k` of 0 is normalised to -1 (off).
    `max_tokens=None` means "until the model's length limit", which the engine enforces.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top alternatives per prompt token (vLLM's; 0: its own only)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    structured_outputs: dict[str, Any] | None = None  # pdserve.sampling.spec (json, regex, ...)

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_distribution()
        self._check_penalties()
        self._check_stops()
        self._check_token_constraints()
        if self.top_k == 0:
            self.top_k = -1

    def _check_counts(self) -> None:
        if not _is_int_in(self.n, 1):
            raise ValueError(f"n must be an int in [1, 2**63), got {self.n!r}")
        if self.seed is not None and not _is_int_in(self.seed, INT64_MIN):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**63), got {self.seed!r}")
        if self.max_tokens is not None and not _is_int_in(self.max_tokens, 0):  # 0: score the prompt only
            raise ValueError(f"max_tokens must be None or an int in [0, 2**63), got {self.max_tokens!r}")
        if not _is_int_in(self.min_tokens, 0):
            raise ValueError(f"min_tokens must be an int in [0, 2**63), got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )

    def _check_distribution(self) -> None:
        if not _is_number(self.temperature) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int_in(self.top_k, -1):
            raise ValueError(f"top_k must be -1 or 0 (off) or an int in [1, 2**63), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty!r}")

    def _check_stops(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop cannot contain an empty string")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if (chars := sum(map(len, stop))) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop strings must have at most {MAX_STOP_CHARS} characters in all, got {chars}"
            )
        ids = list(self.stop_token_ids or [])
        if not all(_is_int_in(t, 0) for t in ids):
            bad = next(t for t in ids if not _is_int_in(t, 0))
            raise ValueError(f"stop_token_ids must be ints in [0, 2**63), got {bad!r}")
        self.stop = stop
        self.stop_token_ids = ids

    def _check_token_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_BIASED_TOKENS:
                raise ValueError(f"logit_bias must be a dict of at most {MAX_BIASED_TOKENS} token ids")
            bias = {}
            for token, value in self.logit_bias.items():
                token_id = int(token) if isinstance(token, str) and token.isdigit() else token
                if not _is_int_in(token_id, 0) or not _is_number(value) or not abs(value) <= MAX_LOGIT_BIAS:
                    raise ValueError(
                        "logit_bias maps token ids in [0, 2**63) to numbers in [-100, 100], "
                        f"got {token!r}: {value!r}"
                    )
                bias[token_id] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids or not all(_is_int_in(t, 0) for t in ids):
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of ints in [0, 2**63), got {ids!r}"
                )
        self.structured_outputs = check_structured_outputs(self.structured_outputs)
        if self.structured_outputs is not None and (self.ignore_eos or self.min_tokens):
            name = "ignore_eos" if self.ignore_eos else "min_tokens"
            raise ValueError(
                f"{name} cannot be combined with structured_outputs: the grammar decides the end"
            )

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, or close enough to it)."""
        return self.temperature < GREEDY_EPS
