"""Tokenizing rendered chats a piece at a time, the pieces between added tokens cached.

A chat resends the whole conversation every turn: its rendered text is the previous turn's plus
a few hundred tokens, and tokenizing all of it again (4.5K tokens, ~8 ms of one core) was most
of the router's preprocessing in 32 concurrent conversations on the H200 (79 ms a first token,
session 16). A Hugging Face tokenizer cuts its input at every added token (`<|im_start|>`,
`<|im_end|>`, `<tool_call>`, ...) before it normalizes and splits the pieces in between, so the
ids of a text are the ids of its pieces, each tokenized alone, with the added tokens' ids between
them. `SegmentEncoder` keeps the pieces it has tokenized (least recently used dropped past
`max_chars` characters), so a follow-up turn tokenizes only its new messages and a shared system
prompt is tokenized once. Only added tokens the tokenizer matches on the raw text cut it (not
normalized, no stripping of the spaces around them, not whole-word only); the whole text is
tokenized as before when there is none, or when pieces would not add up: another added token
that strips spaces or matches whole words (it may overlap a cut), or a normalizer or
pre-tokenizer that treats the text's start apart (Metaspace's `first`, Prepend).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from pdserve.tokenizer import Tokenizer

MIN_CACHED_CHARS = 64  # shorter pieces are tokenized each time: cheaper than their entries


class SegmentEncoder:
    def __init__(self, tokenizer: Tokenizer, max_chars: int = 4_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        added = tokenizer.backend.get_added_tokens_decoder()
        self._added = {
            t.content: i
            for i, t in added.items()
            if t.content and not (t.normalized or t.lstrip or t.rstrip or t.single_word)
        }
        if not _cuts_are_exact(tokenizer, added.values()):
            self._added = {}
        longest_first = sorted(self._added, key=len, reverse=True)  # the tokenizer's leftmost-longest
        self._cut = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if self._added else None
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`tokenizer.encode_batch(texts)` (no special tokens added), from cached pieces where it can."""
        if self._cut is None:
            return self.tokenizer.encode_batch(texts, False)
        split = [self._cut.split(text) for text in texts]  # [piece, added, piece, ..., piece]
        new = list(dict.fromkeys(p for parts in split for p in parts[::2] if p and p not in self._pieces))
        fresh = dict(zip(new, self.tokenizer.encode_batch(new, False), strict=True)) if new else {}
        out = []
        for parts in split:
            ids: list[int] = []
            for j, part in enumerate(parts):
                if j % 2:
                    ids.append(self._added[part])
                elif part:
                    ids.extend(fresh[part] if part in fresh else self._hit(part))
            out.append(ids)
        for piece, ids in fresh.items():
            self._keep(piece, ids)
        return out

    def _hit(self, piece: str) -> list[int]:
        self._pieces.move_to_end(piece)
        return self._pieces[piece]

    def _keep(self, piece: str, ids: list[int]) -> None:
        if len(piece) < MIN_CACHED_CHARS or len(piece) > self.max_chars:
            return
        self._pieces[piece] = ids
        self._chars += len(piece)
        while self._chars > self.max_chars:
            dropped, _ = self._pieces.popitem(last=False)
            self._chars -= len(dropped)

    @property
    def cached_chars(self) -> int:
        return self._chars


def _cuts_are_exact(tokenizer: Tokenizer, added: Iterable[Any]) -> bool:
    """Whether a text's ids are always its pieces' between the added tokens (see the module)."""
    if any(not t.normalized and (t.lstrip or t.rstrip or t.single_word) for t in added):
        return False
    parts = (tokenizer.backend.normalizer, tokenizer.backend.pre_tokenizer)
    rules = " ".join(str(part.__getstate__()) for part in parts if part is not None)
    return "Metaspace" not in rules and "Prepend" not in rules
