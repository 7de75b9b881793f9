"""Per-request incremental detokenization and stop checks.

`IncrementalDetokenizer` turns token ids into text deltas one token at a time. It decodes a
small window of recent tokens (from `prefix_offset`) twice, with and without the tokens not yet
emitted, and emits the difference only when it does not end in U+FFFD: a multi-byte character
split across tokens stays held until its last byte arrives. A UTF-8 character has at most 4
bytes, so after `MAX_HELD_TOKENS` tokens that complete nothing (bytes that are no character,
skipped special tokens) the window moves on anyway: it never grows with the output.

`StopChecker` sits on top and decides when a request is finished, in vLLM's order:
  1. an eos token (unless ignore_eos) or one of stop_token_ids -> "stop"; the token is kept
     out of the text unless include_stop_str_in_output. eos is checked first: a token that is
     both has stop_reason None (vLLM's check_stop)
  2. a stop string in the text -> "stop"; the text ends before it (or after it, with
     include_stop_str_in_output); the occurrence that starts first wins, the first listed on a
     tie. Text that could still be the start of a stop string is held back from the deltas
     until it is resolved either way.
  3. max_tokens output tokens -> "length"
Stop tokens and stop strings count only once more than min_tokens tokens were produced.
A structured request's grammar is compiled when its checker is made (it has the tokenizer):
pdserve.sampling.grammar.prepare_request.

Cost per token: the stop strings are one Aho-Corasick automaton (`StopStrings`); each new
character is one (amortised) transition, so a token costs O(its characters) whatever the
number and length of the stop strings and however long the text already is. Only the deltas
that went out and the held-back tail (shorter than the longest stop string) are kept.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

from pdserve.sampling.params import SamplingParams

_REPLACEMENT = "\ufffd"
MAX_HELD_TOKENS = 8  # tokens that complete no character before the detokenizer moves on anyway
STOP_AUTOMATA_CACHED = 32  # distinct stop-string lists whose automata are kept for reuse


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
        stuck = len(self.token_ids) - self.read_offset >= MAX_HELD_TOKENS
        if not stuck and (len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix) :]


class StopStrings:
    """A request's stop strings as one Aho-Corasick automaton over characters (immutable:
    `stop_strings` shares one per distinct list).

    A state is a trie node: the longest suffix of the text so far that is a prefix of some stop
    string. `feed` runs new characters from a state; `held(state)` is the length of the longest
    suffix of the text that is a proper prefix of a stop string (what may still become one).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._next: list[dict[str, int]] = [{}]  # trie edges, then fixed up by failure links
        depth, ends = [0], [-1]  # ends: index of the stop string spelled by the node, or -1
        for index, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                child = self._next[node].get(ch)
                if child is None:
                    child = len(self._next)
                    self._next[node][ch] = child
                    self._next.append({})
                    depth.append(depth[node] + 1)
                    ends.append(-1)
                node = child
            if ends[node] == -1:  # a repeated stop string: the first listed
                ends[node] = index
        size = len(self._next)
        self._fail = [0] * size  # the longest proper suffix of the node that is a node
        self._match = [-1] * size  # the longest stop string ending at the node (its index)
        self._held = [0] * size
        order = [0]  # breadth first: a node's failure link is shallower, so already done
        for node in order:
            if node:
                fail = self._fail[node]
                self._match[node] = ends[node] if ends[node] != -1 else self._match[fail]
                self._held[node] = depth[node] if self._next[node] else self._held[fail]
            for ch, child in self._next[node].items():
                if node:
                    fail = self._fail[node]
                    while fail and ch not in self._next[fail]:
                        fail = self._fail[fail]
                    self._fail[child] = self._next[fail].get(ch, 0)
                order.append(child)
        self._lengths = [len(stop) for stop in self.stops]

    def feed(self, text: str, state: int, search: bool) -> tuple[int, tuple[int, int] | None]:
        """Run `text` from `state`: (the new state, `(start, index)` of the stop string occurrence
        ending in `text` that starts first (first listed on a tie), or None). `start` counts from
        the start of `text` (negative: the occurrence began in earlier text). `search=False`
        only advances the state."""
        edges, fail, match, lengths = self._next, self._fail, self._match, self._lengths
        best = None
        for i, ch in enumerate(text):
            while state and ch not in edges[state]:
                state = fail[state]
            state = edges[state].get(ch, 0)
            if search and (index := match[state]) != -1:
                found = (i + 1 - lengths[index], index)
                if best is None or found < best:
                    best = found
        return state, best

    def held(self, state: int) -> int:
        return self._held[state]


@functools.lru_cache(maxsize=STOP_AUTOMATA_CACHED)
def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """The automaton of `stops`, shared by the requests that send the same list."""
    return StopStrings(stops)


class StopChecker:
    """One request's output text and finish state.

    `append(token_id)` returns `(text_delta, finished)`; the deltas joined are always `.text`.
    After the request finishes, `finish_reason` is "stop" or "length" and `stop_reason` the
    stop string or stop token id that ended it (None for eos, even an eos that is also one of
    stop_token_ids, and for "length", as in vLLM).
    """

    def __init__(self, params: SamplingParams, tokenizer: Decoder, eos_token_ids: Sequence[int] = ()) -> None:
        if params.structured_outputs is not None:  # compiled now: a bad grammar is this request's error
            from pdserve.sampling.grammar import prepare_request

            prepare_request(params, tokenizer)
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.stop_strings = stop_strings(tuple(params.stop)) if params.stop else None
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._state = 0  # of stop_strings
        self._held = ""  # decoded text not sent yet: it may be the start of a stop string
        self._deltas: list[str] = []  # what was sent
        self._text: str | None = ""  # the deltas joined; None until asked again

    @property
    def text(self) -> str:
        """The text sent so far (joined when it changed since it was last asked)."""
        if self._text is None:
            self._text = "".join(self._deltas)
            self._deltas = [self._text]
        return self._text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> tuple[str, bool]:
        if self.finished:
            raise RuntimeError(f"request already finished ({self.finish_reason}); got token {token_id}")
        self.num_tokens += 1
        can_stop = self.num_tokens > self.params.min_tokens
        if can_stop and (token_id in self.eos_token_ids or token_id in self.stop_token_ids):
            self.stop_reason = None if token_id in self.eos_token_ids else token_id  # eos wins
            tail = self._held
            if self.params.include_stop_str_in_output:
                tail += self.detokenizer.append(token_id)
            return self._finish("stop", tail + self.detokenizer.flush())
        new = self.detokenizer.append(token_id)
        pending = self._held + new
        if self.stop_strings is not None:
            self._state, found = self.stop_strings.feed(new, self._state, search=can_stop)
            if found is not None:
                start, index = found  # start >= -len(self._held): the rest was sent as no stop
                stop = self.stop_reason = self.stop_strings.stops[index]
                end = len(self._held) + start + (len(stop) if self.params.include_stop_str_in_output else 0)
                return self._finish("stop", pending[:end])
        max_tokens = self.params.max_tokens
        if max_tokens is not None and self.num_tokens >= max_tokens:
            return self._finish("length", pending + self.detokenizer.flush())
        held = 0 if self.stop_strings is None else self.stop_strings.held(self._state)
        self._held = pending[len(pending) - held :]
        return self._send(pending[: len(pending) - held]), False

    def _send(self, delta: str) -> str:
        if delta:
            self._deltas.append(delta)
            self._text = None
        return delta

    def _finish(self, reason: str, delta: str) -> tuple[str, bool]:
        self.finish_reason = reason
        self._held = ""
        return self._send(delta), True
