"""Prefix-cache keys, token-id based. Pure Python, no engine: the prefix cache of every instance
and the router's prefix-aware choice use these functions.

A cached prefix of `n` tokens is named by two things: its *parent*, the chained hash of its
full blocks (`n // block_size` blocks; the salt alone for none), and its *tail*, the tokens
after the last full block. A prefix that ends on a block boundary has an empty tail and is
named by its block key; any other by a hash of the parent and the exact tail tokens. So a
prompt that diverges from a cached conversation anywhere still finds every entry it fully
contains, and nothing else.

Markers: an instance holding entries with a tail under some parent publishes that parent's
`tail_marker` too, so a router can tell where to look for tails (`candidate_keys`).
"""

from __future__ import annotations

import hashlib
from array import array

_ID_BYTES = 8  # array('q')


def root_key(salt: str) -> bytes:
    """The parent of a prefix shorter than one block."""
    return salt.encode()


def prefix_block_keys(token_ids: list[int], block_size: int, salt: str) -> list[bytes]:
    """Key of every full block boundary: key[i] covers tokens [0, (i + 1) * block_size)."""
    keys: list[bytes] = []
    extend_block_keys(keys, token_ids, block_size, salt)
    return keys


def extend_block_keys(keys: list[bytes], token_ids: list[int], block_size: int, salt: str) -> None:
    """Append to `keys` (the block keys of a prefix of `token_ids`) those of every further full block."""
    parent = keys[-1] if keys else root_key(salt)
    first = len(keys) * block_size
    data = _as_bytes(token_ids[first : len(token_ids) - (len(token_ids) - first) % block_size])
    width = block_size * _ID_BYTES
    for end in range(width, len(data) + 1, width):
        parent = hashlib.sha256(parent + b"|" + data[end - width : end]).digest()
        keys.append(parent)


def _as_bytes(token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Token ids as 8-byte integers: hashed as they are (7x faster than their decimal text)."""
    return array("q", token_ids).tobytes()


def entry_key(parent: bytes, tail: list[int] | tuple[int, ...]) -> bytes:
    """The key of the prefix `parent` + `tail` (`tail` shorter than a block): the block key
    itself when the tail is empty."""
    if not tail:
        return parent
    return hashlib.sha256(parent + b"|tail|" + _as_bytes(tail)).digest()


def tail_marker(parent: bytes) -> bytes:
    """Published next to entries that have a tail under `parent`: "look for tails here"."""
    return hashlib.sha256(parent + b"|tails").digest()


def parents_of(token_ids: list[int], block_size: int, salt: str) -> list[bytes]:
    """parents[i] covers the first i * block_size tokens (parents[0] = the root)."""
    return [root_key(salt), *prefix_block_keys(token_ids, block_size, salt)]


def tail_keys(parent: bytes, tokens_after: list[int], max_len: int) -> list[tuple[int, bytes]]:
    """(length, key) of every tail of 1 .. `max_len` tokens of `tokens_after` under `parent`,
    longest first: `entry_key` of each, hashed incrementally (one pass over the tail, not one a
    length: the router probes up to 3 x 63 tails for a conversation's prompt)."""
    data = _as_bytes(tokens_after[: min(max_len, len(tokens_after))])
    running = hashlib.sha256(parent + b"|tail|")
    keys = []
    for t, at in enumerate(range(0, len(data), _ID_BYTES), 1):
        running.update(data[at : at + _ID_BYTES])
        keys.append((t, running.copy().digest()))
    return keys[::-1]
