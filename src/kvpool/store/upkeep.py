"""The store master's upkeep, a mixin of :class:`kvpool.store.master.Master`: eviction (LRU per
cache class, spilling to a client's SSD tier instead of dropping where it may), and the periodic
work of its ticks (liveness of clients, letting go of dead segments' objects a bounded number at a
time, hot-key replication, task results). Runs under the master's lock, from the master's tick
thread or a request that needs room; every call does bounded work."""

from __future__ import annotations

import gc
import hashlib
import logging
import math
import os
import random
import secrets
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from kvpool.store.objects import Client, Obj, Segment, SsdCopy

if TYPE_CHECKING:
    from kvpool.store.master import Master

    _Base = Master
else:
    _Base = object

log = logging.getLogger("kvpool.master")

DYING_PER_TICK = 4096  # objects of unmounted segments let go of per tick
SLOW_EVERY_S = 1.0  # liveness, fences, spilled objects, hot keys
STALL_S = 1.0  # a tick this late means the master itself was stalled
SPILL_BACKOFF_S = (1.0, 60.0)  # a disk failing spills gets none for 1 s, then 2 s, ... at most 60 s


class Upkeep(_Base):
    """Eviction and periodic work (see the module docstring)."""

    # ------------------------------------------------------------------ eviction
    def _evict(self, now: float, need: int = 0, looks: int = 0) -> int:
        """Free ``need`` bytes (or, above the high watermark, down to ``eviction_ratio`` below it),
        looking at no more than ``looks`` (default ``evict_batch``) objects: ephemeral ones first,
        then default, then soft-pinned; persistent objects are only ever spilled."""
        cap = self.space.capacity
        if cap == 0:
            return 0
        c = self.config
        if need == 0:
            if self._evict_to is None:
                if self.space.used <= c.eviction_high_watermark * cap:
                    return 0
                self._evict_to = int((c.eviction_high_watermark - c.eviction_ratio) * cap)
            need = self.space.used - self._evict_to
            if need <= 0:
                self._evict_to = None
                return 0
        freed = 0
        looked = 0
        ssd: list[Client] | None = None  # SSD clients taking spills now (looked up when needed)
        for obj in self.lru.candidates(now, looks or c.evict_batch):
            if freed >= need:
                break
            looked += 1
            if obj.busy or obj in self._spilled or not obj.replicas or self._leased(obj, now):
                self.lru.skip(obj)
                continue
            held = obj.alloc_size * len(obj.replicas)
            if (obj.soft_pin or obj.cache_class == "persistent") and self._ssd_clients and obj.ssd is None:
                if ssd is None:
                    ssd = [x for x in self._ssd_clients if x.spill_after <= now]
                self.lru.skip(obj)
                if ssd:
                    self._spill(obj, random.choice(ssd))
                    freed += held  # freed once the spill lands
                continue  # else kept until a disk of the SSD tier takes spills again
            if obj.cache_class == "persistent":
                self.lru.skip(obj)  # never dropped from the pool without an SSD tier
                continue
            if obj.ssd is not None:
                self._free_memory(obj)
            else:
                self._drop(obj)
            self.stats["evictions"] += 1
            freed += held
        self.stats["evict_steps"] += 1
        self.stats["evict_looked_max"] = max(self.stats["evict_looked_max"], looked)
        return freed

    def _free_memory(self, obj: Obj) -> None:
        """An object on the SSD tier gives its memory replicas back (it stays, SSD only)."""
        for r in list(obj.replicas):
            self._take_replica(obj, r)
        self.lru.remove(obj)
        self._spilled.discard(obj)
        self._ssd_only.add(obj)

    def _spill(self, obj: Obj, client: Client) -> None:
        r = next(x for x in obj.replicas if x.committed)
        assert obj.key is not None
        digest = hashlib.sha1(obj.key.encode()).hexdigest()
        # A file name of its own per spill (generation and a random token): no two copies ever
        # share a path, so nothing done for one (a late report, unlink, check or sweep; a spill
        # still writing after its task expired; a copy of an earlier master, whose generations
        # were the same numbers) can hit another's file: one that shared it with a copy dropped
        # before (the same object spilled again, maybe by another client on the same directory)
        # was dropped or unlinked by a late report or unlink for the old copy.
        name = f"{digest}-{obj.gen}-{secrets.token_hex(8)}.kvp"
        path = os.path.join(client.ssd_dir or "", digest[:2], name)
        obj.busy += 1
        src = [r.seg.name, r.addr, r.seg.host_id, r.id, r.seg.mount]  # as a get reply names it
        task = {"type": "spill", "key": obj.key, "gen": obj.gen, "epoch": self.incarnation, "size": obj.size,
                "checksum": obj.checksum, "src": src, "path": path}  # fmt: skip
        self._give_task(client.id, task)
        self.stats["spills"] += 1

    # ------------------------------------------------------------------ periodic work
    def _tick(self, now: float) -> None:
        c = self.config
        if now - self._last_tick > STALL_S:
            # The master itself did not run (a long request, or it was stopped): clients could
            # not be heard meanwhile, so nobody is judged on that silence.
            log.warning("store master stalled for %.1fs: liveness restarts now", now - self._last_tick)
            self._live_floor = now
            self.stats["master_stalls"] += 1
        self._last_tick = now
        while self._pending:  # abandoned puts and reservations, oldest first
            obj = next(iter(self._pending.values()))
            if obj.deadline >= now:
                break
            self._drop(obj)
            self.stats["put_revoked_timeout"] += 1
        budget = DYING_PER_TICK
        while self._dying and budget > 0:
            budget = self._let_go(self._dying[0], budget)
            if not self._dying[0].objs:
                self._dying.popleft()
        while self._ssd_dying and budget > 0:
            budget = self._let_go_ssd(self._ssd_dying[0], budget)
            if not self._ssd_dying[0].ssd_objs:
                self._ssd_dying.popleft()
        self.space.release_holds(now)
        self._expire_tasks(now)
        self._evict(now)
        if now < self._next_slow:
            return
        self._next_slow = now + SLOW_EVERY_S
        if self._gc_managed:
            gc.collect(1)
        ttl = c.client_ttl_s
        floor = self._live_floor
        for cid in [cid for cid, cl in self.clients.items() if now - max(cl.last_seen, floor) > ttl]:
            log.warning("client %s missed heartbeats for %.1fs: unmounting its segments", cid, ttl)
            self._remove_client(cid)
            self.stats["clients_dead"] += 1
        self.space.release(self._floor_of, now)
        for cid in [cid for cid in self._departed if not self.space.has_fences(cid)]:
            del self._departed[cid]
        for obj in [o for o in self._spilled if not self._leased(o, now)]:
            self._free_memory(obj)
        if c.hot_key_replication and now - self._last_hot >= c.hot_interval_s:
            self._last_hot = now
            self._hot_keys(now)

    def _let_go(self, seg: Segment, budget: int) -> int:
        """Drop a dead segment's replicas from up to ``budget`` objects; returns what is left."""
        while seg.objs and budget > 0:
            obj = seg.objs.pop()
            budget -= 1
            for r in [r for r in obj.replicas if r.seg is seg]:
                obj.replicas.remove(r)
                self.obj_bytes -= obj.size
            if not obj.committed:
                self._drop(obj)  # a put that lost a target cannot commit
            else:
                self._memory_changed(obj)  # SSD only, or lost, when no memory replica is left
        return budget

    def _let_go_ssd(self, cl: Client, budget: int) -> int:
        """Drop the SSD copies on a removed client's disk from up to ``budget`` objects; returns
        what is left. Nobody can unlink those files any more, nor (off its host) read them: an
        object only there was lost (it stayed for good, every get a miss, every put of its key
        refused); one with a memory replica keeps it."""
        while cl.ssd_objs and budget > 0:
            obj = cl.ssd_objs.pop()
            budget -= 1
            if obj.ssd is None or obj.ssd.client != cl.id or self.objects.get(obj.key or "") is not obj:
                continue
            again = self.clients.get(cl.id)
            if again is not None and obj in again.ssd_objs:
                continue  # spilled again to a client registered under the same id: its copy
            self._forget_ssd(obj)  # a client registered again under its id gets the unlink
            self._spilled.discard(obj)  # its memory is kept: no other copy
            self.stats["ssd_copies_lost"] += 1
            self._memory_changed(obj)  # back in the LRU, or lost
        return budget

    def _remove_client(self, cid: str, floor: int | None = None) -> None:
        cl = self.clients.pop(cid, None)
        if cl is None:
            return
        if cl.ssd_dir:
            self._ssd_clients = [x for x in self._ssd_clients if x is not cl]
        if cl.ssd_objs:
            self._ssd_dying.append(cl)  # its SSD copies are let go of, a bounded number per tick
        for name in list(cl.segments):
            seg = self.space.segments.get(name)
            if seg is not None:
                self._unmount(seg)
        for obj in list(cl.pending):
            self._drop(obj)  # its unfinished puts: fenced until its floor (or the hold) says so
        for tid in list(cl.task_ids):
            self._finish_task(tid, ok=False, result={})
        for obj, mine in cl.changing.values():  # its copies never end: their replicas are taken (fenced)
            self._end_change(obj, mine, None, ok=False)
        if floor is not None:
            self._departed[cid] = floor

    def _unmount(self, seg: Segment) -> None:
        cl = self.clients.get(seg.client)
        if cl is not None:
            cl.segments.discard(seg.name)
        self.space.unmount(seg)
        self._dying.append(seg)

    def _hot_keys(self, now: float) -> None:
        hist, window = self._access_hist, self._access_window
        if len(hist) == hist.maxlen:
            window.subtract(hist[0])  # the count that leaves the window
        hist.append(self._access)
        window.update(self._access)
        self._access = Counter()
        window += Counter()  # drop keys whose count went to zero
        n = len(self.space.segments)
        if n < 2:
            return
        k = max(1, math.ceil(n * math.log2(n)))
        hot = {key for key, cnt in window.most_common(k) if cnt >= 2}
        want = min(self.config.hot_max_replicas, n)
        for key in hot:
            obj = self.objects.get(key)
            if obj is None or not obj.committed or obj.busy or obj in self._spilled:
                continue
            if not any(r.committed for r in obj.replicas) or len(obj.replicas) >= want:
                continue
            self._hot.add(key)
            self._replicate(obj, want - len(obj.replicas), now)
        for key in list(self._hot - hot):
            obj = self.objects.get(key)
            if obj is None:
                self._hot.discard(key)
            elif not obj.busy and not self._leased(obj, now):
                self._hot.discard(key)
                self._shrink(obj, obj.base_replicas)

    def _replicate(self, obj: Obj, extra: int, now: float) -> None:
        src = next(r for r in obj.replicas if r.committed)
        placed = self._place_copies(obj, extra, {r.seg for r in obj.replicas}, now)
        for seg, off in placed:
            r = self._add_replica(obj, seg, off, seg.client)
            obj.busy += 1
            self._give_task(seg.client, {"type": "replicate", "key": obj.key, "gen": obj.gen,
                                         "size": obj.alloc_size, "src": [src.seg.name, src.addr],
                                         "dst": [seg.name, r.addr]}, dst=r)  # fmt: skip
            self.stats["hot_replications"] += 1

    def _shrink(self, obj: Obj, n: int) -> int:
        """Drop committed replicas beyond ``n`` (most loaded segments first); returns how many."""
        extra = [r for r in obj.replicas if r.committed]
        if len(extra) <= n:
            return 0
        extra.sort(key=lambda r: -r.seg.reads)
        drop = extra[: len(extra) - n]
        for r in drop:
            self._take_replica(obj, r)
        return len(drop)

    def _finish_task(self, tid: int, ok: bool, result: dict[str, Any]) -> None:
        entry = self._tasks.pop(tid, None)
        if entry is None:
            return
        cid, task, dst = entry
        if task["type"] == "spill":
            name = os.path.basename(task["path"])
            self._spilling[name] -= 1
            if self._spilling[name] <= 0:
                del self._spilling[name]
        cl = self.clients.get(cid)
        if cl is not None:
            cl.task_ids.discard(tid)
        key = task.get("key")
        obj = self.objects.get(key) if key is not None else None
        if obj is not None and obj.gen != task.get("gen"):
            obj = None  # the object was replaced meanwhile
        if task["type"] == "replicate" and obj is not None:
            obj.busy -= 1
            # The replica this task was handed, if still there: not another copy's placed since
            # on a segment of that name (mounted anew), which this one never wrote.
            r = next((x for x in obj.replicas if x is dst and not x.committed), None)
            if r is not None:
                if ok:
                    r.committed = True
                    r.writer = ""
                else:
                    self._take_replica(obj, r)
            self._memory_changed(obj)  # its source may have died meanwhile
        elif task["type"] == "spill":
            self._spill_ended(cl, ok, bool(result.get("disk_error")))
            if obj is not None:
                obj.busy -= 1
                if ok:
                    owner = self.clients.get(cid)
                    obj.ssd = SsdCopy(cid, task["path"], result["checksum"], owner.host_id if owner else "")
                    self._ssd_names.add(os.path.basename(task["path"]))
                    if owner is not None:
                        owner.ssd_objs.add(obj)
                    self._spilled.add(obj)  # memory freed once no lease holds it
                    if not self._leased(obj, time.monotonic()):
                        self._free_memory(obj)
            elif ok:
                # The object was removed (or replaced) while it spilled: its file is nobody's, and
                # no other spill writes that path (each spill names a file of its own).
                self._give_task(cid, {"type": "unlink", "path": task["path"]})

    def _spill_ended(self, cl: Client | None, ok: bool, disk_error: bool) -> None:
        """A spill by ``cl`` ended. One its disk failed (full, EIO) gets it no spill for a while,
        doubling with each such failure in a row: else every eviction round handed it the same
        spills again, each one a read of the object and a failed write, many per second."""
        if cl is None:
            return
        if ok:
            cl.spill_failures, cl.spill_after = 0, 0.0
        elif disk_error:
            self.stats["spill_disk_errors"] += 1
            now = time.monotonic()
            if now < cl.spill_after:
                return  # a spill handed out before this backoff began: it does not grow it
            cl.spill_failures += 1
            first, most = SPILL_BACKOFF_S
            cl.spill_after = now + min(most, first * 2 ** min(cl.spill_failures - 1, 16))
