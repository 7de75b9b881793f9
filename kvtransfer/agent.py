"""`TransferAgent`: the NIXL (UCX) backend. The decode side READs from the prefill side's pools.

Every pool is registered once, whole (DRAM for CPU tensors, VRAM for CUDA tensors). A pull is
one NIXL transfer whose descriptors are, per pool and per leading index (layer, K/V), the runs of
units that are consecutive on both sides (`kvtransfer.layout.pull_descs`). The request id rides
on the transfer as its notification; NIXL delivers it to the prefill agent after the data.

UCX environment (read when an agent is created, so set before; `UCX_DEFAULTS` fills in what is
unset). DRAM needs nothing: between processes of one host UCX reads with CMA (process_vm_readv;
needs ptrace permission between the processes, the default for one user). Where CMA is not
allowed, set `UCX_TLS=tcp,self` (much slower). VRAM: without NVLink between the two GPUs (one
GPU shared by prefill and decode) UCX disables cuda_ipc GET and falls back to TCP (0.4 GB/s on
an H200); `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y` turns it back on (166 GB/s for 221 MiB of
contiguous pages on one H200, 2026-11-30). Every descriptor costs ~10 us there, so 512
scattered 16-token pages (10,240 descriptors) take ~107 ms: hand out runs of pages.

NIXL behaviours this code relies on (nixl 1.5.1):
- `add_remote_agent` returns the peer name as bytes; notifications are keyed by str names.
- A transfer to a peer whose process has died raises `nixlRemoteDisconnectError` from
  `transfer()` or `check_xfer_state()` (not an "ERR" state): both map to FAILED here.
- A peer that is alive but stalled (e.g. SIGSTOP over TCP) keeps a transfer "PROC" forever;
  the agent's `timeout_s` turns that into FAILED.
- Without the progress thread, destroying an agent after a transfer failed on a dead peer
  aborts the process (UCX `ucs_arbiter_group_is_empty` assertion) unless the worker was
  progressed once after the failure: `_pump()` does that on every failure and in close().
- A READ completes only once the holder's (prefill's) UCX worker has progressed: with no
  progress thread there, a pull takes as long as the holder's gap between two
  take_done_notifications() calls (10 ms apart: every pull 10 ms; back to back: ~7 GiB/s).
- NIXL's UCX progress thread (the Python wrapper fixes its delay at 0) keeps ~0.7 of a core
  busy while idle, and on a 2-core CPU machine halves the transfer rate.
So `progress_thread=None` (the default) turns the thread on for VRAM pools (GPU hosts: cores to
spare, latency matters) and off for DRAM pools (CPU machines). With it off, the prefill side
must call take_done_notifications() often, e.g. every step of its loop and while idle.

What listens (measured, nixl 1.5.1 / UCX 1.23, DRAM pools, 2026-12-01): NIXL's own listener
thread is off (`enable_listen_thread=False`: metadata goes through our gRPC handshake). UCX's
tcp transport opens one LISTEN socket per network interface when an agent is created (none
more at a pull), even though the data moves by CMA; a pull then connects to the peer's (TCP
wire-up and notifications). No UDP socket. Without a bind host that was 127.0.0.1 and the
external address (eth0). `bind_host` (the service's --host) narrows it (`kvtransfer.ucx_bind`):
127.0.0.1 -> `UCX_NET_DEVICES=lo`, `UCX_TCP_AF_PRIO=inet`: only 127.0.0.1 listens; ::1 -> only
::1; another address -> only its interface (its address of that family); 0.0.0.0 or None ->
every interface. These variables are set only while the NIXL agent is created (UCX reads them
then; the process environment is restored after), and one the operator set already is kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import numpy as np
import torch
from nixl import _bindings as nixl_bindings
from nixl._api import nixl_agent, nixl_agent_config

from kvtransfer.base import BaseTransferAgent, TransferHandle, TransferState, done_message, parse_done
from kvtransfer.compat import TransferEndpoint
from kvtransfer.layout import pull_descs
from kvtransfer.ucx_bind import ucx_bind_env

log = logging.getLogger(__name__)

# The exceptions the NIXL bindings raise; they share no base class but Exception.
NIXL_ERRORS = (
    nixl_bindings.nixlRemoteDisconnectError,
    nixl_bindings.nixlBackendError,
    nixl_bindings.nixlNotFoundError,
    nixl_bindings.nixlInvalidParamError,
    nixl_bindings.nixlNotAllowedError,
    nixl_bindings.nixlCancelledError,
    nixl_bindings.nixlUnknownError,
)
UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}  # for VRAM pools; see the module docstring
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.TRANSFERRING, "ERR": TransferState.FAILED}


@contextlib.contextmanager
def _environment(overrides: dict[str, str]) -> Iterator[None]:
    """`os.environ` with `overrides` set, restored afterwards."""
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class TransferAgent(BaseTransferAgent):
    """A NIXL agent (UCX backend) with this process's pools registered.

    pools: e.g. {"kv": [L_attn, 2, num_pages, page_size, Hkv, D], "conv": [L_gdn, num_slots, C, W-1],
    "recurrent": [L_gdn, num_slots, Hv, Dk, Dv]} with unit_dims {"kv": 2, "conv": 1, "recurrent": 1}.
    `bind_host`: the address the service binds; UCX listens only on its interface (see above).
    """

    def __init__(
        self,
        name: str,
        pools: dict[str, torch.Tensor],
        unit_dims: dict[str, int],
        model: str,
        page_size: int,
        timeout_s: float = 30.0,
        progress_thread: bool | None = None,
        bind_host: str | None = None,
    ) -> None:
        super().__init__(name, pools, unit_dims, model, page_size, timeout_s)
        if self.mem_type == "VRAM":
            for key, value in UCX_DEFAULTS.items():
                os.environ.setdefault(key, value)
        if progress_thread is None:
            progress_thread = self.mem_type == "VRAM"
        conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.ucx_env = ucx_bind_env(bind_host)  # what was set for UCX while creating the agent
        with _environment(self.ucx_env):
            self._nixl = nixl_agent(name, conf)
        if self.ucx_env:
            log.info("NIXL agent %s: UCX bound to %s (%s)", name, bind_host, self.ucx_env)
        if "UCX" not in self._nixl.backends:
            raise RuntimeError("NIXL has no UCX plugin here; kvtransfer needs it")
        self._registered = self._nixl.register_memory(list(pools.values()))
        self._peer_mem: dict[str, str] = {}
        self._inbox: list[tuple[str, bytes]] = []  # notifications taken from NIXL, not yet handed out

    def _metadata(self) -> bytes:
        return self._nixl.get_agent_metadata()

    def _connect(self, endpoint: TransferEndpoint) -> str:
        name = self._nixl.add_remote_agent(endpoint["metadata"])
        name = name.decode() if isinstance(name, bytes) else name
        if name != endpoint["agent"]:
            raise ValueError(f"endpoint says agent {endpoint['agent']!r}, its NIXL metadata says {name!r}")
        self._peer_mem[name] = endpoint["mem_type"]
        return name

    def _start(self, handle: TransferHandle, plan: dict[str, tuple[list[int], list[int]]]) -> None:
        remote_specs = self.peers[handle.peer]
        pairs = [pull_descs(self.specs[p], remote_specs[p], loc, rem) for p, (loc, rem) in plan.items()]
        local = np.concatenate([loc for loc, _ in pairs])
        remote = np.concatenate([rem for _, rem in pairs])
        try:
            handle.xfer = self._nixl.initialize_xfer(
                "READ",
                self._nixl.get_xfer_descs(local, self.mem_type),
                self._nixl.get_xfer_descs(remote, self._peer_mem[handle.peer]),
                handle.peer,
                done_message(handle.request_id),
            )
            handle.state = _STATES[self._nixl.transfer(handle.xfer)]
        except NIXL_ERRORS as e:
            handle.state, handle.error = TransferState.FAILED, repr(e)
        if handle.state is TransferState.FAILED:
            log.warning(
                "pull of %r from %s failed to start: %s", handle.request_id, handle.peer, handle.error
            )
            self._pump()

    def _progress(self, handle: TransferHandle) -> TransferState:
        try:
            state = _STATES[self._nixl.check_xfer_state(handle.xfer)]
        except NIXL_ERRORS as e:
            handle.error, state = repr(e), TransferState.FAILED
        if state is TransferState.FAILED:
            log.warning(
                "pull of %r from %s failed: %s", handle.request_id, handle.peer, handle.error or "ERR"
            )
            self._pump()
        return state

    def _release(self, handle: TransferHandle) -> None:
        if handle.xfer is None:
            return
        try:
            handle.xfer.release()
        except NIXL_ERRORS as e:  # a transfer that cannot be cancelled; NIXL keeps it, nothing to do
            log.warning("releasing the pull of %r failed: %r", handle.request_id, e)

    def _pump(self) -> None:
        """Progress the UCX worker once (fetching notifications). Without a progress thread this
        must happen after a failed transfer, or destroying the agent trips a UCX assertion.
        """
        for peer, messages in self._nixl.get_new_notifs().items():
            self._inbox.extend((peer, m) for m in messages)

    def take_done_notifications(self) -> list[str]:
        self._pump()
        done = []
        for peer, message in self._inbox:
            request_id = parse_done(message)
            if request_id is None:
                log.warning("ignoring a notification from %s that is not ours: %r", peer, message[:64])
            else:
                done.append(request_id)
        self._inbox.clear()
        return done

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (and drop the connection to it)."""
        self.peers.pop(peer, None)
        self._peer_mem.pop(peer, None)
        self._nixl.remove_remote_agent(peer)

    def close(self) -> None:
        """Drop every peer and deregister the pools; the agent is unusable afterwards."""
        for peer in list(self.peers):
            self.remove_peer(peer)
        self._nixl.deregister_memory(self._registered)
        self._pump()
