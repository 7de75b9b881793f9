"""The prefix cache's bookkeeping: its entries in LRU order and the indexes a lookup needs.

- `entries`: key -> entry, least recently used first;
- tails: parent block key -> the entries that end off a block boundary under it (their exact
  tail tokens are kept, so a lookup compares tokens and no hashing is needed);
- blocks: block key -> how many entries hold that block's pages (a prompt sharing blocks with
  the cache but no checkpoint has *diverged*: where, is a branch point worth a checkpoint);
- recently evicted keys, to tell an eviction miss from a cold one.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

EVICTED_MEMORY = 4096  # keys of recently evicted entries (and their blocks)
# Entries that go first while never reused, the oldest first: an answer's (a template that drops
# the reasoning never reuses it, and one that keeps it still finds the prompt's checkpoint below
# it) and a chunk's; then the resume and branch points where conversations' next turns start.
EVICT_FIRST = ("decode", "chunk")


@dataclass(slots=True, eq=False)
class CacheEntry:
    key: bytes
    parent: bytes  # the block key its tail hangs from (its own key when it has no tail)
    tail: tuple[int, ...]  # its tokens after the parent's boundary (empty on a block boundary)
    num_tokens: int
    pages: list[int]
    checkpoint: int  # a state slot holding the GDN state after exactly `num_tokens` tokens
    block_keys: list[bytes]  # its full blocks: what a prompt may share with it
    kind: str = "end"  # end | decode | chunk | resume | branch | peer
    hits: int = 0
    pins: int = 0  # peers reading it right now: not evictable
    next_source: str = "gpu"  # what its next hit counts as ("peer" right after a pull)
    tier: str = "gpu"  # "host": evicted to the host tier (`pages`, `checkpoint` are host ids)
    # its one user's conversation has moved past it (`PrefixCache.supersede`): when evicted, it
    # is dropped, not copied to the host tier (~140 MiB of copies for a 4K-token entry)
    superseded: bool = False
    host_restored: bool = False  # on the host tier: restored from there since it was moved there
    # reused once (a second reuse clears it), by a sequence that carries its conversation on and
    # supersedes it when it saves its next entry: the next to make room after superseded ones,
    # dropped rather than copied
    resumed: bool = False
    probe: bool = False  # moved to the host tier while its kind was throttled (`HostAdmission`)
    # the generation's entry (`decode`) that the sequence which made this one made next: a later
    # prompt restoring this one, not that, re-rendered the answer (`PrefixCache._pass_over`)
    followed_by: CacheEntry | None = None


class EntryIndex:
    def __init__(self) -> None:
        self.entries: OrderedDict[bytes, CacheEntry] = OrderedDict()  # least recently used first
        self.tails: dict[bytes, dict[bytes, CacheEntry]] = {}
        self.blocks: Counter[bytes] = Counter()
        self.evicted: OrderedDict[bytes, None] = OrderedDict()

    def add(self, entry: CacheEntry) -> None:
        self.entries[entry.key] = entry
        if entry.tail:
            self.tails.setdefault(entry.parent, {})[entry.key] = entry
        self.blocks.update(entry.block_keys)
        self.evicted.pop(entry.key, None)

    def remove(self, entry: CacheEntry) -> None:
        del self.entries[entry.key]
        if entry.tail:
            under = self.tails[entry.parent]
            del under[entry.key]
            if not under:
                del self.tails[entry.parent]
        self.blocks.subtract(entry.block_keys)
        for key in entry.block_keys:
            if self.blocks[key] <= 0:
                del self.blocks[key]
        for key in (entry.key, *entry.block_keys):
            self.evicted[key] = None
        while len(self.evicted) > EVICTED_MEMORY:
            self.evicted.popitem(last=False)

    def longest(
        self, parents: list[bytes], tokens: list[int], limit: int, block_size: int
    ) -> CacheEntry | None:
        """The longest entry that is a prefix of `tokens[:limit]` (`parents[i]`: the key of its
        first i blocks, parents[0] the root)."""
        for i in range(len(parents) - 1, -1, -1):
            base = i * block_size
            under = sorted(self.tails.get(parents[i], {}).values(), key=lambda e: -len(e.tail))
            for entry in under:
                t = len(entry.tail)
                if base + t <= limit and tuple(tokens[base : base + t]) == entry.tail:
                    return entry
            if i > 0 and parents[i] in self.entries:
                return self.entries[parents[i]]
        return None

    def shared(self, parents: list[bytes], tokens: list[int], limit: int, block_size: int) -> int:
        """How many leading tokens of `tokens[:limit]` some entry holds (checkpoint or not): its
        deepest shared block, then the longest common run with a tail hanging there."""
        i = next((i for i in range(len(parents) - 1, 0, -1) if parents[i] in self.blocks), 0)
        base, run = i * block_size, 0
        for entry in self.tails.get(parents[i], {}).values():
            common = 0
            for a, b in zip(entry.tail, tokens[base:limit], strict=False):
                if a != b:
                    break
                common += 1
            run = max(run, common)
        return min(base + run, limit)

    def was_evicted(self, keys: list[bytes]) -> bool:
        return any(key in self.evicted for key in keys)

    def victim(self, keep: CacheEntry | None, only_unused: bool, tier: str = "gpu") -> CacheEntry | None:
        """Who goes next from `tier` (but `keep` and pinned ones): the oldest entry whose
        conversation moved past it (`superseded`), else the oldest reused once by a sequence
        carrying its conversation on (`resumed`), else the oldest never-reused entry of an
        `EVICT_FIRST` kind, else among the older half of its entries the one reused least, then
        the oldest; `only_unused`: only one never reused. (Ranked by hits alone, a packed turn's
        new resume points took the room of the last turn's not yet restored, which then came back
        from the host tier, instead of those its sequences had just restored: 24 of 32 a turn
        with 40 checkpoints.)"""
        candidates = [e for e in self.entries.values() if e.tier == tier and e is not keep and e.pins == 0]
        if only_unused:
            candidates = [e for e in candidates if e.hits == 0]
        if not candidates:
            return None
        first = (
            next((e for e in candidates if e.superseded), None)
            or next((e for e in candidates if e.resumed), None)
            or next((e for e in candidates if e.hits == 0 and e.kind in EVICT_FIRST and not e.probe), None)
        )
        if first is not None:
            return first
        older = candidates[: (len(candidates) + 1) // 2]
        return min(older, key=lambda e: e.hits)  # min keeps the first (oldest) of equals
