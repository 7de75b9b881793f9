"""Prefix-cache keys: a chained hash over a prompt's token blocks. Pure Python, no engine: the
prefix cache of every instance and the router's prefix-aware choice use this one function."""

from __future__ import annotations

import hashlib


def prefix_block_keys(token_ids: list[int], block_size: int, salt: str) -> list[bytes]:
    """Key of every full block boundary: key[i] covers tokens [0, (i + 1) * block_size)."""
    keys, parent = [], salt.encode()
    for end in range(block_size, len(token_ids) + 1, block_size):
        block = ",".join(map(str, token_ids[end - block_size : end])).encode()
        parent = hashlib.sha256(parent + b"|" + block).digest()
        keys.append(parent)
    return keys
