"""Store master: object metadata, allocation, leases, eviction, replicas, liveness, metrics.

The master never touches object bytes. Put is two-phase (``put_start`` allocates replicas inside
mounted segments, the client writes through the transfer engine, ``put_end`` commits); get takes a
lease that keeps the object from being evicted or removed while the client reads it. Work that
moves bytes on the master's behalf (hot-key replication, SSD spills) is handed to storage clients
as tasks in their heartbeat replies.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import random
import secrets
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvpool._rpc import RpcLimits, RpcServer
from kvpool.config import MasterConfig
from kvpool.store.allocator import RangeAllocator

log = logging.getLogger("kvpool.master")

CACHE_CLASSES = ("default", "ephemeral", "persistent")


class _Err(Exception):
    def __init__(self, code: str, msg: str) -> None:
        super().__init__(msg)
        self.code = code


@dataclass(slots=True)
class Replica:
    """One copy of an object inside a mounted segment."""

    segment: str
    offset: int
    committed: bool


@dataclass(slots=True)
class SsdCopy:
    """An object's copy in a client's SSD directory."""

    client: str
    path: str
    checksum: str
    host_id: str


@dataclass(slots=True)
class Obj:
    """Metadata of one object."""

    size: int
    replicas: list[Replica]
    committed: bool
    deadline: float
    soft_pin: bool = False
    pin_until: float = 0.0
    cache_class: str = "default"
    base_replicas: int = 1
    lease_until: float = 0.0  # latest lease deadline (bounds leases of readers that vanished)
    readers: int = 0  # reads in flight (leases not yet released)
    oid: int = 0  # object id: a release for an older object of the same key is ignored
    busy: int = 0  # master tasks (replicate/spill) in flight
    ssd: SsdCopy | None = None
    owner: str = ""  # the client that put it (only it may commit or revoke the pending put)


@dataclass(frozen=True)
class Placement:
    """The placement part of a put's config (``ReplicateConfig.wire()``), validated."""

    replicas: int
    cache_class: str
    preferred: str | None
    soft_pin: bool
    pin_ttl_s: float

    @classmethod
    def parse(cls, cfg: dict[str, Any]) -> Placement:
        """Validate a config map; bad values are an INVALID error."""
        pl = cls(
            int(cfg.get("replicas", 1)),
            cfg.get("cache_class", "default"),
            cfg.get("preferred_segment"),
            bool(cfg.get("soft_pin", False)),
            float(cfg.get("soft_pin_ttl_s", 3600.0)),
        )
        if pl.replicas < 1 or pl.cache_class not in CACHE_CLASSES:
            raise _Err("INVALID", f"replicas must be >= 1 and cache_class one of {CACHE_CLASSES}")
        return pl

    def new_obj(self, size: int, reps: list[Replica], now: float, put_timeout_s: float, owner: str) -> Obj:
        """A pending object of client ``owner`` placed on ``reps``."""
        return Obj(size, reps, False, now + put_timeout_s, self.soft_pin, now + self.pin_ttl_s,
                   self.cache_class, self.replicas, owner=owner)  # fmt: skip


@dataclass
class Segment:
    """A client's mounted DRAM segment."""

    name: str
    client: str
    base: int
    size: int
    host_id: str
    alloc: RangeAllocator
    keys: set[str] = field(default_factory=set)
    reads: float = 0.0


@dataclass
class Client:
    """A connected store client."""

    id: str
    host_id: str
    last_seen: float
    ssd_dir: str | None = None
    token: bytes = b""
    segments: set[str] = field(default_factory=set)
    tasks: list[dict[str, Any]] = field(default_factory=list)


class Master:
    """The store master. ``start()`` serves in a background thread; ``serve_forever()`` in this one."""

    def __init__(self, config: MasterConfig | None = None, **kwargs: Any) -> None:
        self.config = config.replace(**kwargs) if config is not None else MasterConfig(**kwargs)
        self.incarnation = random.getrandbits(63)
        self.objects: dict[str, Obj] = {}
        self.segments: dict[str, Segment] = {}
        self.clients: dict[str, Client] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # committed keys, least recent first
        self._pending: set[str] = set()  # uncommitted puts
        self._spilled: set[str] = set()  # spilled objects whose memory waits for leases to end
        self._hot: set[str] = set()
        self._evict_futile = False
        self._next_oid = 0
        self._next_rid = 0
        self._access: Counter[str] = Counter()
        self._access_prev: Counter[str] = Counter()
        self._tasks: dict[int, tuple[str, dict[str, Any]]] = {}
        self._task_ids = 0
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self.stats: Counter[str] = Counter()
        c = self.config
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
        self._last_hot = time.monotonic()

    # ------------------------------------------------------------------ serving
    def start(self) -> Master:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="kvpool-master", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Answer RPCs and run periodic work until :meth:`stop`."""
        self._server.serve_forever()

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
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            out = {"id": rid, "ok": False, "err": "INVALID", "msg": f"bad {op} request: {exc!r}"}
        self._rpc_time[op] += time.perf_counter() - t0
        self._rpc_count[op] += 1
        return out

    # ------------------------------------------------------------------ helpers
    @property
    def capacity(self) -> int:
        """Bytes of all mounted segments."""
        return sum(s.size for s in self.segments.values())

    @property
    def used(self) -> int:
        """Bytes allocated in all mounted segments."""
        return sum(s.alloc.used_bytes for s in self.segments.values())

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

    def _addr(self, r: Replica) -> int:
        return self.segments[r.segment].base + r.offset

    def _free_replica(self, key: str, r: Replica) -> None:
        seg = self.segments.get(r.segment)
        if seg is not None:
            seg.alloc.free(r.offset)
            seg.keys.discard(key)

    def _drop(self, key: str) -> None:
        """Forget an object and free all its space (memory and SSD)."""
        obj = self.objects.pop(key, None)
        if obj is None:
            return
        for r in obj.replicas:
            self._free_replica(key, r)
        self._lru.pop(key, None)
        self._pending.discard(key)
        self._spilled.discard(key)
        self._hot.discard(key)
        if obj.ssd is not None:
            self._give_task(obj.ssd.client, {"type": "unlink", "path": obj.ssd.path})

    def _leased(self, obj: Obj, now: float) -> bool:
        """A lease holds until its reader releases it, or at the latest until ``lease_ttl_ms``."""
        if obj.readers > 0 and obj.lease_until <= now:
            obj.readers = 0  # readers that never released (crashed): their leases expired
        return obj.readers > 0

    def _give_task(self, client: str, task: dict[str, Any]) -> int | None:
        c = self.clients.get(client)
        if c is None:
            return None
        self._task_ids += 1
        task["task"] = self._task_ids
        c.tasks.append(task)
        self._tasks[self._task_ids] = (client, task)
        return self._task_ids

    def _place(self, size: int, n: int, preferred: str | None, exclude: set[str]) -> list[Replica]:
        """Allocate up to ``n`` replicas on distinct segments; most free space first."""
        segs = [s for s in self.segments.values() if s.name not in exclude]
        if preferred is not None:
            segs.sort(key=lambda s: (s.name != preferred, -s.alloc.free_bytes))
        else:
            segs.sort(key=lambda s: -s.alloc.free_bytes)
        out: list[Replica] = []
        for s in segs:
            if len(out) == n:
                break
            if s.alloc.largest_free < size:
                continue
            off = s.alloc.allocate(size)
            if off is not None:
                out.append(Replica(s.name, off, False))
        return out

    def _allocate(
        self, key: str, size: int, n: int, preferred: str | None, exclude: set[str]
    ) -> list[Replica]:
        reps = self._place(size, n, preferred, exclude)
        if len(reps) < min(n, len(self.segments) - len(exclude)) and not self._evict_futile:
            # Not enough room: evict, then try again for the missing replicas. An eviction round
            # that frees nothing is not repeated for the rest of this request.
            if self._evict(need=size * (n - len(reps))) == 0:
                self._evict_futile = True
            reps += self._place(size, n - len(reps), preferred, exclude | {r.segment for r in reps})
        for r in reps:
            self.segments[r.segment].keys.add(key)
        return reps

    # ------------------------------------------------------------------ eviction
    def _evict(self, need: int = 0) -> int:
        """Approximate LRU: free ``eviction_ratio`` of capacity (or ``need`` bytes) above the watermark."""
        cap = self.capacity
        if cap == 0:
            return 0
        used = self.used
        c = self.config
        if need == 0 and used <= c.eviction_high_watermark * cap:
            return 0
        target = max(need, int(c.eviction_ratio * cap), used - int(c.eviction_high_watermark * cap))
        now = time.monotonic()
        freed = 0
        ssd_clients = [cl for cl in self.clients.values() if cl.ssd_dir]
        # One pass over the LRU order sorts candidates into classes, evicted in this order:
        # ephemeral, default, soft-pinned; persistent objects are only ever spilled.
        phases: dict[str, list[str]] = {"ephemeral": [], "default": [], "pinned": [], "persistent": []}
        for key in self._lru:
            obj = self.objects[key]
            if obj.busy or key in self._spilled or not obj.replicas or self._leased(obj, now):
                continue
            if obj.cache_class in ("ephemeral", "persistent"):
                phases[obj.cache_class].append(key)
            else:
                phases["pinned" if obj.soft_pin and obj.pin_until > now else "default"].append(key)
        for phase in ("ephemeral", "default", "pinned", "persistent"):
            for key in phases[phase]:
                if freed >= target:
                    return freed
                obj = self.objects[key]
                bytes_held = obj.size * len(obj.replicas)
                if (obj.soft_pin or obj.cache_class == "persistent") and ssd_clients and obj.ssd is None:
                    self._spill(key, obj, random.choice(ssd_clients))
                    freed += bytes_held  # freed once the spill lands
                    continue
                if obj.cache_class == "persistent":
                    continue  # never dropped from the pool without an SSD tier
                if obj.ssd is not None:
                    self._free_memory(key, obj)
                else:
                    self._drop(key)
                self.stats["evictions"] += 1
                freed += bytes_held
        return freed

    def _free_memory(self, key: str, obj: Obj) -> None:
        for r in obj.replicas:
            self._free_replica(key, r)
        obj.replicas = []
        self._spilled.discard(key)

    def _spill(self, key: str, obj: Obj, client: Client) -> None:
        r = next(x for x in obj.replicas if x.committed)
        digest = hashlib.sha1(key.encode()).hexdigest()
        path = os.path.join(client.ssd_dir or "", digest[:2], digest + ".kvp")
        obj.busy += 1
        self._give_task(
            client.id,
            {"type": "spill", "key": key, "size": obj.size, "src": [r.segment, self._addr(r)], "path": path},
        )
        self.stats["spills"] += 1

    # ------------------------------------------------------------------ periodic work
    def _tick(self, now: float) -> None:
        c = self.config
        # Abandoned puts.
        for key in [k for k in self._pending if self.objects[k].deadline < now]:
            self._drop(key)
            self.stats["put_revoked_timeout"] += 1
        # Dead clients.
        for cid in [cid for cid, cl in self.clients.items() if now - cl.last_seen > c.client_ttl_s]:
            log.warning("client %s missed heartbeats for %.1fs: unmounting its segments", cid, c.client_ttl_s)
            self._remove_client(cid)
        # Spilled objects whose readers are gone.
        for key in [k for k in self._spilled if not self._leased(self.objects[k], now)]:
            self._free_memory(key, self.objects[key])
        if c.hot_key_replication and now - self._last_hot >= c.hot_interval_s:
            self._last_hot = now
            self._hot_keys(now)

    def _remove_client(self, cid: str) -> None:
        cl = self.clients.pop(cid, None)
        if cl is None:
            return
        for name in list(cl.segments):
            self._unmount(name)
        for tid in [t for t, (owner, _) in self._tasks.items() if owner == cid]:
            self._finish_task(tid, ok=False, result={})

    def _unmount(self, name: str) -> None:
        seg = self.segments.pop(name, None)
        if seg is None:
            return
        cl = self.clients.get(seg.client)
        if cl is not None:
            cl.segments.discard(name)
        for key in list(seg.keys):
            obj = self.objects.get(key)
            if obj is None:
                continue
            obj.replicas = [r for r in obj.replicas if r.segment != name]
            if not obj.committed:
                self._drop(key)  # a put that lost a target cannot commit
            elif not any(r.committed for r in obj.replicas) and obj.ssd is None:
                self._drop(key)
                self.stats["objects_lost"] += 1

    def _hot_keys(self, now: float) -> None:
        window = self._access + self._access_prev
        self._access_prev, self._access = self._access, Counter()
        n = len(self.segments)
        if n < 2:
            return
        k = max(1, math.ceil(n * math.log2(n)))
        hot = {key for key, cnt in window.most_common(k) if cnt >= 2}
        want = min(self.config.hot_max_replicas, n)
        for key in hot:
            obj = self.objects.get(key)
            if obj is None or not obj.committed or obj.busy or key in self._spilled:
                continue
            committed = [r for r in obj.replicas if r.committed]
            if not committed or len(obj.replicas) >= want:
                continue
            self._hot.add(key)
            self._replicate(key, obj, want - len(obj.replicas))
        for key in list(self._hot - hot):
            obj = self.objects[key]
            if not obj.busy and not self._leased(obj, now):
                self._hot.discard(key)
                self._shrink(key, obj, obj.base_replicas)

    def _replicate(self, key: str, obj: Obj, extra: int) -> None:
        src = next(r for r in obj.replicas if r.committed)
        new = self._place(obj.size, extra, None, {r.segment for r in obj.replicas})
        for r in new:
            seg = self.segments[r.segment]
            seg.keys.add(key)
            obj.replicas.append(r)
            obj.busy += 1
            self._give_task(
                seg.client,
                {
                    "type": "replicate",
                    "key": key,
                    "size": obj.size,
                    "src": [src.segment, self._addr(src)],
                    "dst": [r.segment, self._addr(r)],
                },
            )
            self.stats["hot_replications"] += 1

    def _shrink(self, key: str, obj: Obj, n: int) -> int:
        """Drop committed replicas beyond ``n`` (most loaded segments first); returns how many."""
        extra = [r for r in obj.replicas if r.committed]
        if len(extra) <= n:
            return 0
        extra.sort(key=lambda r: -self.segments[r.segment].reads if r.segment in self.segments else 0)
        drop = extra[: len(extra) - n]
        for r in drop:
            self._free_replica(key, r)
        obj.replicas = [r for r in obj.replicas if r not in drop]
        return len(drop)

    def _finish_task(self, tid: int, ok: bool, result: dict[str, Any]) -> None:
        entry = self._tasks.pop(tid, None)
        if entry is None:
            return
        _, task = entry
        key = task.get("key")
        obj = self.objects.get(key) if key is not None else None
        if task["type"] == "replicate" and obj is not None:
            obj.busy -= 1
            seg_name = task["dst"][0]
            for r in obj.replicas:
                if r.segment == seg_name and not r.committed:
                    if ok:
                        r.committed = True
                    else:
                        self._free_replica(key, r)
                        obj.replicas.remove(r)
                    break
        elif task["type"] == "spill" and obj is not None:
            obj.busy -= 1
            if ok:
                cl = self.clients.get(entry[0])
                obj.ssd = SsdCopy(entry[0], task["path"], result["checksum"], cl.host_id if cl else "")
                self._spilled.add(key)  # memory freed once no lease holds it
                if not self._leased(obj, time.monotonic()):
                    self._free_memory(key, obj)

    # ------------------------------------------------------------------ RPC ops
    def _op_ping(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        return {"master": self.incarnation}

    def _op_register(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """A new client session, bound to this connection; ``token`` lets the client's other
        connections :meth:`_op_attach` to it. An id in use by another connection is refused."""
        cid = req["client"]
        if not isinstance(cid, str) or not cid:
            raise _Err("INVALID", "client id must be a non-empty string")
        bound = sess.get("client")
        if bound is not None and bound != cid:
            raise _Err("INVALID", f"this connection belongs to client {bound!r}")
        if cid in self.clients:
            if bound != cid:
                raise _Err("EXISTS", f"client id {cid!r} is registered by another connection")
            self._remove_client(cid)  # registering again on its own connection: a fresh session
        token = secrets.token_bytes(16)
        self.clients[cid] = Client(cid, req.get("host_id", ""), time.monotonic(), req.get("ssd_dir"), token)
        sess["client"] = cid
        return {
            "master": self.incarnation,
            "token": token,
            "lease_ttl_ms": self.config.lease_ttl_ms,
            "client_ttl_s": self.config.client_ttl_s,
        }

    def _op_attach(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Bind another connection of a registered client to it (proven by its session token)."""
        cid, token = req["client"], req["token"]
        c = self.clients.get(cid)
        if c is None or not isinstance(token, bytes) or not hmac.compare_digest(token, c.token):
            raise _Err("UNKNOWN_CLIENT", f"no session of client {cid!r} with this token: register again")
        bound = sess.get("client")
        if bound is not None and bound != cid:
            raise _Err("INVALID", f"this connection belongs to client {bound!r}")
        sess["client"] = cid
        c.last_seen = time.monotonic()
        return {"master": self.incarnation}

    def _op_unregister(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        self._remove_client(self._client(req, sess).id)
        return {}

    def _op_heartbeat(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        cid = sess.get("client")
        c = self.clients.get(cid) if cid is not None else None
        if c is None:
            return {"master": self.incarnation, "reregister": True, "tasks": []}
        c.last_seen = time.monotonic()
        tasks, c.tasks = c.tasks, []
        return {"master": self.incarnation, "tasks": tasks}

    def _op_mount(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        c = self._client(req, sess)
        name, base, size = req["segment"], int(req["base"]), int(req["size"])
        if size <= 0 or base <= 0:
            raise _Err("INVALID", "segment base and size must be positive")
        if name in self.segments:
            raise _Err("EXISTS", f"segment {name!r} is already mounted")
        self.segments[name] = Segment(
            name, c.id, base, size, c.host_id, RangeAllocator(size, self.config.alignment)
        )
        c.segments.add(name)
        return {}

    def _op_unmount(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        c = self._client(req, sess)
        name = req["segment"]
        if name not in c.segments:
            raise _Err("NOT_FOUND", f"segment {name!r} is not mounted by this client")
        self._unmount(name)
        return {}

    def _op_task_done(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        self._client(req, sess)
        self._finish_task(int(req["task"]), bool(req["ok"]), req.get("result") or {})
        return {}

    def _op_put_start(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        caller = self._client(req, sess)
        keys, sizes = req["keys"], req["sizes"]
        if len(keys) != len(sizes):
            raise _Err("INVALID", "keys and sizes differ in length")
        pl = Placement.parse(req.get("config") or {})
        now = time.monotonic()
        self._evict_futile = False
        out: list[list[Any]] = []
        for key, size in zip(keys, sizes, strict=True):
            if (
                not isinstance(key, str)
                or not key
                or key[0] == "\0"
                or not isinstance(size, int)
                or size <= 0
            ):
                out.append(["INVALID", "key must be a non-empty string (not starting with NUL), size > 0"])
                continue
            if key in self.objects:
                o = self.objects[key]
                out.append(["EXISTS", f"key {key!r} is {'committed' if o.committed else 'being put'}"])
                continue
            if not self.segments:
                out.append(["FULL", "no segment is mounted: start a client with segment_size > 0"])
                continue
            reps = self._allocate(key, size, pl.replicas, pl.preferred, set())
            if not reps:
                out.append(["FULL", f"no segment has {size} free bytes even after eviction"])
                continue
            self._new_pending(key, pl.new_obj(size, reps, now, self.config.put_timeout_s, caller.id))
            out.append([None, [[r.segment, self._addr(r)] for r in reps]])
        reply: dict[str, Any] = {"results": out}
        reserve = int(req.get("reserve") or 0)
        if reserve and len(set(sizes)) == 1 and out and out[0][0] is None:
            reply["reserved"] = self._reserve(sess["client"], sizes[0], pl, reserve)
            reply["reserve_ttl_s"] = self.config.put_timeout_s
        self._evict()
        return reply

    def _reserve(self, cid: str, size: int, pl: Placement, count: int) -> list[list[Any]]:
        """Reservations: space for future puts of one size and config, so that each of them needs
        one round trip (write, then `commit`) instead of two. They are pending puts: never evicted,
        revoked after put_timeout_s when unused. They never push usage over the watermark and take
        at most 1/64 of the pool per request."""
        if size <= 0:
            raise _Err("INVALID", "size must be > 0")
        n = pl.replicas
        now = time.monotonic()
        cap = self.capacity
        budget = min(cap // 64, int(self.config.eviction_high_watermark * cap) - self.used)
        count = min(count, 64, max(0, budget // (size * n)))
        reserved: list[list[Any]] = []
        for _ in range(count):
            self._next_rid += 1
            rkey = f"\0r:{cid}:{self._next_rid}"
            reps = self._place(size, n, pl.preferred, set())
            if len(reps) < min(n, len(self.segments)):
                for r in reps:
                    self._free_replica(rkey, r)
                break
            for r in reps:
                self.segments[r.segment].keys.add(rkey)
            self._new_pending(rkey, pl.new_obj(size, reps, now, self.config.put_timeout_s, cid))
            reserved.append([rkey, [[r.segment, self._addr(r)] for r in reps]])
        return reserved

    def _op_reserve(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Reservations ahead of time (a client's pool of one shape runs low)."""
        self._client(req, sess)
        pl = Placement.parse(req.get("config") or {})
        reserved = self._reserve(sess["client"], int(req["size"]), pl, int(req["count"]))
        return {"reserved": reserved, "reserve_ttl_s": self.config.put_timeout_s}

    def _new_pending(self, key: str, obj: Obj) -> None:
        self._next_oid += 1
        obj.oid = self._next_oid
        self.objects[key] = obj
        self._pending.add(key)

    def _op_commit(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Commit reservations (written by the client) under their keys: ``items`` = [[key, rkey]]."""
        self._client(req, sess)
        out: list[list[Any]] = []
        for key, rkey in req["items"]:
            robj = self.objects.get(rkey)
            if not isinstance(key, str) or not key or key[0] == "\0":
                out.append(["INVALID", "key must be a non-empty string (not starting with NUL)"])
            elif robj is None or robj.committed or not rkey.startswith(f"\0r:{sess['client']}:"):
                out.append(["NOT_FOUND", "reservation expired (older than put_timeout_s)"])
            elif key in self.objects:
                o = self.objects[key]
                out.append(["EXISTS", f"key {key!r} is {'committed' if o.committed else 'being put'}"])
            else:
                del self.objects[rkey]
                self._pending.discard(rkey)
                for r in robj.replicas:
                    seg = self.segments[r.segment]
                    seg.keys.discard(rkey)
                    seg.keys.add(key)
                    r.committed = True
                robj.committed = True
                self._next_oid += 1
                robj.oid = self._next_oid
                self.objects[key] = robj
                self._lru[key] = None
                self.stats["puts"] += 1
                out.append([None, None])
        return {"results": out}

    def _op_put_end(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        caller = self._client(req, sess)
        out: list[list[Any]] = []
        for key in req["keys"]:
            obj = self.objects.get(key)
            if obj is None or obj.committed or obj.owner != caller.id:
                out.append(["NOT_FOUND", f"no pending put of {key!r} (revoked after put_timeout_s?)"])
                continue
            obj.committed = True
            for r in obj.replicas:
                r.committed = True
            self._pending.discard(key)
            self._lru[key] = None
            self.stats["puts"] += 1
            out.append([None, None])
        return {"results": out}

    def _op_put_revoke(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        caller = self._client(req, sess)
        for key in req["keys"]:
            obj = self.objects.get(key)
            if obj is not None and not obj.committed and obj.owner == caller.id:
                self._drop(key)
        return {}

    def _op_get(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        reader = self.clients.get(sess.get("client", ""))
        host = reader.host_id if reader is not None else None
        now = time.monotonic()
        ttl = self.config.lease_ttl_ms / 1000.0
        out: list[list[Any]] = []
        for key in req["keys"]:
            obj = self.objects.get(key)
            if obj is None or not obj.committed:
                self.stats["misses"] += 1
                out.append(["NOT_FOUND", f"no object under key {key!r}"])
                continue
            reps = [r for r in obj.replicas if r.committed]
            if not reps and obj.ssd is None:
                self.stats["misses"] += 1
                out.append(["NOT_FOUND", f"object {key!r} has no readable replica"])
                continue
            obj.lease_until = now + ttl
            obj.readers += 1
            self._lru.move_to_end(key)
            if self.config.hot_key_replication:
                self._access[key] += 1
            self.stats["hits"] += 1
            replicas = [[r.segment, self._addr(r), self.segments[r.segment].host_id] for r in reps]
            if len(replicas) > 1:
                # Replica choice: same host as the reader first, else the less loaded of two random
                # replicas (reads served per segment). The chosen one goes first.
                local = [x for x in replicas if x[2] == host]
                if local:
                    pick = local[0]
                else:
                    a, b = random.sample(replicas, 2)
                    pick = a if self.segments[a[0]].reads <= self.segments[b[0]].reads else b
                replicas.remove(pick)
                replicas.insert(0, pick)
            if replicas:
                self.segments[replicas[0][0]].reads += 1
            ssd = None if obj.ssd is None else [obj.ssd.path, obj.ssd.host_id, obj.ssd.checksum]
            out.append([None, {"size": obj.size, "replicas": replicas, "ssd": ssd, "oid": obj.oid}])
        return {"results": out}

    def _op_release(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """End read leases: ``leases`` is a list of [key, oid] from get replies."""
        for key, oid in req["leases"]:
            obj = self.objects.get(key)
            if obj is not None and obj.oid == oid and obj.readers > 0:
                obj.readers -= 1
        return {}

    def _op_exists(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        objs = self.objects
        return {"results": [(o := objs.get(k)) is not None and o.committed for k in req["keys"]]}

    def _op_remove(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        force = bool(req.get("force", False))
        out: list[list[Any]] = []
        for key in req["keys"]:
            obj = self.objects.get(key)
            if obj is None or not obj.committed:
                out.append(["NOT_FOUND", f"no object under key {key!r}"])
            elif not force and (self._leased(obj, now) or obj.busy):
                out.append(["BUSY", f"object {key!r} is leased by a reader; retry after the lease"])
            else:
                self._drop(key)
                out.append([None, None])
        return {"results": out}

    def _op_remove_all(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        keys = [k for k, o in self.objects.items() if o.committed and not o.busy and not self._leased(o, now)]
        for k in keys:
            self._drop(k)
        return {"removed": len(keys)}

    def _op_replica_start(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """change_replica: lower at once, or allocate new replicas for the caller to fill."""
        self._client(req, sess)
        key, n = req["key"], int(req["replicas"])
        if n < 1:
            raise _Err("INVALID", "replicas must be >= 1")
        obj = self.objects.get(key)
        if obj is None or not obj.committed:
            raise _Err("NOT_FOUND", f"no object under key {key!r}")
        committed = [r for r in obj.replicas if r.committed]
        if not committed:
            raise _Err("NOT_FOUND", f"object {key!r} has no memory replica")
        obj.base_replicas = n
        if n <= len(obj.replicas):
            if self._leased(obj, time.monotonic()) or obj.busy:
                raise _Err("BUSY", f"object {key!r} is leased or being copied; retry later")
            self._shrink(key, obj, n)
            return {"src": None, "dst": []}
        new = self._place(obj.size, n - len(obj.replicas), None, {r.segment for r in obj.replicas})
        for r in new:
            self.segments[r.segment].keys.add(key)
            obj.replicas.append(r)
        obj.busy += 1
        src = committed[0]
        return {
            "src": [src.segment, self._addr(src)],
            "dst": [[r.segment, self._addr(r)] for r in new],
            "size": obj.size,
        }

    def _op_promote_start(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Allocate a memory replica for an object that lives only on the SSD tier."""
        self._client(req, sess)
        key = req["key"]
        obj = self.objects.get(key)
        if obj is None or not obj.committed or obj.ssd is None:
            raise _Err("NOT_FOUND", f"no SSD-tier object under key {key!r}")
        if obj.replicas or obj.busy:
            return {"dst": []}
        new = self._place(obj.size, 1, None, set())
        if not new:
            return {"dst": []}
        for r in new:
            self.segments[r.segment].keys.add(key)
            obj.replicas.append(r)
        obj.busy += 1
        return {"dst": [[r.segment, self._addr(r)] for r in new]}

    def _op_replica_end(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        self._client(req, sess)
        key, ok = req["key"], bool(req["ok"])
        obj = self.objects.get(key)
        if obj is None:
            raise _Err("NOT_FOUND", f"object {key!r} disappeared during change_replica")
        obj.busy = max(0, obj.busy - 1)
        done = set(req.get("segments") or [])
        for r in list(obj.replicas):
            if not r.committed and r.segment in done:
                if ok:
                    r.committed = True
                else:
                    self._free_replica(key, r)
                    obj.replicas.remove(r)
        return {"replicas": sum(r.committed for r in obj.replicas)}

    def _op_info(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        key = req["key"]
        obj = self.objects.get(key)
        if obj is None:
            raise _Err("NOT_FOUND", f"no object under key {key!r}")
        return {
            "size": obj.size,
            "committed": obj.committed,
            "replicas": [[r.segment, self._addr(r), r.committed] for r in obj.replicas],
            "ssd": None if obj.ssd is None else obj.ssd.path,
            "cache_class": obj.cache_class,
            "soft_pin": obj.soft_pin,
        }

    def _op_stats(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        return {"stats": self.snapshot()}

    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges (also used by the metrics endpoint)."""
        with self._lock:
            return {
                "objects": len(self.objects) - len(self._pending),
                "pending": len(self._pending),
                "bytes": sum(o.size * len(o.replicas) for o in self.objects.values()),
                "capacity": self.capacity,
                "used": self.used,
                "clients": len(self.clients),
                "segments": {
                    s.name: {
                        "size": s.size,
                        "used": s.alloc.used_bytes,
                        "fragmentation": s.alloc.fragmentation(),
                        "objects": len(s.keys),
                    }
                    for s in self.segments.values()
                },
                "counters": dict(self.stats),
                "rpc": {op: [self._rpc_count[op], self._rpc_time[op]] for op in self._rpc_count},
            }
