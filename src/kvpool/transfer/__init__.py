"""Transfer engine: register memory, open segments, batch READ/WRITE over TCP or the same-host path."""

from __future__ import annotations

from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.types import (
    BufferDescriptor,
    OpCode,
    SegmentDescriptor,
    SegmentHandle,
    TransferRequest,
    TransferState,
    TransferStatus,
)

BatchID = int

__all__ = [
    "BatchID",
    "BufferDescriptor",
    "OpCode",
    "SegmentDescriptor",
    "SegmentHandle",
    "TransferEngine",
    "TransferRequest",
    "TransferState",
    "TransferStatus",
]
