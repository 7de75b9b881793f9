"""Which UCX settings keep UCX's sockets on the interface a service is configured to bind.

UCX opens one listening TCP socket per network interface it may use (its `tcp` transport: the
wire-up and active messages, even when the data itself goes by CMA or cuda_ipc), on every
interface by default, so an agent of a service bound to 127.0.0.1 listened on the external
address too. `ucx_bind_env(host)` gives the variables that restrict it:

    loopback (127.0.0.1, ::1, localhost)  UCX_NET_DEVICES=lo             UCX_TCP_AF_PRIO=inet|inet6
    an address of this host               UCX_NET_DEVICES=<its interface> UCX_TCP_AF_PRIO=<its family>
    a wildcard (0.0.0.0, ::, "") or None  nothing: every interface, as the service itself

UCX_NET_DEVICES also selects RDMA devices: with it set to one Ethernet interface, transfers
between hosts go over TCP. An operator who wants RDMA sets UCX_NET_DEVICES (e.g.
`mlx5_0:1,eth0`) and UCX_TCP_AF_PRIO; a variable already set is left as it is (`ucx_bind_env`
leaves it out). Shared-memory and GPU transports (cma, posix, cuda_ipc) are not network devices
and are unaffected.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import os
import socket
import struct

WILDCARDS = {"", "0.0.0.0", "::", "*"}
_SIOCGIFCONF = 0x8912
_IFREQ_BYTES = 40  # struct ifreq on 64-bit Linux: name[16] + a 24-byte union


def _ipv4_interfaces() -> dict[str, str]:
    """{IPv4 address: interface} of every address of this host (SIOCGIFCONF; aliases included)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        buffer = array.array("B", bytes(_IFREQ_BYTES * 256))
        address, _ = buffer.buffer_info()
        request = struct.pack("iL", len(buffer), address)
        size = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, request))[0]
    raw, found = buffer.tobytes()[:size], {}
    for offset in range(0, size, _IFREQ_BYTES):
        name = raw[offset : offset + 16].split(b"\0", 1)[0].decode()
        ip = socket.inet_ntoa(raw[offset + 20 : offset + 24])  # sockaddr_in.sin_addr
        found.setdefault(ip, name.split(":", 1)[0])  # a label "eth0:1" is device eth0
    return found


def _ipv6_interfaces() -> dict[str, str]:
    """{IPv6 address: interface} from /proc/net/if_inet6 (empty without IPv6)."""
    found = {}
    try:
        lines = open("/proc/net/if_inet6").read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) == 6:
            found[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    return found


def interface_of(ip: str) -> str:
    """The network interface that holds `ip` on this host; ValueError when none does."""
    address = ipaddress.ip_address(ip)
    table = _ipv4_interfaces() if address.version == 4 else _ipv6_interfaces()
    if str(address) in table:
        return table[str(address)]
    if address.is_loopback:  # 127.0.0.2 and the like: the loopback interface answers them
        return table.get("127.0.0.1" if address.version == 4 else "::1", "lo")
    raise ValueError(f"no network interface of this host has the address {ip}")


def resolve_ip(host: str) -> str:
    """`host` as an IP address (the first one a name resolves to)."""
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None


def ucx_bind_env(bind_host: str | None, environ: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """The UCX variables that keep UCX on `bind_host`'s interface and address family, minus
    those `environ` sets already (the operator's choice wins). Empty for None or a wildcard."""
    if bind_host is None or bind_host.strip("[]") in WILDCARDS:
        return {}
    ip = resolve_ip(bind_host)
    wanted = {
        "UCX_NET_DEVICES": interface_of(ip),
        "UCX_TCP_AF_PRIO": "inet" if ipaddress.ip_address(ip).version == 4 else "inet6",
    }
    return {key: value for key, value in wanted.items() if key not in environ}
