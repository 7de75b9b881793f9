"""The handshake: what one side tells the other, and the check that both lay out memory alike.

The decode side gets the prefill side's `TransferEndpoint` out of band (one msgpack-able dict)
and calls `add_peer` with it. Before any byte moves, `check_peer` compares the protocol version
and the compatibility hash: protocol version + model identity + page size + for every pool its
unit dim, its shape without the unit dim, and its dtype. The number of units (pages, slots) may
differ; anything else that differs is named in an `IncompatiblePeerError` at add time, instead
of garbage states later.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TypedDict

from kvtransfer.layout import PoolSpec
from pdserve.config import ModelConfig

PROTOCOL_VERSION = 1


class TransferEndpoint(TypedDict):
    """What a peer needs to read from this agent; msgpack-able as is."""

    agent: str  # NIXL agent name, unique among the processes of a deployment
    metadata: bytes  # nixl_agent.get_agent_metadata(): connection info + registered regions
    protocol: int
    compat_hash: str
    model: str
    page_size: int
    mem_type: str  # "DRAM" or "VRAM"
    pools: list[dict]  # PoolSpec.to_dict() of every pool: base address, shape, dtype, device


class IncompatiblePeerError(ValueError):
    """The peer's protocol version or memory layout differs from ours."""


def model_identity(cfg: ModelConfig) -> str:
    """A stable id of a model's shape: its type plus a hash of every config field."""
    return cfg.identity()


def _layout(specs: Sequence[PoolSpec]) -> dict[str, dict]:
    return {
        s.name: {"unit_dim": s.unit_dim, "unit_shape": list(s.unit_shape), "dtype": s.dtype} for s in specs
    }


def compat_hash(model: str, page_size: int, specs: Sequence[PoolSpec]) -> str:
    """Hex digest of everything both sides must agree on (not addresses, not unit counts)."""
    raw = json.dumps(
        {"protocol": PROTOCOL_VERSION, "model": model, "page_size": page_size, "pools": _layout(specs)},
        sort_keys=True,
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _differences(mine: TransferEndpoint, theirs: TransferEndpoint) -> list[str]:
    diffs = []
    for key in ("model", "page_size"):
        if mine[key] != theirs[key]:
            diffs.append(f"{key}: local {mine[key]!r}, peer {theirs[key]!r}")
    a = _layout([PoolSpec.from_dict(p) for p in mine["pools"]])
    b = _layout([PoolSpec.from_dict(p) for p in theirs["pools"]])
    if a.keys() != b.keys():
        diffs.append(f"pools: local {sorted(a)}, peer {sorted(b)}")
    for name in sorted(a.keys() & b.keys()):
        for field, value in a[name].items():
            if value != b[name][field]:
                diffs.append(f"pool {name!r} {field}: local {value}, peer {b[name][field]}")
    return diffs


def check_peer(mine: TransferEndpoint, theirs: TransferEndpoint) -> None:
    """Raise IncompatiblePeerError unless `theirs` can be read into (or from) `mine`."""
    missing = sorted(set(TransferEndpoint.__annotations__) - set(theirs))
    if missing:
        raise IncompatiblePeerError(f"peer endpoint is missing field(s) {missing}")
    name = theirs["agent"]
    if theirs["protocol"] != mine["protocol"]:
        raise IncompatiblePeerError(
            f"peer {name!r} speaks kvtransfer protocol {theirs['protocol']}, we speak {mine['protocol']}"
        )
    if theirs["compat_hash"] == mine["compat_hash"]:
        return
    diffs = _differences(mine, theirs)
    if not diffs:
        diffs = [f"compat hash: local {mine['compat_hash']}, peer {theirs['compat_hash']} (other build?)"]
    raise IncompatiblePeerError(f"peer {name!r} lays out KV/state memory differently: " + "; ".join(diffs))
