"""kvpool: the KV cache of LLM serving as a pooled, movable resource.

The public names below are imported on first use (PEP 562), so that ``import kvpool.cli`` and
``kvpool.errors`` do not pay for the store, the transfer engine and its native core up front: a
command that fails on bad input answers within the interpreter's start-up time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvpool import errors

__version__ = "0.1.0"

_LAZY = {
    "MasterConfig": "kvpool.config",
    "StoreConfig": "kvpool.config",
    "TransferConfig": "kvpool.config",
    "Master": "kvpool.store",
    "ReplicateConfig": "kvpool.store",
    "Store": "kvpool.store",
    "BatchID": "kvpool.transfer",
    "OpCode": "kvpool.transfer",
    "SegmentDescriptor": "kvpool.transfer",
    "SegmentHandle": "kvpool.transfer",
    "TransferEngine": "kvpool.transfer",
    "TransferRequest": "kvpool.transfer",
    "TransferState": "kvpool.transfer",
    "TransferStatus": "kvpool.transfer",
}

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        try:  # a submodule (kvpool._native, kvpool.store, ...) reached as an attribute
            return importlib.import_module(f"kvpool.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvpool.{name}":
                raise
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
