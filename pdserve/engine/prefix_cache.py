"""The hybrid prefix cache: K/V pages shared by reference count plus a GDN state checkpoint
(docs/prefix-cache.md).

An entry covers the first `num_tokens` tokens of some sequence (any length): the pages holding
their K/V and a checkpoint of every GDN layer's state after exactly them. A request whose prompt
starts with those tokens shares the pages, restores the checkpoint into its own state slot and
computes only the rest. Entries are keyed by token ids (`pdserve.prefix_keys`: the chained hash
of the full blocks, plus the exact tail), so a prompt reuses the longest entry it contains,
wherever it diverges from the sequences that made them.

Where entries come from (the scheduler decides, `pdserve.engine.checkpoint_plan`): the exact end
of a prompt (the prefill's final state: the slot itself once a handed-over request lets it go,
else a copy), the end of a generation (the slot and pages of a finished request, no copy),
where a prefill chunk ends before its prompt does (a copy), a resume point (where a chat
template's next turn diverges from this prompt), a branch point (where the prompt diverges
from what the cache holds: the next prompt sharing it finds a checkpoint there), and pulls from
peers. A page an entry holds only in part is copied on restore, never written by two holders.

Admission and eviction know what a checkpoint costs (a state slot, ~61 MiB at the full shape):
no entry shorter than `min_entry_tokens`; a chunk-end checkpoint is admitted only over entries
nobody reused; eviction is LRU with a reuse count (`EntryIndex.victim`); pages and checkpoint
always go together; entries a peer is reading are pinned.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from pdserve.engine.prefix_index import CacheEntry, EntryIndex
from pdserve.engine.sequence import Sequence
from pdserve.memory import GdnCheckpointPool, HostTier, KvPagePool
from pdserve.prefix_keys import entry_key, extend_block_keys, prefix_block_keys, root_key, tail_marker
from pdserve.prefix_stats import PrefixStats

__all__ = ["CacheEntry", "Lookup", "PrefixCache", "prefix_block_keys"]
LOW_VALUE_KINDS = ("chunk",)  # admitted only over entries nobody reused


@dataclass(slots=True)
class Lookup:
    """What a prompt can reuse: `entry` (None: a miss, `reason` says why) and `shared_tokens`,
    how many of its tokens the cache holds in some entry (a branch point, beyond the entry)."""

    entry: CacheEntry | None
    reason: str | None = None
    shared_tokens: int = 0


@dataclass(slots=True)
class _SeqKeys:
    keys: list[bytes] = field(default_factory=list)


class PrefixCache:
    def __init__(
        self,
        kv_pool: KvPagePool,
        checkpoints: GdnCheckpointPool,
        block_size: int,
        salt: str,
        min_entry_tokens: int | None = None,
        host_tier_bytes: int | None = None,
    ) -> None:
        if block_size % kv_pool.page_size:
            raise ValueError(
                f"prefix block size {block_size} must be a multiple of the page size {kv_pool.page_size}"
            )
        self.kv_pool = kv_pool
        self.checkpoints = checkpoints
        self.block_size = block_size
        # a prefix shorter than this (default: a block) would cost a checkpoint for a recompute
        # that is cheap anyway: not kept
        self.min_entry_tokens = block_size if min_entry_tokens is None else min_entry_tokens
        self.salt = salt
        self.root = root_key(salt)
        self.index = EntryIndex()
        self.entries = self.index.entries  # key -> entry, least recently used first
        self.version = 0  # bumped whenever the set of entries changes
        self.stats = PrefixStats()
        # token suffixes of generation prompts (`pdserve.engine.resume_points`): a prompt ending
        # in one also checkpoints where that suffix starts, where its next turn diverges
        self.resume_suffixes: list[tuple[int, ...]] = []
        self.refused: weakref.WeakSet[Sequence] = weakref.WeakSet()  # a pull did not pay for them
        # where evicted entries go (`configure_host_tier`); None until configured: the first
        # eviction makes the default for the device (EngineConfig.snapshot_pool_mb's)
        self.host: HostTier | None = None
        self._host_bytes = host_tier_bytes
        if host_tier_bytes is not None:
            self.configure_host_tier(host_tier_bytes)
        self._seq_keys: weakref.WeakKeyDictionary[Sequence, _SeqKeys] = weakref.WeakKeyDictionary()

    def configure_host_tier(self, budget_bytes: int) -> None:
        """Allocate the host tier now (0: none); entries already on the host tier are dropped.
        The same budget again keeps the tier as it is (pinned memory is not given back)."""
        if budget_bytes == self._host_bytes and (self.host is not None or not budget_bytes):
            return
        for entry in [e for e in self.entries.values() if e.tier == "host"]:
            self._drop(entry)
        self._host_bytes = budget_bytes
        self.host = HostTier(self.kv_pool, self.checkpoints.states, budget_bytes) if budget_bytes else None

    def _host_tier(self) -> HostTier | None:
        if self.host is None and self._host_bytes is None:
            self.configure_host_tier((4096 if self.kv_pool.kv.is_cuda else 16) << 20)
        return self.host

    # ---- keys
    def block_keys(self, token_ids: list[int]) -> list[bytes]:
        return prefix_block_keys(token_ids, self.block_size, self.salt)

    def seq_block_keys(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Block keys of `seq`'s first `num_tokens` tokens (memoised: tokens only ever append)."""
        memo = self._seq_keys.setdefault(seq, _SeqKeys())
        if len(memo.keys) < num_tokens // self.block_size:
            extend_block_keys(memo.keys, seq.token_ids(0, num_tokens), self.block_size, self.salt)
        return memo.keys[: num_tokens // self.block_size]

    def key_of(self, seq: Sequence, num_tokens: int) -> tuple[bytes, bytes, tuple[int, ...]]:
        """(key, parent, tail) of `seq`'s first `num_tokens` tokens."""
        blocks = self.seq_block_keys(seq, num_tokens)
        parent = blocks[-1] if blocks else self.root
        tail = tuple(seq.token_ids(len(blocks) * self.block_size, num_tokens))
        return entry_key(parent, tail), parent, tail

    def published_keys(self) -> list[str]:
        """What this instance claims in Redis (hex): every entry, and a marker under each parent
        that has entries with a tail (`pdserve.prefix_keys.tail_marker`)."""
        return [key.hex() for key in self.entries] + [tail_marker(p).hex() for p in self.index.tails]

    def resume_point(self, prompt: list[int]) -> int:
        """Where the generation prompt a prompt ends with starts (0: it ends with none known)."""
        for suffix in self.resume_suffixes:
            if len(prompt) > len(suffix) and tuple(prompt[-len(suffix) :]) == suffix:
                return len(prompt) - len(suffix)
        return 0

    # ---- lookup and restore
    def lookup(self, seq: Sequence) -> Lookup:
        """The longest cached prefix of `seq`'s prompt that leaves at least one token to compute."""
        limit = seq.num_prompt_tokens - 1
        tokens = seq.prompt_token_ids
        keys = self.seq_block_keys(seq, limit)
        parents = [self.root, *keys]
        shared = self.index.shared(parents, tokens, limit, self.block_size)
        entry = self.index.longest(parents, tokens, limit, self.block_size)
        if entry is not None:
            self.entries.move_to_end(entry.key)
            return Lookup(entry, None, shared)
        if seq in self.refused or limit < self.min_entry_tokens:  # a pull that did not pay, or a
            reason = "too_short"  # prompt shorter than any prefix worth its checkpoint
        elif shared:
            reason = "diverged"
        elif self.index.was_evicted(keys):
            reason = "evicted"
        else:
            reason = "no_entry"
        return Lookup(None, reason, shared)

    def pages_to_share(self, entry: CacheEntry) -> int:
        """Pages a restore shares (a partly filled last page is copied, not shared; an entry on
        the host tier is copied whole)."""
        return entry.num_tokens // self.kv_pool.page_size if entry.tier == "gpu" else 0

    def restore(self, entry: CacheEntry, seq: Sequence) -> None:
        """Start `seq` (which owns a fresh state slot and no pages) after the cached prefix; needs
        one free page when the entry ends inside a page (copy-on-write of that page), every page
        of it when it is on the host tier."""
        if entry.tier == "host":
            return self._restore_from_host(entry, seq)
        full = self.pages_to_share(entry)
        self.kv_pool.share(entry.pages[:full])
        seq.block_table = list(entry.pages[:full])
        if len(entry.pages) > full:
            (page,) = self.kv_pool.allocate(1)
            self.kv_pool.copy_page(entry.pages[full], page)
            seq.block_table.append(page)
        self.checkpoints.restore(entry.checkpoint, seq.state_slot)
        seq.num_computed_tokens = entry.num_tokens
        seq.num_cached_tokens = entry.num_tokens
        entry.hits += 1
        self.stats.hit(entry.next_source, entry.num_tokens)
        entry.next_source = "gpu"

    def _restore_from_host(self, entry: CacheEntry, seq: Sequence) -> None:
        seq.block_table = self.kv_pool.allocate(len(entry.pages))
        self.host.load(entry.pages, entry.checkpoint, seq.block_table, seq.state_slot)
        seq.num_computed_tokens = seq.num_cached_tokens = entry.num_tokens
        entry.hits += 1
        self.stats.hit("host", entry.num_tokens)

    # ---- new entries
    def save(self, seq: Sequence, kind: str) -> bool:
        """Checkpoint `seq` (a copy of its slot), whose state holds exactly its first
        `num_computed_tokens` tokens; its pages are shared. False when not admitted."""
        n = seq.num_computed_tokens
        if n < self.min_entry_tokens:
            return False
        key, parent, tail = self.key_of(seq, n)
        if self._touch(key) or not self._room_for_checkpoint(kind):
            return False
        pages = list(seq.block_table[: self.kv_pool.pages_for(n)])
        self.kv_pool.share(pages)
        checkpoint = self.checkpoints.save(seq.state_slot)
        self._add(CacheEntry(key, parent, tail, n, pages, checkpoint, self.seq_block_keys(seq, n), kind))
        return True

    def adopt(self, seq: Sequence, kind: str) -> bool:
        """Turn a request that lets its memory go into an entry as it is: its slot becomes the
        checkpoint and its pages the entry's (no copy). False: nothing taken, free them as usual."""
        n = seq.num_computed_tokens
        if n < self.min_entry_tokens:
            return False
        key, parent, tail = self.key_of(seq, n)
        if self._touch(key) or not self._room_for_checkpoint(kind, adopting=True):
            return False
        if not self.checkpoints.adopt(seq.state_slot):
            return False
        keep = self.kv_pool.pages_for(n)
        self.kv_pool.free(seq.block_table[keep:])
        pages, slot = seq.block_table[:keep], seq.state_slot
        seq.block_table, seq.state_slot = [], None
        self._add(CacheEntry(key, parent, tail, n, pages, slot, self.seq_block_keys(seq, n), kind))
        return True

    def insert_pulled(
        self,
        key: bytes,
        parent: bytes,
        tail: tuple[int, ...],
        block_keys: list[bytes],
        pages: list[int],
        checkpoint: int,
    ) -> CacheEntry:
        """An entry whose pages and checkpoint a transfer from a peer has just filled (the caller
        allocated them: the entry owns them now). Its first hit counts as a peer hit."""
        if self._touch(key):  # raced with a local one on the device: keep that
            self.kv_pool.free(pages)
            self.checkpoints.free(checkpoint)
            return self.entries[key]
        num_tokens = len(block_keys) * self.block_size + len(tail)
        entry = CacheEntry(key, parent, tail, num_tokens, pages, checkpoint, block_keys, "peer")
        entry.next_source = "peer"
        self._add(entry)
        return entry

    def reserve_checkpoint(self) -> int | None:
        """A checkpoint for a transfer to fill (evicting an entry if need be); None: no room."""
        return self.checkpoints.reserve() if self._room_for_checkpoint("peer") else None

    def _touch(self, key: bytes) -> bool:
        """True when `key` is held on the device (made recent); one on the host tier is dropped:
        the caller's fresh device copy replaces it."""
        entry = self.entries.get(key)
        if entry is not None and entry.tier == "host":
            self._drop(entry)
            entry = None
        if entry is not None:
            self.entries.move_to_end(key)
        return entry is not None

    def _add(self, entry: CacheEntry) -> None:
        self.index.add(entry)
        self.stats.saved += 1
        self.version += 1

    def _room_for_checkpoint(self, kind: str, adopting: bool = False) -> bool:
        """A checkpoint can be taken (evicting if need be and allowed for `kind`)."""
        needed = self.checkpoints.num_used >= self.checkpoints.num_checkpoints
        if not adopting:
            needed = needed or self.checkpoints.num_free <= 0
        return not needed or self.evict_one(only_unused=kind in LOW_VALUE_KINDS, to_host=True)

    # ---- pins (a peer READing an entry) and eviction
    def pin(self, key: bytes) -> CacheEntry | None:
        """An entry on the device, pinned for a peer's READ (None: not held there)."""
        entry = self.entries.get(key)
        if entry is not None and entry.tier == "gpu":
            entry.pins += 1
            self.entries.move_to_end(key)
            return entry
        return None

    def unpin(self, entry: CacheEntry) -> None:
        entry.pins -= 1
        if entry.pins < 0:
            raise RuntimeError(f"prefix entry of {entry.num_tokens} tokens unpinned twice")

    @property
    def num_pages(self) -> int:
        """Distinct device KV pages the cache holds a reference to."""
        return len({p for e in self.entries.values() if e.tier == "gpu" for p in e.pages})

    def evict_one(
        self, keep: CacheEntry | None = None, only_unused: bool = False, to_host: bool = False
    ) -> bool:
        """Take one entry other than `keep` (the one a request is about to restore) and pinned
        ones (`EntryIndex.victim`) off the device: dropped, or (`to_host`: memory pressure) moved
        to the host tier when it has room; False when none can go."""
        victim = self.index.victim(keep, only_unused)
        if victim is None:
            return False
        if not (to_host and self._demote(victim, keep)):
            self._drop(victim)
        self.stats.evicted += 1
        return True

    def _demote(self, entry: CacheEntry, keep: CacheEntry | None) -> bool:
        """Move a device entry to the host tier (making room there, least valuable first)."""
        host = self._host_tier()
        if host is None or len(entry.pages) > host.num_pages:
            return False
        while not host.fits(len(entry.pages)):
            victim = self.index.victim(keep, only_unused=False, tier="host")
            if victim is None:
                return False
            self._drop(victim)
        host_pages, host_ck = host.store(entry.pages, entry.checkpoint)
        self.kv_pool.free(entry.pages)
        self.checkpoints.free(entry.checkpoint)
        entry.pages, entry.checkpoint, entry.tier = host_pages, host_ck, "host"
        return True

    def _drop(self, entry: CacheEntry) -> None:
        self.index.remove(entry)
        self.version += 1
        if entry.tier == "host":
            self.host.free(entry.pages, entry.checkpoint)
            return
        self.kv_pool.free(entry.pages)
        self.checkpoints.free(entry.checkpoint)

    def clear(self) -> None:
        """Drop every entry not pinned by a peer (the host tier's too)."""
        for entry in [e for e in self.entries.values() if e.pins == 0]:
            self._drop(entry)
