"""The units (pages, slots) of every pdserve pool that hold one request's state."""

from __future__ import annotations


def pool_units(kv_pages: list[int], state_slot: int) -> dict[str, list[int]]:
    """Units of every pdserve pool for one request: its pages in `kv`, its slot in both states."""
    return {"kv": list(kv_pages), "conv": [state_slot], "recurrent": [state_slot]}
