"""The store master's RPC operations on clients and their segments: ``ping``, ``register``,
``attach``, ``unregister``, ``heartbeat`` (liveness, write floor, queued tasks), ``mount``,
``unmount``, ``task_done`` and ``report`` (an unreachable segment, a corrupt replica, a bad or
unreadable SSD file). A mixin of :class:`kvpool.store.master.Master`, whose state and helpers it
uses; every operation runs under the master's lock, called by :meth:`Master.handle` once per
request."""

from __future__ import annotations

import hmac
import secrets
import time
from typing import TYPE_CHECKING, Any

from kvpool.store.layout import HEADER_SIZE
from kvpool.store.objects import Client, MasterError

if TYPE_CHECKING:
    from kvpool.store.master import Master

    _Base = Master
else:
    _Base = object

_Err = MasterError

#: The kinds of report this master takes (:meth:`ClientOps._op_report`), listed in its reply.
REPORT_KINDS = ("unreachable", "corrupt", "ssd_corrupt", "ssd_missing", "ssd_unreadable")


class ClientOps(_Base):
    """``_op_*`` handlers for clients and segments (see the module docstring)."""

    def _op_ping(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        return {"master": self.incarnation}

    def _op_register(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """A new client session, bound to this connection; ``token`` lets the client's other
        connections :meth:`_op_attach` to it. An id in use by another connection is refused."""
        cid, host_id, ssd_dir = req["client"], req.get("host_id", ""), req.get("ssd_dir")
        if not isinstance(cid, str) or not cid:
            raise _Err("INVALID", "client id must be a non-empty string")
        if not isinstance(host_id, str) or not isinstance(ssd_dir, (str, type(None))):
            # a spill's path is made of ssd_dir: one of another type raised in every eviction round
            # (in a tick, on the master's thread: it ended the master)
            raise _Err("INVALID", "host_id must be a string, ssd_dir a string or None")
        bound = sess.get("client")
        if bound is not None and bound != cid:
            raise _Err("INVALID", f"this connection belongs to client {bound!r}")
        if cid in self.clients:
            if bound != cid:
                raise _Err("EXISTS", f"client id {cid!r} is registered by another connection")
            self._remove_client(cid)  # registering again on its own connection: a fresh session
        token = secrets.token_bytes(16)
        cl = Client(cid, host_id, time.monotonic(), ssd_dir, token)
        self.clients[cid] = cl
        if cl.ssd_dir:
            self._ssd_clients.append(cl)
        self._departed.pop(cid, None)
        sess["client"] = cid
        c = self.config
        return {
            "master": self.incarnation,
            "token": token,
            "lease_ttl_ms": c.lease_ttl_ms,
            "client_ttl_s": c.client_ttl_s,
            "put_timeout_s": c.put_timeout_s,
            "quarantine_s": c.quarantine_s,
            "max_batch": c.max_batch,
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
        c = self._client(req, sess)
        self._remove_client(c.id, floor=int(req.get("floor") or 0))
        return {}

    def _op_heartbeat(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """Liveness, the client's write floor (releases its fences), and its queued tasks."""
        cid = sess.get("client")
        if req.get("client") not in (None, cid):
            raise _Err("INVALID", f"this connection belongs to client {cid!r}, not {req['client']!r}")
        c = self.clients.get(cid) if cid is not None else None
        if c is None:
            return {"master": self.incarnation, "reregister": True, "tasks": []}
        now = time.monotonic()
        c.last_seen = now
        c.beats = (c.beats[1], now)
        if req.get("floor") is not None:
            c.floor = int(req["floor"])
            if self.space.has_fences(c.id):
                self.space.release(self._floor_of, now, only=c.id)
        tasks, c.tasks = c.tasks, []
        return {"master": self.incarnation, "tasks": self._hand_out(tasks, now)}

    def _hand_out(self, tasks: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
        """The queued tasks a heartbeat reply carries. Each one the master waits a report of gets
        ``ttl_s``: what is left of its ``task_timeout_s`` now, not all of it (it was queued up to
        a heartbeat period ago: the client, counting from its heartbeat, started tasks the master
        had given up on). Ones past their deadline, or already ended, are not handed out."""
        out = []
        for task in tasks:
            due = task.pop("_due", None)
            if due is not None:
                if due <= now or task["task"] not in self._tasks:
                    continue  # failed (or about to be, at the next tick): nothing to run
                task["ttl_s"] = due - now
            out.append(task)
        return out

    def _op_mount(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        c = self._client(req, sess)
        name, base, size = req["segment"], int(req["base"]), int(req["size"])
        if not isinstance(name, str) or not name:
            raise _Err("INVALID", "segment name must be a non-empty string")
        if size <= HEADER_SIZE or base <= 0 or base + size > 1 << 64:
            # addresses in it go on the wire as uint64: one past 2**64 made every reply naming it
            # unencodable (puts placed there answered ERROR with their space taken)
            raise _Err("INVALID", f"segment base must be positive, size above {HEADER_SIZE} bytes, and the "
                       "segment inside the 64-bit address space")  # fmt: skip
        if name in self.space.segments:
            raise _Err("EXISTS", f"segment {name!r} is already mounted")
        for other in c.segments:
            s = self.space.segments.get(other)
            if s is not None and base < s.base + s.size and s.base < base + size:
                # one memory under two segments: an object placed in one would be written over by
                # objects placed in the other (a large one, checked by its header only, read wrong)
                raise _Err("INVALID", f"segment {name!r} overlaps this client's segment {other!r}")
        self.space.mount(name, c.id, base, size, c.host_id).mount = self._new_id()
        c.segments.add(name)
        return {}

    def _op_unmount(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        c = self._client(req, sess)
        name = req["segment"]
        seg = self.space.segments.get(name)
        if seg is None or name not in c.segments:
            raise _Err("NOT_FOUND", f"segment {name!r} is not mounted by this client")
        self._unmount(seg)
        return {}

    def _op_task_done(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """A task the client ran ended. The report of a task an earlier master handed out (its
        ``epoch``) is ignored: that task's id may be the id of another task here. ``accepted``
        says whether the report counted: a spill's file of one that did not (its task expired,
        or an earlier master's) belongs to no object, and the client removes it."""
        c = self._client(req, sess)
        tid, ok, result = int(req["task"]), bool(req["ok"]), req.get("result") or {}
        if not isinstance(result, dict):
            raise _Err("INVALID", "task_done: result must be a map")
        if req.get("epoch") not in (None, self.incarnation):
            self.stats["tasks_stale_reports"] += 1
            return {"accepted": False}
        if tid not in c.task_ids:
            self.stats["tasks_late_reports"] += 1
            return {"accepted": False}
        if ok and self._tasks[tid][1]["type"] == "spill" and not isinstance(result.get("checksum"), str):
            # checked before the task ends: a report that fails halfway left its object busy for good
            raise _Err("INVALID", "task_done: a spill that succeeded names its file's checksum")
        self._finish_task(tid, ok, result)
        return {"accepted": True}

    def _expire_tasks(self, now: float) -> None:
        """Tasks not reported done by their deadline failed (the heartbeat reply that carried them
        may have been lost): their objects are free again, a late report of them is ignored."""
        deadlines = self._task_deadlines
        while deadlines and deadlines[0][0] <= now:
            _, tid = deadlines.popleft()
            if tid in self._tasks:
                self._finish_task(tid, ok=False, result={})
                self.stats["tasks_expired"] += 1

    def _ssd_corrupt(self, key: str, gen: int, path: str, by: str | None = None) -> None:
        """A reader on its host found an object's SSD file bad: the copy is let go of (its file
        unlinked), and the object too when no memory replica is left. ``by``: the client that
        reported it ``ssd_unreadable`` (its own check could not open it on checks apart), which
        must be the copy's own client; that copy is counted in ``ssd_copies_unreadable``."""
        obj = self.objects.get(key)
        if obj is None or obj.gen != gen or obj.ssd is None or obj.ssd.path != path:
            return
        if by is not None and by != obj.ssd.client:
            return  # only the copy's client can tell its file cannot be opened there
        self._forget_ssd(obj)
        self._ssd_only.discard(obj)
        self._spilled.discard(obj)  # its memory is kept: no other copy
        self.stats["ssd_copies_corrupt" if by is None else "ssd_copies_unreadable"] += 1
        if obj.committed and not any(r.committed for r in obj.replicas):
            self._drop(obj)
            self.stats["objects_lost"] += 1

    def _ssd_missing(self, key: str, gen: int, path: str) -> None:
        """A reader could not use an object's SSD file, and cannot tell whether it is bad (off
        the copy's host: the directory may not be shared with it; or missing on it: maybe
        replaced meanwhile): the copy's client checks the file (an ``ssd_check`` task, at most
        one per copy per ``client_ttl_s``) and reports it corrupt (:meth:`_ssd_corrupt`) when
        it is bad. Without this an SSD-only object whose file was lost stayed for good when its
        readers were off its host."""
        obj = self.objects.get(key)
        if obj is None or obj.gen != gen or obj.ssd is None or obj.ssd.path != path:
            return
        now = time.monotonic()
        if now - obj.ssd.checked_at < self.config.client_ttl_s or obj.ssd.client not in self.clients:
            return  # checked lately; or its client is gone (the copy is being let go of)
        obj.ssd.checked_at = now
        self.stats["ssd_checks"] += 1
        task = {"type": "ssd_check", "key": key, "gen": gen, "path": path, "size": obj.size,
                "checksum": obj.ssd.checksum}  # fmt: skip
        self._give_task(obj.ssd.client, task)

    def _op_ssd_known(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """A client sweeping its SSD directory asks which of its file names (at most
        ``max_batch``) no SSD copy has (``unknown``); it removes those older than ``grace_s``
        (by then any spill that wrote one was reported done or given up on: one accepted is
        listed). Only from a registered client. The file of a spill in flight is known too: it
        may be written, its report not taken yet, and its mtime older than the grace by another
        clock's (a directory shared by two clients, on NFS or after a clock step)."""
        self._client(req, sess)
        names = req.get("names")
        if not isinstance(names, list) or len(names) > self.config.max_batch:
            raise _Err("INVALID", f"names must be a list of at most {self.config.max_batch} file names")
        known, flying = self._ssd_names, self._spilling
        unknown = [n for n in names if isinstance(n, str) and n not in known and n not in flying]
        return {"unknown": unknown, "grace_s": 2 * self.config.task_timeout_s + 1}

    def _op_report(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        """A reader could not reach a segment (others skip it at once), found a replica whose
        bytes fail their checksum (that replica is dropped), an SSD file that is not its
        object's (``ssd_corrupt``: that copy is dropped) or one it could not use
        (``ssd_missing``: :meth:`_ssd_missing`); or its own client's check could not open one
        of its SSD files on checks apart (``ssd_unreadable``: that copy is dropped, counted
        apart from corrupt ones). Only from a registered client. The reply lists the ``kinds``
        this master knows: an older one ignores a kind it does not know and answers ``{}``
        (the client then reports ``ssd_unreadable`` as ``ssd_corrupt``).

        A report names what its reader saw in its get reply (a writer: what its put reply
        granted, ``mounts``): the master's ``epoch``, the segment's ``mount`` and (a reader's)
        the ``replica`` id; one about another master, an earlier mount of the segment (mounted
        again since: it is not demoted) or another replica (a later one at the same address: it
        is kept) is ignored. Without them (older clients) a report names the segment, and a
        corrupt one the replica's ``addr`` (None: any replica there)."""
        c = self._client(req, sess)
        self._report(c, req)
        return {"kinds": REPORT_KINDS}

    def _report(self, c: Client, req: dict[str, Any]) -> None:
        """Take one report of client ``c`` (:meth:`_op_report`)."""
        if req.get("epoch") not in (None, self.incarnation):
            self.stats["reports_stale"] += 1
            return
        if req["kind"] in ("ssd_corrupt", "ssd_unreadable"):
            by = c.id if req["kind"] == "ssd_unreadable" else None
            self._ssd_corrupt(req["key"], req["gen"], req["path"], by)
            return
        if req["kind"] == "ssd_missing":
            self._ssd_missing(req["key"], req["gen"], req["path"])
            return
        now = time.monotonic()
        seg = self.space.segments.get(req["segment"])
        if seg is None:
            return
        if req.get("mount") not in (None, seg.mount):
            self.stats["reports_stale"] += 1  # about an earlier mount of the segment
            return
        if req["kind"] == "unreachable":
            if seg.reported_until <= now:
                self.stats["segments_reported"] += 1
            seg.reported_until = now + self.config.client_ttl_s
        elif req["kind"] == "corrupt":
            obj = self.objects.get(req["key"])
            rid, addr = req.get("replica"), req.get("addr")
            if obj is not None and obj.gen == req["gen"]:
                for r in obj.replicas:
                    if r.seg is not seg or not r.committed:
                        continue
                    if r.id == rid if rid is not None else addr in (None, r.addr):
                        r.committed, r.writer = False, "?"  # fenced: whoever wrote over it may go on
                        self._take_replica(obj, r)
                        self.stats["replicas_corrupt"] += 1
                        break
                self._memory_changed(obj)  # SSD only, or lost, when no memory replica is left
