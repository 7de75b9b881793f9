"""The prefix cache's entries and the memory they hold, on the device and on the host tier:
room for a new checkpoint, eviction, demotion to the host tier, pins (docs/prefix-cache.md).

`PrefixEntryStore` is the bookkeeping half of `pdserve.engine.prefix_cache.PrefixCache` (which
adds the keys, the lookup and restore, and the making of entries): it owns the entries' device
KV pages and checkpoints (state slots) and the host tier's copies, and takes them back.

Admission and eviction know what a checkpoint costs (a state slot, ~61 MiB at the full shape):
a chunk-end checkpoint is admitted only over entries nobody reused (`LOW_VALUE_KINDS`); eviction
takes links a conversation moved past or is moving past first, then LRU with a reuse count
(`EntryIndex.victim`); pages and checkpoint always go together; an entry evicted for memory
moves to the host tier when it fits there (least valuable host entries dropped first) and its
kind's recent entries there were restored (`HostAdmission`), else it is dropped; a long prompt's
chunk-end entry whose pages its prompt (or a later entry) still holds is dropped too: the copy
would free no KV page, and a prompt prefilling 131K tokens in chunks would copy each of its
growing prefixes out (~800 MiB at 40K tokens, in the engine's stream beside the decode steps);
entries a peer is reading are pinned.
"""

from __future__ import annotations

from pdserve.engine.host_admission import HostAdmission
from pdserve.engine.prefix_index import CacheEntry, EntryIndex
from pdserve.memory import GdnCheckpointPool, HostTier, KvPagePool
from pdserve.prefix_stats import PrefixStats

LOW_VALUE_KINDS = ("chunk",)  # admitted only over entries nobody reused


class PrefixEntryStore:
    def __init__(
        self, kv_pool: KvPagePool, checkpoints: GdnCheckpointPool, host_tier_bytes: int | None = None
    ) -> None:
        self.kv_pool = kv_pool
        self.checkpoints = checkpoints
        self.index = EntryIndex()
        self.entries = self.index.entries  # key -> entry, least recently used first
        self.version = 0  # bumped whenever the set of entries changes
        self.stats = PrefixStats()
        # where evicted entries go (`configure_host_tier`); None until configured: the first
        # eviction makes the default for the device (EngineConfig.snapshot_pool_mb's)
        self.host: HostTier | None = None
        self.admission = HostAdmission()
        self._host_bytes = host_tier_bytes
        if host_tier_bytes is not None:
            self.configure_host_tier(host_tier_bytes)

    def configure_host_tier(self, budget_bytes: int) -> None:
        """Allocate the host tier now (0: none); entries already on the host tier are dropped.
        The same budget again keeps the tier as it is (pinned memory is not given back)."""
        if budget_bytes == self._host_bytes and (self.host is not None or not budget_bytes):
            return
        for entry in [e for e in self.entries.values() if e.tier == "host"]:
            self._drop(entry)
        self.admission = HostAdmission()
        self._host_bytes = budget_bytes
        self.host = HostTier(self.kv_pool, self.checkpoints.states, budget_bytes) if budget_bytes else None

    def _host_tier(self) -> HostTier | None:
        if self.host is None and self._host_bytes is None:
            self.configure_host_tier((4096 if self.kv_pool.kv.is_cuda else 16) << 20)
        return self.host

    # ---- admission
    def reserve_checkpoint(self) -> int | None:
        """A checkpoint for a transfer to fill (evicting an entry if need be); None: no room."""
        return self.checkpoints.reserve() if self._room_for_checkpoint("peer") else None

    def _touch(self, key: bytes) -> bool:
        """True when `key` is held on the device (made recent); one on the host tier is dropped:
        the caller's fresh device copy replaces it."""
        entry = self.entries.get(key)
        if entry is not None and entry.tier == "host":
            if not entry.host_restored:  # its prefix was wanted again: the move was not wasted
                entry.host_restored = True
                self.admission.left(entry.kind, restored=True)
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
        to the host tier when it has room, unless its conversation moved past it (or is moving
        past it: `resumed`); False when none can go."""
        victim = self.index.victim(keep, only_unused)
        if victim is None:
            return False
        if to_host and self._worth_a_copy(victim) and self._demote(victim, keep):
            self.stats.demoted += 1
        else:
            self._drop(victim)
        self.stats.evicted += 1
        return True

    def _worth_a_copy(self, entry: CacheEntry) -> bool:
        """Whether moving `entry` to the host tier beats dropping it: not a link its conversation
        moved past, and not a chunk-end entry none of whose pages the copy would free."""
        if entry.superseded or entry.resumed:
            return False
        return entry.kind not in LOW_VALUE_KINDS or any(self.kv_pool.refcount(p) == 1 for p in entry.pages)

    def _demote(self, entry: CacheEntry, keep: CacheEntry | None) -> bool:
        """Move a device entry to the host tier (making room there, least valuable first)."""
        host = self._host_tier()
        probe = self.admission.throttled(entry.kind)
        if host is None or len(entry.pages) > host.num_pages or not self.admission.admits(entry.kind):
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
        entry.host_restored, entry.probe = False, probe
        return True

    def _drop(self, entry: CacheEntry) -> None:
        self.index.remove(entry)
        self.version += 1
        if entry.tier == "host":
            self.host.free(entry.pages, entry.checkpoint)
            if not entry.host_restored:
                self.admission.left(entry.kind, restored=False)
            return
        self.kv_pool.free(entry.pages)
        self.checkpoints.free(entry.checkpoint)

    def clear(self) -> None:
        """Drop every entry not pinned by a peer (the host tier's too)."""
        for entry in [e for e in self.entries.values() if e.pins == 0]:
            self._drop(entry)
        self.admission = HostAdmission()  # what was dropped here says nothing of reuse
