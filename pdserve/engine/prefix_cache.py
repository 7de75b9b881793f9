"""The hybrid prefix cache: K/V pages shared by reference count plus a GDN state checkpoint
(docs/prefix-cache.md).

An entry covers the first `num_tokens` tokens of some sequence (any length): the pages holding
their K/V and a checkpoint of every GDN layer's state after exactly them. A request whose prompt
starts with those tokens shares the pages, restores the checkpoint into its own state slot and
computes only the rest. Entries are keyed by token ids (`pdserve.prefix_keys`: the chained hash
of the full blocks, plus the exact tail), so a prompt reuses the longest entry it contains,
wherever it diverges from the sequences that made them.

Where entries come from (the scheduler decides, `Scheduler._plan_checkpoints`): the exact end of
a prompt (the prefill's final state: the slot itself once the request lets it go, or a copy),
the end of a generation (the slot and pages of a finished request, no copy), the last block
boundary of a prompt, a resume point (where a chat template's next turn diverges from this
prompt's generation prompt), a branch point (a block boundary other cached prompts share), and
pulls from peers. A page that an entry holds only partly (a tail) is copied on restore, never
written by two holders.

Eviction, least recently used with a reuse count: among the older half of the entries, the one
reused least goes first. Pages and checkpoint always go together. A candidate that is only a
block-boundary checkpoint is admitted only by evicting entries never reused.
"""

from __future__ import annotations

import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from pdserve.engine.prefix_stats import PrefixStats
from pdserve.engine.sequence import Sequence
from pdserve.memory import GdnCheckpointPool, KvPagePool
from pdserve.prefix_keys import entry_key, extend_block_keys, prefix_block_keys, root_key, tail_marker

__all__ = ["CacheEntry", "Lookup", "PrefixCache", "prefix_block_keys"]
EVICTED_MEMORY = 4096  # keys of recently evicted entries, to tell an eviction miss apart
LOW_VALUE_KINDS = ("boundary",)  # admitted only over entries nobody reused


@dataclass(slots=True, eq=False)
class CacheEntry:
    key: bytes
    parent: bytes  # the block key its tail hangs from (its own key when it has no tail)
    tail_len: int
    num_tokens: int
    pages: list[int]
    checkpoint: int  # a state slot holding the GDN state after exactly `num_tokens` tokens
    block_keys: list[bytes]  # its full blocks: what a prompt may share with it
    kind: str = "end"  # end | decode | boundary | resume | branch | peer
    hits: int = 0
    pins: int = 0  # peers reading it right now: not evictable
    next_source: str = "gpu"  # what its next hit counts as ("peer" right after a pull)


@dataclass(slots=True)
class Lookup:
    """What a prompt can reuse: `entry` (None: a miss, `reason` says why) and `shared_tokens`,
    the longest block-aligned prefix some entry holds pages for (a branch point if beyond)."""

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
        tail_tokens: int = 16,
        min_hit_tokens: int = 1,
    ) -> None:
        if block_size % kv_pool.page_size:
            raise ValueError(
                f"prefix block size {block_size} must be a multiple of the page size {kv_pool.page_size}"
            )
        self.kv_pool = kv_pool
        self.checkpoints = checkpoints
        self.block_size = block_size
        self.tail_tokens = tail_tokens
        self.min_hit_tokens = min_hit_tokens
        self.salt = salt
        self.root = root_key(salt)
        self.entries: OrderedDict[bytes, CacheEntry] = OrderedDict()  # least recently used first
        self.version = 0  # bumped whenever the set of entries changes
        self.stats = PrefixStats()
        # token suffixes of generation prompts (`pdserve.engine.resume_points`): a prompt ending
        # in one also checkpoints where that suffix starts, where its next turn diverges
        self.resume_suffixes: list[tuple[int, ...]] = []
        self._tails: dict[bytes, Counter[int]] = {}  # parent -> tail length -> entries
        self._blocks: Counter[bytes] = Counter()  # block key -> entries holding its pages
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self._seq_keys: weakref.WeakKeyDictionary[Sequence, _SeqKeys] = weakref.WeakKeyDictionary()
        self.refused: weakref.WeakSet[Sequence] = weakref.WeakSet()  # a pull did not pay for them

    # ---- keys
    def block_keys(self, token_ids: list[int]) -> list[bytes]:
        return prefix_block_keys(token_ids, self.block_size, self.salt)

    def seq_block_keys(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Block keys of `seq`'s first `num_tokens` tokens (memoised: tokens only ever append)."""
        memo = self._seq_keys.setdefault(seq, _SeqKeys())
        if len(memo.keys) < num_tokens // self.block_size:
            extend_block_keys(memo.keys, seq.token_ids(0, num_tokens), self.block_size, self.salt)
        return memo.keys[: num_tokens // self.block_size]

    def key_of(self, seq: Sequence, num_tokens: int) -> tuple[bytes, bytes, int]:
        """(key, parent, tail length) of `seq`'s first `num_tokens` tokens."""
        blocks = self.seq_block_keys(seq, num_tokens)
        parent = blocks[-1] if blocks else self.root
        start = len(blocks) * self.block_size
        return entry_key(parent, seq.token_ids(start, num_tokens)), parent, num_tokens - start

    def published_keys(self) -> list[str]:
        """What this instance claims in Redis (hex): every entry, and a marker under each parent
        that has entries with a tail (`pdserve.prefix_keys.tail_marker`)."""
        keys = [key.hex() for key in self.entries]
        keys += [tail_marker(parent).hex() for parent in self._tails]
        return keys

    # ---- policy
    def checkpoint_boundary(self, num_prompt_tokens: int) -> int:
        """The block boundary a prompt checkpoints at (0: none): its last one that leaves a token
        to compute, moved back a block when inside the prompt's last `tail_tokens` tokens."""
        boundary = (num_prompt_tokens - 1) // self.block_size * self.block_size
        if 0 < boundary and num_prompt_tokens - boundary <= self.tail_tokens:
            boundary -= self.block_size
        return max(boundary, 0)

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
        shared = next((i for i in range(len(keys), 0, -1) if parents[i] in self._blocks), 0)
        shared *= self.block_size
        for i in range(len(keys), -1, -1):
            base = i * self.block_size
            for t in sorted(self._tails.get(parents[i], ()), reverse=True):
                if base + t <= limit:
                    entry = self.entries.get(entry_key(parents[i], tokens[base : base + t]))
                    if entry is not None:
                        return self._found(entry, shared)
            if i > 0 and parents[i] in self.entries:
                return self._found(self.entries[parents[i]], shared)
        if seq in self.refused:
            reason = "too_short"
        elif shared:
            reason = "diverged"
        elif any(k in self._evicted for k in keys):
            reason = "evicted"
        else:
            reason = "no_entry"
        return Lookup(None, reason, shared)

    def _found(self, entry: CacheEntry, shared: int) -> Lookup:
        if entry.num_tokens < self.min_hit_tokens:
            return Lookup(None, "too_short", shared)
        self.entries.move_to_end(entry.key)
        return Lookup(entry, None, shared)

    def pages_to_share(self, entry: CacheEntry) -> int:
        """Pages a restore shares (a partly filled last page is copied, not shared)."""
        return entry.num_tokens // self.kv_pool.page_size

    def restore(self, entry: CacheEntry, seq: Sequence) -> None:
        """Start `seq` (which owns a fresh state slot and no pages) after the cached prefix; needs
        one free page when the entry ends inside a page (copy-on-write of that page)."""
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

    # ---- new entries
    def save(self, seq: Sequence, kind: str = "boundary") -> bool:
        """Checkpoint `seq` (a copy of its slot), whose state holds exactly its first
        `num_computed_tokens` tokens; its pages are shared. False when not admitted."""
        n = seq.num_computed_tokens
        key, parent, tail_len = self.key_of(seq, n)
        if self._touch(key) or not self._room_for_checkpoint(kind):
            return False
        pages = seq.block_table[: self.kv_pool.pages_for(n)]
        self.kv_pool.share(pages)
        self._insert(
            CacheEntry(
                key,
                parent,
                tail_len,
                n,
                list(pages),
                self.checkpoints.save(seq.state_slot),
                self.seq_block_keys(seq, n),
                kind,
            )
        )
        return True

    def adopt(self, seq: Sequence, kind: str) -> bool:
        """Turn a request that lets its memory go into an entry as it is: its slot becomes the
        checkpoint and its pages the entry's (no copy). False: nothing taken, free them as usual."""
        n = seq.num_computed_tokens
        key, parent, tail_len = self.key_of(seq, n)
        if self._touch(key) or not self._room_for_checkpoint(kind, adopting=True):
            return False
        if not self.checkpoints.adopt(seq.state_slot):
            return False
        keep = self.kv_pool.pages_for(n)
        self.kv_pool.free(seq.block_table[keep:])
        entry = CacheEntry(
            key,
            parent,
            tail_len,
            n,
            seq.block_table[:keep],
            seq.state_slot,
            self.seq_block_keys(seq, n),
            kind,
        )
        seq.block_table, seq.state_slot = [], None
        self._insert(entry)
        return True

    def insert_pulled(
        self,
        key: bytes,
        parent: bytes,
        tail_len: int,
        block_keys: list[bytes],
        pages: list[int],
        checkpoint: int,
    ) -> CacheEntry:
        """An entry whose pages and checkpoint a transfer from a peer has just filled (the caller
        allocated them: the entry owns them now). Its first hit counts as a peer hit."""
        num_tokens = len(block_keys) * self.block_size + tail_len
        entry = CacheEntry(key, parent, tail_len, num_tokens, pages, checkpoint, block_keys, "peer")
        entry.next_source = "peer"
        if key in self.entries:  # raced with a local one: keep the local
            self.kv_pool.free(pages)
            self.checkpoints.free(checkpoint)
            return self.entries[key]
        self._insert(entry)
        return entry

    def reserve_checkpoint(self) -> int | None:
        """A checkpoint for a transfer to fill (evicting an entry if need be); None: no room."""
        return self.checkpoints.reserve() if self._room_for_checkpoint("peer") else None

    def _touch(self, key: bytes) -> bool:
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        return False

    def _insert(self, entry: CacheEntry) -> None:
        self.entries[entry.key] = entry
        if entry.tail_len:
            self._tails.setdefault(entry.parent, Counter())[entry.tail_len] += 1
        self._blocks.update(entry.block_keys)
        self._evicted.pop(entry.key, None)
        self.stats.saved += 1
        self.version += 1

    def _room_for_checkpoint(self, kind: str, adopting: bool = False) -> bool:
        """A checkpoint can be taken (evicting if need be and allowed for `kind`)."""
        needed = self.checkpoints.num_used >= self.checkpoints.num_checkpoints
        if not adopting:
            needed = needed or self.checkpoints.num_free <= 0
        if not needed:
            return True
        return self.evict_one(only_unused=kind in LOW_VALUE_KINDS)

    # ---- pins (a peer READing an entry) and eviction
    def pin(self, key: bytes) -> CacheEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            entry.pins += 1
            self.entries.move_to_end(key)
        return entry

    def unpin(self, entry: CacheEntry) -> None:
        entry.pins -= 1
        if entry.pins < 0:
            raise RuntimeError(f"prefix entry of {entry.num_tokens} tokens unpinned twice")

    @property
    def num_pages(self) -> int:
        """Distinct KV pages the cache holds a reference to."""
        return len({p for entry in self.entries.values() for p in entry.pages})

    def evict_one(self, keep: CacheEntry | None = None, only_unused: bool = False) -> bool:
        """Drop one entry other than `keep` (the one a request is about to restore) and pinned
        ones: among the older half, the one reused least (then the oldest). False when none can go."""
        candidates = [e for e in self.entries.values() if e is not keep and e.pins == 0]
        if only_unused:
            candidates = [e for e in candidates if e.hits == 0]
        if not candidates:
            return False
        older = candidates[: (len(candidates) + 1) // 2]
        victim = min(older, key=lambda e: e.hits)  # min keeps the first (oldest) of equals
        self._drop(victim)
        self.stats.evicted += 1
        return True

    def _drop(self, entry: CacheEntry) -> None:
        del self.entries[entry.key]
        if entry.tail_len:
            lengths = self._tails[entry.parent]
            lengths[entry.tail_len] -= 1
            if lengths[entry.tail_len] == 0:
                del lengths[entry.tail_len]
            if not lengths:
                del self._tails[entry.parent]
        self._blocks.subtract(entry.block_keys)
        for k in entry.block_keys:
            if self._blocks[k] <= 0:
                del self._blocks[k]
        for k in (entry.key, *entry.block_keys):
            self._evicted[k] = None
        while len(self._evicted) > EVICTED_MEMORY:
            self._evicted.popitem(last=False)
        self.version += 1
        self.kv_pool.free(entry.pages)
        self.checkpoints.free(entry.checkpoint)

    def clear(self) -> None:
        """Drop every entry not pinned by a peer."""
        for entry in [e for e in self.entries.values() if e.pins == 0]:
            self._drop(entry)
