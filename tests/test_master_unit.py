"""Master policies driven through its request handler (no data moves; placement and choice only)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.store.master import Master


class Conn:
    """What the master sees of a connection: the session state it binds a client to."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}


class Driver:
    """Requests as the clients a, b (storage), r and ra (readers) send them, each on its own connection."""

    def __init__(self, m: Driver) -> None:
        self.m = m
        self.conns: dict[str, Conn] = {}

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        cid = req.get("client", "")
        conn = self.conns.setdefault(cid, Conn())
        out = self.m.handle(req, conn)
        assert out is not None
        return out

    def stop(self) -> None:
        self.m.stop()


@pytest.fixture
def master() -> Iterator[Driver]:
    m = Driver(Master(port=0))
    for cid, host in (("a", "host-a"), ("b", "host-b"), ("r", "host-r"), ("ra", "host-a")):
        assert m.handle({"op": "register", "client": cid, "host_id": host})["ok"]
    for cid in ("a", "b"):
        assert m.handle(
            {"op": "mount", "client": cid, "segment": f"seg-{cid}", "base": 1 << 20, "size": 1 << 24}
        )["ok"]
    yield m
    m.stop()


def _put(m: Driver, key: str, replicas: int = 2) -> None:
    r = m.handle(
        {"op": "put_start", "client": "r", "keys": [key], "sizes": [4096], "config": {"replicas": replicas}}
    )
    assert r["results"][0][0] is None
    assert len({x[0] for x in r["results"][0][1]}) == replicas  # distinct segments
    assert m.handle({"op": "put_end", "client": "r", "keys": [key]})["results"] == [[None, None]]


def test_same_host_replica_first(master: Driver) -> None:
    _put(master, "k")
    for _ in range(20):
        reply = master.handle({"op": "get", "client": "ra", "keys": ["k"]})
        assert reply["results"][0][1]["replicas"][0][0] == "seg-a"


def test_remote_reader_balances_between_replicas(master: Driver) -> None:
    _put(master, "k")
    picks = Counter(
        master.handle({"op": "get", "client": "r", "keys": ["k"]})["results"][0][1]["replicas"][0][0]
        for _ in range(200)
    )
    # Power of two choices on reads served: the two segments stay within one read of each other.
    assert abs(picks["seg-a"] - picks["seg-b"]) <= 1, picks


def test_leases_end_on_release_and_expire(master: Driver) -> None:
    _put(master, "k", replicas=1)
    oid = master.handle({"op": "get", "client": "r", "keys": ["k"]})["results"][0][1]["oid"]
    assert master.handle({"op": "remove", "keys": ["k"]})["results"][0][0] == "BUSY"
    master.handle({"op": "release", "client": "r", "leases": [["k", oid + 1000]]})  # wrong object: ignored
    assert master.handle({"op": "remove", "keys": ["k"]})["results"][0][0] == "BUSY"
    master.handle({"op": "exists", "keys": ["k"], "release": [["k", oid]]})  # piggy-backed release
    assert master.handle({"op": "remove", "keys": ["k"]})["results"] == [[None, None]]


def test_unknown_op_and_unknown_client(master: Driver) -> None:
    assert master.handle({"op": "nope", "id": 1})["err"] == "INVALID"
    assert (
        master.handle({"op": "put_start", "client": "ghost", "keys": ["x"], "sizes": [1]})["err"]
        == "UNKNOWN_CLIENT"
    )
    assert master.m.handle([1, 2], Conn())["err"] == "INVALID"  # type: ignore[index]
    r = master.handle({"op": "put_start", "client": "r", "keys": ["\0r:evil"], "sizes": [1]})
    assert r["results"][0][0] == "INVALID"  # reservation key space is not for users


def test_identity_is_the_connection_not_what_a_request_says(master: Driver) -> None:
    m = master.m
    a, r = master.conns["a"], master.conns["r"]
    start = m.handle({"op": "put_start", "keys": ["mine"], "sizes": [100]}, r)
    assert start is not None and start["results"][0][0] is None
    # Client a cannot commit, revoke, heartbeat or unregister as r, even when it names r.
    for op in ("put_end", "put_revoke", "heartbeat", "unregister"):
        out = m.handle({"op": op, "client": "r", "keys": ["mine"]}, a)
        assert out is not None
        if op == "heartbeat":
            assert out["ok"] and "r" in m.clients  # a's own heartbeat, r untouched
        else:
            assert out["err"] == "INVALID" and "belongs to client 'a'" in out["msg"]
    assert m.handle({"op": "put_end", "keys": ["mine"]}, a)["results"][0][0] == "NOT_FOUND"  # type: ignore[index]
    # A fresh connection is nobody until it registers or attaches with the session token.
    anon = Conn()
    assert m.handle({"op": "put_end", "client": "r", "keys": ["mine"]}, anon)["err"] == "UNKNOWN_CLIENT"  # type: ignore[index]
    assert m.handle({"op": "register", "client": "r"}, anon)["err"] == "EXISTS"  # type: ignore[index]
    assert m.handle({"op": "attach", "client": "r", "token": b"guess"}, anon)["err"] == "UNKNOWN_CLIENT"  # type: ignore[index]
    assert m.handle({"op": "put_end", "keys": ["mine"]}, r)["results"] == [[None, None]]  # type: ignore[index]
