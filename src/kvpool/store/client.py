"""Store client: contributes memory (and optionally an SSD directory) to the pool; put/get objects.

Bytes never pass through the master: a put allocates replicas at the master (or uses a
reservation), writes them through the transfer engine (one batch for all replicas and keys), then
commits; a get takes a lease, reads the replica the master chose (same host first, else the less
loaded of two random ones), and ends the lease with its next request.
"""

from __future__ import annotations

import ctypes
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

import xxhash

from kvpool import _native
from kvpool._rpc import ERRORS, RpcClient, UnknownClient
from kvpool.config import StoreConfig
from kvpool.errors import (
    InvalidArgument,
    KvpoolError,
    MasterUnavailable,
    ObjectNotFound,
    StoreError,
    TransferError,
)
from kvpool.store.allocator import RangeAllocator
from kvpool.transfer.engine import TransferEngine, buffer_range
from kvpool.transfer.types import OpCode, TransferRequest, TransferState, host_id

log = logging.getLogger("kvpool.store")

_SSD_MAGIC = b"KVPSSD01"
DIRECT_MIN = 64 << 10  # values this big move without a staging copy
SMALL_SLOT = 64 << 10  # staging slot kept for one small value at a time
_NATIVE_READ = _native.OP_READ
_NATIVE_WRITE = _native.OP_WRITE
RESERVE_MAX = 4 << 20  # single puts up to this size use reservations (one round trip)
RESERVE_BYTES = 16 << 20  # bytes of reservations asked for at a time, per (size, config)
RESERVE_LOW = 6  # below this many left, a pool is refilled in the background


def _reserve_count(size: int) -> int:
    """How many reservations to ask for with a put of ``size`` bytes (2 to 16)."""
    return max(2, min(16, RESERVE_BYTES // size)) if 0 < size <= RESERVE_MAX else 0


_SSD_HDR = struct.Struct("<8sQQI")  # magic, size, xxh3_64, key length


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

    def wire(self) -> dict[str, Any]:
        """The map sent to the master."""
        return {
            "replicas": self.replicas,
            "soft_pin": self.soft_pin,
            "soft_pin_ttl_s": self.soft_pin_ttl_s,
            "preferred_segment": self.preferred_segment,
            "cache_class": self.cache_class,
        }


def _err(code: str, msg: str) -> KvpoolError:
    return ERRORS.get(code, StoreError)(msg)


def _write_ssd_file(path: str, key: str, data: memoryview) -> str:
    """Write an object file atomically; returns its xxh3-64 hex checksum."""
    digest = xxhash.xxh3_64_intdigest(data)
    kb = key.encode()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as f:
        f.write(_SSD_HDR.pack(_SSD_MAGIC, len(data), digest, len(kb)))
        f.write(kb)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return f"{digest:016x}"


def read_ssd_file(path: str, key: str, size: int, checksum: str) -> bytes | None:
    """Read and verify an SSD-tier file; None when missing, truncated or corrupt."""
    try:
        with open(path, "rb") as f:
            hdr = f.read(_SSD_HDR.size)
            magic, n, digest, klen = _SSD_HDR.unpack(hdr)
            if magic != _SSD_MAGIC or n != size or f.read(klen) != key.encode():
                return None
            data = f.read(n + 1)
    except (OSError, struct.error):
        return None
    if len(data) != size or xxhash.xxh3_64_intdigest(data) != digest or f"{digest:016x}" != checksum:
        return None
    return data


class _Staging:
    """A registered local-only buffer carved into regions for put/get of Python bytes."""

    def __init__(self, engine: TransferEngine, size: int) -> None:
        self.engine = engine
        self.mem = mmap.mmap(-1, size)
        self.view = memoryview(self.mem)
        self.base = engine.register_local_memory(self.view, remote_accessible=False)
        self.alloc = RangeAllocator(size, 64)
        self.lock = threading.Lock()
        # A fixed region for one small value at a time: no allocator on the common small path.
        self.small_off = self.alloc.allocate(SMALL_SLOT)
        self.small_lock = threading.Lock()

    def take(self, size: int) -> tuple[int, memoryview, Any]:
        """(address, view, token) of ``size`` bytes; a temporary registration when it does not fit."""
        if size <= SMALL_SLOT and self.small_off is not None and self.small_lock.acquire(blocking=False):
            off = self.small_off
            return self.base + off, self.view[off : off + size], "small"
        with self.lock:
            off = self.alloc.allocate(size)
        if off is not None:
            return self.base + off, self.view[off : off + size], off
        tmp = mmap.mmap(-1, size)
        view = memoryview(tmp)
        addr = self.engine.register_local_memory(view, remote_accessible=False)
        return addr, view[:size], (tmp, view)

    def source(self, value: memoryview) -> tuple[int, Any]:
        """(address, token) to WRITE ``value`` from: big values are registered in place for the
        call (read-only, local: no copy); small ones are copied into the staging buffer."""
        n = value.nbytes
        if n >= DIRECT_MIN:
            try:
                addr = self.engine.register_local_memory(value, remote_accessible=False)
                return addr, ("registered", addr)
            except KvpoolError:
                pass  # e.g. the same object is being put by another thread: copy it
        addr, view, token = self.take(n)
        view[:] = value
        return addr, token

    def sink(self, size: int) -> tuple[int, Any, Any]:
        """(address, result, token) to READ ``size`` bytes into: a fresh ``bytes`` object filled
        in place for big values, a staging region (copied out afterwards) for small ones."""
        if size >= DIRECT_MIN:
            obj, addr = _native.new_bytes(size)
            self.engine.register_local_memory(addr, size, remote_accessible=False)
            return addr, obj, ("registered", addr)
        addr, view, token = self.take(size)
        return addr, view, token

    def give(self, token: Any) -> None:
        """Return a region taken with :meth:`take`, :meth:`source` or :meth:`sink`."""
        if token == "small":
            self.small_lock.release()
            return
        if isinstance(token, int):
            with self.lock:
                self.alloc.free(token)
            return
        if token[0] == "registered":
            self.engine.unregister_local_memory(token[1])
            return
        _tmp, view = token
        self.engine.unregister_local_memory(_addr_of(view))  # the mapping goes with its last view


def _addr_of(view: memoryview) -> int:
    return _native.buffer_address(view)[0]


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
        self.master_incarnation: int | None = None
        rpc_args: dict[str, Any] = dict(on_connect=self._on_master, bind=self._session, what="store master")
        self._rpc = RpcClient(master_addr, config.rpc_timeout_s, config.secret, **rpc_args)
        self._hb_rpc = RpcClient(master_addr, config.rpc_timeout_s, config.secret, **rpc_args)
        self._staging = _Staging(self.engine, config.buffer_size)
        self.segment_name: str | None = None
        if config.segment_size > 0:
            # Shared memory, pre-faulted (as RDMA registration would pin it): same-host clients map
            # it and copy straight in; remote ones go through the engine's TCP path.
            self._segment_view = self.engine.alloc_shared_buffer(config.segment_size, "kvpool-segment")
            self._segment_base = _addr_of(self._segment_view)
            self.segment_name = self.engine.segment_name
        if config.ssd_dir:
            os.makedirs(config.ssd_dir, exist_ok=True)
        self._closed = threading.Event()
        self._register_lock = threading.Lock()
        self._resv: dict[tuple[Any, ...], list[tuple[float, str, list[list[Any]]]]] = {}
        self._resv_lock = threading.Lock()
        self._refilling: dict[tuple[Any, ...], tuple[int, ReplicateConfig | None]] = {}
        self._refill_wanted = threading.Event()
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

    # ------------------------------------------------------------------ lifecycle
    def _call(self, op: str, **args: Any) -> dict[str, Any]:
        """Master RPC; registers again (and retries once) when the master forgot this client."""
        if self._releases:
            with self._release_lock:
                args["release"], self._releases = self._releases, []
        try:
            return self._rpc.call(op, **args)
        except UnknownClient:
            log.warning("store master does not know us (restarted?): registering again")
            self._register()
            return self._rpc.call(op, **args)

    def _session(self) -> dict[str, Any] | None:
        """What a new master connection attaches to (see kvpool._rpc.RpcClient ``bind``)."""
        token = self._token
        return None if token is None else {"client": self.client_id, "token": token}

    def _on_master(self, hello: dict[str, Any]) -> None:
        """Every new master connection: a different incarnation means the master restarted."""
        if self.master_incarnation is not None and hello.get("instance") != self.master_incarnation:
            log.warning("store master restarted: dropping reservations and registering again")
            self._token = None
            with self._resv_lock:
                self._resv.clear()

    def _register(self) -> None:
        with self._register_lock:
            self._register_locked()

    def _register_locked(self) -> None:
        self._token = None  # this connection registers; others attach with the new token
        reply = self._rpc.call(
            "register", client=self.client_id, host_id=self.host_id, ssd_dir=self.config.ssd_dir
        )
        self.master_incarnation = reply["master"]
        self._token = reply["token"]
        if self.segment_name is not None:
            self._rpc.call(
                "mount",
                client=self.client_id,
                segment=self.segment_name,
                base=self._segment_base,
                size=self.config.segment_size,
            )

    def _refill(self) -> None:
        """Top up reservation pools that ran low (off the put path, on the heartbeat connection)."""
        with self._resv_lock:
            wanted, self._refilling = self._refilling, {}
            self._refill_wanted.clear()
        for ck, (size, config) in wanted.items():
            cfg = None if config is None else config.wire()
            reply = self._hb_rpc.call(
                "reserve", client=self.client_id, size=size, config=cfg, count=_reserve_count(size)
            )
            deadline = time.monotonic() + reply["reserve_ttl_s"] / 2
            with self._resv_lock:
                self._resv.setdefault(ck, [])[:0] = [(deadline, r, reps) for r, reps in reply["reserved"]]

    def _heartbeat_loop(self) -> None:
        next_beat = time.monotonic() + self.config.heartbeat_s
        while not self._closed.is_set():
            self._refill_wanted.wait(max(0.0, next_beat - time.monotonic()))
            if self._closed.is_set():
                return
            if self._refill_wanted.is_set():
                try:
                    self._refill()
                except KvpoolError as exc:
                    log.debug("reservation refill failed: %s", exc)
                if time.monotonic() < next_beat:
                    continue
            next_beat = time.monotonic() + self.config.heartbeat_s
            try:
                self._flush_releases(self._hb_rpc)
                reply = self._hb_rpc.call("heartbeat", client=self.client_id)
                if reply.get("reregister") or reply["master"] != self.master_incarnation:
                    log.warning("store master restarted or forgot us: registering again")
                    self._register()
                    continue
                for task in reply.get("tasks", []):
                    self._run_task(task)
            except UnknownClient:
                log.warning("store master does not know us (restarted?): registering again")
                try:
                    self._register()
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
        self._refill_wanted.set()
        self._hb.join(5)
        with self._resv_lock:
            unused = [rkey for pool in self._resv.values() for _, rkey, _ in pool]
            self._resv.clear()
        if unused:
            try:
                self._call("put_revoke", client=self.client_id, keys=unused)
            except KvpoolError:
                pass
        try:
            self._rpc.call("unregister", client=self.client_id)
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

    # ------------------------------------------------------------------ transfers

    def _run(self, reqs: list[TransferRequest]) -> list[bool]:
        """Submit one batch and wait; per-request success."""
        if not reqs:
            return []
        if len(reqs) == 1:
            r = reqs[0]
            op = _NATIVE_WRITE if r.opcode == OpCode.WRITE else _NATIVE_READ
            return [self._sync(op, r.source, int(r.target_id), r.target_offset, r.length)]
        bid = self.engine.allocate_batch_id(len(reqs))
        try:
            self.engine.submit_transfer(bid, reqs)
            st = self.engine.wait_batch(bid)
            if st.state == TransferState.COMPLETED:
                return [True] * len(reqs)
            return [self.engine.get_transfer_status(bid, i).ok for i in range(len(reqs))]
        finally:
            self.engine.free_batch_id(bid)

    def _sync(self, op: int, local: int, handle_id: int, remote: int, length: int) -> bool:
        """One request done in this thread when a lane is idle (no hand-off to a worker)."""
        return not self.engine._native.transfer_sync(op, local, handle_id, remote, length)

    def _req(self, op: OpCode, local: int, segment: str, remote: int, size: int) -> TransferRequest:
        return TransferRequest(op, local, self.engine.open_segment(segment), remote, size)

    # ------------------------------------------------------------------ put
    def _put(
        self,
        keys: Sequence[str],
        sources: list[tuple[int, int] | memoryview],
        config: ReplicateConfig | None,
        reserve: int = 0,
    ) -> list[KvpoolError | None]:
        cfg = None if config is None else config.wire()
        sizes = [s[1] if isinstance(s, tuple) else s.nbytes for s in sources]
        if any(n <= 0 for n in sizes):
            raise InvalidArgument("values must not be empty")
        reply = self._call(
            "put_start", client=self.client_id, keys=list(keys), sizes=sizes, config=cfg, reserve=reserve
        )
        results = reply["results"]
        if reply.get("reserved"):
            # Keep them until well before the master revokes them.
            deadline = time.monotonic() + reply["reserve_ttl_s"] / 2
            with self._resv_lock:
                pool = self._resv.setdefault(self._resv_key(sizes[0], config), [])
                pool[:0] = [(deadline, rkey, reps) for rkey, reps in reply["reserved"]]
        out: list[KvpoolError | None] = [None] * len(keys)
        reqs: list[TransferRequest] = []
        owner: list[int] = []
        tokens: list[Any] = []
        try:
            for i, (res, src) in enumerate(zip(results, sources, strict=True)):
                code, val = res
                if code is not None:
                    out[i] = _err(code, val)
                    continue
                if isinstance(src, tuple):
                    addr = src[0]
                else:
                    addr, token = self._staging.source(src)
                    tokens.append(token)
                for seg, raddr in val:
                    try:
                        reqs.append(self._req(OpCode.WRITE, addr, seg, raddr, sizes[i]))
                    except KvpoolError as exc:
                        out[i] = exc
                        continue
                    owner.append(i)
            ok = self._run(reqs) if reqs else []
        except KvpoolError as exc:
            ok = [False] * len(reqs)
            for i, res in enumerate(results):
                if res[0] is None and out[i] is None:
                    out[i] = exc
        finally:
            for t in tokens:
                self._staging.give(t)
        for i, good in zip(owner, ok, strict=True):
            if not good and out[i] is None:
                out[i] = TransferError(f"writing {keys[i]!r} to a replica failed")
        commit = [k for i, k in enumerate(keys) if results[i][0] is None and out[i] is None]
        revoke = [k for i, k in enumerate(keys) if results[i][0] is None and out[i] is not None]
        if revoke:
            self._call("put_revoke", client=self.client_id, keys=revoke)
        if commit:
            ends = self._call("put_end", client=self.client_id, keys=commit)["results"]
            idx = {k: i for i, k in enumerate(keys)}
            for k, (code, msg) in zip(commit, ends, strict=True):
                if code is not None:
                    out[idx[k]] = _err(code, msg)
        return out

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
        view = self._view(value)
        if 0 < view.nbytes <= RESERVE_MAX and self._put_reserved(key, view, config):
            return
        err = self._put([key], [view], config, reserve=_reserve_count(view.nbytes))[0]
        if err is not None:
            raise err

    def _resv_key(self, size: int, config: ReplicateConfig | None) -> tuple[Any, ...]:
        return (size, None if config is None else tuple(config.wire().values()))

    def _put_reserved(self, key: str, view: memoryview, config: ReplicateConfig | None) -> bool:
        """Put through a reservation: write, then one `commit`. False when none is usable."""
        ck = self._resv_key(view.nbytes, config)
        now = time.monotonic()
        with self._resv_lock:
            pool = self._resv.get(ck)
            while pool and pool[-1][0] < now:
                pool.pop()  # expired at the master (it revokes them after put_timeout_s)
            if not pool:
                return False
            entry = pool.pop()
            if len(pool) < RESERVE_LOW and ck not in self._refilling:
                self._refilling[ck] = (view.nbytes, config)  # the heartbeat thread refills it
                self._refill_wanted.set()
        _, rkey, replicas = entry
        addr, token = self._staging.source(view)
        try:
            reqs = [self._req(OpCode.WRITE, addr, seg, raddr, view.nbytes) for seg, raddr in replicas]
            ok = all(self._run(reqs))
        except KvpoolError:
            ok = False
        finally:
            self._staging.give(token)
        if not ok:
            self._call("put_revoke", client=self.client_id, keys=[rkey])
            raise TransferError(f"writing {key!r} to a replica failed")
        code, msg = self._call("commit", client=self.client_id, items=[[key, rkey]])["results"][0]
        if code == "NOT_FOUND":
            return False  # the reservation expired meanwhile: put the normal way
        if code is not None:
            with self._resv_lock:
                self._resv.setdefault(ck, []).append(entry)  # unused: keep it for the next put
            raise _err(code, msg)
        return True

    def put_from(self, key: str, addr: int, size: int, config: ReplicateConfig | None = None) -> None:
        """Store ``size`` bytes at ``addr`` (memory registered with :meth:`register_buffer`)."""
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

    # ------------------------------------------------------------------ get
    def _lookup(self, keys: Sequence[str]) -> list[list[Any]]:
        return self._call("get", client=self.client_id, keys=list(keys))["results"]

    def _get(
        self, keys: Sequence[str], dests: list[tuple[int, int] | None], infos: list[list[Any]] | None = None
    ) -> list[bytes | int | KvpoolError]:
        """Read objects into ``dests`` (addr, capacity) or, for None, into new bytes."""
        if infos is None:
            infos = self._lookup(keys)
        out: list[bytes | int | KvpoolError] = [ObjectNotFound("")] * len(keys)
        reqs: list[TransferRequest] = []
        owner: list[tuple[int, Any, memoryview | None]] = []
        ssd: list[int] = []
        for i, (code, info) in enumerate(infos):
            if code is not None:
                out[i] = _err(code, info)
                continue
            size = info["size"]
            dest = dests[i]
            if dest is not None and dest[1] < size:
                out[i] = InvalidArgument(
                    f"buffer of {dest[1]} bytes is too small for {keys[i]!r} ({size} bytes)"
                )
                continue
            if not info["replicas"]:
                ssd.append(i)
                continue
            seg, raddr, _host = info["replicas"][0]  # the master's choice (same host, else less loaded)
            if dest is None:
                addr, view, token = self._staging.sink(size)
            else:
                addr, view, token = dest[0], None, None
            try:
                reqs.append(self._req(OpCode.READ, addr, seg, raddr, size))
            except KvpoolError as exc:
                out[i] = exc
                if token is not None:
                    self._staging.give(token)
                continue
            owner.append((i, token, view))
        try:
            ok = self._run(reqs)
        except KvpoolError as exc:
            ok = [False] * len(reqs)
            for i, _, _ in owner:
                out[i] = exc
        for (i, token, view), good in zip(owner, ok, strict=True):
            size = infos[i][1]["size"]
            if good:
                if view is None:
                    out[i] = size
                else:
                    out[i] = view if isinstance(view, bytes) else bytes(view)
            elif not isinstance(out[i], KvpoolError) or isinstance(out[i], ObjectNotFound):
                out[i] = TransferError(f"reading {keys[i]!r} from its replica failed")
            if token is not None:
                self._staging.give(token)
        for i in ssd:
            out[i] = self._get_from_ssd(keys[i], infos[i][1], dests[i])
        leases = [[k, info["oid"]] for k, (code, info) in zip(keys, infos, strict=True) if code is None]
        if leases:
            # Reads are done: the leases end with this client's next request (or heartbeat).
            with self._release_lock:
                self._releases += leases
                flush = len(self._releases) >= 1024
            if flush:
                self._flush_releases(self._rpc)
        return out

    def _flush_releases(self, rpc: RpcClient) -> None:
        with self._release_lock:
            leases, self._releases = self._releases, []
        if leases:
            rpc.send("release", leases=leases)

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
        ctypes.memmove(dest[0], data, len(data))
        return len(data)

    def get(self, key: str) -> bytes:
        """The object's bytes; raises :class:`ObjectNotFound` when missing."""
        infos = self._lookup([key])
        code, info = infos[0]
        staging = self._staging
        if (
            code is None
            and info["replicas"]
            and info["size"] <= SMALL_SLOT
            and staging.small_off is not None
            and staging.small_lock.acquire(blocking=False)
        ):
            # Fast path for small objects: the fixed staging slot, one native call, one copy out.
            size = info["size"]
            seg, raddr, _host = info["replicas"][0]
            try:
                off = staging.small_off
                ok = self._sync(
                    _NATIVE_READ, staging.base + off, self.engine.open_segment(seg).id, raddr, size
                )
                data = bytes(staging.view[off : off + size]) if ok else None
            finally:
                staging.small_lock.release()
            with self._release_lock:
                self._releases.append([key, info["oid"]])
            if data is None:
                raise TransferError(f"reading {key!r} from its replica failed")
            return data
        res = self._get([key], [None], infos)[0]
        if isinstance(res, KvpoolError):
            raise res
        assert isinstance(res, bytes)
        return res

    def get_into(self, key: str, buffer_or_addr: Any, size: int | None = None) -> int:
        """Read the object into a buffer or registered address; returns its size."""
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
            return self._get(list(keys), dests)  # type: ignore[return-value]
        finally:
            for k in keeps:
                self._release(k)

    def _dest(self, buffer_or_addr: Any, size: int | None) -> tuple[tuple[int, int], int | None]:
        """Destination range; buffers not yet registered are registered local-only for the call."""
        addr, n, keep = buffer_range(buffer_or_addr, size)
        if self.engine._native.is_registered(addr, n):
            return (addr, n), None
        if isinstance(buffer_or_addr, int):
            return (addr, n), None  # unregistered raw address: the engine reports it
        self.engine.register_local_memory(
            keep if keep is not None else buffer_or_addr, n, remote_accessible=False
        )
        return (addr, n), addr

    def _release(self, addr: int | None) -> None:
        if addr is not None:
            self.engine.unregister_local_memory(addr)

    # ------------------------------------------------------------------ other ops
    def exists(self, key: str) -> bool:
        """True when a committed object is stored under ``key``."""
        return bool(self.batch_exists([key])[0])

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Existence of each key (one master round trip)."""
        return list(self._call("exists", keys=list(keys))["results"])

    def size(self, key: str) -> int:
        """Size in bytes of the object."""
        return int(self._call("info", key=key)["size"])

    def remove(self, key: str, force: bool = False) -> None:
        """Remove an object; a leased one raises ObjectBusy unless ``force``."""
        code, msg = self._call("remove", keys=[key], force=force)["results"][0]
        if code is not None:
            raise _err(code, msg)

    def remove_all(self) -> int:
        """Remove every committed object not currently leased; returns how many."""
        return int(self._call("remove_all")["removed"])

    def stats(self) -> dict[str, Any]:
        """The master's counters and gauges."""
        return self._call("stats")["stats"]

    def info(self, key: str) -> dict[str, Any]:
        """Placement of an object: size, replicas (segment, address, committed), SSD path."""
        return self._call("info", key=key)

    def register_buffer(self, buffer_or_addr: Any, size: int | None = None) -> int:
        """Register memory for put_from/get_into without per-call registration; returns its address."""
        return self.engine.register_local_memory(buffer_or_addr, size, remote_accessible=False)

    def unregister_buffer(self, addr_or_buffer: Any) -> None:
        """Undo :meth:`register_buffer`."""
        self.engine.unregister_local_memory(addr_or_buffer)

    # ------------------------------------------------------------------ replicas
    def _copy(self, size: int, src: list[Any], dsts: list[list[Any]]) -> list[bool]:
        """Copy one replica to others through a staging region of this client."""
        addr, _view, token = self._staging.take(size)
        try:
            if not self._run([self._req(OpCode.READ, addr, src[0], src[1], size)])[0]:
                return [False] * len(dsts)
            return self._run([self._req(OpCode.WRITE, addr, d[0], d[1], size) for d in dsts])
        finally:
            self._staging.give(token)

    def change_replica(self, key: str, replicas: int) -> int:
        """Raise or lower the replica count of a committed object; returns the new count.

        New copies move client to client through the transfer engine (via this client's staging
        buffer), never through the master. Raising is capped by the number of segments.
        """
        r = self._call("replica_start", client=self.client_id, key=key, replicas=replicas)
        if not r["dst"]:
            return len([x for x in self.info(key)["replicas"] if x[2]])
        ok = False
        try:
            ok = all(self._copy(r["size"], r["src"], r["dst"]))
        finally:
            done = self._call(
                "replica_end", client=self.client_id, key=key, ok=ok, segments=[d[0] for d in r["dst"]]
            )
        if not ok:
            raise TransferError(f"copying {key!r} to its new replicas failed")
        return int(done["replicas"])

    def _promote(self, key: str, data: bytes) -> None:
        r = self._call("promote_start", client=self.client_id, key=key)
        if not r["dst"]:
            return
        addr, view, token = self._staging.take(len(data))
        ok = False
        try:
            view[:] = data
            ok = all(self._run([self._req(OpCode.WRITE, addr, d[0], d[1], len(data)) for d in r["dst"]]))
        finally:
            self._staging.give(token)
            self._call(
                "replica_end", client=self.client_id, key=key, ok=ok, segments=[d[0] for d in r["dst"]]
            )

    # ------------------------------------------------------------------ master tasks
    def _run_task(self, task: dict[str, Any]) -> None:
        kind = task["type"]
        ok, result = False, {}
        try:
            if kind == "replicate":
                ok = self._run(
                    [self._req(OpCode.READ, task["dst"][1], task["src"][0], task["src"][1], task["size"])]
                )[0]
            elif kind == "spill":
                addr, view, token = self._staging.take(task["size"])
                try:
                    if self._run(
                        [self._req(OpCode.READ, addr, task["src"][0], task["src"][1], task["size"])]
                    )[0]:
                        result["checksum"] = _write_ssd_file(task["path"], task["key"], view)
                        ok = True
                finally:
                    self._staging.give(token)
            elif kind == "unlink":
                try:
                    os.remove(task["path"])
                except FileNotFoundError:
                    pass
                return
        except (KvpoolError, OSError) as exc:
            log.warning("task %s failed: %s", kind, exc)
        try:
            self._hb_rpc.call("task_done", client=self.client_id, task=task["task"], ok=ok, result=result)
        except KvpoolError as exc:
            log.warning("could not report task %s: %s", kind, exc)

    # ------------------------------------------------------------------ tensors
    def put_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> None:
        """Store a CPU torch tensor (dtype and shape travel with the bytes)."""
        import msgpack

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
