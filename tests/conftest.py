"""Shared fixtures: engines, target processes and the real metadata servers (tests/servers.py)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

import pytest

from kvpool import TransferEngine
from kvpool.transfer.peer import PeerProcess
from tests.servers import etcd_url, http_metadata_url, redis_url  # noqa: F401  (fixtures)


def view_at(addr: int, n: int) -> memoryview:
    """A writable memoryview over ``n`` bytes at ``addr`` (memory the test registered)."""
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


def run_batch(eng: TransferEngine, reqs: list, timeout: float = 30) -> tuple:
    """Submit ``reqs`` as one batch, wait; (batch status, per-request statuses)."""
    bid = eng.allocate_batch_id(len(reqs))
    eng.submit_transfer(bid, reqs)
    st = eng.wait_batch(bid, timeout)
    per = [eng.get_transfer_status(bid, k) for k in range(len(reqs))]
    eng.free_batch_id(bid)
    return st, per


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    """An initiator engine with a short timeout."""
    eng = TransferEngine(timeout_s=5.0, connect_timeout_s=2.0)
    yield eng
    eng.close()


@pytest.fixture
def tcp_engine() -> Iterator[TransferEngine]:
    """An initiator engine restricted to TCP."""
    eng = TransferEngine(protocol="tcp", timeout_s=5.0, connect_timeout_s=2.0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    """A target engine in another process with a 72 MiB registered buffer."""
    with PeerProcess(72 << 20, timeout_s=5.0) as p:
        yield p


@pytest.fixture(autouse=True)
def _release_sync_holds() -> Iterator[None]:
    """A test that stopped the fake driver's streams (fakecuda.SyncHold) and failed before letting
    them go must not leave this process's CUDA IPC completion waiting for the next tests."""
    yield
    import sys

    fakecuda = sys.modules.get("kvpool.testing.fakecuda")
    if fakecuda is not None:
        fakecuda.release_holds()


@pytest.fixture(scope="module")
def fake_driver() -> Iterator[str]:
    """CUDA TEST DOUBLE: the fake driver library (kvpool.testing.fakecuda), compiled once per machine
    (one path: one fake driver per process); KVPOOL_CUDA_DRIVER names it for the module's tests and
    the processes they start, restored afterwards."""
    from kvpool.testing import fakecuda

    path = fakecuda.build()
    old = os.environ.get("KVPOOL_CUDA_DRIVER")
    os.environ["KVPOOL_CUDA_DRIVER"] = path
    yield path
    if old is None:
        os.environ.pop("KVPOOL_CUDA_DRIVER", None)
    else:
        os.environ["KVPOOL_CUDA_DRIVER"] = old
