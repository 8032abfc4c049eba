"""Read leases end to end: a master and real store clients (in this process, on loopback) where a
reader's read is held in flight while others release, remove and put. Every get must return the
object's own bytes or raise a kvpool error, never bytes of whatever reused its space."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool import Store
from kvpool.errors import ObjectBusy
from kvpool.store.master import Master

K = bytes([0xAA]) * (1 << 20)


class Pool:
    """A master (``lease_ttl_ms`` as asked), a storage client ``a`` (16 MiB) and pure clients."""

    def __init__(self, lease_ttl_ms: int) -> None:
        self.m = Master(port=0, lease_ttl_ms=lease_ttl_ms).start()
        self.stores: list[Store] = []
        self.a = self.store(16 << 20)

    def store(self, segment_size: int = 0) -> Store:
        st = Store.connect(master=self.m.address, segment_size=segment_size, buffer_size=8 << 20,
                           location_cache=0)  # fmt: skip
        self.stores.append(st)
        return st

    def close(self) -> None:
        for st in reversed(self.stores):
            st.close()
        self.m.stop()


@pytest.fixture
def pool(request: Any) -> Iterator[Pool]:
    p = Pool(getattr(request, "param", 2000))
    yield p
    p.close()


def during_read(reader: Store, action: Any) -> None:
    """Run ``action`` once while ``reader``'s next read is in flight (its lease held)."""
    orig = reader._data.read

    def read(epoch: int, jobs: list[Any]) -> Any:
        reader._data.read = orig
        action()
        return orig(epoch, jobs)

    reader._data.read = read


@pytest.mark.parametrize("pool", [2000], indirect=True)
def test_a_late_release_of_an_expired_lease_never_frees_a_live_readers_object(pool: Pool) -> None:
    x, y, w = pool.store(), pool.store(), pool.store()
    w.put("k", K)
    gen = w.info("k")["gen"]
    seq = x._call("get", keys=["k"])["results"][0][1].get("lease")  # x looks k up and stalls
    time.sleep(2.2)  # past x's lease
    w.change_replica("k", 1)  # looks at k's leases: x's is written off
    seen: list[Any] = []

    def meanwhile() -> None:
        x._call("release", leases=[["k", gen] + ([seq] if seq is not None else [])])  # x's, late
        try:
            w.remove("k")
            seen.append("removed")
        except ObjectBusy:
            seen.append("busy")
        w._call("put_start", keys=["s"], sizes=[100_000], config=None)  # allocated, never written
        w.put("t", bytes([0x55]) * 300_000)

    during_read(y, meanwhile)
    assert y.get("k") == K
    assert seen == ["busy"]


def test_a_forced_remove_during_a_read_never_gives_the_reader_foreign_bytes(pool: Pool) -> None:
    y, w = pool.store(), pool.store()
    w.put("k", K)

    def meanwhile() -> None:
        w.remove("k", force=True)
        w._call("put_start", keys=["s"], sizes=[100_000], config=None)  # allocated, never written
        w.put("t", bytes([0x55]) * 300_000)

    during_read(y, meanwhile)
    assert y.get("k") == K
    assert not w.exists("k") and w.get("t") == bytes([0x55]) * 300_000


@pytest.mark.parametrize("pool", [5000], indirect=True)
def test_a_release_from_another_client_never_ends_a_readers_lease(pool: Pool) -> None:
    """A hostile client names another client's lease ([key, gen, epoch] are all in a get reply
    anyone can have): its release is ignored, the reader's lease keeps the object from removal;
    the reader's own release ends it."""
    x, y, w = pool.store(), pool.store(), pool.store()
    w.put("k", K)
    gen = w.info("k")["gen"]
    seq = x._call("get", keys=["k"])["results"][0][1]["lease"]  # x holds a lease on k
    for _ in range(3):
        y._call("release", leases=[["k", gen, seq]])  # y holds none: ignored
    with pytest.raises(ObjectBusy):
        w.remove("k")
    x._call("release", leases=[["k", gen, seq]])
    w.remove("k")
    assert not w.exists("k")
