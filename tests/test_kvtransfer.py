"""kvtransfer: layout math, the handshake, and real NIXL/UCX pulls between two processes on DRAM.

The prefill side runs in a spawned child process: it fills its pools from a fixed seed, sends its
endpoint (msgpack bytes) over a pipe and reports the done notifications it receives. The test
process is the decode side: it regenerates the expected data from the same seed.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import time
import uuid

import msgpack
import numpy as np
import pytest
import torch

from kvtransfer import (
    POOL_UNIT_DIMS,
    IncompatiblePeerError,
    LocalCopyAgent,
    PoolSpec,
    TransferAgent,
    TransferState,
    pool_units,
)
from kvtransfer.layout import merge_runs, run_descs

pytestmark = pytest.mark.timeout(60)

MODEL, PAGE = "qwen3_5_moe_text:test", 4
PREFILL_PAGES, PREFILL_SLOTS, DECODE_PAGES, DECODE_SLOTS = 16, 3, 24, 5


def make_pools(
    num_pages: int, num_slots: int, seed: int, page_size: int = PAGE, kv_dtype=torch.bfloat16
) -> dict[str, torch.Tensor]:
    """kv [3, 2, pages, page_size, 2, 8] and conv [4, slots, 24, 3] in kv_dtype,
    recurrent [4, slots, 2, 4, 4] fp32, random from `seed`.
    """
    g = torch.Generator().manual_seed(seed)
    return {
        "kv": torch.randn(3, 2, num_pages, page_size, 2, 8, generator=g).to(kv_dtype),
        "conv": torch.randn(4, num_slots, 24, 3, generator=g).to(kv_dtype),
        "recurrent": torch.randn(4, num_slots, 2, 4, 4, generator=g),
    }


def _prefill_main(conn, name: str, ucx_tls: str | None) -> None:
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    agent = TransferAgent(name, make_pools(PREFILL_PAGES, PREFILL_SLOTS, seed=1), POOL_UNIT_DIMS, MODEL, PAGE)
    conn.send_bytes(msgpack.packb(agent.endpoint()))
    while not conn.poll(0.005):
        done = agent.take_done_notifications()
        if done:
            conn.send(done)


def start_prefill(ucx_tls: str | None = None):
    """A prefill process; returns (process, pipe end, its endpoint as the decode side gets it)."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_prefill_main, args=(there, f"prefill-{uuid.uuid4().hex[:8]}", ucx_tls))
    proc.start()
    if here not in mp_connection.wait([here, proc.sentinel], timeout=30):
        proc.kill()
        pytest.fail(f"prefill process sent no endpoint (exit code {proc.exitcode})")
    return proc, here, msgpack.unpackb(here.recv_bytes())


def stop(proc, conn) -> None:
    conn.send("exit")
    proc.join(5)
    if proc.is_alive():
        proc.kill()


@pytest.fixture(scope="module")
def prefill():
    proc, conn, endpoint = start_prefill()
    yield conn, endpoint
    stop(proc, conn)


def decode_agent(timeout_s: float = 30.0, page_size: int = PAGE, kv_dtype=torch.bfloat16) -> TransferAgent:
    pools = make_pools(DECODE_PAGES, DECODE_SLOTS, seed=2, page_size=page_size, kv_dtype=kv_dtype)
    name = f"decode-{uuid.uuid4().hex[:8]}"
    return TransferAgent(name, pools, POOL_UNIT_DIMS, MODEL, page_size, timeout_s=timeout_s)


def units(t: torch.Tensor, dim: int, ids: list[int]) -> torch.Tensor:
    return t.index_select(dim, torch.tensor(ids, dtype=torch.long))


def others(n: int, ids: list[int]) -> list[int]:
    return [i for i in range(n) if i not in ids]


def test_merge_runs_pairs_consecutive_units_on_both_sides():
    assert merge_runs([0, 1, 9], [5, 6, 7]).tolist() == [[0, 5, 2], [9, 7, 1]]
    assert merge_runs([3, 4, 5], [1, 2, 3]).tolist() == [[3, 1, 3]]
    assert merge_runs([2, 1], [1, 2]).tolist() == [[2, 1, 1], [1, 2, 1]]
    with pytest.raises(ValueError, match="2 local units for 1 remote"):
        merge_runs([0, 1], [0])


def test_descriptors_address_the_units_torch_indexes():
    kv = make_pools(7, 2, seed=0)["kv"]
    spec = PoolSpec.of("kv", kv, POOL_UNIT_DIMS["kv"])
    descs = run_descs(spec, np.array([5, 1]), np.array([2, 1]))
    expect = [
        (kv[lay, k, p].data_ptr(), n * kv[0, 0, 0].nbytes)
        for lay in range(3)
        for k in range(2)
        for p, n in ((5, 2), (1, 1))
    ]
    assert [(int(a), int(n)) for a, n, _ in descs] == expect


def test_pull_is_byte_exact_and_notifies(prefill):
    conn, endpoint = prefill
    agent = decode_agent()
    before = {n: t.clone() for n, t in agent.pools.items()}
    source = make_pools(PREFILL_PAGES, PREFILL_SLOTS, seed=1)
    remote = pool_units([5, 6, 7, 2, 11], state_slot=2)
    local = pool_units([0, 1, 9, 3, 4], state_slot=4)
    peer = agent.add_peer(endpoint)
    assert peer == endpoint["agent"]
    handle = agent.pull(peer, "req-A", remote, local)
    assert agent.wait(handle, timeout=10) is TransferState.DONE, handle.error
    agent.release(handle)
    for name, t in agent.pools.items():
        dim, n = POOL_UNIT_DIMS[name], t.shape[POOL_UNIT_DIMS[name]]
        got, want = units(t, dim, local[name]), units(source[name], dim, remote[name])
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        assert torch.equal(
            units(t, dim, others(n, local[name])), units(before[name], dim, others(n, local[name]))
        )
    unit_bytes = {n: PoolSpec.of(n, t, POOL_UNIT_DIMS[n]).unit_bytes for n, t in agent.pools.items()}
    assert handle.nbytes == 5 * 6 * unit_bytes["kv"] + 4 * (unit_bytes["conv"] + unit_bytes["recurrent"])
    assert agent.stats.done == 1 and agent.stats.nbytes == handle.nbytes
    assert conn.poll(5), "prefill got no done notification"
    assert conn.recv() == ["req-A"]
    agent.close()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kv_dtype": torch.float16}, r"pool 'kv' dtype: local float16, peer bfloat16"),
        ({"page_size": 8}, r"page_size: local 8, peer 4"),
        ({"protocol": 99}, r"protocol 1, we speak 99"),
    ],
)
def test_incompatible_peer_is_refused_at_add_peer(prefill, change, match):
    _, endpoint = prefill
    protocol = change.pop("protocol", None)
    agent = decode_agent(**change)
    if protocol is not None:
        agent.endpoint = lambda: {**TransferAgent.endpoint(agent), "protocol": protocol}
    with pytest.raises(IncompatiblePeerError, match=match):
        agent.add_peer(endpoint)
    assert agent.peers == {}
    agent.close()


def test_dead_peer_fails_fast():
    proc, conn, endpoint = start_prefill()
    agent = decode_agent()
    peer = agent.add_peer(endpoint)
    args = (pool_units([1, 2], 0), pool_units([3, 4], 1))
    assert agent.wait(agent.pull(peer, "warm", *args), timeout=10) is TransferState.DONE
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    start = time.monotonic()
    handle = agent.pull(peer, "after-death", *args)
    assert agent.wait(handle, timeout=5) is TransferState.FAILED
    assert time.monotonic() - start < 5
    assert "DISCONNECT" in handle.error and agent.stats.failed == 1
    agent.release(handle)
    agent.close()


def test_stalled_peer_times_out(monkeypatch):
    """Over TCP a stopped peer keeps a READ pending: wait(timeout) raises, the agent timeout fails it."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    proc, conn, endpoint = start_prefill(ucx_tls="tcp")
    agent = decode_agent(timeout_s=1.5)
    peer = agent.add_peer(endpoint)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        handle = agent.pull(peer, "stalled", pool_units([1], 0), pool_units([1], 0))
        with pytest.raises(TimeoutError, match="stalled"):
            agent.wait(handle, timeout=0.3)
        assert agent.wait(handle, timeout=5) is TransferState.FAILED
        assert "no completion after 1.5 s" in handle.error
        agent.release(handle)
    finally:
        proc.kill()
        proc.join(5)
    agent.close()


def test_local_copy_agent_moves_units_and_notifies():
    src = LocalCopyAgent("local-prefill", make_pools(8, 2, seed=1), POOL_UNIT_DIMS, MODEL, PAGE)
    dst = LocalCopyAgent("local-decode", make_pools(8, 2, seed=2), POOL_UNIT_DIMS, MODEL, PAGE)
    peer = dst.add_peer(src.endpoint())
    handle = dst.pull(peer, "r1", pool_units([6, 2], 1), pool_units([0, 7], 0))
    assert dst.poll(handle) is TransferState.DONE
    assert torch.equal(dst.pools["kv"][:, :, 7], src.pools["kv"][:, :, 2])
    assert torch.equal(dst.pools["recurrent"][:, 0], src.pools["recurrent"][:, 1])
    assert src.take_done_notifications() == ["r1"] and src.take_done_notifications() == []
