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

Admission: no entry shorter than `min_entry_tokens`; the room for its checkpoint, eviction
(LRU with a reuse count, to the host tier under memory pressure) and pins are the entry store's
(`pdserve.engine.prefix_entries.PrefixEntryStore`, which `PrefixCache` extends).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdserve.engine.prefix_entries import PrefixEntryStore
from pdserve.engine.prefix_index import CacheEntry
from pdserve.engine.sequence import Sequence
from pdserve.memory import GdnCheckpointPool, KvPagePool
from pdserve.prefix_keys import entry_key, extend_block_keys, prefix_block_keys, root_key, tail_marker

__all__ = ["CacheEntry", "Lookup", "PrefixCache", "prefix_block_keys"]


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


NEAR_TOKENS = 4  # an end checkpoint this close to one the prompt made is not worth its slot


class PrefixCache(PrefixEntryStore):
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
        super().__init__(kv_pool, checkpoints, host_tier_bytes)
        self.block_size = block_size
        # a prefix shorter than this (default: a block) would cost a checkpoint for a recompute
        # that is cheap anyway: not kept
        self.min_entry_tokens = block_size if min_entry_tokens is None else min_entry_tokens
        self.salt = salt
        self.root = root_key(salt)
        # token suffixes of generation prompts (`pdserve.engine.resume_points`): a prompt ending
        # in one also checkpoints where that suffix starts, where its next turn diverges
        self.resume_suffixes: list[tuple[int, ...]] = []
        self.refused: weakref.WeakSet[Sequence] = weakref.WeakSet()  # a pull did not pay for them
        self._seq_keys: weakref.WeakKeyDictionary[Sequence, _SeqKeys] = weakref.WeakKeyDictionary()

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

    @contextmanager
    def using_resume_suffixes(self, suffixes: list[tuple[int, ...]]) -> Iterator[None]:
        """`resume_suffixes` is `suffixes` inside the block, and what it was before once the block
        ends, by an exception too (warm-up and `pdserve check` borrow a serving cache)."""
        saved, self.resume_suffixes = self.resume_suffixes, list(suffixes)
        try:
            yield
        finally:
            self.resume_suffixes = saved

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
        self._started_from(entry, seq, entry.next_source)
        entry.next_source = "gpu"

    def _restore_from_host(self, entry: CacheEntry, seq: Sequence) -> None:
        if not entry.host_restored:  # moving it there paid off
            entry.host_restored = True
            self.admission.left(entry.kind, restored=True)
        seq.block_table = self.kv_pool.allocate(len(entry.pages))
        self.host.load(entry.pages, entry.checkpoint, seq.block_table, seq.state_slot)
        self._started_from(entry, seq, "host")

    def _started_from(self, entry: CacheEntry, seq: Sequence, source: str) -> None:
        """`seq` goes on from `entry`'s prefix (its pages and state in place): a hit from `source`;
        the entry's first reuse makes it `resumed` (its conversation is moving past it)."""
        seq.num_computed_tokens = seq.num_cached_tokens = entry.num_tokens
        seq.restored_from = entry
        entry.hits += 1
        entry.superseded, entry.resumed = False, entry.hits == 1
        self.stats.hit(source, entry.num_tokens)
        self._pass_over(entry.followed_by)

    def _pass_over(self, answer: CacheEntry | None) -> None:
        """A prompt restored the entry the generation `answer` went on from, so it does not extend
        `answer` (the lookup takes the longest entry): its chat template re-rendered that answer
        (Qwen3.6's drops the reasoning). Never reused, it is superseded: the first to make room,
        and dropped rather than copied to the host tier (the H200 copied ~30 of them a turn, ~110
        MB each in the compute stream, until `HostAdmission` throttled the kind)."""
        held = answer is not None and self.entries.get(answer.key) is answer
        if held and answer.tier == "gpu" and not answer.hits:
            answer.superseded = True
            self.entries.move_to_end(answer.key, last=False)

    # ---- new entries
    def save(self, seq: Sequence, kind: str) -> bool:
        """Checkpoint `seq` (a copy of its slot), whose state holds exactly its first
        `num_computed_tokens` tokens; its pages are shared. False when not admitted."""
        n = seq.num_computed_tokens
        checkpoint = self.reserve_save(seq, n, kind)
        if checkpoint is None:
            return False
        self.checkpoints.copy(seq.state_slot, checkpoint)
        self.commit_save(seq, n, checkpoint, kind)
        return True

    def reserve_save(self, seq: Sequence, num_tokens: int, kind: str) -> int | None:
        """A checkpoint for `seq`'s state after its first `num_tokens` tokens, which the caller
        fills (a copy, or the pass crossing that position); None when not admitted (too short,
        held already, no room)."""
        if num_tokens < self.min_entry_tokens:
            return None
        key, _, _ = self.key_of(seq, num_tokens)
        if self._touch(key) or not self._room_for_checkpoint(kind):
            return None
        return self.checkpoints.reserve()

    def commit_save(self, seq: Sequence, n: int, checkpoint: int, kind: str) -> None:
        """The entry of `seq`'s first `n` tokens, whose state a `reserve_save` checkpoint now
        holds; its pages are shared."""
        key, parent, tail = self.key_of(seq, n)
        if self._touch(key):  # the same prefix saved twice in one pass: keep the first
            self.checkpoints.free(checkpoint)
            return
        pages = list(seq.block_table[: self.kv_pool.pages_for(n)])
        self.kv_pool.share(pages)
        blocks = self.seq_block_keys(seq, n)
        self._made(seq, CacheEntry(key, parent, tail, n, pages, checkpoint, blocks, kind))

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
        self._made(seq, CacheEntry(key, parent, tail, n, pages, slot, self.seq_block_keys(seq, n), kind))
        return True

    def _made(self, seq: Sequence, entry: CacheEntry) -> None:
        """Add `seq`'s new `entry`. A generation's entry is linked from the one `seq` made last
        (`CacheEntry.followed_by`: in a chat, the resume point before the generation prompt), so
        the next turn restoring that one passes the answer over (`_pass_over`)."""
        self._add(entry)
        if entry.kind == "decode" and seq.last_entry is not None:
            seq.last_entry.followed_by = entry
        seq.last_entry = entry
        self.supersede(seq, entry.num_tokens)

    def supersede(self, seq: Sequence, num_tokens: int) -> None:
        """`seq` made an entry of `num_tokens` tokens. The entry it started from, if only it ever
        reused that one (a conversation's previous turn), is now a link its conversation has moved
        past: it goes back to never-reused and least recent, the first to make room, and is
        dropped rather than moved to the host tier when it goes (a conversation of 32 on the
        H200 demoted ~97 such entries a turn, ~11 GB of copies in the engine's stream); entries
        reused by several sequences are branch points and keep their count."""
        seq.last_checkpoint = num_tokens
        old, seq.restored_from = seq.restored_from, None
        if old is not None and old.hits == 1 and self.entries.get(old.key) is old:
            old.hits, old.superseded = 0, True
            self.entries.move_to_end(old.key, last=False)

    def wants_end_checkpoint(self, seq: Sequence) -> bool:
        """Whether the exact end of `seq`'s prompt is worth a checkpoint copy of its own: not when
        it made one within `NEAR_TOKENS` tokens of it (the resume point before a generation
        prompt such as `<think>\n`: a prompt extending this one reuses that and recomputes the
        few tokens between)."""
        return seq.num_computed_tokens - seq.last_checkpoint > NEAR_TOKENS

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
