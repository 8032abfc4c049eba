"""Tasks the master hands a storage client in its heartbeat replies: copy an object into its own
segment (hot-key replicas), spill one to its SSD directory, remove an SSD file, check one a reader
could not use; and the client's own sweep of its SSD directory (``ssd_sweep``, every
``ssd_sweep_s``).

They run on a thread of their own (:class:`TaskRunner`), never on the heartbeat thread: a copy
from an unreachable or stopped source waits up to ``transfer_timeout_s``, and heartbeats held up
that long would get a healthy client declared dead (its segment unmounted, its objects lost)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from kvpool._rpc import UnknownClient
from kvpool.errors import KvpoolError
from kvpool.store.datapath import ReadJob
from kvpool.store.layout import HEADER_SIZE, header_mismatch, key_hash
from kvpool.store.ssd import SWEEP_BATCH, UnreadableFiles, read_ssd_file, sweep_ssd_dir, write_ssd_file
from kvpool.transfer.types import OpCode

if TYPE_CHECKING:
    from kvpool.store.client import Store

log = logging.getLogger("kvpool.store")

#: Tasks waiting for the task thread at most (more are dropped: the master fails them after its
#: ``task_timeout_s`` and the objects are free again).
MAX_QUEUED_TASKS = 4096


class TaskRunner:
    """The store client's task thread (started on the first task): runs the tasks the heartbeat
    thread queues (:meth:`submit`), one at a time, in order; :meth:`close` stops it."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._cv = threading.Condition()
        self._queue: deque[tuple[dict[str, Any], float]] = deque()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.unreadable = UnreadableFiles()  # SSD files of ours a check could not open

    def submit(self, task: dict[str, Any], deadline: float) -> None:
        """Queue one task (heartbeat thread, per task of a reply); returns at once."""
        with self._cv:
            if self._closed:
                return
            if len(self._queue) >= MAX_QUEUED_TASKS:
                self.dropped += 1
                log.warning("task %s dropped: %d tasks already wait", task.get("type"), MAX_QUEUED_TASKS)
                return
            self._queue.append((task, deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvpool-store-tasks", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                task, deadline = self._queue.popleft()
            try:
                run_task(self._store, task, deadline)
            except Exception:  # noqa: BLE001 - one bad task must not end the thread
                log.exception("task %s failed", task.get("type"))

    def close(self, timeout_s: float = 5.0) -> None:
        """Drop the queued tasks and wait (up to ``timeout_s``) for the one running."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)


def run_task(store: Store, task: dict[str, Any], deadline: float = float("inf")) -> None:
    """Do one task the master handed out in a heartbeat reply, and report how it went. One past
    its ``deadline`` (monotonic: the master counts it failed by then) is not started.

    Called by the store client's task thread (:class:`TaskRunner`), one task at a time."""
    kind = task["type"]
    if kind in ("unlink", "ssd_check", "ssd_sweep"):  # never reported back
        try:
            if kind == "unlink":
                _unlink(task["path"])
            elif kind == "ssd_check":
                _ssd_check(store, task)
            else:
                _ssd_sweep(store)
        except (KvpoolError, OSError) as exc:
            log.warning("task %s failed: %s", kind, exc)
        return
    ok, result = False, {}
    try:
        if time.monotonic() > deadline:
            log.warning("task %s not started: the master gave up on it (task_timeout_s)", kind)
        elif kind == "replicate":
            ok = _replicate_task(store, task)
        elif kind == "spill":
            ok = _spill_task(store, task, result)
    except (KvpoolError, OSError) as exc:
        log.warning("task %s failed: %s", kind, exc)
    try:
        # the master that handed the task out: a restarted one ignores it (task ids start again)
        reply = store._hb_rpc.call(
            "task_done", task=task["task"], ok=ok, result=result, epoch=task.get("epoch")
        )
    except UnknownClient:
        reply = {"accepted": False}  # declared dead meanwhile: its tasks ended unreported
    except KvpoolError as exc:
        log.warning("could not report task %s: %s", kind, exc)
        return
    if kind == "spill" and ok and reply.get("accepted") is False:
        # The master gave up on this spill (task_timeout_s) or is another one: no object has
        # this file, and it stayed on the disk for good. Removed now (the path is this spill's
        # alone: no other copy's file is ever there).
        _unlink(task["path"])


def _ssd_check(store: Store, task: dict[str, Any]) -> None:
    """A reader could not use an SSD file of ours (off our host, or missing): read it here, and
    report it corrupt when it is missing or bad (the master drops that copy). One we could not
    open for another reason (out of file descriptors, a permission, a stale NFS handle) is
    reported (``ssd_unreadable``) only once :class:`UnreadableFiles` calls it lost (a permission
    denied on checks a while apart, the directory fine): till then the file may be fine (a
    reader's next miss asks again)."""
    why: list[str] = []
    err: list[int] = []
    path, unreadable = task["path"], store._task_runner.unreadable
    kind = "ssd_corrupt"
    if read_ssd_file(path, task["key"], task["size"], task["checksum"], why, err) is not None:
        unreadable.done(path)
        return
    if why and why[0] == "unreadable":
        code = errno.errorcode.get(err[0], str(err[0])) if err else "?"
        if not unreadable.lost(path, err[0] if err else 0):
            log.warning("SSD file %s of %r could not be opened (%s) to check it (not reported)",
                        path, task["key"], code)  # fmt: skip
            return
        log.warning(
            "SSD file %s of %r could not be opened (%s) on checks apart: reported", path, task["key"], code
        )
        kind = "ssd_unreadable"
    else:
        unreadable.done(path)
        log.warning("SSD file %s of %r is %s: reported", path, task["key"], why[0] if why else "bad")
    fields = dict(segment="", key=task["key"], gen=task["gen"], path=path, epoch=task.get("epoch"))
    reply = store._hb_rpc.call("report", kind=kind, **fields)
    if kind == "ssd_unreadable" and kind not in (reply or {}).get("kinds", ()):
        # A master older than this kind: it ignores one it does not know (answers {}), and lets
        # go of the copy on ``ssd_corrupt``.
        store._hb_rpc.call("report", kind="ssd_corrupt", **fields)


def _ssd_sweep(store: Store) -> None:
    """Remove the files of our SSD directory no SSD copy has (:func:`sweep_ssd_dir`)."""

    def unknown(names: list[str]) -> tuple[list[str], float]:
        reply = store._hb_rpc.call("ssd_known", names=names)
        return list(reply["unknown"]), float(reply["grace_s"])

    if store.config.ssd_dir:
        n = sweep_ssd_dir(store.config.ssd_dir, unknown, min(SWEEP_BATCH, store._max_batch))
        if n:
            log.info("removed %d files of the SSD tier that no copy has", n)


def _unlink(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def _replicate_task(store: Store, task: dict[str, Any]) -> bool:
    """Copy an object (header + value) straight into this client's own segment; checked there."""
    epoch, gen = store.master_incarnation or 0, task["gen"]
    dst = task["dst"][1]
    store._writes.begin(epoch, [gen])
    try:
        req = store._data.req(OpCode.READ, dst, task["src"][0], task["src"][1], task["size"])
        if not store._data.run([req])[0]:
            return False
    finally:
        store._writes.end(epoch, [gen])
    hdr = (ctypes.c_char * HEADER_SIZE).from_address(dst)
    return header_mismatch(memoryview(hdr).cast("B"), epoch, gen, key_hash(task["key"]),
                           task["size"] - HEADER_SIZE, None) is None  # fmt: skip


def _spill_task(store: Store, task: dict[str, Any], result: dict[str, Any]) -> bool:
    """Read an object from memory, check it, and write it to this client's SSD directory."""
    job = ReadJob(task["key"], task["size"], task["gen"], task["checksum"], [task["src"]], None,
                  float("inf"))  # fmt: skip
    store._data.read(task["epoch"], [job])
    if job.error is not None or not isinstance(job.result, bytes):
        return False
    try:
        result["checksum"] = write_ssd_file(task["path"], task["key"], job.result)
    except OSError as exc:
        log.warning("spill of %s failed: %s", task["key"], exc)
        result["disk_error"] = str(exc)  # the master hands this client no spill for a while
        return False
    return True
