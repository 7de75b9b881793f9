"""Constrained decoding on xgrammar: a request's `structured_outputs` spec (pdserve.sampling.spec)
becomes a compiled grammar, its matcher follows the tokens the request gets, and each step the
sampler masks the logits of the constrained rows to the tokens the grammar allows next.

  TokenizerGrammars   xgrammar's view of a tokenizer (~3.7 s to build for the 248k-token Qwen3.6
                      vocabulary, ~0.7 s from pdserve.sampling.vocab_cache's disk cache once
                      built) and the grammars compiled for it, one per distinct spec (an LRU
                      of GRAMMARS_CACHED, keyed by the spec's JSON)
  RequestGrammar      one request's matcher. It accepts the output tokens it has not seen yet
                      when the next mask is asked for, so a decode instance that starts from the
                      first token a prefill instance sampled (and appended to the output) catches
                      up by itself. With `reasoning_tags` and a prompt that leaves the reasoning
                      open, the output is free until the end tag and constrained after it.
  apply_grammars      one [B, ceil(V/32)] bitmask for a batch, its constrained rows filled by
                      their matchers and applied to those rows only (xgrammar's kernel: CPU or
                      CUDA, where the logits are)

The end: once the grammar is complete the mask allows the end-of-sequence tokens (forced when
nothing else may follow), and the stop checker ends the request on one. A token the grammar
does not accept (never sampled under the mask; possible only if the output was made elsewhere)
leaves the matcher broken: the row is then forced to end-of-sequence.

Set-up: `prepare_request(params, tokenizer)` compiles the spec when the request is built (the
stop checker calls it: a spec that does not compile is the request's ValueError, not a failed
engine step) and hands the tokenizer's grammars to the request's `SamplingState`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr
from torch import Tensor

from pdserve.sampling.params import SamplingParams
from pdserve.sampling.spec import grammar_key, spec_kind
from pdserve.sampling.vocab_cache import vocabulary_info
from pdserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)
GRAMMARS_CACHED = 256
JSON_MAX_WHITESPACE = 20  # consecutive whitespace characters in JSON: "\n" + 4 levels of 4 spaces
COMPILE_THREADS = 8  # a compile runs on the thread that sets the request up: ~30 ms (JSON schema) to
# ~300 ms (two tools' call grammar) on one core for the 248k-token vocabulary
PREPARED_KEPT = 4096  # requests set up but not sampled yet (the hand-over to their SamplingState)
_lock = threading.Lock()
_by_tokenizer: dict[int, tuple[Tokenizer, TokenizerGrammars]] = {}
_prepared: OrderedDict[int, tuple[SamplingParams, TokenizerGrammars]] = OrderedDict()


class TokenizerGrammars:
    """A tokenizer as xgrammar sees it, and the grammars compiled for it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.info = vocabulary_info(tokenizer)  # built once per tokenizer, then read from disk
        self.vocab_size = self.info.vocab_size
        threads = min(COMPILE_THREADS, os.cpu_count() or 1)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._bitmask = torch.zeros(0, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def bitmask(self, batch_size: int) -> Tensor:
        """A [batch_size, ceil(V/32)] int32 buffer, reused from step to step (the engine thread's:
        only the rows a step fills are read)."""
        if self._bitmask.shape[0] < batch_size:
            self._bitmask = torch.zeros(
                max(batch_size, 2 * self._bitmask.shape[0]), self._bitmask.shape[1], dtype=torch.int32
            )
        return self._bitmask[:batch_size]

    def compile(self, spec: dict[str, Any]) -> xgr.CompiledGrammar:
        """The grammar of a checked spec, compiled once and kept while it is among the recent ones."""
        key = grammar_key(spec)
        with self._lock:
            if (hit := self._compiled.get(key)) is not None:
                self._compiled.move_to_end(key)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > GRAMMARS_CACHED:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: dict[str, Any]) -> xgr.CompiledGrammar:
        kind = spec_kind(spec)
        value = spec[kind]
        compact = spec.get("disable_any_whitespace", False)
        whitespace = {
            "any_whitespace": not compact,
            "max_whitespace_cnt": None if compact else JSON_MAX_WHITESPACE,
        }
        try:
            if kind == "json":
                schema = value if isinstance(value, str) else json.dumps(value)
                return self.compiler.compile_grammar(json_schema_grammar(schema, True, **whitespace))
            if kind == "json_object":
                return self.compiler.compile_grammar(
                    json_schema_grammar('{"type": "object"}', False, **whitespace)
                )
            if kind == "regex":
                return self.compiler.compile_regex(value)
            if kind == "grammar":
                return self.compiler.compile_grammar(value)
            if kind == "choice":
                options = [{"type": "const_string", "value": c} for c in value]
                value = {"type": "structural_tag", "format": {"type": "or", "elements": options}}
            return self.compiler.compile_structural_tag(
                value if isinstance(value, str) else json.dumps(value)
            )
        except Exception as e:  # xgrammar raises RuntimeError, ValueError, its own errors
            raise ValueError(f"structured_outputs {kind} does not compile: {compile_error(e)}") from None

    def prompt_opens(self, prompt_ids: Sequence[int], tag: str) -> bool:
        """Does the prompt end in `tag` (whitespace after it aside)?"""
        tail = self.tokenizer.decode(list(prompt_ids[-16:]), skip_special_tokens=False)
        return tail.rstrip().endswith(tag)


def compile_error(error: Exception) -> str:
    """xgrammar's message without its C++ log prefix (`[01:02:03] /project/cpp/x.cc:94: `)."""
    return LOG_PREFIX.sub("", str(error)).strip()


LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ", re.MULTILINE)
# xgrammar's rule for the characters of a string with a length bound (maxLength, minLength)
LAX_STRING_CHARACTER = '[^\\"\\\\\\r\\n]'
STRICT_STRING_CHARACTER = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def json_schema_grammar(schema: str, strict_mode: bool, **whitespace: Any) -> xgr.Grammar:
    """xgrammar's grammar of a JSON schema, its strings refusing raw control characters: its rule
    for the characters of a string with a length bound lets a tab or U+0001 through unescaped,
    which RFC 8259 forbids and `json.loads` refuses (its unbounded strings already refuse them)."""
    grammar = xgr.Grammar.from_json_schema(schema, strict_mode=strict_mode, **whitespace)
    return xgr.Grammar.from_ebnf(str(grammar).replace(LAX_STRING_CHARACTER, STRICT_STRING_CHARACTER))


def tokenizer_grammars(tokenizer: Tokenizer) -> TokenizerGrammars:
    """The grammars of `tokenizer` (made on first use; the tokenizer is kept alive with them)."""
    with _lock:
        entry = _by_tokenizer.get(id(tokenizer))
    if entry is None:
        entry = (tokenizer, TokenizerGrammars(tokenizer))
        with _lock:
            entry = _by_tokenizer.setdefault(id(tokenizer), entry)
    return entry[1]


def prepare_request(params: SamplingParams, tokenizer: Any) -> None:
    """Compile a structured request's grammar now (ValueError if it cannot be) and remember the
    tokenizer for the request's SamplingState."""
    if params.structured_outputs is None:
        return
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError("structured_outputs needs the engine's tokenizer")
    grammars = tokenizer_grammars(tokenizer)
    grammars.compile(params.structured_outputs)
    with _lock:
        _prepared[id(params)] = (params, grammars)
        _prepared.move_to_end(id(params))
        while len(_prepared) > PREPARED_KEPT:
            _prepared.popitem(last=False)


def _grammars_for(params: SamplingParams) -> TokenizerGrammars:
    with _lock:
        entry = _prepared.get(id(params))
        if entry is not None and entry[0] is params:
            return entry[1]
        if not _by_tokenizer:
            raise ValueError("structured_outputs: the request was not prepared (prepare_request)")
        return next(reversed(_by_tokenizer.values()))[1]  # the latest tokenizer: the engine's


class RequestGrammar:
    """One request's grammar matcher, following its output tokens."""

    def __init__(
        self, params: SamplingParams, prompt_ids: Sequence[int], eos_token_ids: Sequence[int]
    ) -> None:
        spec = params.structured_outputs
        assert spec is not None
        self.grammars = _grammars_for(params)
        self.matcher = xgr.GrammarMatcher(
            self.grammars.compile(spec), override_stop_tokens=list(eos_token_ids) or None
        )
        self.eos_token_ids = list(eos_token_ids) or list(self.grammars.info.stop_token_ids)
        self.start: int | None = 0  # where the constrained part of the output begins; None: not yet
        self.end_ids: list[int] = []
        tags = spec.get("reasoning_tags")
        if tags and self.grammars.prompt_opens(prompt_ids, tags[0]):
            self.start, self.end_ids = None, self.grammars.tokenizer.encode(tags[1])
        self.accepted = 0  # output tokens looked at (accepted by the matcher once `start` is known)
        self.broken = False

    def advance(self, output_ids: Sequence[int]) -> None:
        """Accept the output tokens not seen yet (or look for the end of the reasoning in them)."""
        if self.start is None:
            n = len(self.end_ids)
            for end in range(max(self.accepted, n), len(output_ids) + 1):
                if list(output_ids[end - n : end]) == self.end_ids:
                    self.start = self.accepted = end
                    break
            else:
                self.accepted = len(output_ids)
                return
        for token in output_ids[self.accepted :]:
            if self.broken or self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(token):
                log.warning("token %d breaks the grammar of a structured request: it ends here", token)
                self.broken = True
        self.accepted = len(output_ids)

    @property
    def active(self) -> bool:
        """Is the next token constrained (False while the reasoning runs)?"""
        return self.start is not None

    def fill(self, bitmask: Tensor, row: int) -> None:
        if self.broken or self.matcher.is_terminated():
            bitmask[row] = 0
            for token in self.eos_token_ids:
                bit = token % 32  # int32 words: bit 31 is the sign
                bitmask[row, token // 32] |= (1 << bit) if bit < 31 else -(1 << 31)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammars(logits: Tensor, rows: list[int], grammars: list[RequestGrammar]) -> None:
    """Mask in place the logits of `rows` to what their grammars allow (columns beyond the
    tokenizer's vocabulary, the padding rows of the embedding, are never allowed)."""
    vocab = grammars[0].grammars.vocab_size
    if any(g.grammars.vocab_size != vocab for g in grammars):
        raise ValueError("the constrained rows of a batch must share one tokenizer")
    bitmask = grammars[0].grammars.bitmask(logits.shape[0])
    for row, grammar in zip(rows, grammars, strict=True):
        grammar.fill(bitmask, row)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
    if logits.shape[1] > vocab:
        logits[torch.tensor(rows, device=logits.device), vocab:] = float("-inf")
