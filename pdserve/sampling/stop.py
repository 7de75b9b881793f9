"""Per-request incremental detokenization and stop checks.

`IncrementalDetokenizer` turns token ids into text deltas one token at a time. It decodes a
small window of recent tokens (from `prefix_offset`) twice, with and without the tokens not yet
emitted, and emits the difference only when it does not end in U+FFFD: a multi-byte character
split across tokens stays held until its last byte arrives.

`StopChecker` sits on top and decides when a request is finished, in vLLM's order:
  1. an eos token (unless ignore_eos) or one of stop_token_ids -> "stop"; the token is kept
     out of the text unless include_stop_str_in_output
  2. a stop string in the text -> "stop"; the text ends before it (or after it, with
     include_stop_str_in_output). Text that could still be the start of a stop string is held
     back from the deltas until it is resolved either way.
  3. max_tokens output tokens -> "length"
Stop tokens and stop strings count only once more than min_tokens tokens were produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.sampling.params import SamplingParams

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What a tokenizer must offer: `tokenizers.Tokenizer` and transformers' fast tokenizers do."""

    def decode(self, ids: list[int], /, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Appends token ids and returns the newly stable text."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: decoded again for context
        self.read_offset = 0  # the tokens before this are already turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """The text the new token completes; "" while it ends in an incomplete character."""
        self.token_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held (the request is over), U+FFFD included if bytes are missing."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix) :]


class StopChecker:
    """One request's output text and finish state.

    `append(token_id)` returns `(text_delta, finished)`; the deltas joined are always `.text`.
    After the request finishes, `finish_reason` is "stop" or "length" and `stop_reason` the
    stop string or stop token id that ended it (None for eos and for "length", as in vLLM).
    """

    def __init__(self, params: SamplingParams, tokenizer: Decoder, eos_token_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._decoded = ""  # all text decoded so far (the emitted text plus what is held back)
        self._emitted = 0  # how many characters of _decoded went out as deltas

    @property
    def text(self) -> str:
        return self._decoded[: self._emitted]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> tuple[str, bool]:
        if self.finished:
            raise RuntimeError(f"request already finished ({self.finish_reason}); got token {token_id}")
        self.num_tokens += 1
        can_stop = self.num_tokens > self.params.min_tokens
        if can_stop and (token_id in self.eos_token_ids or token_id in self.stop_token_ids):
            self.stop_reason = token_id if token_id in self.stop_token_ids else None
            if self.params.include_stop_str_in_output:
                self._decoded += self.detokenizer.append(token_id)
            return self._finish("stop", self._decoded + self.detokenizer.flush())
        old_len = len(self._decoded)
        self._decoded += self.detokenizer.append(token_id)
        if can_stop and self.params.stop and (end := self._find_stop_string(old_len)) is not None:
            return self._finish("stop", self._decoded[:end])
        max_tokens = self.params.max_tokens
        if max_tokens is not None and self.num_tokens >= max_tokens:
            return self._finish("length", self._decoded + self.detokenizer.flush())
        stable = len(self._decoded) - self._held_back()
        delta = self._decoded[self._emitted : stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        return delta, False

    def _finish(self, reason: str, text: str) -> tuple[str, bool]:
        self.finish_reason = reason
        delta = text[self._emitted :]
        self._decoded, self._emitted = text, len(text)
        return delta, True

    def _find_stop_string(self, old_len: int) -> int | None:
        """Where the text ends if a stop string ends in the newly decoded text (the earliest
        such stop string wins), else None. Sets `stop_reason`."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = self._decoded.find(stop, max(0, old_len - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.stop_reason = stop
        return at + len(stop) if self.params.include_stop_str_in_output else at

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        held = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(self._decoded)), held, -1):
                if self._decoded.endswith(stop[:k]):
                    held = k
                    break
        return held
