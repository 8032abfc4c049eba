"""Store master: object metadata, allocation, leases, eviction, replicas, liveness, metrics.

The master never touches object bytes. Put is two-phase: ``put_start`` allocates replicas (each
allocation carries the master's epoch and a fresh generation), the client writes header + value
through the transfer engine, and the same client commits (``put_end``, or ``commit`` for a
reservation) naming that generation. A get takes a lease that keeps the object's space from being
freed while the client reads it; the client checks the object's header after the bytes landed.
Work that moves bytes on the master's behalf (hot-key replication, SSD spills) is handed to
storage clients as tasks in their heartbeat replies.

Every request does bounded work (``max_batch`` keys at most, eviction a bounded number of objects
at a time, a dead segment's objects let go of a few thousand per tick), gauges are kept as
counters, and a master that was itself stalled (busy, or stopped) gives every client a fresh
``client_ttl_s`` before judging it dead.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import random
import threading
import time
from collections import Counter, OrderedDict
from typing import Any

from kvpool._rpc_server import RpcLimits, RpcServer
from kvpool.config import MasterConfig
from kvpool.store.changes import ChangeLog, ChangeOps
from kvpool.store.client_ops import ClientOps
from kvpool.store.layout import CHECKSUM_ALWAYS_MAX, HEADER_SIZE
from kvpool.store.objects import (
    ClassLru,
    Client,
    KeyTable,
    MasterError,
    Obj,
    Placement,
    Replica,
    Segment,
)
from kvpool.store.ops import ObjectOps
from kvpool.store.space import Space
from kvpool.store.upkeep import SLOW_EVERY_S, Upkeep

log = logging.getLogger("kvpool.master")

_Err = MasterError


class Master(ObjectOps, ClientOps, ChangeOps, Upkeep):
    """The store master. ``start()`` serves in a background thread; ``serve_forever()`` in this one."""

    def __init__(self, config: MasterConfig | None = None, **kwargs: Any) -> None:
        self.config = config.replace(**kwargs) if config is not None else MasterConfig(**kwargs)
        c = self.config
        self.incarnation = random.getrandbits(63) | 1
        self.objects = KeyTable()  # committed objects and pending puts, by key
        self.changes = ChangeLog(c.change_log) if c.change_log else None  # key feed (store/changes.py)
        self._resv: dict[int, Obj] = {}  # reservations (pending, no key yet), by generation
        self._pending: OrderedDict[int, Obj] = OrderedDict()  # pending puts + reservations, oldest first
        self.space = Space(c.alignment, c.quarantine_s, c.fence_hold_s, self._drained)
        self.clients: dict[str, Client] = {}
        self._departed: dict[str, int] = {}  # floors of clients that unregistered with fences left
        self.lru = ClassLru()
        self._spilled: set[Obj] = set()  # spilled objects whose memory waits for leases to end
        self._ssd_only: set[Obj] = set()  # committed objects with no memory replica (SSD tier)
        self._hot: set[str] = set()
        self._dying: collections.deque[Segment] = collections.deque()
        self._ssd_dying: collections.deque[Client] = collections.deque()  # removed SSD clients
        self._ssd_clients: list[Client] = []
        self._ssd_names: set[str] = set()  # file names of the SSD copies (clients' sweeps keep those)
        self._spilling: Counter[str] = Counter()  # file names of the spills in flight (kept too)
        self._next_gen = 0
        self._ids = 0  # the last replica or segment mount id handed out (see _new_id)
        self._access: Counter[str] = Counter()  # gets per key since the hot-key policy last ran
        # the counts of the last hot_window_s, one per hot_interval_s, and their running sum
        n_counts = max(1, round(self.config.hot_window_s / self.config.hot_interval_s))
        self._access_hist: collections.deque[Counter[str]] = collections.deque(maxlen=n_counts)
        self._access_window: Counter[str] = Counter()
        # tasks a report is waited for: id -> client, task, and the replica a hot-key copy fills
        self._tasks: dict[int, tuple[str, dict[str, Any], Replica | None]] = {}
        self._task_deadlines: collections.deque[tuple[float, int]] = collections.deque()  # oldest first
        self._task_ids = 0
        self._change_ids = 0  # replica copies run by clients (replica/promote_start)
        self._evict_to: int | None = None
        self.n_committed = 0
        self.obj_bytes = 0
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self.stats: Counter[str] = Counter()
        now = time.monotonic()
        self._last_tick = now
        self._next_slow = now + SLOW_EVERY_S
        self._last_hot = now
        self._live_floor = 0.0  # no client is judged dead on silence from before this
        limits = RpcLimits(
            max_message=c.max_message, idle_timeout_s=c.idle_timeout_s, max_connections=c.max_connections
        )
        self._server = RpcServer(
            c.host, c.port, self.handle, self._on_tick,
            secret=c.secret, instance=self.incarnation, limits=limits, with_connection=True,
        )  # fmt: skip
        self.port = self._server.port
        self.address = f"{c.host}:{self.port}"
        self.metrics_port: int | None = None
        self._metrics_server: Any = None
        if c.metrics_port is not None:
            from kvpool.store.metrics import start_metrics_server

            self._metrics_server, self.metrics_port = start_metrics_server(self, c.host, c.metrics_port)
        self._handlers = {name[4:]: getattr(self, name) for name in dir(self) if name.startswith("_op_")}
        self._rpc_time: Counter[str] = Counter()
        self._rpc_count: Counter[str] = Counter()
        self.max_request_s = 0.0
        self._gc_managed = False
        self.max_request_op = ""

    # ------------------------------------------------------------------ serving
    def start(self) -> Master:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="kvpool-master", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Answer RPCs and run periodic work until :meth:`stop`."""
        self._server.serve_forever()

    def manage_gc(self) -> None:
        """For a process that is only a master (``kvpool master``): no automatic collections of
        Python's cyclic garbage collector, whose full passes take time proportional to the
        heap (hundreds of ms at a million objects, with the master stalled meanwhile). Young
        objects are collected every second instead; the master's records break their own cycles
        when they are dropped, so nothing is left for full passes to find."""
        gc.disable()
        gc.freeze()
        self._gc_managed = True

    def _on_tick(self) -> None:
        with self._lock:
            self._tick(time.monotonic())

    def stop(self) -> None:
        """Stop serving (the socket closes) and the metrics server."""
        self._server.stop()
        if self._thread is not None:
            self._thread.join(5)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()

    def handle(self, req: Any, conn: Any) -> dict[str, Any] | None:
        """Dispatch one decoded request of an authenticated connection; never raises.

        ``conn.state`` holds what the connection is bound to (``"client"``: the id registered or
        attached on it); in-process callers (tests) pass any object with a ``state`` dict.
        """
        if not isinstance(req, dict):
            return {"id": None, "ok": False, "err": "INVALID", "msg": "malformed request: not a map"}
        rid = req.get("id")
        op = req.get("op")
        fn = self._handlers.get(op) if isinstance(op, str) else None
        if fn is None:
            return {"id": rid, "ok": False, "err": "INVALID", "msg": f"unknown op {op!r}"}
        sess: dict[str, Any] = conn.state
        t0 = time.perf_counter()
        try:
            with self._lock:
                if req.get("release"):  # read leases a client ended, piggy-backed on this request
                    self._op_release({"leases": req["release"]}, sess)
                out = fn(req, sess)
            out["id"] = rid
            out["ok"] = True
        except _Err as exc:
            out = {"id": rid, "ok": False, "err": exc.code, "msg": str(exc)}
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
            # OverflowError: int() of an infinite float (msgpack carries them), float() of a huge int
            out = {"id": rid, "ok": False, "err": "INVALID", "msg": f"bad {op} request: {exc!r}"}
        dt = time.perf_counter() - t0
        self._rpc_time[op] += dt
        self._rpc_count[op] += 1
        if dt > self.max_request_s:
            self.max_request_s, self.max_request_op = dt, op
        return out

    # ------------------------------------------------------------------ helpers
    @property
    def capacity(self) -> int:
        """Bytes of all mounted segments."""
        return self.space.capacity

    @property
    def used(self) -> int:
        """Bytes allocated in all mounted segments."""
        return self.space.used

    def _client(self, req: dict[str, Any], sess: dict[str, Any]) -> Client:
        """The client bound to the calling connection (never the one a request names)."""
        cid = sess.get("client")
        if cid is None:
            raise _Err("UNKNOWN_CLIENT", "this connection is not registered: register (or attach) first")
        named = req.get("client")
        if named is not None and named != cid:
            raise _Err("INVALID", f"this connection belongs to client {cid!r}, not {named!r}")
        c = self.clients.get(cid)
        if c is None:
            raise _Err("UNKNOWN_CLIENT", f"unknown client {cid!r} (declared dead, or the master restarted): "
                       "register again")  # fmt: skip
        c.last_seen = time.monotonic()
        return c

    def _check_epoch(self, req: dict[str, Any]) -> None:
        epoch = req.get("epoch")
        if epoch is not None and epoch != self.incarnation:
            raise _Err("STALE", "the store master restarted since this allocation was made: put again")

    def _check_batch(self, n: int) -> None:
        if n > self.config.max_batch:
            raise _Err("TOO_LARGE", f"request carries {n} keys; the master takes at most "
                       f"{self.config.max_batch} per request (max_batch): split it")  # fmt: skip

    def _drained(self, seg: Segment, t: float) -> bool:
        """Whether segment ``seg``'s storage process ran after ``t``: a heartbeat of its came
        after ``t`` and another one after that (so it ran a heartbeat interval past a resume),
        its engine reading whatever waited in its sockets. Called by :meth:`Space.release`."""
        owner = self.clients.get(seg.client)
        return owner is not None and owner.beats[0] >= t

    def _floor_of(self, cid: str) -> int | None:
        c = self.clients.get(cid)
        return c.floor if c is not None else self._departed.get(cid)

    def _new_id(self) -> int:
        """A fresh id for a replica or a segment's mount: get replies carry them, and a reader's
        report names them, so a late report about an earlier replica at the same address (or an
        earlier mount of the segment) matches nothing."""
        self._ids += 1
        return self._ids

    def _add_replica(self, obj: Obj, seg: Segment, offset: int, writer: str) -> Replica:
        r = Replica(seg, offset, False, writer, self._new_id())
        obj.replicas.append(r)
        seg.objs.add(obj)
        self.obj_bytes += obj.size
        return r

    def _take_replica(self, obj: Obj, r: Replica, written: bool = True) -> None:
        """Remove one replica; an unfinished one whose writer may still write into it is fenced,
        a committed one that readers may still read (leased) is held until their leases end."""
        obj.replicas.remove(r)
        r.seg.objs.discard(obj)
        self.obj_bytes -= obj.size
        if not r.committed and written and r.writer:
            self.space.fence(r.seg, r.offset, obj.gen, r.writer, time.monotonic())
        elif r.committed and obj.readers > 0 and self._leased(obj, time.monotonic()):
            self.space.hold(r.seg, r.offset, obj.lease_until)
        else:
            self.space.free(r.seg, r.offset)

    def _memory_changed(self, obj: Obj) -> None:
        """A committed object gained or lost memory replicas (a segment died, a replica was bad,
        a copy or promotion ended). With a committed one it is in the eviction LRU; with none
        left but an SSD copy it lives on the SSD tier only, out of the LRU (whose every scan
        skipped it); with neither it is lost."""
        if not obj.committed:
            return
        if any(r.committed for r in obj.replicas):
            if obj.lru is None:
                self.lru.add(obj, time.monotonic())  # back in memory (a promotion)
                self._ssd_only.discard(obj)
        elif obj.ssd is not None:
            self.lru.remove(obj)
            self._spilled.discard(obj)  # no memory left to free
            self._ssd_only.add(obj)
        else:
            self._drop(obj)
            self.stats["objects_lost"] += 1

    def _drop(self, obj: Obj, written: bool = True) -> None:
        """Forget an object (or pending put) and give back all its space (memory and SSD)."""
        for r in list(obj.replicas):
            self._take_replica(obj, r, written)
        if obj.key is not None and self.objects.get(obj.key) is obj:
            del self.objects[obj.key]
        self._resv.pop(obj.gen, None)
        if self._pending.pop(obj.gen, None) is not None:
            owner = self.clients.get(obj.owner)
            if owner is not None:
                owner.pending.discard(obj)
        if obj.committed:
            self.n_committed -= 1
            obj.committed = False
            if self.changes is not None and obj.key is not None:
                self.changes.add("-", obj.key)
        self.lru.remove(obj)
        self._spilled.discard(obj)
        self._ssd_only.discard(obj)
        if obj.key is not None:
            self._hot.discard(obj.key)
        self._forget_ssd(obj)

    def _forget_ssd(self, obj: Obj) -> None:
        """Let go of an object's SSD copy: its file is unlinked by its client (by one registered
        under that id again, if the client is gone: nobody else can reach its disk)."""
        if obj.ssd is None:
            return
        cl = self.clients.get(obj.ssd.client)
        if cl is not None:
            cl.ssd_objs.discard(obj)
        self._ssd_names.discard(os.path.basename(obj.ssd.path))
        self._give_task(obj.ssd.client, {"type": "unlink", "path": obj.ssd.path})
        obj.ssd = None

    def _leased(self, obj: Obj, now: float) -> bool:
        """A lease holds until its reader releases it, or at the latest until ``lease_ttl_ms``.
        Expired leases are written off in a new lease epoch: their late releases are ignored."""
        if obj.readers > 0 and obj.lease_until <= now:
            obj.readers = 0  # readers that never released (crashed, or slow): their leases expired
            obj.holders.clear()
            obj.lease_seq += 1
        return obj.readers > 0

    def _give_task(self, client: str, task: dict[str, Any], dst: Replica | None = None) -> int | None:
        """Queue ``task`` for ``client``'s next heartbeat; returns its id (None: no such client).
        ``dst``: the replica a hot-key copy fills (its report ends that one, no other)."""
        c = self.clients.get(client)
        if c is None:
            return None
        self._task_ids += 1
        task["task"] = self._task_ids
        task["epoch"] = self.incarnation  # task ids restart with the master: its report names it
        c.tasks.append(task)
        if task["type"] not in ("unlink", "ssd_check"):  # fire and forget: never reported back
            c.task_ids.add(self._task_ids)
            self._tasks[self._task_ids] = (client, task, dst)
            if task["type"] == "spill":
                self._spilling[os.path.basename(task["path"])] += 1
            due = time.monotonic() + self.config.task_timeout_s
            task["_due"] = due  # the heartbeat that hands it out sends what is left of it (ttl_s)
            self._task_deadlines.append((due, self._task_ids))
        return self._task_ids

    def _make_room(self, need: int, now: float, looks: int) -> None:
        """Before placing ``need`` bytes: evict what would push usage over the high watermark
        (down to ``eviction_ratio`` below it), looking at no more than ``looks`` objects."""
        c = self.config
        cap = self.space.capacity
        if cap and self.space.used + need > c.eviction_high_watermark * cap:
            target = int((c.eviction_high_watermark - c.eviction_ratio) * cap)
            self._evict(now, need=self.space.used + need - target, looks=looks)

    def _allocate(self, size: int, pl: Placement, room: list[int], now: float) -> list[Any]:
        """Place up to ``pl.replicas`` allocations. ``room`` = [full scans, evictions] this request
        may still spend when sampled segments lack space (bounded work per request)."""
        alloc = size + HEADER_SIZE
        want = min(pl.replicas, len(self.space.segments))
        got = self.space.place(alloc, want, pl.preferred, set(), now, scan=room[0] > 0)
        if len(got) < want and room[0] > 0:
            room[0] -= 1
            if room[1] > 0:
                room[1] -= 1
                self._evict(now, need=alloc * (want - len(got)), looks=self.config.evict_batch)
                taken = {s for s, _ in got}
                got += self.space.place(alloc, want - len(got), pl.preferred, taken, now, scan=True)
        return got

    def _place_copies(self, obj: Obj, n: int, exclude: set[Segment], now: float) -> list[tuple[Segment, int]]:
        """Space for up to ``n`` new replicas of a committed object (replica changes, hot-key
        copies, promotions). An object without a checksum gets none over suspect space: readers
        check only its header there, so a lost writer's late write into its value would be
        returned (a put places such an object with a checksum instead: ``_new_pending``)."""
        placed = self.space.place(obj.alloc_size, n, None, exclude, now)
        if obj.checksum is not None:
            return placed
        kept = []
        for seg, off in placed:
            if self.space.suspect(seg, off, obj.alloc_size):
                self.space.free(seg, off)
            else:
                kept.append((seg, off))
        return kept

    def _new_pending(self, key: str | None, size: int, pl: Placement, placed: list[Any], owner: Client,
                     now: float) -> Obj:  # fmt: skip
        self._next_gen += 1
        obj = Obj(key, size, self._next_gen, owner.id, [], deadline=now + self.config.put_timeout_s,
                  soft_pin=pl.soft_pin, pin_until=now + pl.pin_ttl_s, cache_class=pl.cache_class,
                  base_replicas=pl.replicas)  # fmt: skip
        for seg, off in placed:
            self._add_replica(obj, seg, off, owner.id)
        obj.verify = size <= CHECKSUM_ALWAYS_MAX or any(
            self.space.suspect(seg, off, obj.alloc_size) for seg, off in placed
        )
        self._pending[obj.gen] = obj
        owner.pending.add(obj)
        if key is not None:
            self.objects[key] = obj
        else:
            self._resv[obj.gen] = obj
        return obj

    @staticmethod
    def _grant(obj: Obj) -> list[Any]:
        """What a writer gets for an allocation: generation, checksum required, replica addresses."""
        return [obj.gen, obj.verify, [[r.seg.name, r.addr] for r in obj.replicas]]

    def _commit(self, obj: Obj, csum: int | None, now: float, owner: Client | None = None) -> None:
        """``owner``: the object's owner when the caller has it at hand (else looked up)."""
        obj.committed = True
        obj.checksum = csum
        for r in obj.replicas:
            r.committed = True
            r.writer = ""
        self._pending.pop(obj.gen, None)
        if owner is None:
            owner = self.clients.get(obj.owner)
        if owner is not None:
            owner.pending.discard(obj)
        self.lru.add(obj, now)
        self.n_committed += 1
        self.stats["puts"] += 1
        if self.changes is not None and obj.key is not None:
            self.changes.add("+", obj.key)

    # ------------------------------------------------------------------ RPC ops: metadata
    def _op_info(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        key = req["key"]
        obj = self.objects.get(key)
        if obj is None:
            raise _Err("NOT_FOUND", f"no object under key {key!r}")
        return {
            "size": obj.size,
            "gen": obj.gen,
            "committed": obj.committed,
            "replicas": [[r.seg.name, r.addr, r.committed] for r in obj.replicas],
            "ssd": None if obj.ssd is None else obj.ssd.path,
            "cache_class": obj.cache_class,
            "soft_pin": obj.soft_pin,
            "checksum": obj.checksum,
        }

    def _op_stats(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        out = {"stats": self.snapshot()}
        if req.get("reset_max"):  # benchmarks measure the longest request per phase
            self.max_request_s, self.max_request_op = 0.0, ""
            self._server.max_frame_s = 0.0
        return out

    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges (also used by the metrics endpoint); O(segments), not O(objects)."""
        with self._lock:
            return {
                "objects": self.n_committed,
                "pending": len(self._pending),
                "bytes": self.obj_bytes,
                "capacity": self.space.capacity,
                "used": self.space.used,
                "fenced": self.space.fenced,
                "clients": len(self.clients),
                "segments": {
                    s.name: {
                        "size": s.size,
                        "used": s.alloc.used_bytes,
                        "fragmentation": s.alloc.fragmentation(),
                        "objects": len(s.objs),
                    }
                    for s in self.space.segments.values()
                },
                "counters": dict(self.stats),
                "rpc": {op: [self._rpc_count[op], self._rpc_time[op]] for op in self._rpc_count},
                "max_request_s": self.max_request_s,
                "max_request_op": self.max_request_op,
                "max_message_s": self._server.max_frame_s,
                "connections": self._server.connections,
                "rpc_server": dict(self._server.stats),
            }
