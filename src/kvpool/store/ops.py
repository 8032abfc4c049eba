"""The store master's RPC operations on objects: puts (``put_start``, ``reserve``, ``commit``,
``put_end``, ``put_revoke``), reads (``get``, ``release``, ``exists``), removal, and replica
changes. A mixin of :class:`kvpool.store.master.Master`, whose state and helpers it uses; every
operation runs under the master's lock and does work bounded by ``max_batch``."""

from __future__ import annotations

import itertools
import random
import time
from typing import TYPE_CHECKING, Any

from kvpool.store.layout import HEADER_SIZE
from kvpool.store.objects import Client, MasterError, Obj, Placement, Replica

if TYPE_CHECKING:
    from kvpool.store.master import Master

    _Base = Master
else:
    _Base = object

_Err = MasterError
HOT_KEYS_TRACKED = 1 << 16  # distinct keys counted per hot-key window


_CONN_HOLDERS = itertools.count(1)


def _bad_checksum(csum: Any, verify: bool) -> str | None:
    """Why a commit's checksum is refused (None: it is fine). Checked before the item changes
    anything: the master hands it to every reader, and one past 64 bits made every get reply
    naming the object unencodable (a batch with it failed whole); another type failed each read."""
    if csum is None:
        return "this allocation needs a checksum" if verify else None
    if type(csum) is not int or not 0 <= csum < 1 << 64:
        return "a checksum is the value's xxh3-64: an int in [0, 2**64)"
    return None


def _lease_holder(sess: dict[str, Any]) -> Any:
    """Who a read lease belongs to: the connection's registered client id (a reconnect keeps its
    leases), else the connection itself (a token kept in its state)."""
    cid = sess.get("client")
    if cid is not None:
        return cid
    if "lease_holder" not in sess:
        sess["lease_holder"] = ("conn", next(_CONN_HOLDERS))
    return sess["lease_holder"]


class ObjectOps(_Base):
    """``_op_*`` handlers for objects (see the module docstring)."""

    # ------------------------------------------------------------------ RPC ops: puts
    def _op_put_start(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        caller = self._client(req, sess)
        keys, sizes = req["keys"], req["sizes"]
        self._check_batch(len(keys))
        if len(keys) != len(sizes):
            raise _Err("INVALID", "keys and sizes differ in length")
        pl = Placement.parse(req.get("config") or {})
        reserve = int(req.get("reserve") or 0)  # checked before anything is allocated
        now = time.monotonic()
        fits = self.space.fits_anywhere
        need = sum(n + HEADER_SIZE for n in sizes if isinstance(n, int) and 0 < n and fits(n + HEADER_SIZE))
        reps = min(pl.replicas, len(self.space.segments))  # what can be placed: one per segment
        self._make_room(need * reps, now, looks=max(self.config.evict_batch, 2 * len(keys) * reps))
        room = [8, 2]
        out: list[list[Any]] = []
        objects = self.objects
        for key, size in zip(keys, sizes, strict=True):
            if type(key) is not str or not key or type(size) is not int or size <= 0:
                if not isinstance(key, str) or not key or not isinstance(size, int) or size <= 0:
                    out.append(["INVALID", "key must be a non-empty string, size > 0"])
                    continue
            o = objects.get(key)
            if o is not None:
                out.append(["EXISTS", f"key {key!r} is {'committed' if o.committed else 'being put'}"])
            elif not self.space.segments:
                out.append(["FULL", "no segment is mounted: start a client with segment_size > 0"])
            elif not self.space.fits_anywhere(size + HEADER_SIZE):
                out.append(["FULL", f"{size} bytes do not fit into any mounted segment (nothing evicted)"])
            else:
                placed = self._allocate(size, pl, room, now)
                if not placed:
                    out.append(["FULL", f"no segment has {size} free bytes even after eviction"])
                else:
                    out.append([None, self._grant(self._new_pending(key, size, pl, placed, caller, now))])
        reply: dict[str, Any] = {"results": out, "epoch": self.incarnation}
        grants = [val for code, val in out if code is None]
        if reserve > 0 and out and out[0][0] is None and all(n == sizes[0] for n in sizes):
            reply["reserved"] = self._reserve(caller, sizes[0], pl, reserve, now)
            reply["reserve_ttl_s"] = self.config.put_timeout_s
            grants += reply["reserved"]
        reply["mounts"] = self._mounts(grants)
        self._evict(now)
        return reply

    def _mounts(self, grants: list[list[Any]]) -> dict[str, int]:
        """Segment -> mount id of each segment ``grants`` ([gen, verify, [[segment, address]]])
        place a replica on, as put replies carry it (beside the grants: older clients ignore
        it). A writer's unreachable report names the mount it was granted, so that a late one
        does not demote the segment mounted again since (see ``_op_report``)."""
        segs = self.space.segments
        return {name: segs[name].mount for g in grants for name, _ in g[2]}

    def _reserve(self, caller: Client, size: int, pl: Placement, count: int, now: float) -> list[list[Any]]:
        """Reservations: space for future puts of one size and config, so that each of them needs
        one round trip (write, then ``commit``) instead of two. They are pending puts: never
        evicted, revoked after put_timeout_s when unused. They never push usage over the
        watermark and take at most 1/64 of the pool per request."""
        if not isinstance(size, int) or size <= 0:
            raise _Err("INVALID", "size must be > 0")
        alloc = size + HEADER_SIZE
        n = min(pl.replicas, len(self.space.segments))
        cap = self.space.capacity
        budget = min(cap // 64, int(self.config.eviction_high_watermark * cap) - self.space.used)
        count = min(count, 64, max(0, budget // (alloc * max(1, n))))
        out: list[list[Any]] = []
        for _ in range(count):
            placed = self.space.place(alloc, n, pl.preferred, set(), now, scan=False)
            if len(placed) < n or not placed:
                for seg, off in placed:
                    self.space.free(seg, off)
                break
            out.append(self._grant(self._new_pending(None, size, pl, placed, caller, now)))
        return out

    def _op_reserve(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Reservations ahead of time (a client's pool of one shape runs low)."""
        caller = self._client(req, sess)
        pl = Placement.parse(req.get("config") or {})
        reserved = self._reserve(caller, req["size"], pl, int(req["count"]), time.monotonic())
        return {"reserved": reserved, "reserve_ttl_s": self.config.put_timeout_s, "epoch": self.incarnation,
                "mounts": self._mounts(reserved)}  # fmt: skip

    def _op_commit(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Commit reservations (written by the caller) under keys: ``items`` = [[key, gen, checksum]];
        with ``reserve`` (a count), ``size`` and ``config``, new reservations come with the reply."""
        caller = self._client(req, sess)
        self._check_epoch(req)
        items = req["items"]
        self._check_batch(len(items))
        count, size = req.get("reserve") or 0, req.get("size")
        if count:  # checked before anything is committed
            if type(count) is not int or type(size) is not int or size <= 0:
                raise _Err("INVALID", "reserve and size must be ints, size > 0")
            pl = Placement.parse(req.get("config") or {})
        now = time.monotonic()
        out: list[list[Any]] = []
        for item in items:
            if not isinstance(item, (list, tuple)) or len(item) != 3 or type(item[1]) is not int:
                out.append(["INVALID", "an item is [key, generation, checksum]"])
                continue
            key, gen, csum = item
            robj = self._resv.get(gen)
            if not isinstance(key, str) or not key:
                out.append(["INVALID", "key must be a non-empty string"])
            elif robj is None or robj.owner != caller.id:
                out.append(["NOT_FOUND", "reservation expired (put_timeout_s) or not this client's"])
            elif key in self.objects:
                o = self.objects[key]
                out.append(["EXISTS", f"key {key!r} is {'committed' if o.committed else 'being put'}"])
            elif (why := _bad_checksum(csum, robj.verify)) is not None:
                out.append(["INVALID", why])
            else:
                del self._resv[gen]
                robj.key = key
                self.objects[key] = robj
                self._commit(robj, csum, now)
                out.append([None, None])
        reply: dict[str, Any] = {"results": out}
        if count:  # a batch's reservations for the next batch of its shape
            reply["reserved"] = self._reserve(caller, size, pl, count, now)
            reply["reserve_ttl_s"] = self.config.put_timeout_s
            reply["mounts"] = self._mounts(reply["reserved"])
        return reply

    def _op_put_end(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Commit pending puts of the caller: ``items`` = [[key, gen, checksum, written segments]];
        replicas not written are taken back (fenced)."""
        caller = self._client(req, sess)
        self._check_epoch(req)
        items = req["items"]
        self._check_batch(len(items))
        now = time.monotonic()
        out: list[list[Any]] = []
        get, cid = self.objects.get, caller.id
        for item in items:
            if not isinstance(item, (list, tuple)) or len(item) != 4 or not isinstance(item[3], list | tuple):
                out.append(["INVALID", "an item is [key, generation, checksum, segments written]"])
                continue
            key, gen, csum, written = item
            obj = get(key)
            if obj is None or obj.committed or obj.gen != gen or obj.owner != cid:
                out.append(["NOT_FOUND", f"no pending put of {key!r} by this client (revoked after "
                            "put_timeout_s?)"])  # fmt: skip
                continue
            if (why := _bad_checksum(csum, obj.verify)) is not None:
                out.append(["INVALID", why])
                continue
            reps = obj.replicas
            if not (len(reps) == 1 and written == [reps[0].seg.name] and not reps[0].seg.dead):
                ok = {w for w in written if type(w) is str}
                for r in [r for r in reps if r.seg.name not in ok or r.seg.dead]:
                    self._take_replica(obj, r)
            if not obj.replicas:
                self._drop(obj)
                out.append(["ERROR", f"no replica of {key!r} was written"])
                continue
            self._commit(obj, csum, now, caller)
            out.append([None, None])
        return {"results": out}

    def _op_put_revoke(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Give back pending puts/reservations: ``items`` = [[gen, written]] (unwritten space is
        free at once; written space is fenced)."""
        caller = self._client(req, sess)
        items = req["items"]
        self._check_batch(len(items))
        if req.get("epoch") not in (None, self.incarnation):
            return {}
        for item in items:
            if not isinstance(item, (list, tuple)) or len(item) != 2 or type(item[0]) is not int:
                continue  # not an allocation of this client's
            gen, written = item
            obj = self._pending.get(gen)
            if obj is not None and obj.owner == caller.id:
                self._drop(obj, written=bool(written))
        return {}

    # ------------------------------------------------------------------ RPC ops: reads
    def _op_get(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        keys = req["keys"]
        self._check_batch(len(keys))
        reader = self.clients.get(sess.get("client", ""))
        holder = _lease_holder(sess)
        host = reader.host_id if reader is not None else None
        now = time.monotonic()
        ttl = self.config.lease_ttl_ms / 1000.0
        hot = self.config.hot_key_replication
        out: list[list[Any]] = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None or not obj.committed:
                self.stats["misses"] += 1
                out.append(["NOT_FOUND", f"no object under key {key!r}"])
                continue
            reps = [r for r in obj.replicas if r.committed and not r.seg.dead]
            if not reps and obj.ssd is None:
                self.stats["misses"] += 1
                out.append(["NOT_FOUND", f"object {key!r} has no readable replica"])
                continue
            if obj.readers and obj.lease_until <= now:  # expired leases: written off (see _leased)
                obj.readers = 0
                obj.holders.clear()
                obj.lease_seq += 1
            obj.lease_until = now + ttl
            obj.readers += 1
            obj.holders[holder] = obj.holders.get(holder, 0) + 1
            self.lru.touch(obj)
            if hot and (key in self._access or len(self._access) < HOT_KEYS_TRACKED):
                self._access[key] += 1
            self.stats["hits"] += 1
            if len(reps) > 1:
                reps = self._order(reps, host, now)
            if reps:
                reps[0].seg.reads += 1
            ssd = None if obj.ssd is None else [obj.ssd.path, obj.ssd.host_id, obj.ssd.checksum]
            # a replica: [segment, address, host, replica id, mount id] (the ids: see _op_report)
            out.append([None, {"size": obj.size, "gen": obj.gen, "checksum": obj.checksum, "ssd": ssd,
                               "replicas": [[r.seg.name, r.addr, r.seg.host_id, r.id, r.seg.mount]
                                            for r in reps], "lease": obj.lease_seq}])  # fmt: skip
        return {"results": out, "epoch": self.incarnation, "lease_s": ttl}

    @staticmethod
    def _order(reps: list[Replica], host: str | None, now: float) -> list[Replica]:
        """Replica choice: the reader's host first, else the less loaded of two random replicas;
        segments a reader reported unreachable last. The first one is the one to read."""
        good = [r for r in reps if r.seg.reported_until <= now] or reps
        local = [r for r in good if r.seg.host_id == host]
        if local:
            pick = local[0]
        else:
            a, b = random.sample(good, 2) if len(good) > 1 else (good[0], good[0])
            pick = a if a.seg.reads <= b.seg.reads else b
        rest = [r for r in reps if r is not pick]
        rest.sort(key=lambda r: r.seg.reported_until > now)
        return [pick, *rest]

    def _op_release(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """End read leases: ``leases`` is a list of [key, gen, lease] from get replies. A release
        from an older lease epoch (its lease expired and was written off, see ``_leased``) is
        ignored: it must not end a newer reader's lease. So is one without an epoch ([key, gen],
        an older client): that lease ends at its deadline. So is one from a client (connection,
        when unregistered) that holds no lease on the object: a client ends its own leases only."""
        leases = req["leases"]
        self._check_batch(len(leases) // 4)
        holder = _lease_holder(sess)
        now = time.monotonic()
        for item in leases:
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                continue
            key, gen, seq = item
            obj = self.objects.get(key)
            if obj is not None and obj.gen == gen and obj.readers > 0 and self._leased(obj, now):
                held = obj.holders.get(holder, 0)
                if obj.lease_seq == seq and held > 0:
                    obj.readers -= 1
                    if held > 1:
                        obj.holders[holder] = held - 1
                    else:
                        del obj.holders[holder]
        return {}

    def _op_exists(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        keys = req["keys"]
        self._check_batch(len(keys))
        return {"results": self.objects.committed_many(keys)}

    def _op_remove(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Remove objects; a leased (or busy) one is BUSY unless ``force``: then its key is gone at
        once, its space held until the leases end (see ``_take_replica``)."""
        keys = req["keys"]
        self._check_batch(len(keys))
        now = time.monotonic()
        force = bool(req.get("force", False))
        out: list[list[Any]] = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None or not obj.committed:
                out.append(["NOT_FOUND", f"no object under key {key!r}"])
            elif not force and (self._leased(obj, now) or obj.busy):
                out.append(["BUSY", f"object {key!r} is leased by a reader; retry after the lease"])
            else:
                self._drop(obj)
                out.append([None, None])
        return {"results": out}

    def _op_remove_all(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Remove up to ``max_batch`` committed objects that are not leased; ``more`` says whether
        to call again (the client does)."""
        now = time.monotonic()
        removed = 0
        for obj in list(self.lru.candidates(now, self.config.max_batch)):
            if obj.busy or self._leased(obj, now):
                self.lru.skip(obj)
            else:
                self._drop(obj)
                removed += 1
        ssd_only = [o for o in itertools.islice(self._ssd_only, self.config.max_batch) if not o.busy]
        for obj in ssd_only:
            self._drop(obj)
        removed += len(ssd_only)
        return {"removed": removed, "more": removed > 0 and self.n_committed > 0}

    # ------------------------------------------------------------------ RPC ops: replicas
    def _op_replica_start(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """change_replica: lower at once, or allocate new replicas for the caller to fill."""
        caller = self._client(req, sess)
        key, n = req["key"], int(req["replicas"])
        if n < 1:
            raise _Err("INVALID", "replicas must be >= 1")
        obj = self.objects.get(key)
        if obj is None or not obj.committed:
            raise _Err("NOT_FOUND", f"no object under key {key!r}")
        committed = [r for r in obj.replicas if r.committed and not r.seg.dead]
        if not committed:
            raise _Err("NOT_FOUND", f"object {key!r} has no memory replica")
        if n <= len(obj.replicas):
            if self._leased(obj, time.monotonic()) or obj.busy:
                raise _Err("BUSY", f"object {key!r} is leased or being copied; retry later")
            obj.base_replicas = n  # after the checks: a refused change leaves the count
            self._shrink(obj, n)
            return {"src": None, "dst": []}
        obj.base_replicas = n
        have = {r.seg for r in obj.replicas}
        placed = self._place_copies(obj, n - len(obj.replicas), have, time.monotonic())
        new = [self._add_replica(obj, seg, off, caller.id) for seg, off in placed]
        if not new:  # nowhere to place one: nothing to copy, nothing to end
            return {"src": None, "dst": []}
        src = committed[0]
        return {
            "src": [src.seg.name, src.addr],
            "dst": [[r.seg.name, r.addr] for r in new],
            "size": obj.alloc_size,
            "gen": obj.gen,
            "epoch": self.incarnation,
            "change": self._start_change(caller, obj, new),
        }

    def _start_change(self, caller: Client, obj: Obj, new: list[Replica]) -> int:
        """A replica copy by ``caller`` into the ``new`` replicas begins; returns its id, which
        its ``replica_end`` names: that ends these replicas, and no others."""
        obj.busy += 1
        self._change_ids += 1
        caller.changing[self._change_ids] = (obj, new)
        return self._change_ids

    def _op_promote_start(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Allocate a memory replica for an object that lives only on the SSD tier; ``gen`` is the
        generation whose bytes the caller read (another one under the key now: NOT_FOUND)."""
        caller = self._client(req, sess)
        key, gen = req["key"], req["gen"]
        obj = self.objects.get(key)
        if obj is None or not obj.committed or obj.ssd is None:
            raise _Err("NOT_FOUND", f"no SSD-tier object under key {key!r}")
        if obj.gen != gen:
            raise _Err("NOT_FOUND", f"object {key!r} was replaced since generation {gen} was read")
        if obj.replicas or obj.busy:
            return {"dst": []}
        placed = self._place_copies(obj, 1, set(), time.monotonic())
        new = [self._add_replica(obj, seg, off, caller.id) for seg, off in placed]
        change = self._start_change(caller, obj, new) if new else None
        return {"dst": [[r.seg.name, r.addr] for r in new], "gen": obj.gen, "epoch": self.incarnation,
                "checksum": obj.checksum, "change": change,
                "mounts": {r.seg.name: r.seg.mount for r in new}}  # fmt: skip

    def _op_replica_end(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """End the caller's copy into new replicas (``replica_start`` or ``promote_start``, named
        by its ``change`` id; without one, an older client's, its first copy of ``key`` and
        ``gen``): ``ok`` commits the replicas it was handed on ``segments``, else they are taken
        back (fenced). No other replica is touched: one placed on a segment of that name since
        (remounted after its client was declared dead) by another copy is that copy's."""
        caller = self._client(req, sess)
        key, ok, gen, change = req["key"], bool(req["ok"]), req.get("gen"), req.get("change")
        done = set(req.get("segments") or [])  # before the change ends: a bad one ends nothing
        if change is None:
            ids = (i for i, (o, _) in caller.changing.items() if o.key == key and gen in (None, o.gen))
            change = next(ids, None)
        entry = caller.changing.get(change) if isinstance(change, int) else None
        if entry is None or entry[0].key != key:
            raise _Err("NOT_FOUND", f"no change_replica of {key!r} by this client")
        del caller.changing[change]
        obj, mine = entry
        if self.objects.get(key) is not obj:  # removed (or replaced): its replicas went with it
            raise _Err("NOT_FOUND", f"object {key!r} disappeared during change_replica")
        self._end_change(obj, mine, done, ok)
        self._memory_changed(obj)  # promoted back into memory, or still SSD only
        return {"replicas": sum(r.committed for r in obj.replicas)}

    def _end_change(self, obj: Obj, mine: list[Replica], done: set[str] | None, ok: bool) -> None:
        """A replica copy into ``mine`` ended: the object is no longer busy with it; those of its
        replicas still there on ``done`` segments (None: all of them) are committed when ``ok``,
        the rest taken (fenced). None is left unfinished: no end but this one would ever come
        for it (it stayed, its space held and the object's count of replicas one too high)."""
        obj.busy = max(0, obj.busy - 1)
        for r in list(obj.replicas):
            if not r.committed and any(r is x for x in mine):
                if ok and (done is None or r.seg.name in done) and not r.seg.dead:
                    r.committed, r.writer = True, ""
                else:
                    self._take_replica(obj, r)
