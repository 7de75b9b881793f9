"""The prefix cache's part of a service: what one instance's cache shares with the others.

One `PrefixSharing` per engine host (`PrefixSharing.of(host)`; the prefill and decode roles of a
two-role engine share it):
  - resume points: read from the model's chat template at start (`engine.resume_points`);
  - giving: a peer asks to READ an entry (`pin_prefix`): it is pinned (never evicted) until the
    peer unpins it or `PIN_TTL_S` passes, and this side's transfer worker is pumped meanwhile
    (no NIXL progress thread on CPU);
  - taking: a request whose router named another instance holding a longer prefix of its prompt
    (`GenerateItem.prefix_source`, e.g. a decode instance that generated the previous turn)
    waits (`Scheduler.fetching`) while that entry's pages and checkpoint are READ into this
    instance's pools, when the cost model says the READ beats recomputing the difference;
    the result is an ordinary cache entry, which the scheduler restores (its first hit counts
    as a peer hit). Anything failing on the way: the request computes the tokens instead;
  - counting: the cache's hit and miss counters go out with the instance's load.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import weakref
from dataclasses import dataclass, field

from kvtransfer import TransferHandle, pool_units
from pdserve.engine.prefix_cache import CacheEntry
from pdserve.engine.resume_points import resume_suffix
from pdserve.engine.sequence import Sequence
from pdserve.memory import KvPagePool
from pdserve.peer_directory import PeerDirectory
from pdserve.peer_reads import PeerReads
from pdserve.rpc import RpcError
from pdserve.serving import EngineHost, ServiceRole

log = logging.getLogger("pdserve.prefix")
PIN_TTL_S = 30.0
PIN_TIMEOUT_S = 5.0
LINK_PRIOR = {"DRAM": 1 << 30, "VRAM": 20 << 30}  # bytes/s until pulls are measured
PULL_OVERHEAD_S = 0.005  # a pin and engine-thread turns on both sides, until measured


@dataclass(slots=True)
class Pin:
    entry: CacheEntry
    expires: float


@dataclass(slots=True)
class Pull:
    seq: Sequence
    agent: str
    key: bytes
    parent: bytes
    tail: tuple[int, ...]
    block_keys: list[bytes]
    num_tokens: int
    pin_id: str | None = None
    pages: list[int] = field(default_factory=list)
    checkpoint: int | None = None
    started: float = field(default_factory=time.monotonic)


class PrefixSharing(ServiceRole):
    _of: weakref.WeakKeyDictionary[EngineHost, PrefixSharing] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, host: EngineHost) -> PrefixSharing:
        if host not in cls._of:
            cls._of[host] = cls(host)
        return cls._of[host]

    def __init__(self, host: EngineHost) -> None:
        super().__init__(host)
        self.cache = self.engine.prefix_cache
        self.pins: dict[str, Pin] = {}
        self.pulls: dict[str, Pull] = {}  # by request id
        self.peers = PeerDirectory(host, roles=("decode", "prefill"))
        self.reads = PeerReads(host, self.peers)  # READ, unpin on the holder; a failed peer forgotten
        self.link_bytes_per_s = float(LINK_PRIOR[self.agent.mem_type])
        self.overhead_s = PULL_OVERHEAD_S  # a pull's time beyond its bytes: measured, averaged
        if self.cache is not None:  # the host tier, allocated now rather than at the first eviction
            self.cache.configure_host_tier(self.engine.config.snapshot_pool_mb << 20)
        if self.cache is not None and self.engine.tokenizer is not None:
            suffix = resume_suffix(self.engine.tokenizer)
            self.cache.resume_suffixes = [suffix] if suffix else []
            if suffix:
                log.info("prefix cache: prompts ending in %s also checkpoint where it starts", suffix)

    def load(self) -> dict:
        """Merged into the instance's published load. A checkpoint is a state slot that any
        request may have (its entry is evicted for it), so `free_state_slots` counts the slots
        of unpinned entries as free; `prefix_checkpoints` says how many hold one."""
        if self.cache is None:
            return {}
        evictable = sum(1 for e in self.cache.entries.values() if e.tier == "gpu" and e.pins == 0)
        return {
            "free_state_slots": self.engine.runner.state_pool.num_free + evictable,
            "prefix_checkpoints": self.cache.checkpoints.num_used,
            "prefix_host_entries": sum(1 for e in self.cache.entries.values() if e.tier == "host"),
            "prefix_pins": len(self.pins),
            "prefix_pulls": len(self.pulls),
            "prefix_cache": self.cache.stats.report(),
        }

    async def clear_prefix_cache(self, msg: dict) -> dict:
        """Drop every entry no peer is reading (vLLM's reset_prefix_cache)."""
        return {"cleared": await self.thread.call(self._clear)}

    def _clear(self) -> int:
        if self.cache is None:
            return 0
        before = len(self.cache.entries)
        self.cache.clear()
        return before - len(self.cache.entries)

    # ---- giving: RPC handlers (a peer READs one of our entries)
    async def endpoint(self, msg: dict) -> dict:
        return dict(self.agent.endpoint())

    async def pin_prefix(self, msg: dict) -> dict:
        """{"key": hex, "num_tokens": n} -> the entry's units and a pin id (None: not held)."""
        key, num_tokens = msg.get("key"), msg.get("num_tokens")
        if not isinstance(key, str) or not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
            raise ValueError("pin_prefix needs a hex key and an integer num_tokens")
        return await self.thread.call(self._pin, bytes.fromhex(key), num_tokens)

    async def unpin_prefix(self, msg: dict) -> dict:
        return {"unpinned": await self.thread.call(self._unpin, str(msg.get("pin_id")))}

    def _pin(self, key: bytes, num_tokens: int) -> dict:
        entry = self.cache.pin(key) if self.cache is not None else None
        if entry is not None and entry.num_tokens != num_tokens:
            self.cache.unpin(entry)
            entry = None
        if entry is None:
            return {"pin_id": None}
        pin_id = secrets.token_hex(8)
        self.pins[pin_id] = Pin(entry, time.monotonic() + PIN_TTL_S)
        return {"pin_id": pin_id, "kv_pages": list(entry.pages), "checkpoint": entry.checkpoint}

    def _unpin(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is not None:
            self.cache.unpin(pin.entry)
        return pin is not None

    # ---- taking (on the engine thread unless said otherwise)
    def start(self, seq: Sequence, source: dict) -> bool:
        """Called right after `seq` is queued: pull `source`'s entry for it if that pays. True
        when a pull started (the sequence waits for it)."""
        cache, n = self.cache, source["num_tokens"]
        if cache is None or n >= seq.num_prompt_tokens or source["agent"] == self.agent.name:
            return False
        local = cache.lookup(seq)
        gain = n - (local.entry.num_tokens if local.entry else 0)
        if gain <= 0:
            return False
        pull_s, compute_s = self._costs(gain, n)
        if pull_s >= compute_s:
            log.info(
                "not pulling %d tokens for %s: ~%.1f ms to pull, ~%.1f ms to compute %d",
                n,
                seq.request_id,
                1e3 * pull_s,
                1e3 * compute_s,
                gain,
            )
            cache.refused.add(seq)
            cache.stats.pulls["refused"] += 1
            return False
        key, parent, tail = cache.key_of(seq, n)
        if key.hex() != source["key"]:  # another prompt's key: the router's view was stale
            return False
        block_keys = list(cache.seq_block_keys(seq, n))
        pull = Pull(seq, source["agent"], key, parent, tail, block_keys, n)
        self.pulls[seq.request_id] = pull
        self.engine.scheduler.fetching[seq.request_id] = seq
        asyncio.run_coroutine_threadsafe(self._pin_remote(pull), self._loop)
        return True

    def _costs(self, gain_tokens: int, num_tokens: int) -> tuple[float, float]:
        """(seconds to pull `num_tokens` tokens' entry, seconds to compute the `gain_tokens` more
        it gives): bytes over the measured link rate, tokens over the measured prefill rate."""
        cfg = self.engine.config
        page = KvPagePool.bytes_per_page(cfg.model_config, cfg.page_size, cfg.dtype)
        nbytes = self.engine.runner.kv_pool.pages_for(num_tokens) * page
        nbytes += self.cache.checkpoints.bytes_per_checkpoint
        pull_s = self.overhead_s + nbytes / self.link_bytes_per_s
        return pull_s, gain_tokens / self.engine.prefill_rate.tokens_per_s

    async def _pin_remote(self, pull: Pull) -> None:
        """On the event loop: handshake with the holder if new, pin the entry there, then READ."""
        try:
            peer = await self.peers.connect(pull.agent)
            answer = await self.peers.client(pull.agent).unary(
                "pin_prefix", {"key": pull.key.hex(), "num_tokens": pull.num_tokens}, timeout=PIN_TIMEOUT_S
            )
        except (TimeoutError, LookupError, RpcError, OSError) as e:
            self.thread.post(self._give_up, pull, f"cannot reach {pull.agent}: {e}")
            return
        if answer.get("pin_id") is None:
            self.thread.post(self._give_up, pull, f"{pull.agent} no longer holds it")
            return
        pull.pin_id = answer["pin_id"]
        self.thread.post(self._read, pull, peer, answer)

    def _read(self, pull: Pull, peer: str, answer: dict) -> None:
        kv = self.engine.runner.kv_pool
        remote_pages = answer.get("kv_pages")
        if not isinstance(remote_pages, list) or len(remote_pages) != kv.pages_for(pull.num_tokens):
            return self._give_up(pull, "the holder's pages do not match the entry")
        if not self.engine.scheduler.make_room(len(remote_pages)):
            return self._give_up(pull, "no room for the pulled prefix")
        checkpoint = self.cache.reserve_checkpoint()
        if checkpoint is None:
            return self._give_up(pull, "no checkpoint free for the pulled prefix")
        pull.checkpoint, pull.pages = checkpoint, kv.allocate(len(remote_pages))
        self.reads.start(
            f"prefix-{pull.seq.request_id}",
            pull.agent,
            peer,
            pool_units(remote_pages, answer.get("checkpoint")),
            pool_units(pull.pages, pull.checkpoint),
            on_done=lambda handle: self._pulled(pull, handle),
            on_failed=lambda why: self._give_up(pull, why),
        )

    def tick(self) -> bool:
        now = time.monotonic()
        for pin_id in [p for p, pin in self.pins.items() if pin.expires < now]:
            log.warning("prefix pin %s was never released; unpinned after %.0f s", pin_id, PIN_TTL_S)
            self._unpin(pin_id)
        if self.pins:  # a peer's READ completes only as our worker progresses
            self.agent.take_done_notifications()
        self.reads.tick()
        return bool(self.pulls or self.pins)

    def _pulled(self, pull: Pull, handle: TransferHandle) -> None:
        """The READ is done: the entry is this instance's own now."""
        cache = self.cache
        cache.insert_pulled(pull.key, pull.parent, pull.tail, pull.block_keys, pull.pages, pull.checkpoint)
        cache.stats.pulls["done"] += 1
        cache.stats.pull_bytes += handle.nbytes
        took = time.monotonic() - pull.started
        beyond = max(0.0, took - handle.nbytes / self.link_bytes_per_s)
        self.overhead_s = 0.7 * self.overhead_s + 0.3 * beyond
        log.info(
            "pulled %d cached tokens from %s for %s: %d bytes, %.1f ms in all",
            pull.num_tokens,
            pull.agent,
            pull.seq.request_id,
            handle.nbytes,
            1e3 * took,
        )
        pull.pages, pull.checkpoint = [], None
        self._done(pull)

    def _give_up(self, pull: Pull, why: str) -> None:
        log.warning("prefix pull for %s: %s; computing it instead", pull.seq.request_id, why)
        self.cache.stats.pulls["failed"] += 1
        if pull.pages:
            self.engine.runner.kv_pool.free(pull.pages)
        if pull.checkpoint is not None:
            self.cache.checkpoints.free(pull.checkpoint)
        pull.pages, pull.checkpoint = [], None
        self._done(pull)

    def _done(self, pull: Pull) -> None:
        self.pulls.pop(pull.seq.request_id, None)
        self.engine.scheduler.fetching.pop(pull.seq.request_id, None)
        if pull.pin_id is not None:  # a failed unpin is logged: the pin expires anyway
            self.reads.let_go(pull.agent, "unpin_prefix", {"pin_id": pull.pin_id})
