"""The most characters of prompt text one token can stand for, read once from the tokenizer, so
that a prompt that cannot fit `max_model_len` tokens is refused by its length alone, before the
work (and, for tens of megabytes, the seconds) of tokenizing it.

A BPE token covers at most as many input characters as its vocabulary entry has (byte-level
entries have one character a byte, and a character is at least one byte). The normalizer may
compose characters first: NFC and NFKC turn at most 4 code points into one (the longest canonical
decomposition), hence `NORMALIZER_FACTOR`. A tokenizer that can drop input characters (another
normalizer, a pre-tokenizer that removes what it splits on, whitespace splitting, an unknown
token that swallows a run of characters) has no such bound: `max_chars_per_token` is then None
and every prompt is tokenized.

The bound is a pass over the whole vocabulary (0.15 s for Qwen3.6's 248,077 entries on one
core: a tenth of the router's start-up), so it runs on a worker thread
(`max_chars_per_token_async`), once per tokenizer: the router starts it as it starts serving,
without waiting for it, and a prompt that needs it before it is done joins the pass under way.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from tokenizers.models import BPE

from pdserve.tokenizer import Tokenizer

NORMALIZER_FACTOR = 4
KEEPS_CHARACTERS = {  # component type -> a check of its settings; everything else may drop some
    "NFC": None, "NFD": None, "NFKC": None, "NFKD": None, "Sequence": None, "Prepend": None,
    "ByteLevel": None, "Metaspace": None, "Digits": None, "UnicodeScripts": None,
    "Split": lambda c: str(c.get("behavior", "")).lower() != "removed",
    "Punctuation": lambda c: str(c.get("behavior", "")).lower() != "removed",
}  # fmt: skip


def _keeps_characters(component: Any) -> bool:
    if component is None:
        return True
    if isinstance(component, list):
        return all(map(_keeps_characters, component))
    kind = component.get("type")
    if kind not in KEEPS_CHARACTERS:
        return False
    check = KEEPS_CHARACTERS[kind]
    return (check is None or check(component)) and all(
        _keeps_characters(component[key]) for key in ("normalizers", "pretokenizers") if key in component
    )


@functools.lru_cache(maxsize=8)
def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """An upper bound on the prompt characters one token covers, or None when there is none
    (cached per tokenizer; the first call reads the whole vocabulary)."""
    backend = tokenizer.backend
    model = backend.model
    if not isinstance(model, BPE) or (model.unk_token and model.fuse_unk):
        return None
    parts = [
        None if part is None else json.loads(part.__getstate__())
        for part in (backend.normalizer, backend.pre_tokenizer)
    ]
    if not all(map(_keeps_characters, parts)):
        return None
    return longest_token(backend) * (NORMALIZER_FACTOR if parts[0] is not None else 1)


def longest_token(backend: Any) -> int:
    """The characters of the vocabulary's longest entry, added tokens included. Read id by id:
    `get_vocab` builds its 248k-entry dict in one call that holds the GIL for 0.3 s, so the event
    loop beside this thread stood still that long (the router's first answer came 0.3 s late); a
    call per id hands the GIL back every few milliseconds. Ids with a gap fall back to the dict."""
    size = backend.get_vocab_size(with_added_tokens=True)
    lengths = [len(token) if (token := backend.id_to_token(i)) is not None else -1 for i in range(size)]
    if -1 in lengths:  # some entry's id is past the size: only the dict has them all
        lengths = list(map(len, backend.get_vocab(with_added_tokens=True)))
    return max(lengths, default=1)


_passes: dict[Tokenizer, asyncio.Future] = {}  # the vocabulary pass under way, per tokenizer


async def max_chars_per_token_async(tokenizer: Tokenizer) -> int | None:
    """`max_chars_per_token` on a worker thread: its first call must not stall the event loop
    (only texts long enough to be tokenized on a thread ask, so the hop costs nothing there).
    The first burst of long prompts after start-up shares one pass: each running its own, 32 at
    once under the GIL, had held the H200's first conversation turn back (session 15); waiting
    callers hold no worker thread (tokenizing goes on meanwhile)."""
    loop = asyncio.get_running_loop()
    task = _passes.get(tokenizer)
    if task is None or task.get_loop() is not loop:  # none under way here (done: the cache has it)
        task = _passes[tokenizer] = loop.create_task(asyncio.to_thread(max_chars_per_token, tokenizer))
        task.add_done_callback(lambda done: _passes.get(tokenizer) is done and _passes.pop(tokenizer))
    return await asyncio.shield(task)  # a caller that leaves does not cancel the others' pass
