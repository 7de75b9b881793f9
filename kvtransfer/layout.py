"""How a pool tensor is cut into units (pages or slots) and turned into NIXL descriptors.

A pool is one contiguous tensor with a "unit" dimension `u`. For every combination of the
leading indices `shape[:u]` one unit is one contiguous byte block of the trailing dims
`shape[u+1:]`; units of the same leading index lie side by side. So unit `k` at leading index
`i` (row-major over `shape[:u]`) starts at

    addr + i * shape[u] * unit_bytes + k * unit_bytes

Both sides compute offsets with this one formula, each from its own shape: the number of
units (pages, slots) may differ between prefill and decode, everything else may not.

The pools of pdserve (see docs/architecture.md, "Memory layout"):

- `kv`        [L_attn, 2, num_pages, page_size, Hkv, D]   unit dim 2 (a page)
- `conv`      [L_gdn, num_slots, conv_dim, kernel - 1]    unit dim 1 (a state slot)
- `recurrent` [L_gdn, num_slots, Hv, Dk, Dv]              unit dim 1 (a state slot)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

POOL_UNIT_DIMS = {"kv": 2, "conv": 1, "recurrent": 1}


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One registered pool as the transfer layer sees it: where it lies and how it is cut."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    itemsize: int
    unit_dim: int
    addr: int = 0
    device: int = 0  # CUDA device index; 0 for DRAM, as NIXL wants it

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, unit_dim: int) -> PoolSpec:
        """Describe `tensor` (contiguous, on CPU or one CUDA device) as a pool cut at `unit_dim`."""
        if not tensor.is_contiguous():
            raise ValueError(f"pool {name!r} must be a contiguous tensor")
        if not 0 <= unit_dim < tensor.dim():
            raise ValueError(
                f"pool {name!r}: unit dim {unit_dim} out of range for shape {tuple(tensor.shape)}"
            )
        return cls(
            name=name,
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            itemsize=tensor.element_size(),
            unit_dim=unit_dim,
            addr=tensor.data_ptr(),
            device=max(tensor.get_device(), 0),
        )

    @property
    def num_units(self) -> int:
        return self.shape[self.unit_dim]

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """Every dim but the unit dim: what both sides must agree on."""
        return self.shape[: self.unit_dim] + self.shape[self.unit_dim + 1 :]

    @property
    def unit_bytes(self) -> int:
        """Bytes of one unit at one leading index: the trailing dims."""
        return math.prod(self.shape[self.unit_dim + 1 :]) * self.itemsize

    @property
    def num_lead(self) -> int:
        """Leading index combinations (layers x K/V): how many blocks one unit is made of."""
        return math.prod(self.shape[: self.unit_dim])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def lead_offsets(self) -> np.ndarray:
        """Byte offset of unit 0 at every leading index: [prod(shape[:unit_dim])] uint64."""
        return np.arange(self.num_lead, dtype=np.uint64) * np.uint64(self.num_units * self.unit_bytes)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "itemsize": self.itemsize,
            "unit_dim": self.unit_dim,
            "addr": self.addr,
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, d: dict) -> PoolSpec:
        return cls(**{**d, "shape": tuple(d["shape"])})


def check_units(spec: PoolSpec, units: Sequence[int], side: str) -> None:
    """Raise ValueError unless every unit id is a valid unit of `spec`."""
    bad = [u for u in units if not 0 <= u < spec.num_units]
    if bad:
        raise ValueError(f"{side} {spec.name} unit(s) {bad[:8]} out of range [0, {spec.num_units})")


def merge_runs(local: Sequence[int], remote: Sequence[int]) -> np.ndarray:
    """Pair `local[i]` with `remote[i]` and merge neighbours that are consecutive on both sides.

    Returns [R, 3] int64 rows of (local_start, remote_start, length).
    E.g. local [0, 1, 9], remote [5, 6, 7] -> [(0, 5, 2), (9, 7, 1)].
    """
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local units for {len(remote)} remote units")
    loc = np.asarray(local, dtype=np.int64)
    rem = np.asarray(remote, dtype=np.int64)
    if loc.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = (np.diff(loc) != 1) | (np.diff(rem) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(np.concatenate((starts, [loc.size])))
    return np.stack([loc[starts], rem[starts], lengths], axis=1)


def run_descs(spec: PoolSpec, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """NIXL descriptors for runs of units at every leading index: [n_lead * R, 3] uint64 rows of
    (address, length in bytes, device id), ordered leading index first, then run.
    """
    unit = np.uint64(spec.unit_bytes)
    addrs = np.uint64(spec.addr) + spec.lead_offsets()[:, None] + starts.astype(np.uint64)[None, :] * unit
    sizes = np.broadcast_to(lengths.astype(np.uint64)[None, :] * unit, addrs.shape)
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs.ravel()
    out[:, 1] = sizes.ravel()
    out[:, 2] = spec.device
    return out


def pull_descs(
    local: PoolSpec, remote: PoolSpec, local_units: Sequence[int], remote_units: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Matching (local, remote) descriptor arrays, [N, 3] each, that copy `remote_units[i]` of
    `remote` into `local_units[i]` of `local` for every leading index (ids checked by the caller).
    """
    runs = merge_runs(local_units, remote_units)
    return run_descs(local, runs[:, 0], runs[:, 2]), run_descs(remote, runs[:, 1], runs[:, 2])
