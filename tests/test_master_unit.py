"""Master policies driven through its request handler (no data moves; placement and choice only)."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.store.master import Master
from kvpool.store.space import Space


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

    def beat_storages(self) -> None:
        """Two heartbeats of every client with a segment: each storage process ran since the
        fences so far (Space.release frees a fence only then)."""
        for _ in range(2):
            for seg in list(self.m.space.segments.values()):
                self.handle({"op": "heartbeat", "client": seg.client})


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


def _put(m: Driver, key: str, replicas: int = 2, size: int = 4096, client: str = "r") -> int:
    """A whole put by ``client``; returns the object's generation."""
    r = m.handle({"op": "put_start", "client": client, "keys": [key], "sizes": [size],
                  "config": {"replicas": replicas}})  # fmt: skip
    code, (gen, verify, reps) = r["results"][0]
    assert code is None and verify is (size <= 64 << 10)
    assert len({x[0] for x in reps}) == replicas  # distinct segments
    segs = [x[0] for x in reps]
    out = m.handle({"op": "put_end", "client": client, "items": [[key, gen, 7, segs]], "epoch": r["epoch"]})
    assert out["results"] == [[None, None]]
    return gen


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
    info = master.handle({"op": "get", "client": "r", "keys": ["k"]})["results"][0][1]
    gen, seq = info["gen"], info["lease"]
    assert master.handle({"op": "remove", "keys": ["k"]})["results"][0][0] == "BUSY"
    master.handle({"op": "release", "client": "r", "leases": [["k", gen + 1000, seq]]})  # wrong object
    master.handle({"op": "release", "client": "r", "leases": [["k", gen]]})  # no lease epoch: ignored
    assert master.handle({"op": "remove", "keys": ["k"]})["results"][0][0] == "BUSY"
    master.handle({"op": "exists", "client": "r", "keys": ["k"], "release": [["k", gen, seq]]})  # piggy-back
    assert master.handle({"op": "remove", "keys": ["k"]})["results"] == [[None, None]]


def test_a_late_release_never_ends_a_newer_readers_lease() -> None:
    """Reader x's lease expires (written off by whatever looks at it next); reader y takes a
    fresh one; x's late release must not end y's: k stays unremovable while y reads it."""
    m = Driver(Master(port=0, lease_ttl_ms=200))
    try:
        for cid in ("a", "r", "x", "y"):
            assert m.handle({"op": "register", "client": cid})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 1 << 24})
        gen = _put(m, "k", replicas=1)
        for write_off in ("replica_start", "get"):  # what finds x's lease expired
            gx = m.handle({"op": "get", "client": "x", "keys": ["k"]})["results"][0][1]
            time.sleep(0.25)  # x's read outlives its lease
            if write_off == "replica_start":
                assert m.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 1})["ok"]
            gy = m.handle({"op": "get", "client": "y", "keys": ["k"]})["results"][0][1]
            assert gy["lease"] != gx["lease"]
            m.handle({"op": "release", "client": "x", "leases": [["k", gen, gx["lease"]]]})  # late
            assert m.handle({"op": "remove", "client": "r", "keys": ["k"]})["results"][0][0] == "BUSY"
            m.handle({"op": "release", "client": "y", "leases": [["k", gen, gy["lease"]]]})
        assert m.handle({"op": "remove", "client": "r", "keys": ["k"]})["results"] == [[None, None]]
    finally:
        m.stop()


def test_unknown_op_and_unknown_client(master: Driver) -> None:
    assert master.handle({"op": "nope", "id": 1})["err"] == "INVALID"
    assert (
        master.handle({"op": "put_start", "client": "ghost", "keys": ["x"], "sizes": [1]})["err"]
        == "UNKNOWN_CLIENT"
    )
    assert master.m.handle([1, 2], Conn())["err"] == "INVALID"  # type: ignore[index]


def test_commit_brings_new_reservations_and_refuses_a_bad_ask_before_committing(master: Driver) -> None:
    r = master.handle({"op": "put_start", "client": "r", "keys": ["k0"], "sizes": [4096], "reserve": 4})
    assert len(r["reserved"]) == 4 and r["results"][0][0] is None
    gens = [g[0] for g in r["reserved"]]
    items = [[f"k{i + 1}", gen, 7] for i, gen in enumerate(gens)]
    for bad in ({"reserve": "many", "size": 4096}, {"reserve": 4, "size": -1}, {"reserve": 4},
                {"reserve": 4, "size": 4096, "config": {"preferred_segment": []}}):  # fmt: skip
        out = master.handle({"op": "commit", "client": "r", "items": items, **bad})
        assert out["err"] == "INVALID", bad
        assert "k1" not in master.m.objects  # nothing was committed
    out = master.handle({"op": "commit", "client": "r", "items": items, "reserve": 3, "size": 4096,
                         "epoch": r["epoch"]})  # fmt: skip
    assert out["results"] == [[None, None]] * 4 and len(out["reserved"]) == 3
    assert all(master.m.objects[f"k{i + 1}"].committed for i in range(4))
    assert master.handle({"op": "commit", "client": "r", "items": items})["results"][0][0] == "NOT_FOUND"


def test_identity_is_the_connection_not_what_a_request_says(master: Driver) -> None:
    m = master.m
    a, r = master.conns["a"], master.conns["r"]
    start = m.handle({"op": "put_start", "keys": ["mine"], "sizes": [100]}, r)
    assert start is not None and start["results"][0][0] is None
    gen, _, reps = start["results"][0][1]
    item = ["mine", gen, 1, [reps[0][0]]]
    # Client a cannot commit, revoke, heartbeat or unregister as r, even when it names r.
    for op in ("put_end", "put_revoke", "heartbeat", "unregister"):
        out = m.handle({"op": op, "client": "r", "items": [item]}, a)
        assert out is not None and out["err"] == "INVALID" and "belongs to client 'a'" in out["msg"]
    assert "r" in m.clients
    assert m.handle({"op": "put_end", "items": [item]}, a)["results"][0][0] == "NOT_FOUND"  # type: ignore[index]
    assert m.handle({"op": "put_revoke", "items": [[gen, True]]}, a)["ok"]  # type: ignore[index]
    assert m.objects["mine"].gen == gen  # a's revoke of r's put did nothing
    # A fresh connection is nobody until it registers or attaches with the session token.
    anon = Conn()
    out = m.handle({"op": "put_end", "client": "r", "items": [item]}, anon)
    assert out is not None and out["err"] == "UNKNOWN_CLIENT"
    assert m.handle({"op": "register", "client": "r"}, anon)["err"] == "EXISTS"  # type: ignore[index]
    out = m.handle({"op": "attach", "client": "r", "token": b"guess"}, anon)
    assert out is not None and out["err"] == "UNKNOWN_CLIENT"
    assert m.handle({"op": "put_end", "items": [item]}, r)["results"] == [[None, None]]  # type: ignore[index]


def test_put_end_needs_the_allocations_generation_and_epoch(master: Driver) -> None:
    m = master.m
    r = master.handle({"op": "put_start", "client": "r", "keys": ["k"], "sizes": [100], "config": {}})
    gen, _, reps = r["results"][0][1]
    seg = [reps[0][0]]
    stale = master.handle({"op": "put_end", "client": "r", "items": [["k", gen, 1, seg]], "epoch": 12345})
    assert stale["err"] == "STALE"  # an allocation from another master life
    wrong = master.handle({"op": "put_end", "client": "r", "items": [["k", gen + 1, 1, seg]]})
    assert wrong["results"][0][0] == "NOT_FOUND"  # not the allocation it got
    no_sum = master.handle({"op": "put_end", "client": "r", "items": [["k", gen, None, seg]]})
    assert no_sum["results"][0][0] == "INVALID"  # small objects must carry a checksum
    ok = master.handle(
        {"op": "put_end", "client": "r", "items": [["k", gen, 5, seg]], "epoch": m.incarnation}
    )
    assert ok["results"] == [[None, None]]
    late = master.handle({"op": "put_end", "client": "r", "items": [["k", gen, 5, seg]]})
    assert late["results"][0][0] == "NOT_FOUND"  # a late second commit changes nothing


def test_a_late_commit_never_commits_the_next_put_of_the_key(master: Driver) -> None:
    m = master.m
    m.config = m.config.replace(put_timeout_s=0.05)
    r1 = master.handle({"op": "put_start", "client": "r", "keys": ["k"], "sizes": [100], "config": {}})
    g1, _, reps1 = r1["results"][0][1]
    time.sleep(0.1)
    m._tick(time.monotonic())  # r's put is revoked ...
    m.config = m.config.replace(put_timeout_s=30)
    r2 = master.handle({"op": "put_start", "client": "ra", "keys": ["k"], "sizes": [100], "config": {}})
    g2, _, reps2 = r2["results"][0][1]
    assert g2 != g1
    assert (reps2[0][0], reps2[0][1]) != (reps1[0][0], reps1[0][1])  # its space is fenced, not reused
    late = master.handle({"op": "put_end", "client": "r", "items": [["k", g1, 1, [reps1[0][0]]]]})
    assert late["results"][0][0] == "NOT_FOUND"  # ... and its late commit does not commit ra's put
    assert not m.objects["k"].committed and m.objects["k"].owner == "ra"


def test_fenced_space_is_freed_by_the_writers_floor_or_turns_suspect(master: Driver) -> None:
    m = master.m
    m.space.quarantine_s = 0.0
    m.space.fence_hold_s = 3600
    r = master.handle({"op": "put_start", "client": "r", "keys": ["k"], "sizes": [1 << 20], "config": {}})
    gen = r["results"][0][1][0]
    master.handle({"op": "put_revoke", "client": "r", "items": [[gen, True]]})  # written, then failed
    assert m.space.fenced == 1
    master.handle({"op": "heartbeat", "client": "r", "floor": gen})  # still writing gen
    assert m.space.fenced == 1
    master.handle({"op": "heartbeat", "client": "r", "floor": gen + 1})  # done with it ...
    assert m.space.fenced == 1  # ... but the segment's storage process did not run since
    master.beat_storages()
    master.handle({"op": "heartbeat", "client": "r", "floor": gen + 1})
    assert m.space.fenced == 0
    # A writer that dies without confirming: its space comes back after the hold, as suspect space
    # in which every object must carry a checksum.
    r = master.handle({"op": "put_start", "client": "ra", "keys": ["big"], "sizes": [1 << 20], "config": {}})
    gen, verify, reps = r["results"][0][1]
    assert verify is False
    m._remove_client("ra")
    assert m.space.fenced == 1
    m.space.fence_hold_s = 0.0
    master.beat_storages()
    m.space.release(m._floor_of, time.monotonic())
    assert m.space.fenced == 0
    seg = m.space.segments[reps[0][0]]
    assert seg.suspect
    r = master.handle({"op": "put_start", "client": "r", "keys": ["big2"], "sizes": [1 << 20],
                       "config": {"preferred_segment": seg.name}})  # fmt: skip
    gen2, verify2, reps2 = r["results"][0][1]
    assert reps2[0][1] == reps[0][1] and verify2 is True


def _lost_writer_space(m: Driver, writer: str, size: int, segment: str) -> tuple[str, int]:
    """A put by ``writer`` that never finishes, its client declared gone and its fence held to
    the end: its range on ``segment`` is reused as suspect space. Returns (segment, address)."""
    r = m.handle({"op": "put_start", "client": writer, "keys": [f"lost-{writer}"], "sizes": [size],
                  "config": {"preferred_segment": segment}})  # fmt: skip
    _, _, reps = r["results"][0][1]
    assert reps[0][0] == segment
    space = m.m.space
    space.quarantine_s = space.fence_hold_s = 0.0
    m.m._remove_client(writer)
    m.beat_storages()
    space.release(m.m._floor_of, time.monotonic())
    assert space.segments[segment].suspect and space.fenced == 0
    return reps[0][0], reps[0][1]


def _over_suspect(m: Driver, dst: list[list[Any]], size: int) -> bool:
    seg = m.m.space.segments
    return any(Space.suspect(seg[s], a - seg[s].base, size + 64) for s, a in dst)


def test_no_copy_of_an_object_without_a_checksum_is_placed_over_suspect_space(master: Driver) -> None:
    """Readers check only the header of an object without a checksum: a new replica of one
    (change_replica, hot-key copy) over the range a lost writer may still write into would serve
    that late write. Such copies go elsewhere or not at all; checksummed objects may go there."""
    m = master.m
    size = 1 << 20
    lost = _lost_writer_space(master, "ra", size, "seg-a")
    for key, csum in (("plain", None), ("summed", 7)):
        r = master.handle({"op": "put_start", "client": "r", "keys": [key], "sizes": [size],
                           "config": {"preferred_segment": "seg-b"}})  # fmt: skip
        gen, verify, reps = r["results"][0][1]
        assert reps[0][0] == "seg-b" and verify is False
        items = [[key, gen, csum, ["seg-b"]]]
        assert master.handle({"op": "put_end", "client": "r", "items": items, "epoch": r["epoch"]})["ok"]
    out = master.handle({"op": "replica_start", "client": "r", "key": "plain", "replicas": 2})
    assert out["ok"] and not _over_suspect(master, out["dst"], size), (lost, out["dst"])
    m._replicate(m.objects["plain"], 1, time.monotonic())  # a hot key's extra copy
    assert not any(_over_suspect(master, [t["dst"]], size) for t in m.clients["a"].tasks)
    assert all(r.seg.name == "seg-b" for r in m.objects["plain"].replicas)
    out = master.handle({"op": "replica_start", "client": "r", "key": "summed", "replicas": 2})
    assert out["ok"] and out["dst"] and _over_suspect(master, out["dst"], size)  # checked by its readers


def test_an_ssd_hit_without_a_checksum_is_not_promoted_over_suspect_space() -> None:
    m = Driver(Master(port=0, eviction_high_watermark=0.5))
    try:
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
        assert m.handle({"op": "register", "client": "r"})["ok"]
        assert m.handle({"op": "register", "client": "w"})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 16 << 20})
        gen = _spilled(m, "k", csum=None)
        for key in [k for k, o in m.m.objects._d[0].items() if o.replicas][:4]:  # room for the hit
            assert m.handle({"op": "remove", "client": "r", "keys": [key], "force": True})["ok"]
        _lost_writer_space(m, "w", 1 << 20, "seg-a")
        out = m.handle({"op": "promote_start", "client": "r", "key": "k", "gen": gen})
        assert out["ok"] and not _over_suspect(m, out["dst"], 1 << 20), out["dst"]
    finally:
        m.stop()


def test_batches_are_bounded_and_impossible_puts_evict_nothing(master: Driver) -> None:
    m = master.m
    too_many = master.handle({"op": "get", "client": "r", "keys": [f"k{i}" for i in range(5000)]})
    assert too_many["err"] == "TOO_LARGE" and "split" in too_many["msg"]
    for i in range(20):
        _put(master, f"small{i}", replicas=1)
    huge = master.handle({"op": "put_start", "client": "r", "keys": ["huge"], "sizes": [1 << 30]})
    assert huge["results"][0][0] == "FULL" and "any mounted segment" in huge["results"][0][1]
    assert m.stats["evictions"] == 0 and m.n_committed == 20


def test_eviction_is_incremental_and_by_class(master: Driver) -> None:
    m = master.m
    m.config = m.config.replace(evict_batch=8, eviction_high_watermark=0.5, eviction_ratio=0.1)
    for i in range(40):
        _put(master, f"e{i}", replicas=1, size=256 << 10)
    before = m.stats["evictions"]
    m._evict(time.monotonic(), need=1 << 40)  # asks for everything; looks at 8 objects at most
    assert 0 < m.stats["evictions"] - before <= 8


def test_a_forced_remove_keeps_a_leased_objects_space_until_the_lease_ends() -> None:
    m = Driver(Master(port=0, lease_ttl_ms=300))
    try:
        for cid in ("a", "r", "y"):
            assert m.handle({"op": "register", "client": cid})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 1 << 24})
        used0 = m.m.space.used
        _put(m, "k", replicas=1, size=1 << 20)
        info = m.handle({"op": "get", "client": "y", "keys": ["k"]})["results"][0][1]  # y reads k
        used = m.m.space.used
        k_alloc = used - used0
        assert m.handle({"op": "remove", "client": "r", "keys": ["k"], "force": True})["results"] == [
            [None, None]
        ]
        assert m.m.space.used == used  # k's key is gone, its space is not
        for i in range(8):  # nothing new is placed where y may still be reading
            _put(m, f"n{i}", replicas=1, size=1 << 20)
            addr = m.handle({"op": "info", "key": f"n{i}"})["replicas"][0][1]
            assert addr != info["replicas"][0][1]
        m.m._tick(time.monotonic())
        assert m.m.space.fenced == 1
        used = m.m.space.used
        time.sleep(0.35)  # y's lease is over
        m.m._tick(time.monotonic())
        assert m.m.space.fenced == 0 and m.m.space.used == used - k_alloc  # k's space is free now
    finally:
        m.stop()


def _spilled(m: Driver, key: str, size: int = 1 << 20, csum: int | None = 7) -> int:
    """Put ``key`` (persistent, committed with ``csum``) and push the pool over its watermark until
    it lives only on the SSD tier of client ``a`` (its spill tasks done as ``a`` would); returns
    its generation."""
    cfg = {"cache_class": "persistent"}
    r = m.handle({"op": "put_start", "client": "r", "keys": [key], "sizes": [size], "config": cfg})
    gen, _, reps = r["results"][0][1]
    items = [[key, gen, csum, [reps[0][0]]]]
    m.handle({"op": "put_end", "client": "r", "items": items, "epoch": r["epoch"]})
    for i in range(64):
        obj = m.m.objects.get(key)
        assert obj is not None
        if obj.ssd is not None and not obj.replicas:
            return gen
        fill = f"fill-{key}-{i}"
        r = m.handle({"op": "put_start", "client": "r", "keys": [fill], "sizes": [size], "config": cfg})
        if r["results"][0][0] is None:
            g, _, reps = r["results"][0][1]
            m.handle(
                {"op": "put_end", "client": "r", "items": [[fill, g, 7, [reps[0][0]]]], "epoch": r["epoch"]}
            )
        for task in m.handle({"op": "heartbeat", "client": "a"})["tasks"]:
            if task["type"] == "spill":
                m.handle({"op": "task_done", "client": "a", "task": task["task"], "ok": True,
                          "result": {"checksum": "c"}})  # fmt: skip
    raise AssertionError(f"{key} was never spilled")


def test_a_sweep_is_told_the_file_names_no_ssd_copy_has() -> None:
    """``ssd_known``: the name of a copy's file is known while the copy is, unknown once it is
    let go of (a removed object) and for names no copy ever had; the grace is twice
    task_timeout_s; more names than max_batch are refused."""
    m = Driver(Master(port=0, eviction_high_watermark=0.5, task_timeout_s=4.0, max_batch=8))
    try:
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
        assert m.handle({"op": "register", "client": "r"})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 16 << 20})
        _spilled(m, "k")
        name = m.m.objects["k"].ssd.path.rsplit("/", 1)[-1]
        ask = {"op": "ssd_known", "client": "a", "names": [name, "0" * 40 + "-1.kvp"]}
        out = m.handle(ask)
        assert out["unknown"] == ["0" * 40 + "-1.kvp"] and out["grace_s"] >= 8.0
        m.handle({"op": "remove", "client": "r", "keys": ["k"]})
        assert m.handle(ask)["unknown"] == ask["names"]
        assert m.handle({**ask, "names": ["x"] * 9}).get("err") == "INVALID"
    finally:
        m.stop()


def test_a_sweep_is_never_told_the_file_of_a_spill_in_flight_is_unknown() -> None:
    """A spill handed out and not reported yet: its file may be written, and (by another
    client's clock, sharing the directory; or after a clock step) older than the grace. Its
    name is known until the spill ends (it was unknown: the sweep removed the file, then the
    report was taken: an SSD copy without a file); once refused, it is nobody's."""
    m = Driver(Master(port=0, eviction_high_watermark=0.5, task_timeout_s=4.0))
    try:
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
        assert m.handle({"op": "register", "client": "r"})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 16 << 20})
        size, cfg = 1 << 20, {"cache_class": "persistent"}
        spill = None
        for i in range(64):  # fill the pool until eviction hands out a spill
            r = m.handle(
                {"op": "put_start", "client": "r", "keys": [f"k{i}"], "sizes": [size], "config": cfg}
            )
            if r["results"][0][0] is None:
                g, _, reps = r["results"][0][1]
                items = [[f"k{i}", g, 7, [reps[0][0]]]]
                m.handle({"op": "put_end", "client": "r", "items": items, "epoch": r["epoch"]})
            spills = [
                t for t in m.handle({"op": "heartbeat", "client": "a"})["tasks"] if t["type"] == "spill"
            ]
            if spills:
                spill = spills[0]
                for t in spills[1:]:  # the others failed
                    m.handle({"op": "task_done", "client": "a", "task": t["task"], "ok": False, "result": {}})
                break
        assert spill is not None, "no spill was handed out"
        name = spill["path"].rsplit("/", 1)[-1]
        ask = {"op": "ssd_known", "client": "a", "names": [name]}
        assert m.handle(ask)["unknown"] == []  # in flight: its file stays
        m.handle(
            {"op": "task_done", "client": "a", "task": spill["task"], "ok": True, "result": {"checksum": "c"}}
        )
        assert m.handle(ask)["unknown"] == []  # a copy's file now
        m.handle({"op": "remove", "client": "r", "keys": [spill["key"]], "force": True})
        assert m.handle(ask)["unknown"] == [name]
        assert not m.m._spilling  # nothing left behind
    finally:
        m.stop()


def test_promotion_of_an_ssd_hit_names_the_generation_it_read() -> None:
    m = Driver(Master(port=0, eviction_high_watermark=0.5))
    try:
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
        assert m.handle({"op": "register", "client": "r"})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 16 << 20})
        g1 = _spilled(m, "k")
        assert m.handle({"op": "remove", "client": "r", "keys": ["k"]})["results"] == [[None, None]]
        g2 = _spilled(m, "k")  # k put again (another value), also SSD-only now
        # A reader that read g1's bytes from the SSD may not promote them into g2's object.
        out = m.handle({"op": "promote_start", "client": "r", "key": "k", "gen": g1})
        assert out.get("err") == "NOT_FOUND" and not m.m.objects["k"].replicas
        out = m.handle({"op": "promote_start", "client": "r", "key": "k", "gen": g2})
        assert out["ok"] and len(out["dst"]) == 1 and out["gen"] == g2
    finally:
        m.stop()


def test_a_bad_ssd_file_report_drops_that_copy_only() -> None:
    """``ssd_corrupt`` names the object's generation and file: a report of another one changes
    nothing; an object whose memory is still held (a lease outlived its spill) keeps that memory
    (it would have been freed for the copy that is gone), an SSD-only one is dropped."""
    m = Driver(Master(port=0, eviction_high_watermark=0.5))
    try:
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
        assert m.handle({"op": "register", "client": "r"})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 16 << 20})
        r = m.handle({"op": "put_start", "client": "r", "keys": ["k"], "sizes": [1 << 20], "config": {}})
        gen, _, reps = r["results"][0][1]
        m.handle(
            {"op": "put_end", "client": "r", "items": [["k", gen, None, ["seg-a"]]], "epoch": r["epoch"]}
        )
        assert m.handle({"op": "get", "client": "r", "keys": ["k"]})["results"][0][0] is None  # leased
        obj = m.m.objects["k"]
        m.m._spill(obj, m.m.clients["a"])
        (task,) = m.handle({"op": "heartbeat", "client": "a"})["tasks"]
        done = {
            "op": "task_done",
            "client": "a",
            "task": task["task"],
            "ok": True,
            "result": {"checksum": "c"},
        }
        m.handle(done)
        assert obj.ssd is not None and obj in m.m._spilled and obj.replicas  # memory waits for the lease
        bad = {"op": "report", "client": "r", "kind": "ssd_corrupt", "segment": "", "key": "k"}
        m.handle({**bad, "gen": gen, "path": task["path"] + "x"})
        m.handle({**bad, "gen": gen + 1, "path": task["path"]})
        assert obj.ssd is not None
        m.handle({**bad, "gen": gen, "path": task["path"]})
        assert obj.ssd is None and obj not in m.m._spilled and m.m.objects["k"] is obj
        m.m.objects["k"].lease_until = 0  # the lease ends
        m.m._tick(time.monotonic() + 2)
        assert obj.replicas and m.handle({"op": "get", "client": "r", "keys": ["k"]})["results"][0][0] is None
        unlinks = [t for t in m.handle({"op": "heartbeat", "client": "a"})["tasks"] if t["type"] == "unlink"]
        assert [t["path"] for t in unlinks] == [task["path"]]
        g2 = _spilled(m, "j", csum=None)
        m.handle({**bad, "key": "j", "gen": g2, "path": m.m.objects["j"].ssd.path})
        assert "j" not in m.m.objects  # SSD only: nothing left of it
    finally:
        m.stop()


def test_an_unreadable_ssd_file_report_is_its_copys_clients_and_counted_apart() -> None:
    """``ssd_unreadable`` (the copy's own client could not open its file on checks apart) drops
    that copy as ``ssd_corrupt`` does, counted in ``ssd_copies_unreadable``, not in
    ``ssd_copies_corrupt``; one from another client (which cannot tell: the file is not its own)
    changes nothing. Every report's reply lists the kinds the master knows (an older master
    answers {} and ignores an unknown kind: the client falls back to ``ssd_corrupt``)."""
    m = Driver(Master(port=0, eviction_high_watermark=0.5))
    try:
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
        assert m.handle({"op": "register", "client": "r"})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 16 << 20})
        gen = _spilled(m, "j", csum=None)
        obj = m.m.objects["j"]
        lost = {"op": "report", "kind": "ssd_unreadable", "segment": "", "key": "j", "gen": gen,
                "path": obj.ssd.path}  # fmt: skip
        out = m.handle({**lost, "client": "r"})  # a reader: not its file
        assert "ssd_unreadable" in out["kinds"] and "ssd_corrupt" in out["kinds"]
        assert obj.ssd is not None and m.m.objects["j"] is obj
        m.handle({**lost, "client": "a", "gen": gen + 1})  # another generation's
        m.handle({**lost, "client": "a", "epoch": m.m.incarnation + 1})  # another master's
        assert obj.ssd is not None and m.m.stats["ssd_copies_unreadable"] == 0
        out = m.handle({**lost, "client": "a", "epoch": m.m.incarnation})
        assert "ssd_unreadable" in out["kinds"]
        assert "j" not in m.m.objects  # SSD only: nothing left of it
        assert m.m.stats["ssd_copies_unreadable"] == 1 and m.m.stats["ssd_copies_corrupt"] == 0
        assert m.m.stats["objects_lost"] == 1
    finally:
        m.stop()


def test_asking_more_replicas_than_segments_evicts_only_what_the_placeable_ones_need() -> None:
    m = Driver(Master(port=0))
    try:
        for cid in ("a", "b", "r"):
            assert m.handle({"op": "register", "client": cid})["ok"]
        for cid in ("a", "b"):
            m.handle(
                {"op": "mount", "client": cid, "segment": f"seg-{cid}", "base": 1 << 20, "size": 64 << 20}
            )
        for i in range(40):
            _put(m, f"o{i}", replicas=1, size=1 << 20)  # 40 of 128 MiB used: far below the watermark
        r = m.handle({"op": "put_start", "client": "r", "keys": ["new"], "sizes": [1 << 20],
                      "config": {"replicas": 128}})  # fmt: skip
        assert len(r["results"][0][1][2]) == 2  # capped by the number of segments
        assert m.m.stats["evictions"] == 0 and all(f"o{i}" in m.m.objects for i in range(40))
    finally:
        m.stop()


def test_replica_changes_that_place_nothing_or_whose_client_dies_leave_the_object_free(
    master: Driver,
) -> None:
    _put(master, "k", replicas=2)
    obj = master.m.objects["k"]
    # Both segments hold k: raising to 3 places nothing, and nothing stays busy.
    assert master.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 3})["dst"] == []
    assert obj.busy == 0
    _put(master, "j", replicas=1)
    j = master.m.objects["j"]
    start = master.handle({"op": "replica_start", "client": "r", "key": "j", "replicas": 2})
    assert len(start["dst"]) == 1 and j.busy == 1
    # Only the client that started the copy ends it.
    out = master.handle({"op": "replica_end", "client": "ra", "key": "j", "gen": start["gen"], "ok": True,
                         "segments": [start["dst"][0][0]]})  # fmt: skip
    assert out["err"] == "NOT_FOUND" and j.busy == 1
    # r dies between replica_start and replica_end: its copy is undone, j is free again.
    master.m._remove_client("r")
    assert j.busy == 0 and len(j.replicas) == 1 and all(r.committed for r in j.replicas)
    out = master.handle({"op": "remove", "client": "ra", "keys": ["k", "j"]})
    assert out["results"] == [[None, None], [None, None]]


def test_a_replica_copys_end_touches_only_the_replicas_it_was_handed(master: Driver) -> None:
    """r copies k to seg-b (change_replica); b is declared dead meanwhile, registers again and
    mounts seg-b anew, and r starts another copy of k, which the master places on the new seg-b.
    The first copy ends (ok: it wrote what was the old seg-b): the replica it was handed is gone,
    so nothing is committed; the second copy's replica, not written yet, is committed only when
    that copy ends. The end matched any unfinished replica of r's on a segment of that name, and
    committed the second one before a byte of it was written (a reader got whatever was there)."""
    m = master.m
    _put(master, "k", replicas=1)
    home = m.objects["k"].replicas[0].seg.name
    other = "seg-b" if home == "seg-a" else "seg-a"
    first = master.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 2})
    assert [d[0] for d in first["dst"]] == [other]
    m._remove_client(other[-1])  # declared dead (missed heartbeats)
    assert master.handle({"op": "register", "client": other[-1], "host_id": "host-x"})["ok"]
    assert master.handle(
        {"op": "mount", "client": other[-1], "segment": other, "base": 1 << 20, "size": 1 << 24}
    )["ok"]
    m._tick(time.monotonic())  # the old segment's replicas are let go of
    second = master.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 2})
    assert [d[0] for d in second["dst"]] == [other]

    def end(start: dict[str, Any]) -> dict[str, Any]:
        return master.handle({"op": "replica_end", "client": "r", "key": "k", "gen": start["gen"], "ok": True,
                              "segments": [other], "change": start.get("change")})  # fmt: skip

    assert end(first)["replicas"] == 1
    (new,) = [x for x in m.objects["k"].replicas if x.seg.name == other]
    assert not new.committed, "the first copy's end committed the second copy's unwritten replica"
    assert end(second)["replicas"] == 2 and new.committed and m.objects["k"].busy == 0
    assert end(second)["err"] == "NOT_FOUND"  # ended once
    assert first["change"] != second["change"]


def test_a_hot_key_copys_report_ends_only_the_replica_it_was_handed(master: Driver) -> None:
    """A hot-key copy of k onto the other storage client's segment is under way when that client
    unmounts the segment and mounts it again (the same name); r then copies k there
    (change_replica). The hot-key copy reports done: the replica it was handed is gone, so
    nothing is committed; r's replica, not written yet, is committed only when r's copy ends.
    The report committed any unfinished replica on a segment of that name: r's, unwritten."""
    m = master.m
    _put(master, "k", replicas=1)
    home = m.objects["k"].replicas[0].seg.name
    other = "seg-b" if home == "seg-a" else "seg-a"
    owner = other[-1]
    m._replicate(m.objects["k"], 1, time.monotonic())
    (task,) = master.handle({"op": "heartbeat", "client": owner})["tasks"]
    assert task["type"] == "replicate" and task["dst"][0] == other
    assert master.handle({"op": "unmount", "client": owner, "segment": other})["ok"]
    m._tick(time.monotonic())  # the old segment's replicas are let go of
    assert master.handle(
        {"op": "mount", "client": owner, "segment": other, "base": 1 << 20, "size": 1 << 24}
    )["ok"]
    start = master.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 2})
    assert [d[0] for d in start["dst"]] == [other]
    done = {"op": "task_done", "client": owner, "task": task["task"], "ok": True, "epoch": task["epoch"]}
    assert master.handle(done)["accepted"]
    (new,) = [x for x in m.objects["k"].replicas if x.seg.name == other]
    assert not new.committed, "the hot-key copy's report committed r's unwritten replica"
    out = master.handle({"op": "replica_end", "client": "r", "key": "k", "gen": start["gen"], "ok": True,
                         "segments": [other], "change": start.get("change")})  # fmt: skip
    assert out["replicas"] == 2 and new.committed and m.objects["k"].busy == 0 and not m._tasks


def test_ssd_unlink_tasks_are_not_kept_waiting_for_a_report_that_never_comes() -> None:
    m = Driver(Master(port=0, eviction_high_watermark=0.5))
    try:
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
        assert m.handle({"op": "register", "client": "r"})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 16 << 20})
        _spilled(m, "k")
        _spilled(m, "j")
        assert m.handle({"op": "remove", "client": "r", "keys": ["k", "j"]})["results"] == [[None, None]] * 2
        tasks = m.handle({"op": "heartbeat", "client": "a"})["tasks"]
        assert sum(t["type"] == "unlink" for t in tasks) == 2  # handed out (the client runs them) ...
        assert all(t["type"] != "unlink" for _, t, _ in m.m._tasks.values())  # ... and not kept
        assert m.m.clients["a"].task_ids == set(m.m._tasks)
    finally:
        m.stop()


def _over_the_watermark(m: Driver) -> None:
    """Client ``a`` (with an SSD directory) mounts a 16 MiB segment and ``r`` puts 15 persistent
    1 MiB objects on it: past the master's eviction watermark (0.5), so ``a``'s next heartbeat
    hands out spills."""
    assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
    assert m.handle({"op": "register", "client": "r"})["ok"]
    m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 16 << 20})
    cfg = {"cache_class": "persistent"}
    for i in range(15):
        r = m.handle({"op": "put_start", "client": "r", "keys": [f"p{i}"], "sizes": [1 << 20], "config": cfg})
        gen, _, reps = r["results"][0][1]
        items = [[f"p{i}", gen, 7, [reps[0][0]]]]
        assert m.handle({"op": "put_end", "client": "r", "items": items, "epoch": r["epoch"]})["ok"]


def test_tasks_of_a_lost_heartbeat_reply_expire_and_a_late_report_commits_nothing() -> None:
    m = Driver(Master(port=0, eviction_high_watermark=0.5, task_timeout_s=0.3))
    try:
        _over_the_watermark(m)
        lost = m.handle({"op": "heartbeat", "client": "a"})["tasks"]  # this reply never arrives
        assert lost and all(t["type"] == "spill" and 0 < t["ttl_s"] <= 0.3 for t in lost)
        busy = [t["key"] for t in lost]
        assert all(m.m.objects[k].busy == 1 for k in busy)
        time.sleep(0.35)
        m.m._tick(time.monotonic())  # the lost tasks failed: their objects are spilled again
        assert m.m.stats["tasks_expired"] == len(lost) and not any(t["task"] in m.m._tasks for t in lost)
        again = m.handle({"op": "heartbeat", "client": "a"})["tasks"]
        respilled = {t["key"] for t in again}  # as many as eviction needs now
        assert respilled and respilled <= set(busy)
        assert all(m.m.objects[k].busy == (k in respilled) for k in busy)
        # The client ran a lost one after all and reports success: too late, nothing is recorded.
        t = lost[0]
        done = {"op": "task_done", "client": "a", "task": t["task"], "ok": True, "result": {"checksum": "c"}}
        m.handle(done)
        obj = m.m.objects[t["key"]]
        assert obj.ssd is None and obj.busy == (t["key"] in respilled) and obj.replicas
    finally:
        m.stop()


def test_a_late_disk_error_of_an_expired_spill_changes_nothing() -> None:
    """A spill the master gave up on (``task_timeout_s``) reports late that its disk failed
    (``disk_error``): the report is not taken (``accepted`` false, counted late), the client gets
    no spill backoff and its expired spill's object is left as it is (spilled again, or free);
    a disk error of a spill still in flight does back the client off."""
    m = Driver(Master(port=0, eviction_high_watermark=0.5, task_timeout_s=0.3))
    try:
        _over_the_watermark(m)
        expired = m.handle({"op": "heartbeat", "client": "a"})["tasks"]
        assert expired and all(t["type"] == "spill" for t in expired)
        time.sleep(0.35)
        m.m._tick(time.monotonic())  # they failed: their objects are spilled again
        again = m.handle({"op": "heartbeat", "client": "a"})["tasks"]
        assert again and m.m.stats["tasks_expired"] == len(expired)
        cl = m.m.clients["a"]
        before = {
            t["key"]: (m.m.objects[t["key"]].busy, len(m.m.objects[t["key"]].replicas)) for t in expired
        }
        for t in expired:
            late = {"op": "task_done", "client": "a", "task": t["task"], "ok": False, "epoch": t["epoch"],
                    "result": {"disk_error": "[Errno 28] No space left on device"}}  # fmt: skip
            assert m.handle(late)["accepted"] is False
        assert m.m.stats["tasks_late_reports"] == len(expired) and m.m.stats["spill_disk_errors"] == 0
        assert cl.spill_failures == 0 and cl.spill_after == 0.0
        assert {k: (m.m.objects[k].busy, len(m.m.objects[k].replicas)) for k in before} == before
        assert all(m.m.objects[t["key"]].ssd is None for t in expired)
        t = again[0]  # one still in flight: its disk error counts
        failed = {"op": "task_done", "client": "a", "task": t["task"], "ok": False, "epoch": t["epoch"],
                  "result": {"disk_error": "[Errno 28] No space left on device"}}  # fmt: skip
        assert m.handle(failed)["accepted"] is True
        assert cl.spill_failures == 1 and cl.spill_after > time.monotonic()
    finally:
        m.stop()


def test_a_task_handed_out_late_carries_only_what_is_left_of_its_deadline() -> None:
    """A task waits in the master's queue until the client's next heartbeat: its ``ttl_s`` is
    what is left of ``task_timeout_s`` then (the client counts it from its heartbeat), so the
    client starts none the master gave up on; one already past its deadline is not handed out."""
    m = Driver(Master(port=0, task_timeout_s=0.4))
    try:
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
        assert m.handle({"op": "register", "client": "r"})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 16 << 20})
        _put(m, "k", replicas=1)
        _put(m, "j", replicas=1)
        with m.m._lock:
            m.m._spill(m.m.objects["k"], m.m.clients["a"])
        time.sleep(0.25)  # the client's heartbeat comes later
        (task,) = m.handle({"op": "heartbeat", "client": "a"})["tasks"]
        assert 0 < task["ttl_s"] <= 0.4 - 0.25, task["ttl_s"]
        assert "_due" not in task
        with m.m._lock:
            m.m._spill(m.m.objects["j"], m.m.clients["a"])
        time.sleep(0.45)  # past its deadline, before the tick that fails it
        assert m.handle({"op": "heartbeat", "client": "a"})["tasks"] == []
        m.m._tick(time.monotonic())
        assert m.m.objects["j"].busy == 0 and not m.m._tasks
    finally:
        m.stop()


def test_an_object_whose_memory_replicas_died_leaves_the_eviction_lru_and_returns_when_promoted() -> None:
    """A promoted SSD object (memory replica + SSD copy) whose segment dies is SSD only: out of
    the eviction LRU (it stayed there with no replica, skipped by every eviction scan for good)
    and where ``remove_all`` finds SSD-only objects; promoted again, it is back in the LRU."""
    m = Driver(Master(port=0, eviction_high_watermark=0.5))
    try:
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
        assert m.handle({"op": "register", "client": "r"})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 16 << 20})
        gen = _spilled(m, "k")
        obj = m.m.objects["k"]

        def promote() -> None:
            out = m.handle({"op": "promote_start", "client": "r", "key": "k", "gen": gen})
            assert len(out["dst"]) == 1, out
            end = {"op": "replica_end", "client": "r", "key": "k", "gen": gen, "ok": True,
                   "segments": [out["dst"][0][0]]}  # fmt: skip
            assert m.handle(end)["replicas"] == 1

        promote()
        assert obj.lru is not None and obj not in m.m._ssd_only
        assert m.handle({"op": "unmount", "client": "a", "segment": "seg-a"})["ok"]
        m.m._tick(time.monotonic())  # the dead segment's objects are let go of
        assert m.m.objects["k"] is obj and not obj.replicas and obj.ssd is not None
        assert obj.lru is None and obj in m.m._ssd_only
        m.handle({"op": "mount", "client": "a", "segment": "seg-c", "base": 1 << 30, "size": 16 << 20})
        promote()
        assert obj.lru is not None and obj not in m.m._ssd_only
    finally:
        m.stop()


def test_the_ssd_copies_of_a_client_that_is_gone_are_let_go_of() -> None:
    """A storage client declared dead takes its SSD copies with it (nobody can unlink their files
    or, off its host, read them): an object only there is lost and its key free again (it stayed:
    every get a miss, every put of the key refused), one with a memory replica keeps it; a client
    registered again under that id is handed the unlinks."""
    m = Driver(Master(port=0, eviction_high_watermark=0.5))
    try:
        for cid, ssd in (("a", "/nonexistent"), ("b", None), ("r", None)):
            assert m.handle({"op": "register", "client": cid, "ssd_dir": ssd})["ok"]
        m.handle({"op": "mount", "client": "b", "segment": "seg-b", "base": 1 << 20, "size": 16 << 20})
        _spilled(m, "k")  # SSD only, on a's disk
        r = m.handle({"op": "put_start", "client": "r", "keys": ["j"], "sizes": [1 << 20], "config": {}})
        gen, _, reps = r["results"][0][1]
        m.handle(
            {"op": "put_end", "client": "r", "items": [["j", gen, None, ["seg-b"]]], "epoch": r["epoch"]}
        )
        assert m.handle({"op": "get", "client": "r", "keys": ["j"]})["results"][0][0] is None  # leased
        j = m.m.objects["j"]
        m.m._spill(j, m.m.clients["a"])
        tasks = m.handle({"op": "heartbeat", "client": "a"})["tasks"]
        (task,) = [t for t in tasks if t["type"] == "spill" and t["key"] == "j"]
        m.handle(
            {"op": "task_done", "client": "a", "task": task["task"], "ok": True, "result": {"checksum": "c"}}
        )
        assert j.ssd is not None and j.replicas and j in m.m._spilled  # memory waits for the lease
        k_path = m.m.objects["k"].ssd.path
        m.m._remove_client("a")  # declared dead
        m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})  # back, same disk
        m.m._tick(time.monotonic())
        assert "k" not in m.m.objects and m.m.stats["ssd_copies_lost"] >= 2  # k, j (and the fill)
        assert j.ssd is None and j not in m.m._spilled and j.replicas and j.lru is not None
        assert m.handle({"op": "get", "client": "r", "keys": ["j"]})["results"][0][0] is None
        unlinks = {
            t["path"] for t in m.handle({"op": "heartbeat", "client": "a"})["tasks"] if t["type"] == "unlink"
        }
        assert unlinks >= {k_path, task["path"]}
        r = m.handle({"op": "put_start", "client": "r", "keys": ["k"], "sizes": [4096], "config": {}})
        assert r["results"][0][0] is None  # the key is free again
    finally:
        m.stop()


def test_an_infinite_number_is_invalid_not_a_crash(master: Driver) -> None:
    """int() of an infinite float (msgpack carries them) raised OverflowError, which ``handle`` let
    escape: the RPC server answered a bare ERROR and logged a traceback per such request."""
    for req in ({"op": "heartbeat", "client": "a", "floor": math.inf},
                {"op": "changes", "after": 0, "limit": -math.inf},
                {"op": "replica_start", "client": "r", "key": "k", "replicas": math.inf},
                {"op": "mount", "client": "a", "segment": "s", "base": math.inf, "size": 1 << 20},
                {"op": "put_start", "client": "r", "keys": ["k"], "sizes": [1],
                 "config": {"replicas": math.inf}},
                {"op": "put_start", "client": "r", "keys": ["k"], "sizes": [1],
                 "config": {"soft_pin_ttl_s": 1 << 1100}}):  # fmt: skip
        assert master.handle(req)["err"] == "INVALID", req


def test_a_bad_reserve_leaves_no_put_behind(master: Driver) -> None:
    """put_start read ``reserve`` (and hashed the sizes for it) after placing the puts: a bad one
    answered INVALID with the puts allocated, their keys taken until put_timeout_s."""
    for bad in ({"reserve": "many"}, {"reserve": [1]}):
        req = {"op": "put_start", "client": "r", "keys": ["k", "j"], "sizes": [4096, 4096], **bad}
        assert master.handle(req)["err"] == "INVALID", bad
        assert not master.m.objects and not master.m._pending and master.m.space.used == 0, bad
    _put(master, "k")  # the key is free
    req = {"op": "put_start", "client": "r", "keys": ["i", "j"], "sizes": [64, [1]], "reserve": 2}
    out = master.handle(req)
    assert [c for c, _ in out["results"]] == [None, "INVALID"] and "reserved" not in out  # the put answered


def test_a_bad_spill_report_leaves_the_task_and_its_object_as_they_were() -> None:
    """task_done ended the task (and, for a spill, its object's busy count) before reading the
    result: one that was not a map, or a spill's without its checksum, answered INVALID with the
    task gone and the object busy for good (never evicted again, removable only by force)."""
    m = Driver(Master(port=0))
    try:
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
        m.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 1 << 24})
        _put(m, "k", replicas=1, client="a")
        obj = m.m.objects["k"]
        m.m._spill(obj, m.m.clients["a"])
        (task,) = m.handle({"op": "heartbeat", "client": "a"})["tasks"]
        for result in ([[1]], "x", {}, {"checksum": 7}):
            req = {"op": "task_done", "client": "a", "task": task["task"], "ok": True, "result": result}
            assert m.handle(req)["err"] == "INVALID", result
            assert obj.busy == 1 and task["task"] in m.m._tasks and obj.ssd is None, result
        req.update(result={"checksum": "c"})
        assert m.handle(req)["accepted"] is True
        assert obj.busy == 0 and obj.ssd is not None and not m.m._tasks
    finally:
        m.stop()


def test_register_refuses_an_ssd_dir_or_host_id_that_is_not_a_string() -> None:
    """A spill's path is made of the client's ssd_dir: one of another type (bytes, a list) made
    every eviction round raise, in a request (after it had placed its puts: their space leaked)
    or in a tick, on the master's thread, which it ended."""
    m = Driver(Master(port=0))
    try:
        for bad in ({"ssd_dir": b"/nonexistent"}, {"ssd_dir": [1]}, {"host_id": 7}, {"host_id": None}):
            assert m.handle({"op": "register", "client": "a", **bad})["err"] == "INVALID", bad
            assert "a" not in m.m.clients and not m.m._ssd_clients
        assert m.handle({"op": "register", "client": "a", "ssd_dir": "/nonexistent"})["ok"]
    finally:
        m.stop()


def test_mount_refuses_a_segment_past_the_64_bit_address_space_or_without_a_name(master: Driver) -> None:
    """Addresses go on the wire as uint64: a segment reaching past 2**64 made every reply naming an
    address in it unencodable (a put placed there answered ERROR with its space taken)."""
    for bad in ({"base": (1 << 64) - 4096}, {"segment": 5}, {"segment": ""}, {"segment": None}):
        req = {"op": "mount", "client": "a", "segment": "seg-x", "base": 1 << 20, "size": 1 << 20, **bad}
        assert master.handle(req)["err"] == "INVALID", bad
        assert set(master.m.space.segments) == {"seg-a", "seg-b"}
    req = {"op": "mount", "client": "a", "segment": "seg-x", "base": (1 << 64) - (1 << 20), "size": 1 << 20}
    assert master.handle(req)["ok"]  # ends at 2**64: its last address is 2**64 - 1


def test_a_bad_replica_end_leaves_the_change_in_flight(master: Driver) -> None:
    """replica_end took the change off the caller's list before reading ``segments``: a bad one
    answered INVALID with the change forgotten, its object busy for good (never evicted, removable
    only by force) and its new replica's space held until the object went."""
    _put(master, "k", replicas=1)
    out = master.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 2})
    (dst,) = out["dst"]
    obj = master.m.objects["k"]
    for bad in (7, [[1]]):
        req = {"op": "replica_end", "client": "r", "key": "k", "gen": out["gen"], "ok": True, "segments": bad}
        assert master.handle(req)["err"] == "INVALID", bad
        assert obj.busy == 1 and [o for o, _ in master.m.clients["r"].changing.values()] == [obj]
    req.update(segments=[dst[0]])
    assert master.handle(req)["replicas"] == 2 and obj.busy == 0
    assert master.handle({"op": "remove", "client": "r", "keys": ["k"]})["results"] == [[None, None]]
    assert master.m.space.used == 0


def test_a_malformed_item_fails_alone_not_its_whole_batch(master: Driver) -> None:
    """A batch with a malformed item (an unhashable key, a short item, a generation that is a list)
    failed as a whole, INVALID, after the items before it had taken effect: a get's leases were
    taken (the objects unremovable until the leases expired) and commits, puts, removes done
    while the client was told the request failed. Now the bad item fails alone."""
    m = master.m
    _put(master, "k", replicas=1)
    out = master.handle({"op": "get", "client": "r", "keys": ["k", ["x"]]})
    assert [c for c, _ in out["results"]] == [None, "NOT_FOUND"]
    lease = [["k", out["results"][0][1]["gen"], out["results"][0][1]["lease"]]]
    assert master.handle({"op": "release", "client": "r", "leases": [*lease, 5, [["x"], 1, 0]]}) is not None
    assert m.objects["k"].readers == 0  # the good lease ended
    assert master.handle({"op": "remove", "client": "r", "keys": ["k", {"x": 1}]})["results"] == [
        [None, None], ["NOT_FOUND", "no object under key {'x': 1}"]]  # fmt: skip
    r = master.handle({"op": "put_start", "client": "r", "keys": ["p", "q"], "sizes": [64, 64], "reserve": 2})
    (gp, _, rp), (gq, _, rq) = (v for _, v in r["results"])
    items = [["p", gp, 1, [rp[0][0]]], ["q", gq], ["q", gq, 1, 5]]
    out = master.handle({"op": "put_end", "client": "r", "items": items, "epoch": r["epoch"]})
    assert [c for c, _ in out["results"]] == [None, "INVALID", "INVALID"] and m.objects["p"].committed
    master.handle({"op": "put_revoke", "client": "r", "items": [[gq, False], [[1], False], 3]})
    assert "q" not in m.objects
    (g1, _, _), (g2, _, _) = r["reserved"]
    items = [["r1", g1, 1], ["r2", [g2], 1], ["r2"]]
    out = master.handle({"op": "commit", "client": "r", "items": items, "epoch": r["epoch"]})
    assert [c for c, _ in out["results"]] == [None, "INVALID", "INVALID"] and m.objects["r1"].committed


def test_a_replicate_report_commits_only_its_own_replica(master: Driver) -> None:
    """A hot-key copy's report committed the object's uncommitted replica on a segment of the
    task's name, whoever's it was: after the segment was mounted again (the task's replica let go
    of), another client's copy into it was committed before that client wrote it."""
    m = master.m
    r = master.handle({"op": "put_start", "client": "r", "keys": ["k"], "sizes": [4096],
                       "config": {"preferred_segment": "seg-b"}})  # fmt: skip
    gen, _, reps = r["results"][0][1]
    master.handle({"op": "put_end", "client": "r", "items": [["k", gen, 7, ["seg-b"]]], "epoch": r["epoch"]})
    obj = m.objects["k"]
    m._replicate(obj, 1, time.monotonic())  # the hot-key policy: a copy into seg-a, by a
    (task,) = master.handle({"op": "heartbeat", "client": "a"})["tasks"]
    master.handle({"op": "unmount", "client": "a", "segment": "seg-a"})
    master.handle({"op": "mount", "client": "a", "segment": "seg-a", "base": 1 << 20, "size": 1 << 24})
    m._tick(time.monotonic())  # the old seg-a's replicas let go of
    out = master.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 2})
    assert [d[0] for d in out["dst"]] == ["seg-a"]  # r copies into the new seg-a
    master.handle({"op": "task_done", "client": "a", "task": task["task"], "ok": True, "result": {}})
    assert [(x.seg.name, x.committed) for x in obj.replicas] == [("seg-b", True), ("seg-a", False)]
    got = master.handle({"op": "get", "client": "r", "keys": ["k"]})["results"][0][1]
    assert [x[0] for x in got["replicas"]] == ["seg-b"]  # never the copy r has not written


def test_mount_refuses_a_segment_over_the_clients_own_memory(master: Driver) -> None:
    """A client's two segments over one memory (a buffer mounted twice under two names): objects
    placed in one were written over by objects placed in the other."""
    for base, size in ((1 << 20, 1 << 20), ((1 << 20) + (1 << 23), 1 << 24), (1 << 19, (1 << 19) + 64)):
        req = {"op": "mount", "client": "a", "segment": "seg-a2", "base": base, "size": size}
        assert master.handle(req)["err"] == "INVALID", (base, size)
    for cid, base in (("a", (1 << 20) + (1 << 24)), ("r", 1 << 20)):  # next to it; another process's
        req = {"op": "mount", "client": cid, "segment": f"seg-{cid}2", "base": base, "size": 1 << 20}
        assert master.handle(req)["ok"], cid


def test_a_refused_replica_change_keeps_the_replica_count(master: Driver) -> None:
    """replica_start recorded the count asked for before refusing a leased object (BUSY): the
    hot-key policy later shrank the object to a count its owner was told had not been set."""
    _put(master, "k", replicas=2)
    assert master.handle({"op": "get", "client": "ra", "keys": ["k"]})["results"][0][0] is None  # leased
    out = master.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 1})
    assert out["err"] == "BUSY" and master.m.objects["k"].base_replicas == 2


def test_a_replica_end_ends_its_own_copys_replicas_all_of_them_and_no_other(master: Driver) -> None:
    """A copy's end (replica_end, without a change id: an older client's) ends its own replicas
    only, whatever segments it names (not a hot-key copy's into the caller's segment, nor a
    second copy of its own: neither written yet), and all of them: the ones it does not name
    are taken back (they stayed unfinished for good, their space held, the object's replica
    count one too high)."""
    m = master.m
    master.handle({"op": "mount", "client": "ra", "segment": "seg-c", "base": 1 << 20, "size": 1 << 24})
    r = master.handle({"op": "put_start", "client": "r", "keys": ["k"], "sizes": [4096],
                       "config": {"preferred_segment": "seg-b"}})  # fmt: skip
    gen = r["results"][0][1][0]
    master.handle({"op": "put_end", "client": "r", "items": [["k", gen, 7, ["seg-b"]]], "epoch": r["epoch"]})
    obj = m.objects["k"]

    def state() -> list[tuple[str, bool]]:
        return sorted((x.seg.name, x.committed) for x in obj.replicas)

    def served() -> list[str]:
        got = master.handle({"op": "get", "client": "r", "keys": ["k"]})["results"][0][1]
        master.handle({"op": "release", "client": "r", "leases": [["k", got["gen"], got["lease"]]]})
        return sorted(x[0] for x in got["replicas"])

    # a hot-key copy into seg-a or seg-c (by its client), and that client's own copy of k meanwhile
    m._replicate(obj, 1, time.monotonic())
    ((cid, _, _),) = m._tasks.values()
    (task,) = master.handle({"op": "heartbeat", "client": cid})["tasks"]
    hot = task["dst"][0]
    out = master.handle({"op": "replica_start", "client": cid, "key": "k", "replicas": 3})
    (mine,) = [d[0] for d in out["dst"]]
    assert {hot, mine} == {"seg-a", "seg-c"}
    end = {"op": "replica_end", "client": cid, "key": "k", "gen": gen, "ok": True, "segments": [mine, hot]}
    assert master.handle(end)["replicas"] == 2
    assert state() == sorted([(mine, True), ("seg-b", True), (hot, False)])  # the task's: not written yet
    assert served() == sorted([mine, "seg-b"])
    master.handle({"op": "task_done", "client": cid, "task": task["task"], "ok": True, "result": {}})
    assert state() == [("seg-a", True), ("seg-b", True), ("seg-c", True)] and obj.busy == 0
    # two copies of k by r at once (k back on one segment): the first one's end names both segments
    assert master.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 1})["dst"] == []
    ((base, _),) = state()
    first = master.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 2})["dst"]
    second = master.handle({"op": "replica_start", "client": "r", "key": "k", "replicas": 3})["dst"]
    (s1,), (s2,) = [d[0] for d in first], [d[0] for d in second]
    end = {"op": "replica_end", "client": "r", "key": "k", "gen": gen, "ok": True, "segments": [s1, s2]}
    assert master.handle(end)["replicas"] == 2
    assert state() == sorted([(base, True), (s1, True), (s2, False)]) and obj.busy == 1
    assert served() == sorted([base, s1])
    # the second one ends naming none of its segments: its replica is taken back, not left behind
    used = m.space.used
    assert master.handle({**end, "segments": []})["replicas"] == 2
    assert state() == sorted([(base, True), (s1, True)]) and obj.busy == 0
    assert m.space.fenced == 1 and m.space.used == used  # fenced: r may still write into it


def test_a_commit_with_a_checksum_that_is_no_xxh3_64_is_refused_before_it_changes_anything(
    master: Driver,
) -> None:
    """put_end and commit recorded any checksum: one past 64 bits made every get reply naming the
    object unencodable (a batch get with it failed whole, the object unreadable for good), one of
    another type failed every read. Now the item is INVALID and its allocation stays pending."""
    m = master.m
    r = master.handle({"op": "put_start", "client": "r", "keys": ["k"], "sizes": [100 << 10], "reserve": 1})
    gen, verify, reps = r["results"][0][1]
    assert not verify  # no checksum needed: None is fine, a bad one is not
    ((rgen, _, _),) = r["reserved"]
    used = m.space.used
    for bad in (1 << 64, -1, "0123", 1.5, True, [7]):
        item = ["k", gen, bad, [x[0] for x in reps]]
        out = master.handle({"op": "put_end", "client": "r", "items": [item], "epoch": r["epoch"]})
        assert out["results"][0][0] == "INVALID", bad
        out = master.handle({"op": "commit", "client": "r", "items": [["j", rgen, bad]], "epoch": r["epoch"]})
        assert out["results"][0][0] == "INVALID", bad
        assert not m.objects["k"].committed and len(m.objects["k"].replicas) == len(reps)
        assert "j" not in m.objects and rgen in m._resv and m.space.used == used
    items = [["k", gen, (1 << 64) - 1, [x[0] for x in reps]]]
    out = master.handle({"op": "put_end", "client": "r", "items": items, "epoch": r["epoch"]})
    assert out["results"] == [[None, None]]
    out = master.handle({"op": "commit", "client": "r", "items": [["j", rgen, None]], "epoch": r["epoch"]})
    assert out["results"] == [[None, None]]
    assert m.objects["k"].checksum == (1 << 64) - 1 and m.objects["j"].committed


def _replica_on(m: Driver, key: str, seg: str, client: str = "r") -> tuple[list[Any], int]:
    """The replica of ``key`` on ``seg`` as a get reply names it, and the reply's epoch (the
    lease taken is released)."""
    reply = m.handle({"op": "get", "client": client, "keys": [key]})
    code, info = reply["results"][0]
    assert code is None
    m.handle({"op": "release", "client": client, "leases": [[key, info["gen"], info["lease"]]]})
    return next(rep for rep in info["replicas"] if rep[0] == seg), reply["epoch"]


def test_a_late_corrupt_report_leaves_a_new_replica_at_the_same_address(master: Driver) -> None:
    """Two readers found k's replica on seg-b bad. The first report drops it; once its range is
    free again, a hot-key copy puts k there again at the very same address; only then does the
    second reader's report come. It names the replica it read (the id its get reply gave), not
    this one: the new replica stays. Named by segment and address, the late report dropped it
    (lost the object were it its last). A report without an id (an older client) acts as before."""
    m = master.m
    m.space.quarantine_s = m.space.fence_hold_s = 0.0
    gen = _put(master, "k", size=200_000)
    (seg, addr, _, rid, mount), epoch = _replica_on(master, "k", "seg-b")
    bad = {"op": "report", "client": "r", "kind": "corrupt", "segment": "seg-b", "key": "k", "gen": gen,
           "addr": addr, "replica": rid, "mount": mount, "epoch": epoch}  # fmt: skip
    master.handle(bad)  # the first reader's report
    obj = m.objects["k"]
    assert [r.seg.name for r in obj.replicas] == ["seg-a"] and m.stats["replicas_corrupt"] == 1
    master.beat_storages()
    m.space.release(m._floor_of, time.monotonic() + 1)  # its range is free again
    m._replicate(obj, 1, time.monotonic())  # a hot-key copy onto seg-b, the only other segment
    (task,) = master.handle({"op": "heartbeat", "client": "b"})["tasks"]
    assert task["dst"] == ["seg-b", addr]  # the same address
    master.handle({"op": "task_done", "client": "b", "task": task["task"], "ok": True})
    new = _replica_on(master, "k", "seg-b")[0]
    assert new[:2] == [seg, addr] and new[3] != rid
    master.handle(bad)  # the second reader's report, late
    assert sorted(r.seg.name for r in obj.replicas if r.committed) == ["seg-a", "seg-b"]
    assert m.stats["replicas_corrupt"] == 1
    master.handle({**bad, "epoch": epoch + 1, "replica": new[3]})  # about another master's replica
    assert len(obj.replicas) == 2 and m.stats["replicas_corrupt"] == 1
    master.handle({**bad, "replica": new[3]})  # a report of the new replica drops it
    assert [r.seg.name for r in obj.replicas] == ["seg-a"] and m.stats["replicas_corrupt"] == 2
    old = {k: v for k, v in bad.items() if k not in ("replica", "mount", "epoch")}
    master.handle({**old, "segment": "seg-a", "addr": _replica_on(master, "k", "seg-a")[0][1]})
    assert "k" not in m.objects  # an older client's report, by address: its last replica went


def test_a_late_unreachable_report_leaves_the_segment_mounted_again(master: Driver) -> None:
    """A reader could not reach seg-b; its report comes only after seg-b was unmounted and mounted
    again (its client back with fresh memory). The report names the mount its get reply gave:
    the new mount is not demoted (served last, placed on last for client_ttl_s). It named the
    segment only and demoted the new mount. A report of the current mount, or without one (an
    older client), demotes it."""
    m = master.m
    _put(master, "k")
    (_, _, _, _, mount), epoch = _replica_on(master, "k", "seg-b")
    late = {"op": "report", "client": "r", "kind": "unreachable", "segment": "seg-b", "mount": mount,
            "epoch": epoch}  # fmt: skip
    master.handle({"op": "unmount", "client": "b", "segment": "seg-b"})
    master.handle({"op": "mount", "client": "b", "segment": "seg-b", "base": 1 << 30, "size": 1 << 24})
    seg = m.space.segments["seg-b"]
    assert seg.mount != mount
    master.handle(late)
    assert seg.reported_until == 0.0 and m.stats["segments_reported"] == 0
    master.handle({**late, "mount": seg.mount, "epoch": epoch + 1})  # another master's
    assert seg.reported_until == 0.0
    master.handle({**late, "mount": seg.mount})
    assert seg.reported_until > time.monotonic() and m.stats["segments_reported"] == 1
    seg.reported_until = 0.0
    master.handle({"op": "report", "client": "r", "kind": "unreachable", "segment": "seg-b"})
    assert seg.reported_until > time.monotonic()


def test_replies_that_grant_allocations_name_each_segments_mount(master: Driver) -> None:
    """put_start (its allocations and reservations), reserve and a commit that brings
    reservations name the mount of every segment they place a replica on (``mounts``, beside
    the grants: an older client ignores it), so that a failed write's report can name the mount
    it was granted; a segment mounted again has a new one."""
    m = master.m

    def mounts() -> dict[str, int]:
        return {name: seg.mount for name, seg in m.space.segments.items()}

    def segs(grants: list[Any]) -> set[str]:
        return {rep[0] for _, _, reps in grants for rep in reps}

    cfg = {"replicas": 2}
    r = master.handle({"op": "put_start", "client": "r", "keys": ["k"], "sizes": [4096], "config": cfg,
                       "reserve": 4})  # fmt: skip
    assert r["results"][0][0] is None and r["reserved"]
    assert segs([r["results"][0][1], *r["reserved"]]) == {"seg-a", "seg-b"} and r["mounts"] == mounts()
    master.handle({"op": "unmount", "client": "b", "segment": "seg-b"})
    master.handle({"op": "mount", "client": "b", "segment": "seg-b", "base": 1 << 30, "size": 1 << 24})
    assert mounts()["seg-b"] not in r["mounts"].values()
    r = master.handle({"op": "reserve", "client": "r", "size": 4096, "count": 2, "config": cfg})
    assert segs(r["reserved"]) == {"seg-a", "seg-b"} and r["mounts"] == mounts()
    gen = r["reserved"][0][0]
    c = master.handle({"op": "commit", "client": "r", "items": [["j", gen, 7]], "epoch": r["epoch"],
                       "reserve": 2, "size": 4096, "config": cfg})  # fmt: skip
    assert c["results"] == [[None, None]] and c["reserved"] and c["mounts"] == mounts()
