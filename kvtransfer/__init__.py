"""Moving a request's KV pages and GDN states from a prefill instance to a decode instance.

`TransferAgent` (NIXL/UCX) is the real backend, `LocalCopyAgent` an in-process stand-in for tests;
both follow `BaseTransferAgent`. Where a prefilled request's data lies travels as a
`pdserve.messages.Lease`.
"""

from typing import Any

from kvtransfer.base import BaseTransferAgent, TransferHandle, TransferState, TransferStats
from kvtransfer.compat import (
    PROTOCOL_VERSION,
    IncompatiblePeerError,
    TransferEndpoint,
    compat_hash,
    model_identity,
)
from kvtransfer.layout import POOL_UNIT_DIMS, PoolSpec
from kvtransfer.local import LocalCopyAgent
from kvtransfer.payload import pool_units

__all__ = [
    "POOL_UNIT_DIMS",
    "PROTOCOL_VERSION",
    "BaseTransferAgent",
    "IncompatiblePeerError",
    "LocalCopyAgent",
    "PoolSpec",
    "TransferAgent",
    "TransferEndpoint",
    "TransferHandle",
    "TransferState",
    "TransferStats",
    "compat_hash",
    "model_identity",
    "pool_units",
]


def __getattr__(name: str) -> Any:
    """`TransferAgent` is imported on first use: it loads NIXL, which an engine holding both
    roles (nothing to transfer) does not need."""
    if name == "TransferAgent":
        from kvtransfer.agent import TransferAgent

        return TransferAgent
    raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
