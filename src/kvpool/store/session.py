"""The store client's session with the master (a base of :class:`kvpool.store.client.Store`):
master RPCs that register again when the master forgot this client, registration and mounting
(fresh memory on every new session: writers of an old session may still write into the old
one), reports, reservation refills and the heartbeat thread, which also carries ended read
leases and hands master tasks to the task thread."""

from __future__ import annotations

import logging
import mmap
import threading
import time
from typing import Any

from kvpool._rpc import RpcClient, UnknownClient
from kvpool.errors import ConfigError, KvpoolError, MasterUnavailable
from kvpool.store.client_base import ClientBase
from kvpool.store.reservations import mounts_of, reserve_count
from kvpool.store.staging import addr_of
from kvpool.store.tasks import TaskRunner

log = logging.getLogger("kvpool.store")


class MasterSession(ClientBase):
    """Registration, segments and heartbeat; state set up by ``Store.__init__``."""

    client_id: str
    host_id: str
    segment_name: str | None
    _token: bytes | None
    _session_gen: int
    _register_lock: threading.Lock
    _hb_rpc: RpcClient
    _closed: threading.Event
    _task_runner: TaskRunner
    _next_sweep: float  # monotonic time of the next sweep of the SSD directory (0: at the next beat)
    _segment_view: memoryview | None
    _segment_base: int
    _retired: list[memoryview]
    _mounted: bool

    def _call(self, op: str, **args: Any) -> dict[str, Any]:
        """Master RPC; registers again (and retries once) when the master forgot this client."""
        if self._releases:
            with self._release_lock:
                args["release"], self._releases = self._releases, []
        session = self._session_gen
        try:
            return self._rpc.call(op, **args)
        except UnknownClient:
            log.warning("store master does not know us (restarted?): registering again")
            self._register(session)
            args.pop("release", None)
            return self._rpc.call(op, **args)

    def _session(self) -> dict[str, Any] | None:
        """What a new master connection attaches to (see kvpool._rpc.RpcClient ``bind``)."""
        token = self._token
        return None if token is None else {"client": self.client_id, "token": token}

    def _on_master(self, hello: dict[str, Any]) -> None:
        """Every new master connection: a different incarnation means the master restarted, and
        everything it handed out (reservations, locations) is void."""
        if self.master_incarnation is not None and hello.get("instance") != self.master_incarnation:
            log.warning("store master restarted: dropping reservations and locations, registering again")
            self._token = None
            self._forget_master_state()

    def _forget_master_state(self) -> None:
        self._resv.clear()
        self._loc.clear()
        with self._release_lock:
            self._releases = []
            self._late_releases = []

    def _register(self, session: int | None = None) -> None:
        """Register (again). ``session``: the session the caller saw fail; when another thread
        registered since, there is nothing to do."""
        with self._register_lock:
            if session is None or session == self._session_gen:
                self._register_locked()
                self._session_gen += 1

    def _register_locked(self) -> None:
        self._token = None  # this connection registers; others attach with the new token
        reply = self._rpc.call(
            "register", client=self.client_id, host_id=self.host_id, ssd_dir=self.config.ssd_dir
        )
        if self.master_incarnation is not None and reply["master"] != self.master_incarnation:
            self._forget_master_state()
        self.master_incarnation = reply["master"]
        self._token = reply["token"]
        self._rpc.mark_bound(self._session())  # `register` bound this connection itself
        self._lease_s = reply["lease_ttl_ms"] / 1000.0
        self._write_window_s = reply["put_timeout_s"] / 2
        self._max_batch = int(reply["max_batch"])
        if self.config.transfer_timeout_s > reply["quarantine_s"]:
            raise ConfigError(
                f"transfer_timeout_s ({self.config.transfer_timeout_s}s) is longer than the master's "
                f"quarantine_s ({reply['quarantine_s']}s): a failed write could land in reused space. "
                "Lower transfer_timeout_s or raise the master's quarantine_s"
            )
        if self.segment_name is not None:
            if self._mounted:
                # Registering again (declared dead, or a new master): writers of the old session may
                # still write into the old memory, so mount fresh memory instead.
                self._new_segment()
            self._rpc.call("mount", segment=self.segment_name, base=self._segment_base,
                           size=self.config.segment_size)  # fmt: skip
            self._mounted = True

    def _new_segment(self) -> None:
        """Shared memory, pre-faulted (as RDMA registration would pin it): same-host clients map
        it and copy straight in; remote ones go through the engine's TCP path. A previous segment
        is unregistered (late TCP writes into it are refused), its pages are freed (late writes
        through a peer's mapping land in memory nobody reads), and its address range stays mapped
        so it is never handed out again in this process."""
        old = self._segment_view
        if old is not None:
            try:
                self.engine.unregister_local_memory(self._segment_base)
            except KvpoolError as exc:
                log.debug("unregistering the old segment: %s", exc)
            mem = old.obj
            if isinstance(mem, mmap.mmap) and hasattr(mmap, "MADV_REMOVE"):
                try:
                    mem.madvise(mmap.MADV_REMOVE)
                except OSError as exc:
                    log.debug("freeing the old segment's pages: %s", exc)
            self._retired.append(old)
        self._segment_view = self.engine.alloc_shared_buffer(self.config.segment_size, "kvpool-segment")
        self._segment_base = addr_of(self._segment_view)

    def _refill(self) -> None:
        """Top up reservation pools that ran low (off the put path, on the heartbeat connection)."""
        for ck, (size, config) in self._resv.to_refill().items():
            cfg = None if config is None else config.wire()
            t0 = time.monotonic()
            reply = self._hb_rpc.call("reserve", size=size, config=cfg, count=reserve_count(size))
            deadline = t0 + self._write_window_s
            self._resv.add(
                ck, reply["epoch"], reply["reserved"], deadline, self.master_incarnation, mounts_of(reply)
            )

    def _heartbeat_loop(self) -> None:
        next_beat = time.monotonic() + self.config.heartbeat_s
        while not self._closed.is_set():
            self._resv.wanted.wait(max(0.0, next_beat - time.monotonic()))
            if self._closed.is_set():
                return
            if self._resv.wanted.is_set():
                try:
                    self._refill()
                except KvpoolError as exc:
                    log.debug("reservation refill failed: %s", exc)
                if time.monotonic() < next_beat:
                    continue
            next_beat = time.monotonic() + self.config.heartbeat_s
            session = self._session_gen
            try:
                self._resv.expire()
                self._flush_releases_idle()
                self.engine.release_exited_peers()  # a dead storage server's memory is let go
                # Tasks in the reply are not started after sent + their ttl_s (what was left of the
                # master's deadline when it replied, after sent: so never after that deadline).
                sent = time.monotonic()
                reply = self._hb_rpc.call("heartbeat", floor=self._writes.floor())
                if reply.get("reregister") or reply["master"] != self.master_incarnation:
                    log.warning("store master restarted or forgot us: registering again")
                    self._register(session)
                    self._hb_rpc.close()  # attaches to the new session on its next call
                    continue
                for task in reply.get("tasks", []):  # on the task thread: heartbeats go on meanwhile
                    self._task_runner.submit(task, sent + task.get("ttl_s", float("inf")))
                if self.config.ssd_dir and self.config.ssd_sweep_s and sent >= self._next_sweep:
                    self._next_sweep = sent + self.config.ssd_sweep_s
                    self._task_runner.submit({"type": "ssd_sweep"}, float("inf"))  # after the spills
            except UnknownClient:
                log.warning("store master does not know us (restarted?): registering again")
                try:
                    self._register(session)
                except KvpoolError as exc:
                    log.debug("registering again failed: %s", exc)
            except MasterUnavailable as exc:
                log.debug("heartbeat failed: %s", exc)
            except KvpoolError as exc:
                log.warning("heartbeat error: %s", exc)
