"""GDN state checkpoints for the prefix cache: a request's conv + recurrent state of every GDN
layer after some token, kept after the request has moved on (or finished).

A checkpoint is a slot of the state pool itself, taken out of its free list while it holds a
checkpoint: so checkpoints cost no memory of their own beyond the slots sized for them
(`EngineConfig.num_state_slots` counts `num_prefix_checkpoints` more), they are registered with
the transfer layer like every slot (a peer can READ one), a finished request's slot can become
a checkpoint without a copy (`adopt`), and a restore is one copy per tensor inside one tensor.
"""

from __future__ import annotations

from pdserve.memory.state_pool import GdnStatePool


class GdnCheckpointPool:
    """At most `num_checkpoints` state slots holding checkpoints at once."""

    def __init__(self, states: GdnStatePool, num_checkpoints: int) -> None:
        if num_checkpoints <= 0:
            raise ValueError("a checkpoint pool needs at least one checkpoint")
        self.states = states
        self.num_checkpoints = num_checkpoints
        self._held: set[int] = set()

    @property
    def num_used(self) -> int:
        return len(self._held)

    @property
    def num_free(self) -> int:
        """Checkpoints that can be taken now: under the cap and a free slot in the state pool."""
        return min(self.num_checkpoints - len(self._held), self.states.num_free)

    @property
    def bytes_per_checkpoint(self) -> int:
        s = self.states
        return (s.conv[:, 0].numel() * s.conv.element_size()) + (
            s.recurrent[:, 0].numel() * s.recurrent.element_size()
        )

    def save(self, slot: int) -> int:
        """Copy state slot `slot` into a new checkpoint; returns its id (a slot)."""
        ck = self.reserve()
        self.copy(slot, ck)
        return ck

    def copy(self, src: int, dst: int) -> None:
        """Overwrite state slot `dst` with slot `src` (a checkpoint or a request's)."""
        self.states.conv[:, dst].copy_(self.states.conv[:, src])
        self.states.recurrent[:, dst].copy_(self.states.recurrent[:, src])

    def reserve(self) -> int:
        """A checkpoint whose contents someone else writes (a transfer from a peer)."""
        if self.num_free <= 0:
            raise MemoryError("GDN checkpoint pool is full")
        ck = self.states.allocate(zero=False)
        self._held.add(ck)
        return ck

    def adopt(self, slot: int) -> bool:
        """Make state slot `slot` (a request's, which lets it go) a checkpoint as it is: no copy.
        False (the slot stays the caller's) when the cap is reached."""
        if len(self._held) >= self.num_checkpoints:
            return False
        self._held.add(slot)
        return True

    def restore(self, ck: int, slot: int) -> None:
        """Overwrite state slot `slot` with checkpoint `ck`."""
        self.copy(ck, slot)

    def free(self, ck: int) -> None:
        if ck not in self._held:
            raise RuntimeError(f"GDN checkpoint {ck} freed twice")
        self._held.remove(ck)
        self.states.free(ck)
