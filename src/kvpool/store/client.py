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

The put machinery is in :mod:`kvpool.store.puts`, the get machinery in :mod:`kvpool.store.gets`
and the master session (registration, segments, heartbeat) in :mod:`kvpool.store.session` (bases
of :class:`Store`); this module sets them up and holds the public API.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool._rpc import RpcClient
from kvpool.config import StoreConfig
from kvpool.errors import (
    Fenced,
    InvalidArgument,
    InvalidType,
    KvpoolError,
    ObjectChanged,
    ProtocolError,
    RegistrationError,
    TransferError,
    late_batch,
)
from kvpool.store.client_base import _err
from kvpool.store.datapath import DataPath, WriteJob
from kvpool.store.gets import HOST_MEMORY, GetPath, is_place
from kvpool.store.layout import CHECKSUM_ALWAYS_MAX, HEADER_SIZE, header_mismatch, key_hash
from kvpool.store.locations import COMMITTED, LocationCache
from kvpool.store.puts import PutPath
from kvpool.store.reservations import (
    RESERVE_MAX,
    ReservationPool,
    WriteFloor,
    mounts_of,
    reserve_count,
)
from kvpool.store.session import MasterSession
from kvpool.store.staging import Staging
from kvpool.store.tasks import TaskRunner, run_task
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


def _bad_replica_plan(r: Any) -> str | None:
    """Why a ``replica_start`` answer cannot be acted on, or None. Called by
    :meth:`Store.change_replica` before it reads or writes anything the answer names."""
    if not isinstance(r, dict) or not isinstance(r.get("dst"), list):
        return "no dst list"
    if not r["dst"]:
        return None  # nothing to copy
    if not all(is_place(d) for d in r["dst"]) or not is_place(r.get("src")):
        return "src/dst are not [segment, address] places"
    size = r.get("size")
    if type(size) is not int or not HEADER_SIZE < size <= HOST_MEMORY:
        return f"size {size!r} outside ({HEADER_SIZE}, {HOST_MEMORY}] (this host's memory)"
    if type(r.get("epoch")) is not int or type(r.get("gen")) is not int:
        return "epoch/gen are not integers"
    return None


class Store(MasterSession, PutPath, GetPath):
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
        self._data = DataPath(self.engine, self._staging, self._report_read, config.checksum)
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
        # (batch, lease deadline, leases) of reads whose late GPU copies may still read the objects
        self._late_releases: list[tuple[int, float, list[list[Any]]]] = []
        self._release_lock = threading.Lock()
        try:
            self._register()
        except BaseException:
            self._shutdown_local()
            raise
        self._task_runner = TaskRunner(self)  # master tasks, off the heartbeat thread
        self._next_sweep = 0.0  # the SSD directory is swept after the first heartbeat
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

    def close(self) -> None:
        """Unmount, disconnect and stop the embedded master (if any)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._resv.wanted.set()
        self._hb.join(5)
        self._task_runner.close()
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

    # ------------------------------------------------------------------ get
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
            self._release(keep, sys.exc_info()[1])
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
            during = sys.exc_info()[1]
            for k in keeps:
                self._release(k, during)

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

    def _release(self, addr: int | None, during: BaseException | None = None) -> None:
        """Unregister memory :meth:`_dest` registered for one call. While a TransferTimeout whose
        copies may still land there propagates (``during``), the unregister's error (it warns of
        those copies) is not raised over it: the caller keeps its ``batch_id``."""
        if addr is not None:
            try:
                self.engine.unregister_local_memory(addr)
            except KvpoolError:
                if late_batch(during) is None:
                    raise

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
        """Remove an object; a leased one raises ObjectBusy unless ``force`` (its space then stays
        allocated until the readers' leases end: they still get its bytes, or an error)."""
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
        why = _bad_replica_plan(r)
        if why is not None:  # the master's answer decides what is read and written where
            raise ProtocolError(f"the store master's replica_start answer for {key!r} is malformed: {why}")
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
            done = self._call("replica_end", key=key, gen=gen, ok=ok, segments=[d[0] for d in r["dst"]],
                              change=r.get("change"))  # fmt: skip
        if not ok:
            raise TransferError(f"copying {key!r} to its new replicas failed")
        return int(done["replicas"])

    def _promote(self, key: str, gen: int, data: bytes) -> None:
        """Copy an SSD hit (``data``, read from generation ``gen``) back into a memory replica;
        the master refuses when the key holds another generation by now."""
        r = self._call("promote_start", key=key, gen=gen)
        if not r["dst"]:
            return
        epoch, gen = r["epoch"], r["gen"]
        verify = r["checksum"] is not None
        job = WriteJob(key, len(data), memoryview(data), gen, verify, r["dst"], mounts=mounts_of(r))
        ok = False
        self._writes.begin(epoch, [gen])
        try:
            self._data.write(epoch, [job])
            ok = len(job.written) == len(r["dst"]) and r["checksum"] in (None, job.csum)
        finally:
            self._writes.end(epoch, [gen])
            self._call("replica_end", key=key, gen=gen, ok=ok, segments=[d[0] for d in r["dst"]],
                       change=r.get("change"))  # fmt: skip

    # ------------------------------------------------------------------ master tasks
    def _run_task(self, task: dict[str, Any], deadline: float = float("inf")) -> None:
        run_task(self, task, deadline)

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
