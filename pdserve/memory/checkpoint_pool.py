"""GDN state checkpoints for the prefix cache: copies of a request's conv + recurrent state of
every GDN layer at a block boundary, kept after the request has moved on (or finished)."""

from __future__ import annotations

from pdserve.memory.state_pool import GdnStatePool


class GdnCheckpointPool:
    """`conv`: [num_gdn_layers, num_checkpoints, conv_dim, kernel - 1];
    `recurrent`: [num_gdn_layers, num_checkpoints, Hv, Dk, Dv]: the state pool's layout, so a
    save or a restore is one copy per tensor."""

    def __init__(self, states: GdnStatePool, num_checkpoints: int) -> None:
        if num_checkpoints <= 0:
            raise ValueError("a checkpoint pool needs at least one checkpoint")
        self.states = states
        self.num_checkpoints = num_checkpoints
        layers = states.conv.shape[0]
        self.conv = states.conv.new_zeros((layers, num_checkpoints, *states.conv.shape[2:]))
        self.recurrent = states.recurrent.new_zeros((layers, num_checkpoints, *states.recurrent.shape[2:]))
        self._free = list(range(num_checkpoints - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def save(self, slot: int) -> int:
        """Copy state slot `slot` into a new checkpoint; returns its id."""
        if not self._free:
            raise MemoryError("GDN checkpoint pool is full")
        ck = self._free.pop()
        self.conv[:, ck].copy_(self.states.conv[:, slot])
        self.recurrent[:, ck].copy_(self.states.recurrent[:, slot])
        return ck

    def restore(self, ck: int, slot: int) -> None:
        """Overwrite state slot `slot` with checkpoint `ck`."""
        self.states.conv[:, slot].copy_(self.conv[:, ck])
        self.states.recurrent[:, slot].copy_(self.recurrent[:, ck])

    def free(self, ck: int) -> None:
        if ck in self._free:
            raise RuntimeError(f"GDN checkpoint {ck} freed twice")
        self._free.append(ck)
