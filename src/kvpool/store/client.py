"""Store client: contributes memory (and optionally an SSD directory) to the pool; put/get objects.

Bytes never pass through the master. A put gets allocations (epoch + generation) from the master
or from a reservation, writes header + value through the transfer engine
(:mod:`kvpool.store.datapath`), and commits them itself. A get asks the master for the object's
replicas under a lease, reads one (others on failure) and checks the object's header (and
checksum) after the bytes landed; small objects whose location this client already knows are read
without asking the master at all (one engine READ, checked the same way), falling back to the
master when the check fails.

Fencing, client side: allocations of a master incarnation are dropped when the master changes
(reservations, cached locations), a write never starts later than half of ``put_timeout_s`` after
its allocation was asked for, and every heartbeat reports the *floor* (the oldest allocation this
client may still write), which lets the master reuse space taken back from it.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool._rpc import ERRORS, RpcClient, UnknownClient
from kvpool.config import StoreConfig
from kvpool.errors import (
    ConfigError,
    Fenced,
    InvalidArgument,
    InvalidType,
    KvpoolError,
    MasterUnavailable,
    ObjectChanged,
    ObjectNotFound,
    RegistrationError,
    StoreError,
    TransferError,
)
from kvpool.store.datapath import DataPath, ReadJob, WriteJob, copy_out, host_view
from kvpool.store.layout import CHECKSUM_ALWAYS_MAX, HEADER_SIZE, checksum, header_mismatch, key_hash
from kvpool.store.locations import COMMITTED, LOCAL, SEEN, Loc, LocationCache
from kvpool.store.reservations import (
    RESERVE_BATCH_MAX,
    RESERVE_BYTES,
    RESERVE_MAX,
    ReservationPool,
    WriteFloor,
    reserve_count,
)
from kvpool.store.ssd import read_ssd_file
from kvpool.store.staging import DIRECT_MIN, Staging, addr_of
from kvpool.store.tasks import run_task
from kvpool.transfer.device import device_buffer
from kvpool.transfer.engine import TransferEngine, buffer_range
from kvpool.transfer.types import OpCode, host_id

log = logging.getLogger("kvpool.store")


@dataclass
class ReplicateConfig:
    """Per-put placement policy.

    Attributes:
        replicas: copies on distinct segments (capped by the number of mounted segments).
        soft_pin: keep in memory as long as possible; spilled to SSD (if any) rather than dropped.
        soft_pin_ttl_s: soft pin lasts this long, then the object is an ordinary one.
        preferred_segment: segment name to place the first replica on, when it has room.
        cache_class: ``"default"``, ``"ephemeral"`` (first evicted) or ``"persistent"`` (never
            dropped from the pool: spilled to the SSD tier instead of evicted).
    """

    replicas: int = 1
    soft_pin: bool = False
    soft_pin_ttl_s: float = 3600.0
    preferred_segment: str | None = None
    cache_class: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            raise InvalidArgument(f"ReplicateConfig.replicas must be an int >= 1, got {self.replicas!r}")
        if self.cache_class not in ("default", "ephemeral", "persistent"):
            raise InvalidArgument(
                f"ReplicateConfig.cache_class must be 'default', 'ephemeral' or 'persistent', "
                f"got {self.cache_class!r}"
            )
        if not isinstance(self.soft_pin_ttl_s, (int, float)) or not self.soft_pin_ttl_s > 0:
            raise InvalidArgument(f"ReplicateConfig.soft_pin_ttl_s must be > 0, got {self.soft_pin_ttl_s!r}")

    def wire(self) -> dict[str, Any]:
        """The map sent to the master."""
        return {
            "replicas": self.replicas,
            "soft_pin": self.soft_pin,
            "soft_pin_ttl_s": self.soft_pin_ttl_s,
            "preferred_segment": self.preferred_segment,
            "cache_class": self.cache_class,
        }


def _check_key(key: Any) -> None:
    """A key is a non-empty str (InvalidType / InvalidArgument naming it otherwise)."""
    if not isinstance(key, str):
        raise InvalidType(f"key must be a str, not {type(key).__name__} ({key!r})")
    if not key:
        raise InvalidArgument("key must not be empty")


def _check_config(config: Any) -> None:
    if config is not None and not isinstance(config, ReplicateConfig):
        raise InvalidType(f"config must be a ReplicateConfig or None, not {type(config).__name__}")


def _err(code: str, msg: str) -> KvpoolError:
    return ERRORS.get(code, StoreError)(msg)


# A get reads objects known only by this client's own checksum (location cache kind LOCAL) without
# the master when they are all it reads and total at most this: xxh3 of 8 MiB (~130 us) costs
# about one master round trip.
LOCAL_READ_MAX = 8 << 20


class Store:
    """A client of the kvpool store. Create with :meth:`Store.connect`.

    ``master=None`` starts an embedded in-process master (the embedded default). A client with
    ``segment_size > 0`` contributes that much DRAM to the pool; ``segment_size=0`` only uses it.
    """

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._master = None
        if config.master is None:
            from kvpool.store.master import Master

            self._master = Master(host=config.hostname, port=0, secret=config.secret).start()
            master_addr = self._master.address
        else:
            master_addr = config.master
        self.master_address = master_addr
        self.engine = TransferEngine(
            hostname=config.hostname,
            metadata=config.metadata,
            protocol=config.protocol,
            secret=config.secret,
            timeout_s=config.transfer_timeout_s,
        )
        self.client_id = f"{self.engine.segment_name}/{uuid.uuid4().hex[:12]}"
        self.host_id = host_id()
        self._token: bytes | None = None  # session token from `register` (other connections attach)
        self._session_gen = 0  # registrations so far
        self.master_incarnation: int | None = None
        self._lease_s = 5.0
        self._write_window_s = 5.0
        self._max_batch = 4096
        rpc_args: dict[str, Any] = dict(on_connect=self._on_master, bind=self._session, what="store master")
        self._rpc = RpcClient(master_addr, config.rpc_timeout_s, config.secret, **rpc_args)
        self._hb_rpc = RpcClient(master_addr, config.rpc_timeout_s, config.secret, **rpc_args)
        self._staging = Staging(self.engine, config.buffer_size)
        self._data = DataPath(self.engine, self._staging, self._report, config.checksum)
        self._writes = WriteFloor()
        self._resv = ReservationPool(self._writes)
        self._loc = LocationCache(config.location_cache, config.location_cache_ttl_s)
        self.segment_name: str | None = None
        self._segment_view: memoryview | None = None
        self._segment_base = 0
        self._retired: list[memoryview] = []  # old segment mappings: address space kept, pages freed
        self._mounted = False
        if config.segment_size > 0:
            self._new_segment()
            self.segment_name = self.engine.segment_name
        if config.ssd_dir:
            os.makedirs(config.ssd_dir, exist_ok=True)
        self._closed = threading.Event()
        self._register_lock = threading.Lock()
        self._releases: list[list[Any]] = []  # ended read leases not yet reported to the master
        self._release_lock = threading.Lock()
        try:
            self._register()
        except BaseException:
            self._shutdown_local()
            raise
        self._hb = threading.Thread(target=self._heartbeat_loop, name="kvpool-store-heartbeat", daemon=True)
        self._hb.start()

    @classmethod
    def connect(
        cls,
        master: str | None = None,
        hostname: str = "127.0.0.1",
        segment_size: int | None = None,
        buffer_size: int | None = None,
        protocol: str = "auto",
        metadata: str = "p2p",
        *,
        config: StoreConfig | None = None,
        **kwargs: Any,
    ) -> Store:
        """Connect to a master (``"host:port"``, or None for an embedded one) and mount memory."""
        fields: dict[str, Any] = dict(master=master, hostname=hostname, protocol=protocol, metadata=metadata)
        if segment_size is not None:
            fields["segment_size"] = segment_size
        if buffer_size is not None:
            fields["buffer_size"] = buffer_size
        fields.update(kwargs)
        cfg = config.replace(**fields) if config is not None else StoreConfig(**fields)
        return cls(cfg)

    # ------------------------------------------------------------------ master session
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

    def _report(self, segment: str, kind: str, key: str | None, gen: int | None) -> None:
        """Tell the master a segment is unreachable or a replica corrupt (one-way)."""
        try:
            self._rpc.send("report", segment=segment, kind=kind, key=key, gen=gen)
        except KvpoolError as exc:
            log.debug("report to the master failed: %s", exc)

    def _refill(self) -> None:
        """Top up reservation pools that ran low (off the put path, on the heartbeat connection)."""
        for ck, (size, config) in self._resv.to_refill().items():
            cfg = None if config is None else config.wire()
            t0 = time.monotonic()
            reply = self._hb_rpc.call("reserve", size=size, config=cfg, count=reserve_count(size))
            deadline = t0 + self._write_window_s
            self._resv.add(ck, reply["epoch"], reply["reserved"], deadline, self.master_incarnation)

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
                reply = self._hb_rpc.call("heartbeat", floor=self._writes.floor())
                if reply.get("reregister") or reply["master"] != self.master_incarnation:
                    log.warning("store master restarted or forgot us: registering again")
                    self._register(session)
                    self._hb_rpc.close()  # attaches to the new session on its next call
                    continue
                for task in reply.get("tasks", []):
                    self._run_task(task)
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

    def close(self) -> None:
        """Unmount, disconnect and stop the embedded master (if any)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._resv.wanted.set()
        self._hb.join(5)
        unused = self._resv.clear()
        mine = [[e.gen, False] for e in unused if e.epoch == self.master_incarnation]
        try:
            for i in range(0, len(mine), self._max_batch):
                self._call("put_revoke", items=mine[i : i + self._max_batch], epoch=self.master_incarnation)
            self._rpc.call("unregister", floor=self._writes.floor())
        except KvpoolError:
            pass
        self._shutdown_local()

    def _shutdown_local(self) -> None:
        self._rpc.close()
        self._hb_rpc.close()
        self.engine.close()
        if self._master is not None:
            self._master.stop()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ put
    def _chunks(self, n: int) -> list[tuple[int, int]]:
        step = self._max_batch
        return [(i, min(n, i + step)) for i in range(0, n, step)]

    def _put(
        self,
        keys: Sequence[str],
        sources: list[tuple[int, int] | memoryview],
        config: ReplicateConfig | None,
        reserve: int = 0,
    ) -> list[KvpoolError | None]:
        sizes = [s[1] if isinstance(s, tuple) else s.nbytes for s in sources]
        for i, n in enumerate(sizes):
            if not isinstance(n, int) or isinstance(n, bool):
                raise InvalidType(f"size of {keys[i]!r} must be an int, not {type(n).__name__}")
            if n <= 0:
                what = "is empty" if n == 0 else f"has a negative size ({n})"
                raise InvalidArgument(f"value of {keys[i]!r} {what}: sizes must be more than 0 bytes")
        out: list[KvpoolError | None] = []
        for a, b in self._chunks(len(keys)):
            out += self._put_chunk(list(keys[a:b]), sources[a:b], sizes[a:b], config, reserve)
        return out

    def _put_chunk(self, keys: list[str], sources: list[Any], sizes: list[int],
                   config: ReplicateConfig | None, reserve: int,
                   batch_reserved: bool = True) -> list[KvpoolError | None]:  # fmt: skip
        if batch_reserved and reserve == 0 and 2 <= len(keys) <= RESERVE_BATCH_MAX and len(set(sizes)) == 1:
            if sizes[0] * len(keys) <= RESERVE_BYTES:
                done = self._put_batch_reserved(keys, sources, sizes[0], config)
                if done is not None:
                    return done
                reserve = len(keys)  # space for the next batch of this shape comes with this one
        cfg = None if config is None else config.wire()
        t0 = time.monotonic()
        reply = self._call("put_start", keys=keys, sizes=sizes, config=cfg, reserve=reserve)
        epoch, results = reply["epoch"], reply["results"]
        gens = [val[0] for code, val in results if code is None]
        self._writes.begin(epoch, gens)
        if reply.get("reserved"):
            deadline = t0 + self._write_window_s
            self._resv.add(
                self._resv_key(sizes[0], config), epoch, reply["reserved"], deadline, self.master_incarnation
            )
        out: list[KvpoolError | None] = [None] * len(keys)
        jobs: list[tuple[int, WriteJob]] = []
        try:
            for i, (code, val) in enumerate(results):
                if code is not None:
                    out[i] = _err(code, val)
                else:
                    jobs.append((i, WriteJob(keys[i], sizes[i], sources[i], val[0], val[1], val[2])))
            if time.monotonic() > t0 + self._write_window_s:
                late = [[j.gen, False] for _, j in jobs]
                self._call("put_revoke", items=late, epoch=epoch)
                for i, _ in jobs:
                    out[i] = Fenced(f"put of {keys[i]!r} could not start writing within put_timeout_s / 2")
                return out
            self._data.write(epoch, [j for _, j in jobs])
            items = [[j.key, j.gen, j.csum, j.written] for _, j in jobs if j.written]
            revoke = [[j.gen, True] for _, j in jobs if not j.written]
            for i, j in jobs:
                if not j.written:
                    out[i] = TransferError(f"writing {keys[i]!r} to its replicas failed")
            if revoke:
                self._call("put_revoke", items=revoke, epoch=epoch)
            if items:
                committed = [(i, j) for i, j in jobs if j.written]
                try:
                    ends = self._call("put_end", items=items, epoch=epoch)["results"]
                except Fenced as exc:  # the master restarted since put_start: nothing was committed
                    ends = [["STALE", str(exc)]] * len(items)
                known = []
                for (i, j), (code, msg) in zip(committed, ends, strict=True):
                    if code is not None:
                        out[i] = _err(code, msg)
                    else:
                        known.append((j.key, j.gen, j.size, j.csum, j.written, j.replicas))
                self._loc.remember_many(epoch, known)
        finally:
            self._writes.end(epoch, gens)
        return out

    def _put_batch_reserved(self, keys: list[str], sources: list[Any], size: int,
                            config: ReplicateConfig | None) -> list[KvpoolError | None] | None:  # fmt: skip
        """A batch of equal-sized values through reservations: write them all, then one ``commit``
        that also asks for the next batch's reservations (one round trip per batch instead of
        two). None when too few reservations are held or the master restarted meanwhile: nothing
        was committed, the caller puts the normal way. Keys whose write failed, or whose
        reservation the master took back before the commit, are put the normal way here."""
        ck = self._resv_key(size, config)
        got = self._resv.take_many(ck, len(keys))
        if got is None:
            return None
        entries, left = got
        epoch = entries[0].epoch
        gens = [e.gen for e in entries]
        out: list[KvpoolError | None] = [None] * len(keys)
        reply: dict[str, Any] | None = None
        try:
            if any(e.epoch != epoch for e in entries):
                return None
            jobs = [WriteJob(k, size, src, e.gen, e.verify, e.replicas)
                    for k, src, e in zip(keys, sources, entries, strict=True)]  # fmt: skip
            self._data.write(epoch, jobs)
            retry = [i for i, j in enumerate(jobs) if len(j.written) < len(j.replicas)]
            if retry:
                self._revoke_failed(epoch, [(jobs[i].gen, jobs[i].replicas, jobs[i].written) for i in retry])
            todo = [i for i, j in enumerate(jobs) if len(j.written) == len(j.replicas)]
            if todo:
                cfg = None if config is None else config.wire()
                want = len(keys) if left < len(keys) else 0
                t0 = time.monotonic()
                items = [[keys[i], jobs[i].gen, jobs[i].csum] for i in todo]
                reply = self._call("commit", items=items, epoch=epoch, reserve=want, size=size, config=cfg)
        except Fenced:
            return None  # the master restarted: nothing of this batch was committed
        finally:
            self._writes.end(epoch, gens)
        if reply is not None:
            if reply.get("reserved"):
                deadline = t0 + self._write_window_s
                self._resv.add(ck, epoch, reply["reserved"], deadline, self.master_incarnation)
            known, unused = [], []
            for i, (code, msg) in zip(todo, reply["results"], strict=True):
                j = jobs[i]
                if code is None:
                    known.append((j.key, j.gen, size, j.csum, j.written, j.replicas))
                elif code == "NOT_FOUND":
                    retry.append(i)  # the reservation expired meanwhile
                else:
                    unused.append([j.gen, False])  # e.g. ObjectExists; the write is over: free at once
                    out[i] = _err(code, msg)
            if unused:
                self._call("put_revoke", items=unused, epoch=epoch)
            self._loc.remember_many(epoch, known)
        if retry:
            again = self._put_chunk([keys[i] for i in retry], [sources[i] for i in retry],
                                    [size] * len(retry), config, 0, batch_reserved=False)  # fmt: skip
            for i, err in zip(retry, again, strict=True):
                out[i] = err
        return out

    def _revoke_failed(self, epoch: int, failed: list[tuple[int, list[list[Any]], list[str]]]) -> None:
        """Writes into reservations failed (``failed``: generation, replicas, segments written):
        revoke them (fenced: bytes may still land) and, freed at once, the pool's unused
        reservations on the segments that failed, which would fail the same way."""
        bad = {r[0] for _, reps, written in failed for r in reps if r[0] not in written}
        items = [[gen, True] for gen, _, _ in failed]
        items += [[e.gen, False] for e in self._resv.drop_on(bad) if e.epoch == epoch]
        for a, b in self._chunks(len(items)):
            self._call("put_revoke", items=items[a:b], epoch=epoch)

    @staticmethod
    def _view(value: Any) -> memoryview:
        try:
            mv = memoryview(value)
        except TypeError:
            raise InvalidArgument(f"value must be bytes-like, got {type(value).__name__}") from None
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> None:
        """Store ``value`` (bytes-like) under ``key``; raises ObjectExists if the key is taken."""
        _check_key(key)
        _check_config(config)
        view = self._view(value)
        if 0 < view.nbytes <= RESERVE_MAX and self._put_reserved(key, view, config):
            return
        err = self._put([key], [view], config, reserve=reserve_count(view.nbytes))[0]
        if isinstance(err, Fenced):  # the master restarted or the put stalled: once more, afresh
            err = self._put([key], [view], config)[0]
        if err is not None:
            raise err

    def _resv_key(self, size: int, config: ReplicateConfig | None) -> tuple[Any, ...]:
        return (size, None if config is None else tuple(config.wire().values()))

    def _put_reserved(self, key: str, view: memoryview, config: ReplicateConfig | None) -> bool:
        """Put through a reservation: write, then one `commit`. False when none is usable."""
        if not isinstance(key, str) or not key:
            return False  # the master explains what is wrong with the key
        size = view.nbytes
        entry = self._resv.take(self._resv_key(size, config), size, config)
        if entry is None:
            return False
        replicas = entry.replicas
        small = len(replicas) == 1 and size <= DIRECT_MIN  # the common case, with fewer layers
        try:
            if small:
                csum = self._data.write_small(entry.epoch, key, entry.gen, view, *replicas[0][:2])
                written = [] if csum is None else [replicas[0][0]]
            else:
                job = WriteJob(key, size, view, entry.gen, entry.verify, replicas)
                self._data.write(entry.epoch, [job])
                csum, written = job.csum, job.written
            if len(written) < len(replicas):
                self._revoke_failed(entry.epoch, [(entry.gen, replicas, written)])
                return False  # e.g. the segment's server died: the master places the put anew
            res = self._call("commit", items=[[key, entry.gen, csum]], epoch=entry.epoch)
            code, msg = res["results"][0]
        except Fenced:
            return False  # the master restarted meanwhile: put the normal way
        finally:
            self._writes.end(entry.epoch, [entry.gen])
        if code == "NOT_FOUND":
            return False  # the reservation expired meanwhile: put the normal way
        if code is not None:
            # e.g. ObjectExists. The write finished (nothing of it is still on its way): the
            # reservation's space can be given back at once.
            self._call("put_revoke", items=[[entry.gen, False]], epoch=entry.epoch)
            raise _err(code, msg)
        self._loc.remember(key, entry.epoch, entry.gen, size, csum, written, replicas)
        return True

    def put_from(self, key: str, addr: int, size: int, config: ReplicateConfig | None = None) -> None:
        """Store ``size`` bytes at ``addr`` (memory registered with :meth:`register_buffer`)."""
        _check_key(key)
        _check_config(config)
        if not isinstance(addr, int) or isinstance(addr, bool) or addr <= 0:
            raise InvalidArgument(f"addr must be a positive int address of registered memory, got {addr!r}")
        err = self._put([key], [(addr, size)], config)[0]
        if err is not None:
            raise err

    def batch_put(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None
    ) -> list[KvpoolError | None]:
        """Put many objects with one master round trip each way; per-key error or None."""
        if len(keys) != len(values):
            raise InvalidArgument("keys and values differ in length")
        return self._put(list(keys), [self._view(v) for v in values], config)

    def batch_put_from(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[KvpoolError | None]:
        """Put many objects from registered memory; per-key error or None."""
        if not len(keys) == len(addrs) == len(sizes):
            raise InvalidArgument("keys, addrs and sizes differ in length")
        return self._put(list(keys), list(zip(addrs, sizes, strict=True)), config)

    # ------------------------------------------------------------------ locations
    def _get_cached(self, key: str, loc: Loc) -> bytes | None:
        """One small object through its cached location: one engine READ of header + value into
        the staging slot, checked there (the common case of :meth:`_get`, without its lists)."""
        st = self._staging
        if st.small_off is None or not st.small_lock.acquire(blocking=False):
            return None
        try:
            off, n = st.small_off, HEADER_SIZE + loc.size
            seg, raddr = loc.replicas[0][0], loc.replicas[0][1]
            try:
                self.engine.transfer_sync(seg, st.base + off, raddr, n, OpCode.READ)
            except KvpoolError:
                self._loc.forget(key)
                return None
            view = st.view[off : off + n]
            if header_mismatch(view, loc.epoch, loc.gen, key_hash(key), loc.size, loc.csum) is not None or (
                checksum(view[HEADER_SIZE:]) != loc.csum
            ):
                self._loc.forget(key)
                return None
            return bytes(view[HEADER_SIZE:])
        finally:
            st.small_lock.release()

    def _lookup(self, keys: Sequence[str]) -> tuple[list[list[Any]], int, float]:
        """Master lookups (leases taken): per-key [code, info], the epoch, and the local time by
        which reads must have landed."""
        t0 = time.monotonic()
        results: list[list[Any]] = []
        epoch = self.master_incarnation or 0
        lease_s = self._lease_s
        for a, b in self._chunks(len(keys)):
            reply = self._call("get", keys=list(keys[a:b]))
            results += reply["results"]
            epoch, lease_s = reply["epoch"], reply["lease_s"]
        return results, epoch, t0 + lease_s * 0.99

    def _get(
        self, keys: Sequence[str], dests: list[tuple[int, int] | None]
    ) -> list[bytes | int | KvpoolError]:
        """Read objects into ``dests`` (addr, capacity) or, for None, into new bytes."""
        n = len(keys)
        out: list[bytes | int | KvpoolError] = [ObjectNotFound("")] * n
        todo = list(range(n))
        cached: list[tuple[int, ReadJob]] = []
        epoch = self.master_incarnation or 0
        local_bytes = 0
        for i in todo:
            loc = self._loc.get(keys[i], self.master_incarnation)
            if loc is None or loc.kind == SEEN:
                continue
            dest = dests[i]
            if dest is not None and (
                dest[1] < loc.size or (loc.kind == LOCAL and self.engine.is_gpu_memory(dest[0], loc.size))
            ):
                continue  # too small (the master's answer says so); GPU: no copy back for a checksum
            if loc.kind == LOCAL:
                local_bytes += loc.size
            cached.append((i, ReadJob(keys[i], loc.size, loc.gen, loc.csum, loc.replicas, dest, float("inf"),
                                      local_csum=loc.kind == LOCAL)))  # fmt: skip
        if local_bytes and (len(cached) < n or local_bytes > LOCAL_READ_MAX):
            # Objects known by this client's own checksum are read without the master only when
            # that saves the round trip and checksumming them costs less than it does.
            cached = [(i, j) for i, j in cached if not j.local_csum]
        if cached:
            self._data.read(epoch, [j for _, j in cached])
            done = set()
            for i, j in cached:
                if j.error is None:
                    out[i] = j.result  # type: ignore[assignment]
                    done.add(i)
                else:
                    self._loc.forget(keys[i])  # stale: ask the master
            todo = [i for i in todo if i not in done]
        for attempt in range(self.config.get_retries + 1):
            if not todo:
                break
            todo = self._get_from_master(keys, dests, todo, out, last=attempt == self.config.get_retries)
        return out

    def _get_from_master(self, keys: Sequence[str], dests: list[tuple[int, int] | None], todo: list[int],
                         out: list[Any], last: bool) -> list[int]:  # fmt: skip
        """One lookup + read round for keys ``todo``; returns the keys to try again."""
        infos, epoch, deadline = self._lookup([keys[i] for i in todo])
        jobs: list[tuple[int, ReadJob, dict[str, Any]]] = []
        for i, (code, info) in zip(todo, infos, strict=True):
            if code is not None:
                out[i] = _err(code, info)
                continue
            size, dest = info["size"], dests[i]
            if dest is not None and dest[1] < size:
                out[i] = InvalidArgument(
                    f"buffer of {dest[1]} bytes is too small for {keys[i]!r} ({size} bytes)"
                )
            else:
                jobs.append((i, ReadJob(keys[i], size, info["gen"], info["checksum"], info["replicas"], dest,
                                        deadline), info))  # fmt: skip
        self._data.read(epoch, [j for _, j, _ in jobs])
        # Objects without a committed checksum are remembered only from gets small enough to be
        # read without the master later (see _get): no checksum is computed for nothing.
        local_ok = sum(j.size for _, j, _ in jobs) <= LOCAL_READ_MAX
        again: list[int] = []
        for i, j, info in jobs:
            if j.error is None:
                out[i] = j.result
                if j.served_by is not None and (local_ok or j.csum is not None):
                    self._remember_read(j, epoch)
            elif j.retry and not last:
                again.append(i)
            elif info["ssd"] is not None and not j.retry:
                out[i] = self._get_from_ssd(keys[i], info, dests[i])
            else:
                out[i] = j.error
        leases = [[keys[i], info["gen"]] for i, (code, info) in zip(todo, infos, strict=True) if code is None]
        if leases:
            # Reads are done: the leases end with this client's next request (or heartbeat).
            with self._release_lock:
                self._releases += leases
                flush = len(self._releases) >= 1024
            if flush:
                self._flush_releases(self._rpc)
        return again

    def _remember_read(self, j: ReadJob, epoch: int) -> None:
        """Keep the location of an object read through the master (see :mod:`.locations`): with its
        committed checksum; else noted on the first read and checksummed here on the second (the
        bytes were read under a lease and header-checked: they are the object's)."""
        segs = [r[0] for r in j.replicas]
        if j.csum is not None:
            self._loc.remember(j.key, epoch, j.gen, j.size, j.csum, segs, j.replicas)
            return
        prev = self._loc.get(j.key, epoch)
        if prev is None or prev.gen != j.gen:
            self._loc.remember_read(j.key, epoch, j.gen, j.size, None, segs, j.replicas)
        elif prev.kind == SEEN:
            if isinstance(j.result, bytes):
                value: Any = j.result
            elif j.dest is not None and not self.engine.is_gpu_memory(j.dest[0], j.size):
                value = host_view(self.engine, j.dest[0], j.size)
            else:
                return  # a GPU destination: not copied back to host for a checksum
            self._loc.remember_read(j.key, epoch, j.gen, j.size, checksum(value), segs, j.replicas)

    def _flush_releases_idle(self) -> None:
        """The heartbeat thread: report ended read leases on the *main* connection when it is idle
        (never on its own connection: the master could then see this client's next ``remove`` of
        the object before the release and answer ObjectBusy); when busy, the caller's next request
        carries them (``_call``)."""
        with self._release_lock:
            leases, self._releases = self._releases, []
        if not leases:
            return
        sent = 0
        for a in range(0, len(leases), 4 * self._max_batch):
            if not self._rpc.try_send("release", leases=leases[a : a + 4 * self._max_batch]):
                break
            sent = a + 4 * self._max_batch
        if sent < len(leases):
            with self._release_lock:
                self._releases = leases[sent:] + self._releases

    def _flush_releases(self, rpc: RpcClient) -> None:
        with self._release_lock:
            leases, self._releases = self._releases, []
        for a in range(0, len(leases), 4 * self._max_batch):
            rpc.send("release", leases=leases[a : a + 4 * self._max_batch])

    def _get_from_ssd(
        self, key: str, info: dict[str, Any], dest: tuple[int, int] | None
    ) -> bytes | int | KvpoolError:
        if info["ssd"] is None:
            return ObjectNotFound(f"object {key!r} has no readable copy")
        path, _host, checksum = info["ssd"]
        data = read_ssd_file(path, key, info["size"], checksum)
        if data is None:
            return ObjectNotFound(f"SSD copy of {key!r} is missing or corrupt (treated as a miss)")
        if self.config.promote_on_hit:
            try:
                self._promote(key, data)
            except KvpoolError as exc:
                log.debug("promotion of %s failed: %s", key, exc)
        if dest is None:
            return data
        copy_out(self.engine, dest[0], data)
        return len(data)

    def get(self, key: str) -> bytes:
        """The object's bytes; raises :class:`ObjectNotFound` when missing."""
        _check_key(key)
        loc = self._loc.get(key, self.master_incarnation)
        if loc is not None and loc.kind == COMMITTED and loc.size <= CHECKSUM_ALWAYS_MAX:
            data = self._get_cached(key, loc)
            if data is not None:
                return data
        res = self._get([key], [None])[0]
        if isinstance(res, KvpoolError):
            raise res
        assert isinstance(res, bytes)
        return res

    def get_into(self, key: str, buffer_or_addr: Any, size: int | None = None) -> int:
        """Read the object into a buffer or registered address; returns its size."""
        _check_key(key)
        dest, keep = self._dest(buffer_or_addr, size)
        try:
            res = self._get([key], [dest])[0]
        finally:
            self._release(keep)
        if isinstance(res, KvpoolError):
            raise res
        return int(res)  # type: ignore[arg-type]

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Bytes of each key, or None where it is missing or could not be read."""
        return [r if isinstance(r, bytes) else None for r in self._get(list(keys), [None] * len(keys))]

    def batch_get_into(
        self, keys: Sequence[str], buffers_or_addrs: Sequence[Any], sizes: Sequence[int]
    ) -> list[int | KvpoolError]:
        """Read many objects into buffers/registered addresses; per key its size or the error."""
        if not len(keys) == len(buffers_or_addrs) == len(sizes):
            raise InvalidArgument("keys, buffers and sizes differ in length")
        dests, keeps = [], []
        try:
            for b, n in zip(buffers_or_addrs, sizes, strict=True):
                d, k = self._dest(b, n)
                dests.append(d)
                keeps.append(k)
            return self._get(list(keys), dests)  # type: ignore[return-value,arg-type]
        finally:
            for k in keeps:
                self._release(k)

    def _dest(self, buffer_or_addr: Any, size: int | None) -> tuple[tuple[int, int], int | None]:
        """Destination range; buffers not yet registered are registered local-only for the call."""
        dev = device_buffer(buffer_or_addr, size)
        if dev is not None:  # a CUDA tensor / array: registered (local-only) as cuda:N memory
            try:
                addr = self.engine.register_local_memory(buffer_or_addr, size, remote_accessible=False)
            except RegistrationError:
                return (dev[0], dev[1]), None  # already registered (register_buffer)
            return (addr, dev[1]), addr
        addr, n, keep = buffer_range(buffer_or_addr, size)
        if isinstance(buffer_or_addr, int):
            return (addr, n), None  # a raw address: registered by the caller (the engine checks)
        try:
            self.engine.register_local_memory(
                keep if keep is not None else buffer_or_addr, n, remote_accessible=False
            )
        except RegistrationError:
            return (addr, n), None  # already registered (register_buffer)
        return (addr, n), addr

    def _release(self, addr: int | None) -> None:
        if addr is not None:
            self.engine.unregister_local_memory(addr)

    # ------------------------------------------------------------------ other ops
    def exists(self, key: str) -> bool:
        """True when a committed object is stored under ``key``."""
        _check_key(key)
        return bool(self.batch_exists([key])[0])

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Existence of each key (one master round trip per ``max_batch`` keys)."""
        out: list[bool] = []
        for a, b in self._chunks(len(keys)):
            out += self._call("exists", keys=list(keys[a:b]))["results"]
        return out

    def size(self, key: str) -> int:
        """Size in bytes of the object."""
        _check_key(key)
        return int(self._call("info", key=key)["size"])

    def remove(self, key: str, force: bool = False) -> None:
        """Remove an object; a leased one raises ObjectBusy unless ``force``."""
        _check_key(key)
        self._loc.forget(key)
        code, msg = self._call("remove", keys=[key], force=force)["results"][0]
        if code is not None:
            raise _err(code, msg)

    def remove_all(self) -> int:
        """Remove every committed object not currently leased; returns how many."""
        self._loc.clear()
        total = 0
        while True:
            r = self._call("remove_all")
            total += int(r["removed"])
            if not r.get("more"):
                return total

    def stats(self) -> dict[str, Any]:
        """The master's counters and gauges."""
        return self._call("stats")["stats"]

    def info(self, key: str) -> dict[str, Any]:
        """Placement of an object: size, replicas (segment, address, committed), SSD path."""
        return self._call("info", key=key)

    def register_buffer(self, buffer_or_addr: Any, size: int | None = None, location: str = "cpu:0") -> int:
        """Register memory for put_from/get_into without per-call registration; returns its address.

        GPU memory: a CUDA tensor / ``__cuda_array_interface__`` object, or an int address with
        ``location="cuda:N"``. Values then move between the GPU and the pool by DMA (same host:
        straight from/into the storage segment's shared memory; other hosts: staged)."""
        return self.engine.register_local_memory(buffer_or_addr, size, location, remote_accessible=False)

    def unregister_buffer(self, addr_or_buffer: Any) -> None:
        """Undo :meth:`register_buffer`."""
        self.engine.unregister_local_memory(addr_or_buffer)

    # ------------------------------------------------------------------ replicas
    def _copy(self, size: int, src: list[Any], dsts: list[list[Any]], check: tuple[Any, ...]) -> list[bool]:
        """Copy one replica (header + value, ``size`` bytes) to others through staging; the
        source is checked (``check``: epoch, gen, key hash, length, checksum) before it is copied."""
        addr, view, token = self._staging.take(size)
        try:
            if not self._data.run([self._data.req(OpCode.READ, addr, src[0], src[1], size)])[0]:
                return [False] * len(dsts)
            if header_mismatch(view, *check) is not None:
                return [False] * len(dsts)
            return self._data.run([self._data.req(OpCode.WRITE, addr, d[0], d[1], size) for d in dsts])
        finally:
            self._staging.give(token)

    def change_replica(self, key: str, replicas: int) -> int:
        """Raise or lower the replica count of a committed object; returns the new count.

        New copies move client to client through the transfer engine (via this client's staging
        buffer), never through the master. Raising is capped by the number of segments.
        """
        r = self._call("replica_start", key=key, replicas=replicas)
        if not r["dst"]:
            return len([x for x in self.info(key)["replicas"] if x[2]])
        epoch, gen = r["epoch"], r["gen"]
        info = self.info(key)
        check = (epoch, gen, key_hash(key), r["size"] - HEADER_SIZE, info.get("checksum"))
        ok = False
        self._writes.begin(epoch, [gen])
        try:
            ok = all(self._copy(r["size"], r["src"], r["dst"], check))
        finally:
            self._writes.end(epoch, [gen])
            done = self._call("replica_end", key=key, gen=gen, ok=ok, segments=[d[0] for d in r["dst"]])
        if not ok:
            raise TransferError(f"copying {key!r} to its new replicas failed")
        return int(done["replicas"])

    def _promote(self, key: str, data: bytes) -> None:
        r = self._call("promote_start", key=key)
        if not r["dst"]:
            return
        epoch, gen = r["epoch"], r["gen"]
        job = WriteJob(key, len(data), memoryview(data), gen, r["checksum"] is not None, r["dst"])
        ok = False
        self._writes.begin(epoch, [gen])
        try:
            self._data.write(epoch, [job])
            ok = len(job.written) == len(r["dst"]) and r["checksum"] in (None, job.csum)
        finally:
            self._writes.end(epoch, [gen])
            self._call("replica_end", key=key, gen=gen, ok=ok, segments=[d[0] for d in r["dst"]])

    # ------------------------------------------------------------------ master tasks
    def _run_task(self, task: dict[str, Any]) -> None:
        run_task(self, task)

    # ------------------------------------------------------------------ tensors
    def put_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> None:
        """Store a CPU torch tensor (dtype and shape travel with the bytes)."""
        import msgpack

        if not (hasattr(tensor, "detach") and hasattr(tensor, "dtype")):
            raise InvalidType(
                f"tensor must be a torch.Tensor, not {type(tensor).__name__} (use put() for bytes, "
                "or torch.tensor(...) first)"
            )
        t = tensor.detach().contiguous().cpu()
        header = msgpack.packb({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)})
        raw = t.view(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b""
        self.put(key, struct.pack("<I", len(header)) + header + raw, config)

    def get_tensor(self, key: str) -> Any:
        """A tensor stored with :meth:`put_tensor`."""
        import msgpack
        import torch

        data = self.get(key)
        (hlen,) = struct.unpack_from("<I", data)
        meta = msgpack.unpackb(data[4 : 4 + hlen])
        dtype = getattr(torch, meta["dtype"])
        body = bytearray(data[4 + hlen :])
        if not body:
            return torch.empty(meta["shape"], dtype=dtype)
        return torch.frombuffer(body, dtype=dtype).reshape(meta["shape"])


__all__ = ["ObjectChanged", "ReplicateConfig", "Store"]
