"""Master policies driven through its request handler (no data moves; placement and choice only)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from kvpool.store.master import Master


@pytest.fixture
def master() -> Iterator[Master]:
    m = Master(port=0)
    for cid, host in (("a", "host-a"), ("b", "host-b"), ("r", "host-r"), ("ra", "host-a")):
        assert m.handle({"op": "register", "client": cid, "host_id": host})["ok"]
    for cid in ("a", "b"):
        assert m.handle(
            {"op": "mount", "client": cid, "segment": f"seg-{cid}", "base": 1 << 20, "size": 1 << 24}
        )["ok"]
    yield m
    m.stop()


def _put(m: Master, key: str, replicas: int = 2) -> None:
    r = m.handle(
        {"op": "put_start", "client": "r", "keys": [key], "sizes": [4096], "config": {"replicas": replicas}}
    )
    assert r["results"][0][0] is None
    assert len({x[0] for x in r["results"][0][1]}) == replicas  # distinct segments
    assert m.handle({"op": "put_end", "client": "r", "keys": [key]})["results"] == [[None, None]]


def test_same_host_replica_first(master: Master) -> None:
    _put(master, "k")
    for _ in range(20):
        reply = master.handle({"op": "get", "client": "ra", "keys": ["k"]})
        assert reply["results"][0][1]["replicas"][0][0] == "seg-a"


def test_remote_reader_balances_between_replicas(master: Master) -> None:
    _put(master, "k")
    picks = Counter(
        master.handle({"op": "get", "client": "r", "keys": ["k"]})["results"][0][1]["replicas"][0][0]
        for _ in range(200)
    )
    # Power of two choices on reads served: the two segments stay within one read of each other.
    assert abs(picks["seg-a"] - picks["seg-b"]) <= 1, picks


def test_leases_end_on_release_and_expire(master: Master) -> None:
    _put(master, "k", replicas=1)
    oid = master.handle({"op": "get", "client": "r", "keys": ["k"]})["results"][0][1]["oid"]
    assert master.handle({"op": "remove", "keys": ["k"]})["results"][0][0] == "BUSY"
    master.handle({"op": "release", "client": "r", "leases": [["k", oid + 1000]]})  # wrong object: ignored
    assert master.handle({"op": "remove", "keys": ["k"]})["results"][0][0] == "BUSY"
    master.handle({"op": "exists", "keys": ["k"], "release": [["k", oid]]})  # piggy-backed release
    assert master.handle({"op": "remove", "keys": ["k"]})["results"] == [[None, None]]


def test_unknown_op_and_unknown_client(master: Master) -> None:
    assert master.handle({"op": "nope", "id": 1})["err"] == "INVALID"
    assert (
        master.handle({"op": "put_start", "client": "ghost", "keys": ["x"], "sizes": [1]})["err"]
        == "UNKNOWN_CLIENT"
    )
    assert master.handle([1, 2])["err"] == "INVALID"
    r = master.handle({"op": "put_start", "client": "r", "keys": ["\0r:evil"], "sizes": [1]})
    assert r["results"][0][0] == "INVALID"  # reservation key space is not for users
