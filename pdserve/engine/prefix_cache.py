"""The hybrid prefix cache: K/V pages shared by reference count plus a GDN state checkpoint at a
block boundary (docs/prefix-cache.md).

An entry covers the first `num_tokens` tokens of some prompt (a multiple of `block_size`): the
pages holding their K/V and a checkpoint of every GDN layer's state after them. A request whose
prompt starts with those tokens shares the pages, restores the checkpoint into its own state
slot, and computes only the rest. Entries are keyed by a chained hash of the token blocks and
evicted least recently used when pages or checkpoints run short.

Policy (from the seed): each prompt saves one checkpoint, at its last block boundary; a boundary
in the prompt's last `tail_tokens` tokens moves back one block, since a follow-up request (the
next turn of a chat) rarely shares a prompt's very end.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence
from pdserve.memory import GdnCheckpointPool, KvPagePool
from pdserve.prefix_keys import prefix_block_keys

__all__ = ["CacheEntry", "PrefixCache", "prefix_block_keys"]


@dataclass(slots=True)
class CacheEntry:
    num_tokens: int
    pages: list[int]
    checkpoint: int


class PrefixCache:
    def __init__(
        self,
        kv_pool: KvPagePool,
        checkpoints: GdnCheckpointPool,
        block_size: int,
        salt: str,
        tail_tokens: int = 16,
    ) -> None:
        if block_size % kv_pool.page_size:
            raise ValueError(
                f"prefix block size {block_size} must be a multiple of the page size {kv_pool.page_size}"
            )
        self.kv_pool = kv_pool
        self.checkpoints = checkpoints
        self.block_size = block_size
        self.tail_tokens = tail_tokens
        self.salt = salt
        self.entries: OrderedDict[bytes, CacheEntry] = OrderedDict()  # least recently used first
        self.version = 0  # bumped whenever the set of entries changes

    def block_keys(self, token_ids: list[int]) -> list[bytes]:
        return prefix_block_keys(token_ids, self.block_size, self.salt)

    def checkpoint_boundary(self, num_prompt_tokens: int) -> int:
        """Where a prompt saves its checkpoint (0: nowhere). At least one token stays to compute."""
        boundary = (num_prompt_tokens - 1) // self.block_size * self.block_size
        if 0 < boundary and num_prompt_tokens - boundary <= self.tail_tokens:
            boundary -= self.block_size
        return max(boundary, 0)

    def lookup(self, seq: Sequence) -> CacheEntry | None:
        """The longest cached prefix of `seq`'s prompt that leaves at least one token to compute."""
        keys = self.block_keys(seq.prompt_token_ids[: seq.num_prompt_tokens - 1])
        for key in reversed(keys):
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
                return entry
        return None

    def restore(self, entry: CacheEntry, seq: Sequence) -> None:
        """Start `seq` (which owns a fresh state slot and no pages) after the cached prefix."""
        self.kv_pool.share(entry.pages)
        seq.block_table = list(entry.pages)
        self.checkpoints.restore(entry.checkpoint, seq.state_slot)
        seq.num_computed_tokens = entry.num_tokens
        seq.num_cached_tokens = entry.num_tokens

    def save(self, seq: Sequence) -> None:
        """Checkpoint `seq`, whose state now holds exactly its first `num_computed_tokens` tokens."""
        n = seq.num_computed_tokens
        key = self.block_keys(seq.prompt_token_ids[:n])[-1]
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if self.checkpoints.num_free == 0 and not self.evict_one():
            return
        pages = seq.block_table[: n // self.kv_pool.page_size]
        self.kv_pool.share(pages)
        self.entries[key] = CacheEntry(n, list(pages), self.checkpoints.save(seq.state_slot))
        self.version += 1

    @property
    def num_pages(self) -> int:
        """Distinct KV pages the cache holds a reference to."""
        return len({p for entry in self.entries.values() for p in entry.pages})

    def evict_one(self, keep: CacheEntry | None = None) -> bool:
        """Drop the least recently used entry other than `keep` (the one a request is about to
        restore); False when there is none."""
        key = next((k for k, e in self.entries.items() if e is not keep), None)
        if key is None:
            return False
        entry = self.entries.pop(key)
        self.version += 1
        self.kv_pool.free(entry.pages)
        self.checkpoints.free(entry.checkpoint)
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass
