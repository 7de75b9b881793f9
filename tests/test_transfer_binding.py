"""NIXL/UCX listens only on the interface of the agent's `bind_host`: real agents in this process,
a real pull between them, and the LISTEN sockets this process owns read from /proc/net/tcp{,6}."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
import uuid

import pytest

from kvtransfer import POOL_UNIT_DIMS, TransferAgent, TransferState, pool_units
from kvtransfer.ucx_bind import _ipv4_interfaces, _ipv6_interfaces, ucx_bind_env
from tests.test_kvtransfer import MODEL, PAGE, make_pools

pytestmark = pytest.mark.timeout(60)
TCP_LISTEN = "0A"


def _proc_address(hex_address: str, family: int) -> str:
    """/proc/net/tcp's "0100007F:1F90" (little-endian words) as "127.0.0.1"."""
    raw = bytes.fromhex(hex_address.split(":")[0])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


def listening_addresses() -> dict[str, str]:
    """{socket inode: local address} of the TCP sockets in LISTEN that this process owns."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:[") : -1])
    found = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == TCP_LISTEN and fields[9] in mine:
                    found[fields[9]] = _proc_address(fields[1], family)
    return found


def external_address() -> str | None:
    """A non-loopback IPv4 address of this host, None when it has none."""
    return next((ip for ip in _ipv4_interfaces() if not ipaddress.ip_address(ip).is_loopback), None)


@pytest.fixture(autouse=True)
def no_ucx_device_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.delenv("UCX_TCP_AF_PRIO", raising=False)


def new_listeners_of_a_pull(bind_host: str | None) -> set[str]:
    """Create two agents bound to `bind_host`, pull between them; the addresses they listen on."""
    before = listening_addresses()
    a, b = (
        TransferAgent(f"bind-{uuid.uuid4().hex[:8]}", pools, POOL_UNIT_DIMS, MODEL, PAGE, bind_host=bind_host)
        for pools in (make_pools(8, 2, seed=1), make_pools(8, 2, seed=2))
    )
    try:
        peer = b.add_peer(a.endpoint())
        handle = b.pull(peer, "r1", pool_units([1, 2], 0), pool_units([3, 4], 1))
        deadline = time.monotonic() + 10
        while b.poll(handle) is TransferState.TRANSFERRING and time.monotonic() < deadline:
            a.take_done_notifications()  # no progress thread on DRAM: the holder must progress
            time.sleep(0.001)
        assert handle.state is TransferState.DONE, handle.error
        assert (b.pools["kv"][:, :, 3:5] == a.pools["kv"][:, :, 1:3]).all()
        b.release(handle)
        new = {inode: address for inode, address in listening_addresses().items() if inode not in before}
        assert new, "the agents opened no listening socket: nothing was checked"
        return set(new.values())
    finally:
        b.close()
        a.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_an_agent_bound_to_loopback_listens_only_on_loopback(host: str) -> None:
    if host == "::1" and "::1" not in _ipv6_interfaces():
        pytest.skip("no IPv6 loopback here")
    addresses = new_listeners_of_a_pull(host)
    assert all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses
    assert "UCX_NET_DEVICES" not in os.environ  # set only while the agents were created


def test_an_agent_bound_to_an_external_address_listens_only_there() -> None:
    address = external_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    assert new_listeners_of_a_pull(address) == {address}


def test_without_a_bind_host_ucx_listens_beyond_loopback() -> None:
    """The defect the bind host fixes (and proof that the checks above can fail)."""
    address = external_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    assert address in new_listeners_of_a_pull(None)


def test_ucx_bind_env() -> None:
    assert ucx_bind_env("127.0.0.1", {}) == {"UCX_NET_DEVICES": "lo", "UCX_TCP_AF_PRIO": "inet"}
    assert ucx_bind_env("[::1]", {}) == {"UCX_NET_DEVICES": "lo", "UCX_TCP_AF_PRIO": "inet6"}
    assert ucx_bind_env("127.0.0.9", {})["UCX_NET_DEVICES"] == "lo"  # all of 127/8 is loopback
    assert ucx_bind_env("0.0.0.0", {}) == ucx_bind_env("::", {}) == ucx_bind_env(None, {}) == {}
    operator = {"UCX_NET_DEVICES": "mlx5_0:1,eth0"}  # the operator's choice is kept
    assert ucx_bind_env("127.0.0.1", operator) == {"UCX_TCP_AF_PRIO": "inet"}
    with pytest.raises(ValueError, match="no network interface of this host has the address 203.0.113.7"):
        ucx_bind_env("203.0.113.7", {})
