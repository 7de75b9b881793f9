"""The transfer interface both backends share: handles, the poll-state enum, the checks.

Lifecycle of one request's data (decode pulls; the prefill service frees its copy when decode
releases the lease, see prefill_svc/service.py):

    prefill: compute KV pages + state slot ──> a Lease (pdserve.messages) to the router/decode
    decode:  allocate local pages + slot ──> pull() ──> poll() until DONE / FAILED ──> release()

A pull reads the units (pages, slots) of every pool in one go; the request id travels with the
transfer as a notification, which reaches the prefill side only after the data has been read
(`take_done_notifications`; the prefill side pumps it to progress its worker).
A pull still pending after `timeout_s` counts as FAILED, so a peer that disappears without the
transport noticing can never hold a caller forever. On FAILED no notification is sent: the
prefill side must time its copies out on its own.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from kvtransfer.compat import PROTOCOL_VERSION, TransferEndpoint, check_peer, compat_hash
from kvtransfer.layout import PoolSpec, check_units

DONE_PREFIX = b"pdkv-done:"


class TransferState(enum.Enum):
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


@dataclass(slots=True)
class TransferHandle:
    """One pull in flight. `nbytes` and `seconds` are what metrics want."""

    request_id: str
    peer: str
    nbytes: int
    started: float = field(default_factory=time.monotonic)
    state: TransferState = TransferState.TRANSFERRING
    finished: float | None = None
    error: str = ""
    xfer: object = None  # the backend's own handle

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started


@dataclass(slots=True)
class TransferStats:
    """Totals over the life of an agent (pulls it started, as seen by poll)."""

    done: int = 0
    failed: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / 2**30 / self.seconds if self.seconds else 0.0


class BaseTransferAgent(ABC):
    """One per process. `pools` maps a pool name to its tensor, `unit_dims` to the dim that
    indexes pages or slots (see `kvtransfer.layout.POOL_UNIT_DIMS`). All pools live on one device.
    `model` is the model identity (`kvtransfer.compat.model_identity`) that goes into the hash.
    """

    def __init__(
        self,
        name: str,
        pools: dict[str, torch.Tensor],
        unit_dims: dict[str, int],
        model: str,
        page_size: int,
        timeout_s: float = 30.0,
    ) -> None:
        if not pools or pools.keys() != unit_dims.keys():
            raise ValueError(
                f"pools {sorted(pools)} and unit_dims {sorted(unit_dims)} must name the same pools"
            )
        devices = {t.device for t in pools.values()}
        if len(devices) != 1:
            raise ValueError(f"all pools must live on one device, got {sorted(map(str, devices))}")
        self.name = name
        self.pools = pools
        self.specs = {n: PoolSpec.of(n, t, unit_dims[n]) for n, t in pools.items()}
        self.mem_type = "DRAM" if devices.pop().type == "cpu" else "VRAM"
        self.model = model
        self.page_size = page_size
        self.timeout_s = timeout_s
        self.compat = compat_hash(model, page_size, list(self.specs.values()))
        self.peers: dict[str, dict[str, PoolSpec]] = {}
        self.stats = TransferStats()

    # ---- the handshake
    def endpoint(self) -> TransferEndpoint:
        """What a peer passes to `add_peer` to read from (or be read by) this agent."""
        return TransferEndpoint(
            agent=self.name,
            metadata=self._metadata(),
            protocol=PROTOCOL_VERSION,
            compat_hash=self.compat,
            model=self.model,
            page_size=self.page_size,
            mem_type=self.mem_type,
            pools=[s.to_dict() for s in self.specs.values()],
        )

    def add_peer(self, endpoint: TransferEndpoint) -> str:
        """Check the peer's version and layout (IncompatiblePeerError names what differs), connect
        to it and return its name, the `peer` argument of `pull`.
        """
        check_peer(self.endpoint(), endpoint)
        if endpoint["agent"] == self.name:
            raise ValueError(f"peer has our own agent name {self.name!r}; names must be unique")
        name = self._connect(endpoint)
        self.peers[name] = {p["name"]: PoolSpec.from_dict(p) for p in endpoint["pools"]}
        return name

    # ---- decode side
    def pull(
        self,
        peer: str,
        request_id: str,
        remote_units: dict[str, list[int]],
        local_units: dict[str, list[int]],
    ) -> TransferHandle:
        """Start reading `remote_units[pool][i]` of the peer into `local_units[pool][i]` here, for
        every pool named, at every leading index (layer, K/V). Returns at once; poll the handle.
        """
        if peer not in self.peers:
            raise ValueError(f"unknown peer {peer!r}; add_peer it first")
        if remote_units.keys() != local_units.keys() or not remote_units.keys() <= self.specs.keys():
            raise ValueError(
                f"remote pools {sorted(remote_units)} and local pools {sorted(local_units)} must match "
                f"and be among {sorted(self.specs)}"
            )
        plan, nbytes = {}, 0
        for pool, remote in remote_units.items():
            local, spec = local_units[pool], self.specs[pool]
            if len(local) != len(remote):
                raise ValueError(f"pool {pool!r}: {len(local)} local units for {len(remote)} remote units")
            check_units(spec, local, "local")
            check_units(self.peers[peer][pool], remote, "remote")
            if remote:
                plan[pool] = (list(local), list(remote))
                nbytes += len(remote) * spec.unit_bytes * spec.num_lead
        if not plan:
            raise ValueError(f"request {request_id!r}: nothing to pull")
        handle = TransferHandle(request_id=request_id, peer=peer, nbytes=nbytes)
        self._start(handle, plan)
        if handle.state is not TransferState.TRANSFERRING:
            self._finish(handle, handle.state)
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        """TRANSFERRING, DONE or FAILED; FAILED too once the pull is older than `timeout_s`."""
        if handle.state is not TransferState.TRANSFERRING:
            return handle.state
        state = self._progress(handle)
        if state is TransferState.TRANSFERRING and time.monotonic() - handle.started > self.timeout_s:
            handle.error = f"no completion after {self.timeout_s} s"
            state = TransferState.FAILED
        if state is not TransferState.TRANSFERRING:
            self._finish(handle, state)
        return state

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> TransferState:
        """Poll until DONE or FAILED; TimeoutError if still transferring after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 1e-4
        while (state := self.poll(handle)) is TransferState.TRANSFERRING:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"pull of request {handle.request_id!r} still running after {timeout} s")
            time.sleep(pause)
            pause = min(2 * pause, 5e-3)
        return state

    def release(self, handle: TransferHandle) -> None:
        """Free the backend's resources of a pull (cancelling it if it still runs)."""
        self._release(handle)
        handle.xfer = None

    def _finish(self, handle: TransferHandle, state: TransferState) -> None:
        handle.state, handle.finished = state, time.monotonic()
        if state is TransferState.DONE:
            self.stats.done += 1
            self.stats.nbytes += handle.nbytes
            self.stats.seconds += handle.seconds
        else:
            self.stats.failed += 1

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (and drop the connection to it)."""
        self.peers.pop(peer, None)

    def close(self) -> None:
        """Drop every peer and release the agent's resources; unusable afterwards."""
        self.peers.clear()

    # ---- prefill side
    @abstractmethod
    def take_done_notifications(self) -> list[str]:
        """Request ids whose data a peer has finished reading since the last call."""

    # ---- what a backend provides
    @abstractmethod
    def _metadata(self) -> bytes: ...

    @abstractmethod
    def _connect(self, endpoint: TransferEndpoint) -> str: ...

    @abstractmethod
    def _start(self, handle: TransferHandle, plan: dict[str, tuple[list[int], list[int]]]) -> None:
        """Post the pull; `plan[pool]` is (local units, remote units). Set handle.state/xfer/error."""

    @abstractmethod
    def _progress(self, handle: TransferHandle) -> TransferState: ...

    @abstractmethod
    def _release(self, handle: TransferHandle) -> None: ...


def done_message(request_id: str) -> bytes:
    return DONE_PREFIX + request_id.encode()


def parse_done(message: bytes) -> str | None:
    """The request id of a done notification, None for any other message."""
    return message[len(DONE_PREFIX) :].decode() if message.startswith(DONE_PREFIX) else None
