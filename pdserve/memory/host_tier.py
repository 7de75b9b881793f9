"""The prefix cache's host tier: pinned host memory, allocated at start, for the checkpoints and
KV pages of entries evicted from the device (`--snapshot-pool-mb`).

Pools unit-major, so each host unit (a checkpoint, a page) is one contiguous block of pinned
memory: `conv` [checkpoints, layers, ...], `recurrent` [checkpoints, layers, ...], `kv` [pages,
layers, 2, page_size, Hkv, D]; an entry's pages move with one gather (or scatter) on the device
and one copy per run of consecutive host pages, its state with one copy per state tensor.
The budget is split between checkpoints and pages in proportion to what one entry of
`typical_tokens` tokens needs.

An entry moves through device staging a piece at a time (`STAGING_BYTES` of pages a piece): one
gather of a whole long prompt's entry (a 40K-token prefix: ~800 MiB of KV, twice, for the gather
and the unit-major copy) asked the caching allocator for that much at once on a device filled to
its KV pool, where a failed cudaMalloc frees the cache and retries, waiting for the device.

Copies are stream-ordered, so the host thread never waits on them. On a GPU an entry goes out
in two steps: on the engine's stream (after the passes that wrote it) its units are gathered
into device snapshots, unit-major; on a copy stream of the tier's own the snapshots go to pinned
host memory (`non_blocking`), beside the engine's next passes: over PCIe a 1K-token entry takes
~1.5 ms, and a c=32 wave evicts 7-9 of them a pass, which on the engine's stream added 10-14 ms
to each pass (session 28's step log). The copy stream first waits for the engine's stream (a
load still reading host pages that a store now reuses), and a load waits for the copy stream
(its entry may still be on its way out). An entry of more than one staging piece, or one whose
snapshots would take the device memory held by stores on their way past MAX_ASIDE_BYTES, goes
out in order on the engine's stream as before (after the copy stream); MAX_ASIDE_BYTES is 0, every
entry in order: the gpu tests pass with the copy stream, but served at c=32 it gained nothing
(H100, session 31). The host side is
contiguous: a device unit spans every layer (strided), and torch copies a strided unit through
a temporary in the destination's layout, which on the host would be pageable memory and a
synchronous copy (it held the engine thread 22% of a c=32 run on the H200 when these pools were
layer-major). On a CPU they are plain copies in order (the same code path, with a small pool).
"""

from __future__ import annotations

import heapq
from collections import deque

import torch

from pdserve.memory.kv_pool import KvPagePool
from pdserve.memory.state_pool import GdnStatePool
from pdserve.pinned import to_device

STAGING_BYTES = 64 << 20  # device memory one piece of a store or load gathers through
# device snapshots of stores on their way out on the copy stream; 0: every store in order on the
# engine's stream (1 << 30, served at c=32 on an H100 in session 31, gained nothing)
MAX_ASIDE_BYTES = 0
ASIDE_BYTES_ON_GPU = 1 << 30  # what the gpu tests run it with


class HostTier:
    def __init__(
        self, kv_pool: KvPagePool, states: GdnStatePool, budget_bytes: int, typical_tokens: int = 2048
    ) -> None:
        self.kv_pool, self.states = kv_pool, states
        ck_bytes = _unit_bytes(states.conv, 1) + _unit_bytes(states.recurrent, 1)
        page_bytes = _unit_bytes(kv_pool.kv, 2)
        per_entry = HostTier.entry_bytes(kv_pool, states, typical_tokens)
        entries = budget_bytes // per_entry
        if entries < 1:
            raise ValueError(f"a host tier of {budget_bytes} bytes holds no entry ({per_entry} bytes each)")
        num_checkpoints = entries
        num_pages = (budget_bytes - num_checkpoints * ck_bytes) // page_bytes
        pin = kv_pool.kv.is_cuda
        self.conv = _like(states.conv, 1, num_checkpoints, pin)
        self.recurrent = _like(states.recurrent, 1, num_checkpoints, pin)
        self.kv = _like(kv_pool.kv, 2, num_pages, pin)
        self.num_checkpoints, self.num_pages = num_checkpoints, num_pages
        self.staging_pages = max(1, STAGING_BYTES // page_bytes)  # pages a piece of a store or load
        self._free_checkpoints = list(range(num_checkpoints - 1, -1, -1))
        self._free_pages = list(range(num_pages))  # a heap, lowest first: an entry's pages tend to run
        device = kv_pool.kv.device
        self._copy_stream = torch.cuda.Stream(device) if pin else None  # stores go out on it
        self._aside_bytes: deque[tuple[torch.cuda.Event, int]] = deque()  # (its last copy's end, bytes)

    @staticmethod
    def entry_bytes(kv_pool: KvPagePool, states: GdnStatePool, typical_tokens: int = 2048) -> int:
        """Host bytes of one entry of `typical_tokens` tokens: its checkpoint and its KV pages."""
        checkpoint = _unit_bytes(states.conv, 1) + _unit_bytes(states.recurrent, 1)
        return checkpoint + kv_pool.pages_for(typical_tokens) * _unit_bytes(kv_pool.kv, 2)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes + self.kv.nbytes

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_checkpoints(self) -> int:
        return len(self._free_checkpoints)

    def fits(self, num_pages: int) -> bool:
        return num_pages <= len(self._free_pages) and bool(self._free_checkpoints)

    def store(self, pages: list[int], slot: int) -> tuple[list[int], int]:
        """Copy device pages `pages` and state slot `slot` out; their host ids (`fits` first)."""
        host_pages = [heapq.heappop(self._free_pages) for _ in pages]
        host_ck = self._free_checkpoints.pop()
        aside = self._copy_stream is not None and self._aside(pages)
        if self._copy_stream is not None and not aside:  # after the stores still on their way
            torch.cuda.current_stream(self._copy_stream.device).wait_stream(self._copy_stream)
        for lo in range(0, len(pages), self.staging_pages):  # a gather into unit-major order a piece,
            piece = slice(lo, lo + self.staging_pages)  # then one copy per run of its host pages
            units = self.kv_pool.kv.index_select(2, self._index(pages[piece])).movedim(2, 0).contiguous()
            runs = _runs(host_pages[piece])
            self._send([(self.kv[first : first + n], units[at : at + n]) for at, n, first in runs], aside)
        self._send(
            [
                (host[host_ck], device[:, slot].clone(memory_format=torch.contiguous_format))
                for host, device in ((self.conv, self.states.conv), (self.recurrent, self.states.recurrent))
            ],
            aside,
        )
        return host_pages, host_ck

    def _aside(self, pages: list[int]) -> bool:
        """Whether a store of `pages` goes out on the copy stream: one staging piece, and the
        snapshots still on their way (each held until its copy ends) within MAX_ASIDE_BYTES."""
        while self._aside_bytes and self._aside_bytes[0][0].query():
            self._aside_bytes.popleft()
        nbytes = len(pages) * _unit_bytes(self.kv_pool.kv, 2) + self.entry_bytes(self.kv_pool, self.states, 0)
        fits = sum(n for _, n in self._aside_bytes) + nbytes <= MAX_ASIDE_BYTES
        if len(pages) > self.staging_pages or not fits:
            return False
        self._aside_bytes.append((torch.cuda.Event(), nbytes))
        return True

    def _send(self, moves: list[tuple[torch.Tensor, torch.Tensor]], aside: bool) -> None:
        """Each device snapshot to its host destination: in order on the current stream, or
        (`aside`) on the copy stream, after what the current stream queued so far."""
        if not aside:
            for host, device in moves:
                host.copy_(device, non_blocking=self.kv.is_pinned())
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self._copy_stream.device))
        with torch.cuda.stream(self._copy_stream):
            for host, device in moves:
                host.copy_(device, non_blocking=True)
                device.record_stream(self._copy_stream)  # its memory is not reused before the copy
            self._aside_bytes[-1][0].record()  # the store's last copy so far

    def load(self, host_pages: list[int], host_ck: int, pages: list[int], slot: int) -> None:
        """Copy an entry back into device pages `pages` and state slot `slot`."""
        pinned = self.kv.is_pinned()
        if self._copy_stream is not None:  # the entry (or a piece of it) may still be going out
            torch.cuda.current_stream(self._copy_stream.device).wait_stream(self._copy_stream)
        for lo in range(0, len(pages), self.staging_pages):  # a piece: one copy per run of its host
            piece = slice(lo, lo + self.staging_pages)  # pages into a unit-major buffer, one scatter
            units = torch.empty(
                (len(pages[piece]), *self.kv.shape[1:]), dtype=self.kv.dtype, device=self.kv_pool.kv.device
            )
            for at, n, first in _runs(host_pages[piece]):
                units[at : at + n].copy_(self.kv[first : first + n], non_blocking=pinned)
            self.kv_pool.kv.index_copy_(2, self._index(pages[piece]), units.movedim(0, 2))
        self.states.conv[:, slot].copy_(self.conv[host_ck], non_blocking=pinned)
        self.states.recurrent[:, slot].copy_(self.recurrent[host_ck], non_blocking=pinned)

    def _index(self, pages: list[int]) -> torch.Tensor:
        return to_device(pages, torch.int64, self.kv_pool.kv.device)

    def free(self, host_pages: list[int], host_ck: int) -> None:
        if host_ck in self._free_checkpoints:
            raise RuntimeError(f"host checkpoint {host_ck} freed twice")
        for page in host_pages:
            heapq.heappush(self._free_pages, page)
        self._free_checkpoints.append(host_ck)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index into `ids`, length, first id) of each run of consecutive ids in `ids`."""
    runs: list[tuple[int, int, int]] = []
    for i, unit in enumerate(ids):
        if runs and unit == runs[-1][2] + runs[-1][1]:
            at, n, first = runs[-1]
            runs[-1] = (at, n + 1, first)
        else:
            runs.append((i, 1, unit))
    return runs


def _unit_bytes(pool: torch.Tensor, unit_dim: int) -> int:
    """Bytes of one unit (a slot, a page) of `pool` across every leading index."""
    return pool.numel() // pool.shape[unit_dim] * pool.element_size()


def _like(pool: torch.Tensor, unit_dim: int, units: int, pin: bool) -> torch.Tensor:
    """`units` host units of `pool`'s unit (its index `unit_dim`), unit-major: [units, the rest]."""
    shape = (units, *pool.shape[:unit_dim], *pool.shape[unit_dim + 1 :])
    return torch.empty(shape, dtype=pool.dtype, device="cpu", pin_memory=pin)
