"""State and helpers the store client's parts share (:class:`ClientBase`): the put path
(:mod:`kvpool.store.puts`), the get path (:mod:`kvpool.store.gets`) and
:class:`kvpool.store.client.Store`, which sets all of it up in ``__init__``."""

from __future__ import annotations

import threading
from typing import Any

from kvpool._rpc import ERRORS, RpcClient
from kvpool.config import StoreConfig
from kvpool.errors import KvpoolError, StoreError
from kvpool.store.datapath import DataPath
from kvpool.store.locations import LocationCache
from kvpool.store.reservations import ReservationPool, WriteFloor
from kvpool.store.staging import Staging
from kvpool.transfer.engine import TransferEngine


def _err(code: str, msg: str) -> KvpoolError:
    """The kvpool error a master's per-key error code names."""
    return ERRORS.get(code, StoreError)(msg)


class ClientBase:
    """What the put and get paths use of a store client (set up by ``Store.__init__``)."""

    config: StoreConfig
    engine: TransferEngine
    master_incarnation: int | None
    host_id: str
    _rpc: RpcClient
    _max_batch: int
    _lease_s: float
    _write_window_s: float
    _staging: Staging
    _data: DataPath
    _writes: WriteFloor
    _resv: ReservationPool
    _loc: LocationCache
    _releases: list[list[Any]]
    _late_releases: list[tuple[int, float, list[list[Any]]]]
    _release_lock: threading.Lock

    def _call(self, op: str, **args: Any) -> dict[str, Any]:
        """One request to the master (``Store._call``)."""
        raise NotImplementedError

    def _flush_releases_idle(self) -> None:
        """Report ended leases no master call carried (``GetPath._flush_releases_idle``)."""
        raise NotImplementedError

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """[start, end) slices of ``n`` keys, at most one master batch each."""
        step = self._max_batch
        return [(i, min(n, i + step)) for i in range(0, n, step)]
