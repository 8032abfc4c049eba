"""Fuzzing the store master's request handler: realistic request sequences from a few clients, a
fraction of them mutated (a field dropped or of the wrong type, huge or negative numbers, another
client's generation, lease or task, duplicates, steps out of order), with the master's whole state
checked after every request and every tick.

What must hold: ``handle`` never raises and answers a map that goes on the wire; the periodic tick
never raises (it runs on the master's thread: an exception there ends the master); and the state
is consistent (:func:`check_invariants`): every allocation in a segment belongs to exactly one
replica, fence or hold, every replica's allocation is as big as its object, the counters match
what they count, and every object that is busy with a task or a replica copy has one in flight.
A request the master refuses must leave nothing of itself behind."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from typing import Any

import msgpack

from kvpool._rpc import pack, unpack
from kvpool.store.master import Master
from kvpool.store.objects import Obj

CODES = {"INVALID", "NOT_FOUND", "EXISTS", "BUSY", "FULL", "STALE", "TOO_LARGE", "UNKNOWN_CLIENT", "ERROR"}


class Conn:
    """What the master sees of a connection: the session state it binds a client to."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}


def _all_objs(m: Master) -> set[Obj]:
    objs: set[Obj] = set(m._resv.values()) | set(m._pending.values())
    for shard in m.objects._d:
        objs.update(shard.values())
    for seg in m.space.segments.values():
        objs.update(seg.objs)
    return objs


def check_invariants(m: Master) -> None:
    """Assert that the master's records agree with each other (see the module docstring)."""
    sp = m.space
    objs = _all_objs(m)
    # -- keys and pending puts
    n_keys = 0
    for shard in m.objects._d:
        for key, obj in shard.items():
            n_keys += 1
            assert obj.key == key, (key, obj.key)
            assert obj.committed or m._pending.get(obj.gen) is obj, f"uncommitted {key!r} is not pending"
    assert n_keys == len(m.objects)
    # -- ids: a replica's (reports name it) and a mount's are the master's only one of that id
    rids = [r.id for o in objs for r in o.replicas]
    assert len(set(rids)) == len(rids) and 0 not in rids, "two replicas share an id"
    mounts = [s.mount for s in sp.segments.values()]
    assert len(set(mounts)) == len(mounts) and 0 not in mounts, "two mounts share an id"
    assert m.n_committed == sum(o.committed for o in objs if o.key is not None and m.objects.get(o.key) is o)
    for gen, obj in m._pending.items():
        assert obj.gen == gen and not obj.committed
        assert (obj.key is None and m._resv.get(gen) is obj) or (
            obj.key is not None and m.objects.get(obj.key) is obj
        ), f"pending {gen} is neither a reservation nor a key's put"
        owner = m.clients.get(obj.owner)
        assert owner is None or obj in owner.pending
    for gen, obj in m._resv.items():
        assert obj.key is None and obj.gen == gen and m._pending.get(gen) is obj
    for cl in m.clients.values():
        for obj in cl.pending:
            assert m._pending.get(obj.gen) is obj, f"client {cl.id} holds a pending put the master forgot"
    # -- replicas and the space they own
    owned: dict[tuple[int, int], str] = {}

    def own(seg: Any, off: int, what: str) -> None:
        k = (id(seg), off)
        assert k not in owned, f"allocation {seg.name}+{off} owned twice: {owned[k]} and {what}"
        assert off in seg.alloc, f"{what}: offset {off} of {seg.name} is not allocated"
        owned[k] = what

    obj_bytes = 0
    for obj in objs:
        assert obj.readers >= 0 and obj.busy >= 0, (obj.key, obj.readers, obj.busy)
        assert sum(obj.holders.values()) == obj.readers, (obj.key, obj.holders, obj.readers)
        assert all(n > 0 for n in obj.holders.values())
        assert len({id(r.seg) for r in obj.replicas}) == len(obj.replicas), (
            f"{obj.key}: two replicas on a segment"
        )
        obj_bytes += obj.size * len(obj.replicas)
        for r in obj.replicas:
            if r.seg.dead:
                continue
            assert sp.segments.get(r.seg.name) is r.seg, f"{obj.key}: replica on a forgotten segment"
            assert obj in r.seg.objs
            own(r.seg, r.offset, f"replica of {obj.key!r}/{obj.gen}")
            assert r.seg.alloc.size_of(r.offset) >= obj.alloc_size, f"{obj.key}: allocation too small"
            assert r.offset + obj.alloc_size <= r.seg.size
            if not r.committed and obj.committed:
                assert r.writer, f"{obj.key}: uncommitted replica of a committed object without a writer"
        if obj.committed:
            assert m._pending.get(obj.gen) is not obj
            assert isinstance(obj.key, str) and obj.key
    assert obj_bytes == m.obj_bytes, (obj_bytes, m.obj_bytes)
    n_fences = 0
    for fences in sp._fences.values():
        for f in fences:
            n_fences += 1
            assert not f.seg.dead
            own(f.seg, f.offset, f"fence of {f.client}/{f.gen}")
    for _, _, seg, off in sp._holds:
        if not seg.dead:
            own(seg, off, "hold")
    assert sp.fenced == n_fences + len(sp._holds), (sp.fenced, n_fences, len(sp._holds))
    used = 0
    for name, seg in sp.segments.items():
        assert seg.name == name and not seg.dead
        mine = {off for (sid, off) in owned if sid == id(seg)}
        assert mine == set(seg.alloc._alloc), (
            f"{name}: allocations nobody owns: {set(seg.alloc._alloc) - mine}"
        )
        assert seg.alloc.used_bytes == sum(seg.alloc._alloc.values())
        used += seg.alloc.used_bytes
        assert seg.alloc.used_bytes <= seg.size
        cl = m.clients.get(seg.client)
        assert cl is not None and name in cl.segments, f"segment {name} of a gone client"
        for obj in seg.objs:
            assert any(r.seg is seg for r in obj.replicas), f"{name} lists {obj.key} without a replica"
        assert seg.base > 0 and seg.base + seg.size <= 1 << 64
    assert used == sp.used, (used, sp.used)
    assert sp.capacity == sum(s.size for s in sp.segments.values())
    for cl in m.clients.values():
        for name in cl.segments:
            assert name in sp.segments and sp.segments[name].client == cl.id
        mine = sorted((sp.segments[n].base, sp.segments[n].size) for n in cl.segments)
        for (b1, s1), (b2, _) in zip(mine, mine[1:], strict=False):
            assert b1 + s1 <= b2, f"{cl.id}'s segments overlap"
    # -- LRU: committed objects in the key table, each once
    in_lru = 0
    for name, chain in m.lru.lists.items():
        o, n = chain.head, 0
        while o is not None:
            n += 1
            assert o.lru == name and o.committed and m.objects.get(o.key or "") is o, f"LRU holds {o.key}"
            o = o.lru_next
        assert n == chain.n
        in_lru += n
    for obj in m._ssd_only:
        assert obj.committed and obj.ssd is not None and obj.lru is None
    # -- tasks and replica changes: every busy object has that many in flight
    busy: Counter[int] = Counter()
    for tid, (cid, task, _) in m._tasks.items():
        cl = m.clients.get(cid)
        assert cl is not None and tid in cl.task_ids, f"task {tid} of a gone client"
        obj = m.objects.get(task.get("key", ""))
        if obj is not None and obj.gen == task.get("gen"):
            busy[id(obj)] += 1
    # each copy in flight (a task's, a replica change's) owns its replicas: only its own end
    # commits them, so none is committed yet, and none is two copies' (one's end would commit
    # the other's before it was written); an unfinished replica of a committed object is a copy's
    copying: dict[int, str] = {}

    def copy_into(r: Any, what: str) -> None:
        assert id(r) not in copying, f"replica on {r.seg.name} is {copying[id(r)]}'s and {what}'s"
        copying[id(r)] = what

    for tid, (_, _, dst) in m._tasks.items():
        if dst is not None:
            copy_into(dst, f"task {tid}")
    for cl in m.clients.values():
        assert cl.task_ids <= set(m._tasks), f"{cl.id} waits for tasks the master forgot"
        for cid_, (obj, mine) in cl.changing.items():
            busy[id(obj)] += 1
            for r in mine:
                copy_into(r, f"{cl.id}'s change {cid_} of {obj.key}")
    for obj in objs:
        for r in obj.replicas:
            if id(r) in copying:
                assert not r.committed, f"{obj.key}: {copying[id(r)]} in flight, its replica committed"
            elif obj.committed and not r.committed and not r.seg.dead:
                raise AssertionError(f"{obj.key}: unfinished replica on {r.seg.name} that no copy fills")
    for obj in objs:
        if obj.key is not None and m.objects.get(obj.key) is obj:
            assert obj.busy == busy[id(obj)], f"{obj.key}: busy {obj.busy}, {busy[id(obj)]} in flight"


def state_of(m: Master) -> tuple[Any, ...]:
    """What a refused request must leave as it was (lease counts are compared by :func:`same`:
    a lease that expired meanwhile may be written off by any request)."""
    objs = sorted(
        (
            o.key or "",
            o.gen,
            o.committed,
            len(o.replicas),
            o.busy,
            o.ssd is not None,
            o.base_replicas,
            o.lease_until,
            o.readers,
        )
        for o in _all_objs(m)
    )
    segs = sorted(map(str, m.space.segments))
    return (m.space.used, m.space.fenced, len(m._pending), sorted(m.clients), segs, sorted(m._tasks), objs)


def same(before: tuple[Any, ...], after: tuple[Any, ...], now: float) -> bool:
    def live(state: tuple[Any, ...]) -> tuple[Any, ...]:
        *rest, objs = state
        return (*rest, [(*o[:7], o[8] if o[7] > now else 0) for o in objs])

    return live(before) == live(after)


# ---------------------------------------------------------------------- the fuzzer
BAD = [None, -1, 0, -(1 << 63), (1 << 64) - 1, math.inf, -math.inf, math.nan, "", "x", b"\x00", [], [[1]],
       {"a": 1}, True, 1.5, [None, None, None, None]]  # fmt: skip


class Fuzzer:
    """Clients a, b (storage: a segment each, b with an SSD directory) and r (a reader that puts
    too), each on its own connection, sending requests about what the master told them."""

    def __init__(self, seed: int, p_bad: float = 0.3) -> None:
        self.rng = random.Random(seed)
        self.p_bad = p_bad
        self.m = Master(
            port=0, lease_ttl_ms=40, put_timeout_s=0.3, quarantine_s=0.05, fence_hold_s=0.2,
            task_timeout_s=0.3, client_ttl_s=5.0, hot_key_replication=True, hot_interval_s=0.05,
            hot_window_s=0.2, max_batch=16, evict_batch=16,
        )  # fmt: skip
        self.conns = {c: Conn() for c in ("a", "b", "r")}
        self.epoch = self.m.incarnation
        self.keys = [f"k{i}" for i in range(16)]
        self.puts: list[tuple[str, str, int, list[str]]] = []  # client, key, gen, segments
        self.resv: list[tuple[str, int, list[str]]] = []  # client, gen, segments
        self.leases: list[tuple[str, list[Any]]] = []  # client, [key, gen, lease]
        self.tasks: list[tuple[str, dict[str, Any]]] = []
        self.changes: list[tuple[str, str, int, list[str], Any]] = []  # client, key, gen, segments, id
        self.gens: list[int] = []
        self.seen: list[tuple[str, int, list[Any], int]] = []  # key, gen, replica, epoch of get replies
        self.segs = {"a": "seg-a", "b": "seg-b", "r": "seg-r"}  # three: two copies of one object at once
        self.failures: list[str] = []
        self.tokens: dict[str, bytes] = {}
        self.n = Counter[str]()

    # -------------------------------------------------------------- sending
    def send(self, cid: str, req: dict[str, Any], mutate: bool = True) -> dict[str, Any] | None:
        if mutate and self.rng.random() < self.p_bad:
            req = self.mutate(req)
        try:
            req = unpack(pack(req))  # what the wire can carry
        except (msgpack.PackException, OverflowError, TypeError, ValueError):
            return None
        conn = self.conns[cid] if self.rng.random() > 0.02 else self.conns[self.rng.choice("abr")]
        before = state_of(self.m) if "release" not in req else None
        try:
            out = self.m.handle(req, conn)
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            self.fail(f"handle raised {exc!r} on {req!r}")
            return None
        self.n[f"{req.get('op')}:{out.get('err') if out else None}"] += 1
        if not isinstance(out, dict) or not isinstance(out.get("ok"), bool):
            self.fail(f"bad reply {out!r} to {req!r}")
            return None
        if not out["ok"] and out.get("err") not in CODES:
            self.fail(f"unknown error code in {out!r}")
        try:
            pack(out)
        except Exception as exc:  # noqa: BLE001 - the server would answer ERROR, the state kept
            self.fail(f"unencodable reply {exc!r} to {req!r}")
        self.check(req)
        if out["ok"] and req.get("op") == "get" and isinstance(req.get("keys"), list):
            self.check_get(req["keys"], out["results"])
        if not out["ok"] and before is not None and not same(before, state_of(self.m), time.monotonic()):
            self.fail(f"refused request changed the state: {out['err']} {req!r}")
        if out.get("err") == "UNKNOWN_CLIENT" and req.get("op") != "attach" and self.rng.random() < 0.5:
            self.register(cid)  # as a client told so does
        return out if out["ok"] else None

    def check(self, what: Any) -> None:
        try:
            check_invariants(self.m)
        except AssertionError as exc:
            self.fail(f"invariant broken after {what!r}: {exc}")

    def check_get(self, keys: list[Any], results: list[list[Any]]) -> None:
        """Every replica a get names is a committed copy of that object, in a live segment."""
        for key, (code, info) in zip(keys, results, strict=True):
            if code is not None:
                continue
            obj = self.m.objects.get(key)
            if obj is None or obj.gen != info["gen"] or not obj.committed:
                self.fail(f"get of {key!r} named generation {info['gen']}, not the object under it")
                return
            for seg, addr, _, rid, mount in info["replicas"]:
                if not any(r.seg.name == seg and r.addr == addr and r.committed and not r.seg.dead
                           and r.id == rid and r.seg.mount == mount for r in obj.replicas):  # fmt: skip
                    self.fail(f"get of {key!r} named {seg}+{addr} (replica {rid}, mount {mount}), "
                              "no committed replica of it")  # fmt: skip

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        raise _Stop(msg)

    def mutate(self, req: dict[str, Any]) -> dict[str, Any]:
        rng = self.rng
        req = dict(req)
        fields = [k for k in req if k != "op"]
        kind = rng.randrange(6)
        if kind == 0 and fields:
            del req[rng.choice(fields)]
        elif kind == 1 and fields:
            req[rng.choice(fields)] = rng.choice(BAD)
        elif kind == 2:  # one element of a list field, or a field inside a list item
            lists = [k for k in fields if isinstance(req[k], list) and req[k]]
            if lists:
                f = rng.choice(lists)
                items = list(req[f])
                i = rng.randrange(len(items))
                if isinstance(items[i], list) and items[i] and rng.random() < 0.7:
                    item = list(items[i])
                    j = rng.randrange(len(item))
                    item[j] = rng.choice(BAD + self.gens[-5:] + ["seg-a", "seg-b"])
                    if rng.random() < 0.2:
                        item = item[:-1] if rng.random() < 0.5 else [*item, 1]
                    items[i] = item
                else:
                    items[i] = rng.choice(BAD)
                req[f] = items
        elif kind == 3:  # another client's (or a forgotten) generation, key or segment
            for f, pool in (("gen", self.gens), ("key", self.keys), ("segment", ["seg-a", "seg-b", "seg-r"])):
                if f in req and pool:
                    req[f] = rng.choice(pool)
        elif kind == 4:
            req["client"] = rng.choice(["a", "b", "r", "ghost"])
        else:
            field = rng.choice(["config", "reserve", "epoch", "release", "force", "floor", "segments"])
            req[field] = rng.choice(
                [*BAD, {"replicas": rng.choice(BAD)}, {"preferred_segment": rng.choice(BAD)},
                 {"soft_pin_ttl_s": rng.choice(BAD)}, {"cache_class": rng.choice(BAD)}]
            )  # fmt: skip
        return req

    # -------------------------------------------------------------- the clients' steps
    def setup(self) -> None:
        for cid in ("a", "b", "r"):
            self.register(cid)

    def register(self, cid: str) -> None:
        """A fresh session on the client's own connection (then its segment), or on a new one."""
        if self.rng.random() < 0.1:
            self.conns[cid] = Conn()
        ssd = "/nonexistent/kvpool-fuzz" if cid == "b" else None
        out = self.send(cid, {"op": "register", "client": cid, "host_id": f"h-{cid}", "ssd_dir": ssd})
        if out is None:
            return
        self.tokens[cid] = out["token"]
        if cid in self.segs:
            size = self.rng.choice([1 << 16, 1 << 17])
            self.send(
                cid, {"op": "mount", "client": cid, "segment": self.segs[cid], "base": 1 << 30, "size": size}
            )

    def step(self) -> None:
        rng = self.rng
        cid = rng.choice("abr")
        op = rng.choices(
            ["put", "put_end", "revoke", "reserve", "commit", "get", "release", "exists", "remove", "replica",
             "replica_end", "promote", "heartbeat", "task_done", "report", "unmount", "register",
             "unregister", "changes", "info", "remove_all", "tick", "stats", "attach", "die"],
            [10, 10, 2, 3, 5, 10, 6, 2, 4, 6, 5, 2, 8, 6, 2, 0.5, 0.5, 0.3, 1, 1, 0.2, 6, 0.3, 0.5, 0.3],
        )[0]  # fmt: skip
        getattr(self, f"do_{op}")(cid)

    def _size(self) -> int:
        return self.rng.choice([1, 100, 4000, 9000, 30000, 70000])

    def _cfg(self) -> dict[str, Any]:
        return {"replicas": self.rng.choice([1, 1, 2, 3]),
                "cache_class": self.rng.choice(["default", "default", "ephemeral", "persistent"]),
                "soft_pin": self.rng.random() < 0.2}  # fmt: skip

    def do_put(self, cid: str) -> None:
        rng = self.rng
        n = rng.choice([1, 1, 2, 4])
        keys = rng.sample(self.keys, n)
        size = self._size()
        sizes = [size] * n if rng.random() < 0.5 else [self._size() for _ in keys]
        req = {"op": "put_start", "client": cid, "keys": keys, "sizes": sizes, "config": self._cfg()}
        if rng.random() < 0.3:
            req["reserve"] = rng.choice([1, 4])
        out = self.send(cid, req)
        if out is None:
            return
        for key, (code, val) in zip(keys, out["results"], strict=False):
            if code is None:
                self.gens.append(val[0])
                self.puts.append((cid, key, val[0], [s for s, _ in val[2]]))
        for gen, _, reps in out.get("reserved", []):
            self.gens.append(gen)
            self.resv.append((cid, gen, [s for s, _ in reps]))
        self._granted(out, [val for code, val in out["results"] if code is None] + out.get("reserved", []))

    def _granted(self, out: dict[str, Any] | None, grants: list[Any]) -> None:
        """A reply that grants allocations names the mount of each segment they are on, the one
        there now (nothing ran since), and of no other: a writer's report names it."""
        segs = {rep[0] for _, _, reps in grants for rep in reps}
        named = (out or {}).get("mounts")
        if segs and named != {s: self.m.space.segments[s].mount for s in segs}:
            self.fail(f"a reply granting allocations on {sorted(segs)} named mounts {named}")

    def _pop(self, items: list[Any], cid: str) -> Any:
        mine = [i for i, x in enumerate(items) if x[0] == cid or self.rng.random() < 0.05]
        return items.pop(self.rng.choice(mine)) if mine else None

    def do_put_end(self, cid: str) -> None:
        got = self._pop(self.puts, cid)
        if got is None:
            return
        _, key, gen, segs = got
        written = segs if self.rng.random() < 0.8 else segs[:-1]
        item = [key, gen, self.rng.getrandbits(64), written]
        self.send(cid, {"op": "put_end", "client": cid, "items": [item], "epoch": self.epoch})
        if self.rng.random() < 0.1:
            self.send(cid, {"op": "put_end", "client": cid, "items": [item], "epoch": self.epoch})  # twice

    def do_revoke(self, cid: str) -> None:
        got = self._pop(self.puts, cid) or self._pop(self.resv, cid)
        if got is not None:
            self.send(cid, {"op": "put_revoke", "client": cid, "items": [[got[-2], self.rng.random() < 0.5]],
                            "epoch": self.epoch})  # fmt: skip

    def do_reserve(self, cid: str) -> None:
        out = self.send(
            cid, {"op": "reserve", "client": cid, "size": self._size(), "count": 3, "config": self._cfg()}
        )
        for gen, _, reps in (out or {}).get("reserved", []):
            self.gens.append(gen)
            self.resv.append((cid, gen, [s for s, _ in reps]))
        self._granted(out, (out or {}).get("reserved", []))

    def do_commit(self, cid: str) -> None:
        items = []
        for _ in range(self.rng.choice([1, 2])):
            got = self._pop(self.resv, cid)
            if got is not None:
                items.append([self.rng.choice(self.keys), got[1], self.rng.getrandbits(64)])
        if not items:
            return
        req: dict[str, Any] = {"op": "commit", "client": cid, "items": items, "epoch": self.epoch}
        if self.rng.random() < 0.4:
            req.update(reserve=2, size=self._size(), config=self._cfg())
        out = self.send(cid, req)
        for gen, _, reps in (out or {}).get("reserved", []):
            self.gens.append(gen)
            self.resv.append((cid, gen, [s for s, _ in reps]))
        self._granted(out, (out or {}).get("reserved", []))

    def do_get(self, cid: str) -> None:
        keys = self.rng.sample(self.keys, self.rng.choice([1, 3]))
        req: dict[str, Any] = {"op": "get", "client": cid, "keys": keys}
        got = self._pop(self.leases, cid) if self.rng.random() < 0.3 else None
        if got is not None:
            req["release"] = [got[1]]  # a lease ended, piggy-backed on the next request
        out = self.send(cid, req)
        for key, (code, info) in zip(keys, (out or {}).get("results", []), strict=False):
            if code is None:
                self.leases.append((cid, [key, info["gen"], info["lease"]]))
                self.seen += [(key, info["gen"], rep, out["epoch"]) for rep in info["replicas"]]  # type: ignore[index]
                del self.seen[:-64]
                if info["ssd"] is not None and self.rng.random() < 0.3:
                    self.send(cid, {"op": "report", "client": cid, "segment": "", "kind": "ssd_corrupt",
                                    "key": key, "gen": info["gen"], "path": info["ssd"][0]})  # fmt: skip
                elif info["ssd"] is not None and self.rng.random() < 0.2:
                    self._report_unreadable(cid, key, info["gen"], info["ssd"][0])

    def _report_unreadable(self, cid: str, key: str, gen: int, path: str) -> None:
        """An ``ssd_unreadable`` report (its client's check could not open the file): it drops
        that SSD copy when ``cid`` is the copy's own client and the copy is still that file;
        from any other client it changes nothing."""
        obj = self.m.objects.get(key)
        copy = obj.ssd if obj is not None else None
        own = copy is not None and obj.gen == gen and copy.path == path and copy.client == cid  # type: ignore[union-attr]
        req = {"op": "report", "client": cid, "segment": "", "kind": "ssd_unreadable", "key": key, "gen": gen,
               "path": path}  # fmt: skip
        if self.send(cid, req, mutate=False) is None or obj is None:
            return
        if own and obj.ssd is not None:
            self.fail(f"{cid}'s ssd_unreadable report of its own copy of {key!r} did not drop it")
        if not own and obj.ssd is not copy:
            self.fail(f"{cid}'s ssd_unreadable report of {key!r} (a copy of another client) dropped it")

    def do_release(self, cid: str) -> None:
        got = self._pop(self.leases, cid)
        if got is not None:
            self.send(cid, {"op": "release", "client": cid, "leases": [got[1]]})

    def do_exists(self, cid: str) -> None:
        self.send(cid, {"op": "exists", "client": cid, "keys": self.rng.sample(self.keys, 3)})

    def do_remove(self, cid: str) -> None:
        self.send(cid, {"op": "remove", "client": cid, "keys": self.rng.sample(self.keys, 2),
                        "force": self.rng.random() < 0.3})  # fmt: skip

    def do_remove_all(self, cid: str) -> None:
        self.send(cid, {"op": "remove_all", "client": cid})

    def do_replica(self, cid: str) -> None:
        held = [k for k in self.keys if (o := self.m.objects.get(k)) is not None and o.committed]
        key = self.rng.choice(held if held and self.rng.random() < 0.7 else self.keys)
        busy = [c[1] for c in self.changes if c[0] == cid] + [t["key"] for c, t in self.tasks if c == cid
                                                              and t["type"] == "replicate"]  # fmt: skip
        if busy and self.rng.random() < 0.5:
            key = self.rng.choice(busy)  # a second copy of an object this client is copying already
        out = self.send(
            cid, {"op": "replica_start", "client": cid, "key": key, "replicas": self.rng.choice([1, 2, 3])}
        )
        if out and out.get("dst"):
            self.changes.append((cid, key, out["gen"], [s for s, _ in out["dst"]], out.get("change")))

    def do_promote(self, cid: str) -> None:
        key = self.rng.choice(self.keys)
        info = self.send(cid, {"op": "info", "client": cid, "key": key}, mutate=False)
        if info and info["ssd"]:
            out = self.send(cid, {"op": "promote_start", "client": cid, "key": key, "gen": info["gen"]})
            if out and out.get("dst"):
                self.changes.append((cid, key, out["gen"], [s for s, _ in out["dst"]], out.get("change")))

    def do_replica_end(self, cid: str) -> None:
        got = self._pop(self.changes, cid)
        if got is not None:
            _, key, gen, segs, change = got
            if self.rng.random() < 0.2:  # segments of another copy in flight (or none at all)
                segs = segs[1:] + self.rng.choice([[], list(self.segs.values())])
            req = {"op": "replica_end", "client": cid, "key": key, "gen": gen, "ok": self.rng.random() < 0.7,
                   "segments": segs}  # fmt: skip
            if self.rng.random() < 0.7:
                req["change"] = change  # else as an older client ends it: its first copy of key, gen
            self.send(cid, req)

    def do_heartbeat(self, cid: str) -> None:
        out = self.send(cid, {"op": "heartbeat", "client": cid, "floor": max(self.gens[-50:], default=0) + 1
                              if self.rng.random() < 0.5 else 0})  # fmt: skip
        if out is None:
            return
        if out.get("reregister"):
            self.register(cid)
        self.tasks += [(cid, t) for t in out["tasks"] if t["type"] != "unlink"]

    def do_task_done(self, cid: str) -> None:
        got = self._pop(self.tasks, cid)
        if got is None:
            return
        ok = self.rng.random() < 0.7
        result = {"checksum": "0" * 16} if ok and got[1]["type"] == "spill" else {}
        if not ok and self.rng.random() < 0.3:
            result = {"disk_error": "ENOSPC"}
        self.send(cid, {"op": "task_done", "client": cid, "task": got[1]["task"], "ok": ok, "result": result,
                        "epoch": got[1]["epoch"]})  # fmt: skip

    def do_report(self, cid: str) -> None:
        on_ssd = [(k, o) for k in self.keys if (o := self.m.objects.get(k)) is not None and o.ssd is not None]
        if on_ssd and self.rng.random() < 0.3:  # half the time a copy of this client's (its check)
            mine = [(k, o) for k, o in on_ssd if o.ssd.client == cid]  # type: ignore[union-attr]
            key, obj = self.rng.choice(mine if mine and self.rng.random() < 0.5 else on_ssd)
            self._report_unreadable(cid, key, obj.gen, obj.ssd.path)  # type: ignore[union-attr]
            return
        if self.seen and self.rng.random() < 0.6:
            self._report_seen(cid, *self.rng.choice(self.seen))
            return
        key = self.rng.choice(self.keys)
        info = self.send(cid, {"op": "info", "client": cid, "key": key}, mutate=False)
        if info and info["replicas"]:
            seg = self.rng.choice(info["replicas"])[0]
            kind = self.rng.choice(["corrupt", "unreachable"])
            self.send(cid, {"op": "report", "client": cid, "segment": seg, "kind": kind, "key": key,
                            "gen": info["gen"]})  # fmt: skip

    def _report_seen(self, cid: str, key: str, gen: int, rep: list[Any], epoch: int) -> None:
        """A report about a replica a get reply named (maybe long ago): it drops that replica or
        none, and demotes that mount of its segment or none."""
        seg, addr, _, rid, mount = rep
        kind = self.rng.choice(["corrupt", "unreachable"])
        obj = self.m.objects.get(key)
        before = {r.id for r in obj.replicas if r.committed} if obj is not None else set()
        live = self.m.space.segments.get(seg)
        until = live.reported_until if live is not None else 0.0
        req = {"op": "report", "client": cid, "segment": seg, "kind": kind, "key": key, "gen": gen,
               "addr": addr, "replica": rid, "mount": mount, "epoch": epoch}  # fmt: skip
        self.send(cid, req, mutate=False)
        after = {r.id for r in obj.replicas if r.committed} if obj is not None else set()
        if not before - after <= {rid}:
            self.fail(f"a report of replica {rid} of {key!r} dropped replicas {before - after}")
        if live is not None and live.mount != mount and live.reported_until != until:
            self.fail(f"a report of mount {mount} of {seg} demoted mount {live.mount}")

    def do_unmount(self, cid: str) -> None:
        if cid in self.segs:
            self.send(cid, {"op": "unmount", "client": cid, "segment": self.segs[cid]})
            self.send(cid, {"op": "mount", "client": cid, "segment": self.segs[cid], "base": 1 << 30,
                            "size": 1 << 16})  # fmt: skip

    def do_register(self, cid: str) -> None:
        self.register(cid)

    def do_die(self, cid: str) -> None:
        """The client is declared dead (what a tick does to one silent for client_ttl_s)."""
        with self.m._lock:
            self.m._remove_client(cid)
        self.check(f"{cid} declared dead")

    def do_attach(self, cid: str) -> None:
        """Another connection of the client joins its session (then the client uses that one)."""
        conn, self.conns[cid] = self.conns[cid], Conn()
        if self.send(cid, {"op": "attach", "client": cid, "token": self.tokens.get(cid, b"")}) is None:
            self.conns[cid] = conn

    def do_unregister(self, cid: str) -> None:
        self.send(cid, {"op": "unregister", "client": cid, "floor": 0})
        self.register(cid)

    def do_changes(self, cid: str) -> None:
        if self.rng.random() < 0.5:
            self.send(cid, {"op": "changes", "after": self.rng.randrange(-1, 50), "incarnation": self.epoch})
        else:
            self.send(cid, {"op": "changes", "cursor": [0, 0, 0], "limit": 10})

    def do_info(self, cid: str) -> None:
        self.send(cid, {"op": "info", "key": self.rng.choice(self.keys)})

    def do_stats(self, cid: str) -> None:
        self.send(cid, {"op": "stats"})

    def do_tick(self, cid: str) -> None:
        time.sleep(self.rng.choice([0, 0, 0.01, 0.05]))
        try:
            self.m._on_tick()
        except Exception as exc:  # noqa: BLE001 - on the master's thread this ends the master
            self.fail(f"tick raised {exc!r}")
        self.check("tick")

    def run(self, steps: int, budget_s: float) -> None:
        end = time.monotonic() + budget_s
        try:
            self.setup()
            for i in range(steps):
                if i % 64 == 0 and time.monotonic() > end:
                    break
                self.step()
        except _Stop:
            pass
        finally:
            self.m.stop()


class _Stop(Exception):
    pass


def test_master_fuzz_keeps_its_state_consistent() -> None:
    """Two fixed seeds, about a thousand requests each, a third of them mutated: the handler never
    raises, ticks never raise, a refused request changes nothing, and the state is consistent
    after every request (``python tests/test_store_master_fuzz.py SEEDS STEPS`` runs longer)."""
    seen: Counter[str] = Counter()
    for seed in (1, 2):
        f = Fuzzer(seed)
        f.run(steps=1200, budget_s=2.0)
        assert not f.failures, f"seed {seed}: {f.failures[0]}"
        seen += f.n
    # the sequences got far enough to exercise the handlers
    assert seen["put_end:None"] > 20 and seen["get:None"] > 100 and seen["commit:None"] > 2, seen
    assert sum(v for k, v in seen.items() if k.endswith(":None")) > 1000, seen


if __name__ == "__main__":  # a longer run: python tests/test_store_master_fuzz.py [seeds] [steps]
    import sys

    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    found: Counter[str] = Counter()
    for s in range(seeds):
        fz = Fuzzer(s)
        fz.run(steps, budget_s=30.0)
        for msg in fz.failures:
            found[msg[:160]] += 1
            print(f"seed {s}: {msg[:2000]}")
    print(f"{sum(found.values())} failures in {seeds} seeds")
