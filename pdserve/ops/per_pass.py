"""Values derived from a pass's `cu_seqlens`, made once for all the layers of the pass.

Every layer of a pass hands the ops the same `cu_seqlens` tensor, so what is derived from it (an
int64 copy for fla, each token's sequence for the conv) is kept by that tensor's identity. The
tensor is held while kept, so its identity cannot be reused by another pass's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PerPass:
    """`make(cu_seqlens, *args)` once per `cu_seqlens` tensor; the last `keep` kept (a pass scanned
    in pieces alternates between a few cu_seqlens every layer: each keeps its value)."""

    def __init__(self, make: Callable[..., torch.Tensor], keep: int = 4) -> None:
        self.make = make
        self.keep = keep
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, cu_seqlens: torch.Tensor, *args: object) -> torch.Tensor:
        for kept, value in self._kept:
            if kept is cu_seqlens:
                return value
        self._kept.append((cu_seqlens, self.make(cu_seqlens, *args)))
        del self._kept[: -self.keep]
        return self._kept[-1][1]
