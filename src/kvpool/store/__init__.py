"""Distributed KV-block store: a master that keeps metadata, clients that pool their memory."""

from __future__ import annotations

from kvpool.store.client import ReplicateConfig, Store
from kvpool.store.master import Master

__all__ = ["Master", "ReplicateConfig", "Store"]
