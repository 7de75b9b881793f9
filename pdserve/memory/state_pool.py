"""Gated DeltaNet state slots: the conv state and the recurrent state of every GDN layer."""

from __future__ import annotations

import torch

from pdserve.config import ModelConfig


class GdnStatePool:
    """`conv`: [num_gdn_layers, num_slots, conv_dim, kernel - 1] (model dtype);
    `recurrent`: [num_gdn_layers, num_slots, Hv, Dk, Dv] (fp32 by default).

    A running request owns one slot. A slot is zeroed when it is allocated, so a request's
    initial state is always what its slot holds.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        conv_dtype: torch.dtype,
        recurrent_dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_slots <= 0:
            raise ValueError("a GDN state pool needs at least one slot")
        layers = len(cfg.gdn_layer_ids)
        self.num_slots = num_slots
        self.conv = torch.zeros((layers, num_slots, *cfg.conv_state_shape()), dtype=conv_dtype, device=device)
        self.recurrent = torch.zeros(
            (layers, num_slots, *cfg.recurrent_state_shape()), dtype=recurrent_dtype, device=device
        )
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, conv_dtype: torch.dtype, recurrent_dtype: torch.dtype) -> int:
        c, w = cfg.conv_state_shape()
        hv, dk, dv = cfg.recurrent_state_shape()
        return len(cfg.gdn_layer_ids) * (
            c * w * conv_dtype.itemsize + hv * dk * dv * recurrent_dtype.itemsize
        )

    @property
    def nbytes(self) -> int:
        """Bytes of both state tensors, every slot."""
        return self.conv.nbytes + self.recurrent.nbytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, zero: bool = True) -> int:
        """A free slot, zeroed (`zero=False`: for a slot about to be overwritten whole)."""
        if not self._free:
            raise MemoryError("GDN state pool has no free slot")
        slot = self._free.pop()
        if zero:
            self.conv[:, slot].zero_()
            self.recurrent[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self._free.append(slot)
        if len(self._free) > self.num_slots:
            raise RuntimeError("GDN state slot freed twice")
