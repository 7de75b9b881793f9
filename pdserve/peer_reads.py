"""READs from a peer instance: its KV pages and GDN state read into ours through the transfer
agent, then the holder told to let go of its copy. One `PeerReads` per reader: the decode role
(a handed-over request's state, held under a lease on the prefill instance) and the prefix cache
(a peer's cache entry, pinned there while it is read, `pdserve.prefix_sharing`).

One read's life (engine thread, but for the holder's answer):
  1. `start`: the agent's pull of the holder's units into ours. One that cannot start (a bad
     answer, a peer gone) forgets the peer, so the next contact handshakes again;
  2. `tick`, every engine-thread turn: poll; DONE or FAILED releases the handle. A FAILED read
     forgets the peer (a restarted instance is a new agent name). The agent fails a pull
     still pending after its `timeout_s`, so a peer that dies mid-read ends as FAILED, never
     as a read polled forever;
  3. `let_go`: on the event loop, the holder is asked to free its copy (`release` the lease,
     whose answer says whether it was still held: `intact`; `unpin_prefix` the entry) and
     its answer (None when it could not be had, with why) comes back on the engine thread.
     Every failure there is an answer, never an exception lost in a task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvtransfer import TransferHandle, TransferState
from pdserve.instance_clients import InstanceClient
from pdserve.serving import EngineHost

log = logging.getLogger(__name__)
LET_GO_TIMEOUT_S = 5.0

Answer = Callable[[dict | None, str], None]  # (the holder's answer or None, why it is None)


class Peers(Protocol):
    """What reads need of a peer directory (`pdserve.peer_directory.PeerDirectory`)."""

    def forget(self, agent: str) -> None: ...

    def client(self, agent: str) -> InstanceClient: ...


@dataclass(slots=True)
class PeerRead:
    agent: str  # the holder's agent name
    handle: TransferHandle
    on_done: Callable[[TransferHandle], None]
    on_failed: Callable[[str], None]


class PeerReads:
    """The reads of one reader in flight, by transfer id (unique among them)."""

    def __init__(self, host: EngineHost, peers: Peers) -> None:
        self.host = host
        self.peers = peers
        self.reads: dict[str, PeerRead] = {}

    def __len__(self) -> int:
        return len(self.reads)

    def start(
        self,
        transfer_id: str,
        agent: str,
        peer: str,
        remote_units: dict[str, list[int]],
        local_units: dict[str, list[int]],
        on_done: Callable[[TransferHandle], None],
        on_failed: Callable[[str], None],
    ) -> bool:
        """Start reading `agent`'s units (`peer`: its name for the transfer agent) into ours;
        `on_done(handle)` or `on_failed(why)` is called on the engine thread when it ends (at
        once, with False, when it cannot start: also when a read of that id is still in flight,
        e.g. a request aborted mid-READ and sent here again, whose caller then frees what it
        allocated for this one)."""
        if transfer_id in self.reads:
            on_failed(f"cannot start the READ: a read {transfer_id!r} is still in flight")
            return False
        try:
            handle = self.host.agent.pull(peer, transfer_id, remote_units, local_units)
        except Exception as e:  # a bad answer or a peer gone: this read only
            self.peers.forget(agent)
            on_failed(f"cannot start the READ: {e}")
            return False
        self.reads[transfer_id] = PeerRead(agent, handle, on_done, on_failed)
        return True

    def tick(self) -> bool:
        """Poll every read; True while some are still in flight."""
        for transfer_id, read in list(self.reads.items()):
            state = self.host.agent.poll(read.handle)
            if state is TransferState.TRANSFERRING:
                continue
            del self.reads[transfer_id]
            self.host.agent.release(read.handle)
            if state is TransferState.FAILED:
                self.peers.forget(read.agent)
                read.on_failed(f"the READ failed: {read.handle.error}")
            else:
                read.on_done(read.handle)
        return bool(self.reads)

    def cancel(self, transfer_id: str) -> bool:
        """Stop a read in flight (its callbacks are never called); False if none was."""
        read = self.reads.pop(transfer_id, None)
        if read is not None:
            self.host.agent.release(read.handle)
        return read is not None

    def let_go(self, agent: str, method: str, msg: dict, then: Answer | None = None) -> None:
        """Call `method(msg)` on the holder `agent` (from any thread); `then(answer, why)` on the
        engine thread, else a warning when there was no answer."""
        asyncio.run_coroutine_threadsafe(self._let_go(agent, method, msg, then), self.host.loop)

    async def _let_go(self, agent: str, method: str, msg: dict, then: Answer | None) -> None:
        try:
            answer = await self.peers.client(agent).unary(method, msg, timeout=LET_GO_TIMEOUT_S)
            why = "" if isinstance(answer, dict) else f"a malformed answer {answer!r}"
        except Exception as e:  # unreachable, gone, timed out: no answer, never a lost exception
            answer, why = None, str(e) or type(e).__name__
        if not isinstance(answer, dict):
            answer = None
        if then is not None:
            self.host.thread.post(then, answer, why)
        elif answer is None:
            log.warning("%s on %s: %s", method, agent, why)
