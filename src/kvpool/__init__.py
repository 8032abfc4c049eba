"""kvpool: the KV cache of LLM serving as a pooled, movable resource."""

from __future__ import annotations

from kvpool import errors
from kvpool.config import MasterConfig, StoreConfig, TransferConfig
from kvpool.store import Master, ReplicateConfig, Store
from kvpool.transfer import (
    BatchID,
    OpCode,
    SegmentDescriptor,
    SegmentHandle,
    TransferEngine,
    TransferRequest,
    TransferState,
    TransferStatus,
)

__version__ = "0.1.0"

__all__ = [
    "BatchID",
    "Master",
    "MasterConfig",
    "ReplicateConfig",
    "Store",
    "StoreConfig",
    "OpCode",
    "SegmentDescriptor",
    "SegmentHandle",
    "TransferConfig",
    "TransferEngine",
    "TransferRequest",
    "TransferState",
    "TransferStatus",
    "errors",
    "__version__",
]
