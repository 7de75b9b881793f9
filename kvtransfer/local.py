"""`LocalCopyAgent`: the same interface as `TransferAgent` with a torch copy between two pool
sets of one process. For unit tests of callers (prefill/decode services) that do not need NIXL.
Peers find each other by agent name in a process-wide registry; a pull completes at once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvtransfer.base import BaseTransferAgent, TransferHandle, TransferState
from kvtransfer.compat import TransferEndpoint

_AGENTS: weakref.WeakValueDictionary[str, LocalCopyAgent] = weakref.WeakValueDictionary()


class LocalCopyAgent(BaseTransferAgent):
    """Takes `BaseTransferAgent`'s arguments; `timeout_s` is moot here, and so is `bind_host`
    (accepted as `TransferAgent` does: nothing listens). Names must be unique."""

    def __init__(self, *args: Any, bind_host: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.name in _AGENTS:
            raise ValueError(f"a LocalCopyAgent named {self.name!r} exists already")
        self._done: list[str] = []
        _AGENTS[self.name] = self

    def _metadata(self) -> bytes:
        return b""

    def _connect(self, endpoint: TransferEndpoint) -> str:
        if endpoint["agent"] not in _AGENTS:
            raise ValueError(f"no LocalCopyAgent named {endpoint['agent']!r} in this process")
        return endpoint["agent"]

    def _start(self, handle: TransferHandle, plan: dict[str, tuple[list[int], list[int]]]) -> None:
        peer = _AGENTS.get(handle.peer)
        if peer is None:
            handle.state, handle.error = TransferState.FAILED, f"peer {handle.peer!r} is gone"
            return
        for pool, (local, remote) in plan.items():
            lead = (slice(None),) * self.specs[pool].unit_dim
            src = peer.pools[pool][(*lead, torch.tensor(remote, device=peer.pools[pool].device))]
            self.pools[pool][(*lead, torch.tensor(local, device=self.pools[pool].device))] = src.to(
                self.pools[pool].device
            )
        handle.state = TransferState.DONE
        peer._done.append(handle.request_id)

    def _progress(self, handle: TransferHandle) -> TransferState:
        return handle.state

    def _release(self, handle: TransferHandle) -> None:
        pass

    def take_done_notifications(self) -> list[str]:
        done, self._done = self._done, []
        return done
