"""The transfer engine: register memory, open segments, submit batches of READ/WRITE, poll, free.

Bytes move in the native extension (``kvpool._native``) on its own threads with the GIL released:
TCP lanes with scatter/gather straight from and into registered memory, or a single kernel copy
(``process_vm_readv/writev``) when the target lives on the same host.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

from kvpool import _native
from kvpool.config import TransferConfig
from kvpool.errors import (
    AddressNotRegistered,
    BatchInFlight,
    InvalidArgument,
    InvalidType,
    KvpoolError,
    ProtocolUnavailable,
    RegistrationError,
    SegmentNotFound,
    TransferError,
    TransferTimeout,
)
from kvpool.transfer.device import StagingPool, device_buffer, get_runtime, parse_location
from kvpool.transfer.metadata import MetadataBackend, open_metadata
from kvpool.transfer.types import (
    BufferDescriptor,
    OpCode,
    SegmentDescriptor,
    SegmentHandle,
    TransferRequest,
    TransferState,
    TransferStatus,
    host_id,
)

log = logging.getLogger("kvpool.transfer")
_AUTO_RDMA_SKIP: str | None = None  # why protocol="auto" does not use RDMA in this process (cached)

_NATIVE_OP = {OpCode.READ: _native.OP_READ, OpCode.WRITE: _native.OP_WRITE}
_ST_TIMEOUT = 101


class _Staged:
    """One request whose local side is GPU memory, moved through a pinned staging range."""

    __slots__ = ("index", "op", "dev", "stage", "n", "done", "error")

    def __init__(self, index: int, op: int, dev: int, stage: int, n: int) -> None:
        self.index = index
        self.op = op
        self.dev = dev
        self.stage = stage
        self.n = n
        self.done = False
        self.error: str | None = None


def split_host_port(name: str) -> tuple[str, int]:
    """Parse ``host:port`` or ``[v6]:port``; raise :class:`InvalidArgument` otherwise."""
    host, sep, port = name.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"segment name {name!r} is not host:port")
    return host.strip("[]"), int(port)


def ops_codes(requests: Sequence[TransferRequest]) -> list[int]:
    """OpCode values of validated requests."""
    return [int(OpCode(r.opcode)) for r in requests]


def buffer_range(obj: Any, length: int | None = None, allow_read_only: bool = False) -> tuple[int, int, Any]:
    """Return (address, length, keepalive) for an int address, a buffer or a torch tensor.

    Buffers must be writable unless ``allow_read_only``.
    """
    if isinstance(obj, bool):
        raise InvalidArgument("expected an address or a buffer, got a bool")
    if isinstance(obj, int):
        if obj <= 0:
            raise InvalidArgument("address must be a positive integer")
        if length is None or length <= 0:
            raise InvalidArgument("length must be a positive integer when passing a raw address")
        return obj, int(length), None
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor, no torch import
        if not obj.is_contiguous():
            raise InvalidArgument("tensor must be contiguous")
        if obj.device.type != "cpu":
            raise ProtocolUnavailable(
                f"tensor on {obj.device}: GPU memory is not supported by the TCP/same-host transports yet"
            )
        n = obj.numel() * obj.element_size()
        return obj.data_ptr(), n if length is None else int(length), obj
    try:
        view = memoryview(obj)  # pins resizable buffers (bytearray) while registered
    except TypeError:
        raise InvalidType(
            f"addr_or_buffer must be an int address (with length), a writable buffer (bytearray, "
            f"memoryview, numpy array) or a tensor, not {type(obj).__name__}"
        ) from None
    addr, n = _native.buffer_address(view, allow_read_only)
    if length is not None:
        if not 0 < length <= n:
            raise InvalidArgument(f"length {length} outside the buffer's {n} bytes")
        n = int(length)
    if n <= 0:
        raise InvalidArgument("cannot register an empty buffer")
    return addr, n, view


class TransferEngine:
    """Batch transfer API over TCP and the same-host path (RDMA arrives behind the same interface).

    The engine starts serving at once on ``hostname`` (only that address is bound).
    ``segment_name`` is the name peers pass to :meth:`open_segment`: for p2p metadata always
    ``"host:port"``; with a metadata server ``name`` or, by default, ``"host:port"``.

    Args:
        hostname: address to listen on and publish.
        metadata: ``"p2p"``, ``http://host:port/metadata``, ``etcd://host:2379`` or ``redis://host:6379``.
        protocol: ``"auto"``, ``"tcp"`` or ``"rdma"``.
        devices: RDMA device allow-list.
        name: segment name to publish through a metadata server.
        config: a full :class:`TransferConfig`; keyword arguments override its fields.
        **kwargs: any other :class:`TransferConfig` field (``secret``, ``timeout_s``, ``lanes`` ...).
    """

    def __init__(
        self,
        hostname: str | None = None,
        metadata: str | None = None,
        protocol: str | None = None,
        devices: list[str] | None = None,
        name: str | None = None,
        *,
        config: TransferConfig | None = None,
        **kwargs: Any,
    ) -> None:
        overrides = {
            k: v
            for k, v in dict(
                hostname=hostname, metadata=metadata, protocol=protocol, devices=devices, name=name
            ).items()
            if v is not None
        }
        overrides.update(kwargs)
        cfg = config.replace(**overrides) if config is not None else TransferConfig(**overrides)
        self.config = cfg
        self._lock = threading.RLock()
        self._meta: MetadataBackend | None = open_metadata(cfg.metadata, timeout_s=cfg.connect_timeout_s)
        self._native = _native.NativeEngine(
            host=cfg.hostname,
            port=cfg.port,
            secret=cfg.secret or "",
            lanes=cfg.lanes,
            slice_size=cfg.slice_size,
            timeout_ms=int(cfg.timeout_s * 1000),
            connect_timeout_ms=int(cfg.connect_timeout_s * 1000),
            max_frame=cfg.max_frame,
        )
        self.port: int = self._native.port
        host = f"[{cfg.hostname}]" if ":" in cfg.hostname else cfg.hostname
        self.endpoint = f"{host}:{self.port}"
        self.segment_name: str = self.endpoint if self._meta is None else (cfg.name or self.endpoint)
        self._buffers: dict[int, tuple[BufferDescriptor, Any]] = {}
        self._segments: dict[str, tuple[SegmentHandle, SegmentDescriptor]] = {}
        self._handles: dict[int, str] = {}
        self._closed = False
        self._rdma: Any = None
        self._rdma_batches: dict[int, Any] = {}
        # GPU (cuda:N) memory: registrations (sorted starts / (start, end, device)), runtime, staging
        self._dev_starts: list[int] = []
        self._dev_regs: list[tuple[int, int, int]] = []
        self._device_rt: Any = None
        self._staging: StagingPool | None = None
        self._staged: dict[int, dict[int, _Staged]] = {}  # batch -> slot index -> staged request
        self._stage_lock = threading.Lock()
        if cfg.protocol in ("rdma", "auto"):
            try:
                self._rdma = self._start_rdma(cfg)
            except BaseException:
                self._native.shutdown()
                raise
        self._publish()

    def _start_rdma(self, cfg: TransferConfig) -> Any:
        """The RDMA transport, or None under "auto" when it cannot run here (logged once)."""
        global _AUTO_RDMA_SKIP
        auto = cfg.protocol == "auto"
        if auto and cfg.rdma_verbs == "pyverbs":
            if _AUTO_RDMA_SKIP is not None:
                return None
            if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
                _AUTO_RDMA_SKIP = "no RDMA device in /sys/class/infiniband"
                log.info("protocol=auto: not using RDMA (%s); TCP and same-host paths only", _AUTO_RDMA_SKIP)
                return None
        from kvpool.transfer.rdma.transport import RdmaTransport

        try:
            return RdmaTransport(cfg, cfg.hostname, self._native.incarnation)
        except ProtocolUnavailable as exc:
            if not auto:
                raise
            if cfg.rdma_verbs == "pyverbs":
                _AUTO_RDMA_SKIP = str(exc)
            log.info("protocol=auto: not using RDMA (%s); TCP and same-host paths only", exc)
            return None

    @property
    def rdma(self) -> Any:
        """The RDMA transport (:class:`kvpool.transfer.rdma.transport.RdmaTransport`) or None."""
        return self._rdma

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop serving, cancel queued transfers and withdraw the descriptor."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._rdma is not None:
            self._rdma.close()
        self._native.shutdown()
        if self._meta is not None:
            try:
                self._meta.delete(self.segment_name)
            except KvpoolError as exc:
                log.warning("could not withdraw descriptor of %s: %s", self.segment_name, exc)
            self._meta.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                if self._rdma is not None:
                    self._rdma.close()
                self._native.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def incarnation(self) -> int:
        """Random id of this engine instance; peers use it to notice restarts."""
        return self._native.incarnation

    # ------------------------------------------------------------------ memory
    def register_local_memory(
        self,
        addr_or_buffer: Any,
        length: int | None = None,
        location: str = "cpu:0",
        remote_accessible: bool = True,
    ) -> int:
        """Register memory for transfers; returns its address.

        Accepts an int address (with ``length``), any writable Python buffer (bytearray,
        memoryview, numpy array) or a CPU torch tensor. GPU memory: a CUDA torch tensor, an object
        with ``__cuda_array_interface__`` (cupy) or an int address with ``location="cuda:N"``
        (validated: a CUDA runtime, N < device count, the range is memory of device N); it moves
        over RDMA directly (GPUDirect) and through pinned staging buffers over TCP/same-host, where
        it can only be local (``remote_accessible=False``). Only ``remote_accessible`` memory may be
        touched by peers. Overlapping registrations raise :class:`RegistrationError`. A read-only
        buffer (e.g. ``bytes``) may be registered with ``remote_accessible=False``: it can then be
        the source of WRITEs but never the destination of a READ.
        """
        kind, index = parse_location(location)
        dev = device_buffer(addr_or_buffer, length)
        if dev is not None or kind == "cuda":
            # a CUDA tensor/array with the default "cpu:0": the location comes from the object
            index = index if kind == "cuda" else None
            return self._register_device(addr_or_buffer, length, index, dev, bool(remote_accessible))
        addr, n, keep = buffer_range(addr_or_buffer, length, allow_read_only=not remote_accessible)
        read_only = isinstance(keep, memoryview) and keep.readonly
        self._native.register_memory(addr, n, bool(remote_accessible), read_only)
        if self._rdma is not None:
            try:
                self._rdma.register(addr, n, location, bool(remote_accessible), writable=not read_only)
            except KvpoolError:
                self._native.unregister_memory(addr)
                raise
        with self._lock:
            self._buffers[addr] = (BufferDescriptor(addr, n, location, bool(remote_accessible)), keep)
        if remote_accessible:  # local-only memory is not published: registering it is cheap
            self._publish()
        return addr

    @property
    def device_runtime(self) -> Any:
        """The CUDA runtime (:class:`kvpool.transfer.device.DeviceRuntime`), selected on first use."""
        if self._device_rt is None:
            self._device_rt = get_runtime(self.config.device_runtime)
        return self._device_rt

    def _register_device(
        self, obj: Any, length: int | None, index: int | None, dev: Any, remote: bool
    ) -> int:
        rt = self.device_runtime  # ProtocolUnavailable when there is no CUDA runtime
        if dev is not None:
            addr, n, keep, tindex = dev
            if index is not None and tindex is not None and index != tindex:
                raise InvalidArgument(f"tensor is on cuda:{tindex}, location says cuda:{index}")
            index = tindex if index is None else index
        else:
            if not isinstance(obj, int) or isinstance(obj, bool):
                raise InvalidArgument(
                    "GPU memory must be a CUDA tensor, a __cuda_array_interface__ object or an int address"
                )
            addr, n, keep = buffer_range(obj, length)
        count = rt.device_count()
        actual = rt.pointer_device(addr)
        if index is None:
            index = actual
        if index is None:
            raise InvalidArgument(f"address {addr:#x} is not CUDA device memory")
        if not 0 <= index < count:
            raise InvalidArgument(
                f"cuda:{index} does not exist: the {rt.name} runtime sees {count} device(s)"
            )
        if actual != index or rt.pointer_device(addr + n - 1) != index:
            where = "not CUDA device memory" if actual is None else f"memory of cuda:{actual}"
            raise InvalidArgument(f"range {addr:#x}+{n} is not all memory of cuda:{index} ({where})")
        if remote and self._rdma is None:
            raise ProtocolUnavailable(
                f"cuda:{index} memory cannot be remote-accessible without RDMA: peers reach TCP/same-host "
                "engines through a server that can only touch host memory. Use protocol='rdma' (GPUDirect: "
                "nvidia-peermem or DMA-BUF) or register it with remote_accessible=False (it can then be "
                "the source of WRITEs and the destination of READs, staged through pinned host memory)"
            )
        loc = f"cuda:{index}"
        with self._lock:
            i = bisect.bisect_right(self._dev_starts, addr)
            if (i and self._dev_regs[i - 1][1] > addr) or (
                i < len(self._dev_starts) and self._dev_starts[i] < addr + n
            ):
                raise RegistrationError(f"range {addr:#x}+{n} overlaps registered {loc} memory")
        if self._rdma is not None:
            self._rdma.register(addr, n, loc, remote, writable=True, dmabuf=lambda: rt.dmabuf_fd(addr, n))
        with self._lock:
            i = bisect.bisect_right(self._dev_starts, addr)
            self._dev_starts.insert(i, addr)
            self._dev_regs.insert(i, (addr, addr + n, index))
            self._buffers[addr] = (BufferDescriptor(addr, n, loc, remote), keep)
        if remote:
            self._publish()
        return addr

    def _dev_region(self, addr: int, n: int) -> tuple[int, int, int] | None:
        """The GPU registration holding [addr, addr+n), None when addr is not in GPU memory."""
        i = bisect.bisect_right(self._dev_starts, addr) - 1
        if i < 0:
            return None
        reg = self._dev_regs[i]
        if addr >= reg[1]:
            return None
        if addr + n > reg[1]:
            raise AddressNotRegistered(f"local range {addr:#x}+{n} runs past registered cuda:{reg[2]} memory")
        return reg

    def _staging_pool(self) -> StagingPool:
        with self._lock:
            if self._staging is None:
                pool = StagingPool(self.device_runtime, self.config.staging_pool_size)
                self._native.register_memory(pool.base, pool.size, False, False)
                self._staging = pool
            return self._staging

    def alloc_shared_buffer(self, size: int, name: str = "kvpool") -> memoryview:
        """Allocate ``size`` bytes of shared memory (memfd), pre-faulted and registered as
        remote-accessible. Same-host peers map it and copy with plain (non-temporal) stores instead
        of ``process_vm_writev``; everyone else reaches it like any registered buffer.
        Unregister with :meth:`unregister_local_memory`."""
        if not isinstance(size, int) or size <= 0:
            raise InvalidArgument("size must be a positive integer")
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mem = mmap.mmap(fd, size, flags=flags)
        except OSError as exc:
            os.close(fd)
            raise InvalidArgument(f"cannot allocate {size} bytes of shared memory: {exc}") from None
        view = memoryview(mem)
        addr = _native.buffer_address(view)[0]
        self._native.register_memory(addr, size, True, False)
        if self._rdma is not None:
            self._rdma.register(addr, size, "cpu:0", True)
        with self._lock:
            self._buffers[addr] = (BufferDescriptor(addr, size, "cpu:0", True, fd), (mem, view, fd))
        self._publish()
        return view

    def unregister_local_memory(self, addr_or_buffer: Any) -> None:
        """Unregister memory previously registered at this address (or buffer)."""
        dev = None if isinstance(addr_or_buffer, int) else device_buffer(addr_or_buffer, None)
        addr = (
            addr_or_buffer
            if isinstance(addr_or_buffer, int)
            else dev[0]
            if dev is not None
            else buffer_range(addr_or_buffer, allow_read_only=True)[0]
        )
        if self._dev_starts and addr in self._dev_starts:
            end = self._dev_regs[self._dev_starts.index(addr)][1]
            for bid, slots in list(self._staged.items()):
                if any(not e.done and addr <= e.dev < end for e in slots.values()):
                    self._finish_staged(bid)  # completes what finished; READs still queued stay
                    if any(not e.done and addr <= e.dev < end for e in slots.values()):
                        raise BatchInFlight(
                            f"batch {bid} still stages transfers for GPU memory at {addr:#x}; wait first"
                        )
            with self._lock:
                i = self._dev_starts.index(addr)
                del self._dev_starts[i], self._dev_regs[i]
        else:
            self._native.unregister_memory(addr)
        if self._rdma is not None:
            self._rdma.unregister(addr)
        with self._lock:
            entry = self._buffers.pop(addr, None)
        if entry is None or entry[0].remote_accessible:
            self._publish()
        if entry is not None and entry[0].shm_fd >= 0:
            os.close(entry[0].shm_fd)  # peers' mappings keep the pages alive; ours goes with the view

    def local_descriptor(self) -> SegmentDescriptor:
        """The descriptor this engine publishes."""
        with self._lock:
            bufs = [b for b, _ in self._buffers.values() if b.remote_accessible]
        return SegmentDescriptor(
            name=self.segment_name,
            hostname=self.config.hostname,
            port=self.port,
            host_id=host_id(),
            pid=os.getpid(),
            incarnation=self.incarnation,
            buffers=bufs,
            protocols=["tcp", "same_host"] + (["rdma"] if self._rdma is not None else []),
            rdma=self._rdma.descriptor_info() if self._rdma is not None else None,
        )

    def _publish(self) -> None:
        blob = self.local_descriptor().to_bytes()
        self._native.set_descriptor(blob)
        if self._meta is not None:
            self._meta.put(self.segment_name, blob)

    # ------------------------------------------------------------------ segments
    def _fetch(self, name: str) -> SegmentDescriptor:
        if not isinstance(name, str) or not name:
            raise InvalidArgument("segment name must be a non-empty string")
        timeout_ms = int(self.config.connect_timeout_s * 1000)
        if self._meta is None:
            host, port = split_host_port(name)
            _, blob = _native.fetch_descriptor(host, port, self.config.secret or "", timeout_ms)
            return SegmentDescriptor.from_bytes(blob)
        blob = self._meta.get(name)
        if blob is None:
            raise SegmentNotFound(f"segment {name!r} is not published in {self.config.metadata}")
        return SegmentDescriptor.from_bytes(blob)

    def _same_host_pid(self, desc: SegmentDescriptor) -> int:
        ok = self.config.protocol == "auto" and self.config.same_host and desc.host_id == host_id()
        return desc.pid if ok and "same_host" in desc.protocols else 0

    def open_segment(self, name: str) -> SegmentHandle:
        """Open (or return the cached handle of) the segment ``name``; re-fetches after a peer restart."""
        with self._lock:
            cached = self._segments.get(name)
        if cached is not None and not self._native.peer_stale(cached[0].id):
            return cached[0]
        desc = self._fetch(name)
        pid = self._same_host_pid(desc)
        with self._lock:
            cached = self._segments.get(name)
            if cached is not None:
                handle = cached[0]
                self._native.update_peer(handle.id, desc.incarnation, pid, desc.remote_regions())
            else:
                hid = self._native.add_peer(
                    desc.hostname, desc.port, desc.incarnation, pid, desc.remote_regions()
                )
                handle = SegmentHandle(hid, name)
                self._handles[hid] = name
            self._segments[name] = (handle, desc)
            shm = [
                (b.addr, b.length, b.shm_fd) for b in desc.buffers if b.shm_fd >= 0 and b.remote_accessible
            ]
            self._native.set_peer_shm(handle.id, pid, shm if pid else [])
            if self._rdma is not None:
                if desc.rdma and not pid:
                    self._rdma.add_peer(handle.id, name, desc.rdma, desc.buffers)
                elif self.config.protocol == "rdma":
                    raise ProtocolUnavailable(
                        f"segment {name!r} does not publish RDMA (its engine runs without the RDMA transport)"
                    )
        return handle

    def get_segment_descriptor(self, name_or_handle: str | SegmentHandle) -> SegmentDescriptor:
        """The (cached, refreshed when stale) descriptor of an opened segment."""
        name = name_or_handle.name if isinstance(name_or_handle, SegmentHandle) else name_or_handle
        self.open_segment(name)
        with self._lock:
            return self._segments[name][1]

    def close_segment(self, handle: SegmentHandle | int) -> None:
        """Forget a segment: its connections are closed and its queued transfers canceled."""
        hid = int(handle)
        with self._lock:
            name = self._handles.pop(hid, None)
            if name is None:
                raise SegmentNotFound("unknown segment handle (already closed?)")
            self._segments.pop(name, None)
        if self._rdma is not None:
            self._rdma.remove_peer(hid)
        self._native.remove_peer(hid)

    def uses_same_host_path(self, handle: SegmentHandle | int) -> bool:
        """True when transfers to this segment take the same-host single-copy path."""
        return bool(self._native.peer_same_host(int(handle)))

    def shared_buffers_mapped(self, handle: SegmentHandle | int) -> int:
        """How many of the segment's shared-memory buffers are mapped here (same host only)."""
        return int(self._native.peer_shm_count(int(handle)))

    # ------------------------------------------------------------------ batches
    def allocate_batch_id(self, batch_size: int) -> int:
        """Allocate a batch with ``batch_size`` request slots."""
        if not isinstance(batch_size, int) or batch_size <= 0 or batch_size >= 1 << 32:
            raise InvalidArgument("batch_size must be a positive integer")
        bid = self._native.alloc_batch(batch_size)
        if self._rdma is not None:
            from kvpool.transfer.rdma.transport import RdmaBatch

            with self._lock:
                self._rdma_batches[bid] = RdmaBatch(batch_size)
        return bid

    def _rdma_batch(self, batch_id: int) -> Any:
        """The batch's RDMA side when its requests went over RDMA, else None."""
        b = self._rdma_batches.get(batch_id) if self._rdma_batches else None
        return b if b is not None and b.mode == "rdma" else None

    def free_batch_id(self, batch_id: int) -> None:
        """Free a batch; raises :class:`BatchInFlight` while any of its transfers is pending."""
        rb = self._rdma_batch(batch_id)
        if rb is not None and rb.pending:
            raise BatchInFlight(f"batch {batch_id} has {rb.pending} RDMA transfers in flight; wait first")
        if self._staged:
            self._finish_staged(batch_id)
        self._native.free_batch(batch_id)
        if self._staged:
            with self._stage_lock:
                left = self._staged.pop(batch_id, None)
            for e in (left or {}).values():
                if not e.done:  # cannot happen after a successful free; never leak the range
                    self._staging_pool().release(e.stage, e.n)
        if self._rdma_batches:
            with self._lock:
                self._rdma_batches.pop(batch_id, None)

    def _refresh_stale(self, handles: set[int]) -> None:
        for hid in handles:
            try:
                stale = self._native.peer_stale(hid)
            except SegmentNotFound:
                continue  # native raises its own typed error in submit
            if stale:
                name = self._handles.get(hid)
                if name is not None:
                    try:
                        self.open_segment(name)
                    except SegmentNotFound:
                        pass  # the peer is down: submit fails its requests with the reason

    def submit_transfer(self, batch_id: int, requests: Sequence[TransferRequest]) -> None:
        """Queue requests into the next free slots of a batch (all-or-nothing validation).

        Raises :class:`AddressNotRegistered`, :class:`RemoteAccessError`, :class:`SegmentNotFound`
        or :class:`InvalidArgument` before anything is sent.
        """
        n = len(requests)
        ops = [0] * n
        locs = [0] * n
        peers = [0] * n
        rems = [0] * n
        lens = [0] * n
        try:
            for i, r in enumerate(requests):
                ops[i] = _NATIVE_OP[OpCode(r.opcode)]
                locs[i] = r.source
                peers[i] = int(r.target_id)
                rems[i] = r.target_offset
                lens[i] = r.length
                if r.length <= 0 or r.source < 0 or r.target_offset < 0:
                    raise ValueError(f"request {i}: length must be positive and addresses non-negative")
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            raise InvalidArgument(f"bad transfer request: {exc}") from None
        self._submit_lists(batch_id, ops, locs, peers, rems, lens, lambda: ops_codes(requests))

    def _submit_lists(
        self,
        batch_id: int,
        ops: list[int],
        locs: list[int],
        peers: list[int],
        rems: list[int],
        lens: list[int],
        opcodes: Any,
        stage_wait_s: float | None = None,
    ) -> None:
        """Queue validated request columns (``opcodes()`` gives OpCode values for RDMA).

        TCP/same-host requests whose local range is GPU memory are staged: a pinned range of the
        staging pool replaces the local address (WRITE: filled by a device-to-host copy now; READ:
        copied to the device when the slot completes, see :meth:`_finish_staged`). Without free
        staging, ``stage_wait_s`` None raises InvalidArgument, else waits that long (TransferTimeout).
        """
        n = len(ops)
        self._refresh_stale(set(peers))
        rb = self._rdma_batches.get(batch_id) if self._rdma_batches else None
        if rb is not None and n:
            rdma = [self._rdma.has_peer(p) for p in peers]
            mode = "rdma" if all(rdma) else "native" if not any(rdma) else "mixed"
            if mode == "mixed" or (rb.mode is not None and rb.mode != mode):
                raise InvalidArgument(
                    "a batch carries requests of one transport: RDMA segments and TCP/same-host segments "
                    "go in separate batches"
                )
            if mode == "rdma":
                self._native.batch_status(batch_id)  # unknown/freed batch -> the native typed error
                rb.mode = "rdma"
                self._rdma.submit(rb, list(zip(opcodes(), locs, peers, rems, lens, strict=True)))
                return
            rb.mode = "native"
        if self._dev_starts:
            self._submit_staged(batch_id, ops, locs, peers, rems, lens, stage_wait_s)
            return
        self._native.submit(batch_id, ops, locs, peers, rems, lens)

    def _submit_staged(
        self,
        batch_id: int,
        ops: list[int],
        locs: list[int],
        peers: list[int],
        rems: list[int],
        lens: list[int],
        wait_s: float | None,
    ) -> None:
        todo = [(i, locs[i], lens[i]) for i in range(len(ops)) if self._dev_region(locs[i], lens[i])]
        if not todo:
            with self._stage_lock:  # status readers finish staged slots under this lock
                self._native.submit(batch_id, ops, locs, peers, rems, lens)
            return
        self._native.batch_status(batch_id)  # unknown/freed batch -> the native typed error, before copies
        pool = self._staging_pool()
        sizes = [n for _, _, n in todo]
        stages = pool.try_alloc(sizes) if wait_s is None else pool.alloc(sizes, wait_s)
        if stages is None:
            need = sum(pool.rounded(n) for n in sizes)
            msg = (
                f"GPU staging: {len(todo)} requests need {need} bytes of pinned staging, the pool has "
                f"{pool.free_bytes} of {pool.size} free"
            )
            if wait_s is not None:
                raise TransferTimeout(msg + f" after waiting {wait_s:g} s")
            raise InvalidArgument(
                msg + "; wait for (or free) batches in flight, raise staging_pool_size, or use "
                "batch_transfer_sync/transfer_sync (they stage in rounds)"
            )
        rt = self.device_runtime
        locs = list(locs)
        staged: list[tuple[int, int, int, int, int]] = []
        try:
            for (i, dev, n), st in zip(todo, stages, strict=True):
                if ops[i] == _native.OP_WRITE:
                    rt.copy_d2h(st, dev, n)
                locs[i] = st
                staged.append((i, ops[i], dev, st, n))
            # Submit and record the staged slots atomically for status readers (they finish staged
            # slots under the same lock); the native submit returns the batch slot of request 0.
            with self._stage_lock:
                base = self._native.submit(batch_id, ops, locs, peers, rems, lens)
                slots = self._staged.setdefault(batch_id, {})
                for i, op, dev, st, n in staged:
                    slots[base + i] = _Staged(base + i, op, dev, st, n)
        except BaseException as exc:
            for st, n in zip(stages, sizes, strict=True):
                pool.release(st, n)
            if isinstance(exc, KvpoolError):
                raise
            raise TransferError(f"GPU staging copy (device to host) failed: {exc}") from exc

    def _finish_staged(self, batch_id: int, index: int | None = None) -> None:
        """Complete staged requests whose slot finished: READs copy staging -> device; ranges go back."""
        with self._stage_lock:
            slots = self._staged.get(batch_id)
            if not slots:
                return
            todo = [slots[index]] if index is not None and index in slots else []
            if index is None:
                todo = list(slots.values())
            for e in todo:
                if e.done:
                    continue
                state = self._native.status(batch_id, e.index)[0]
                if state <= TransferState.PENDING:
                    continue
                if state == TransferState.COMPLETED and e.op == _native.OP_READ:
                    try:
                        self.device_runtime.copy_h2d(e.dev, e.stage, e.n)
                    except Exception as exc:  # noqa: BLE001 - runtime errors become the slot's reason
                        e.error = f"GPU staging copy (host to device) failed: {exc}"
                e.done = True
                self._staging_pool().release(e.stage, e.n)

    def _staged_error(self, batch_id: int) -> str | None:
        slots = self._staged.get(batch_id)
        if slots:
            for e in slots.values():
                if e.error is not None:
                    return e.error
        return None

    def _status(self, state: int, nbytes: int, err: int) -> TransferStatus:
        return TransferStatus(TransferState(state), nbytes, _native.status_text(err) if err else None)

    def get_transfer_status(self, batch_id: int, index: int) -> TransferStatus:
        """Status of request ``index`` of a batch."""
        rb = self._rdma_batch(batch_id)
        if rb is not None:
            if not isinstance(index, int) or not 0 <= index < rb.size:
                raise InvalidArgument(f"index {index} outside batch {batch_id} of {rb.size} slots")
            return rb.status(index)
        state, nbytes = self._native.status(batch_id, index)
        if (self._dev_starts or self._staged) and state > TransferState.PENDING:
            self._finish_staged(batch_id, index)
            e = self._staged.get(batch_id, {}).get(index)
            if e is not None and e.error is not None:
                return TransferStatus(TransferState.FAILED, 0, e.error)
        err = self._native.slot_error(batch_id, index) if state > TransferState.COMPLETED else 0
        return self._status(state, nbytes, err)

    def get_batch_status(self, batch_id: int) -> TransferStatus:
        """Whole-batch status: PENDING while any request is, else COMPLETED or the first failure."""
        rb = self._rdma_batch(batch_id)
        if rb is not None:
            st = rb.batch_status()
            return TransferStatus(st.state, st.transferred_bytes)
        state, nbytes = self._native.batch_status(batch_id)
        if (self._dev_starts or self._staged) and state > TransferState.PENDING:
            self._finish_staged(batch_id)
            if state == TransferState.COMPLETED and self._staged_error(batch_id) is not None:
                state = TransferState.FAILED
        return TransferStatus(TransferState(state), nbytes)

    def wait_batch(self, batch_id: int, timeout_s: float | None = None) -> TransferStatus:
        """Block (GIL released) until every submitted request of the batch finished, or timeout."""
        rb = self._rdma_batch(batch_id)
        if rb is not None:
            rb.done.wait(timeout_s)
            st = rb.batch_status()
            return TransferStatus(st.state, st.transferred_bytes)
        ms = -1 if timeout_s is None else max(0, int(timeout_s * 1000))
        state = self._native.wait(batch_id, ms)
        if (self._dev_starts or self._staged) and state > TransferState.PENDING:
            self._finish_staged(batch_id)
            if state == TransferState.COMPLETED and self._staged_error(batch_id) is not None:
                state = TransferState.FAILED
        return TransferStatus(TransferState(state), self._native.batch_status(batch_id)[1])

    async def wait_batch_async(self, batch_id: int, timeout_s: float | None = None) -> TransferStatus:
        """Awaitable :meth:`wait_batch` for asyncio users (waits in a worker thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.wait_batch, batch_id, timeout_s)

    def _raise_failures(self, batch_id: int, n: int) -> None:
        failed = []
        for i in range(n):
            st = self.get_transfer_status(batch_id, i)
            if not st.ok:
                failed.append((i, st))
        if failed:
            i, st = failed[0]
            msg = f"{len(failed)} of {n} requests failed; request {i}: {st.state.name}: {st.error}"
            if all(s.state == TransferState.TIMEOUT for _, s in failed):
                raise TransferTimeout(msg)
            raise TransferError(msg)

    # ------------------------------------------------------------------ convenience
    def transfer_sync(
        self, target_name: str, local_addr: int, remote_addr: int, length: int, opcode: OpCode = OpCode.WRITE
    ) -> int:
        """Move one range and wait; returns the byte count or raises a typed error."""
        if not isinstance(length, int) or length <= 0:
            raise InvalidArgument("length must be a positive integer")
        handle = self.open_segment(target_name)
        if (self._rdma is not None and self._rdma.has_peer(handle.id)) or (
            self._dev_starts and self._dev_region(local_addr, length) is not None
        ):
            return self.batch_transfer_sync(target_name, [local_addr], [remote_addr], [length], opcode)
        err = self._native.transfer_sync(
            _NATIVE_OP[OpCode(opcode)], local_addr, handle.id, remote_addr, length
        )
        if err:
            cls = TransferTimeout if err == _ST_TIMEOUT else TransferError
            raise cls(f"{OpCode(opcode).name} of {length} bytes to {target_name}: {_native.status_text(err)}")
        return length

    def batch_transfer_sync(
        self,
        target_name: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        opcode: OpCode = OpCode.WRITE,
    ) -> int:
        """Move many ranges to/from one segment and wait; returns total bytes or raises."""
        n = len(local_addrs)
        if len(remote_addrs) != n or len(lengths) != n:
            raise InvalidArgument("local_addrs, remote_addrs and lengths differ in length")
        if n == 0:
            return 0
        handle = self.open_segment(target_name)
        try:
            locs, rems, lens = (
                list(map(int, local_addrs)),
                list(map(int, remote_addrs)),
                list(map(int, lengths)),
            )
            op = OpCode(opcode)
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"bad transfer request: {exc}") from None
        if min(lens) <= 0 or min(locs) < 0 or min(rems) < 0:
            raise InvalidArgument("lengths must be positive and addresses non-negative")
        if self._dev_starts and not (self._rdma is not None and self._rdma.has_peer(handle.id)):
            if any(self._dev_region(a, b) is not None for a, b in zip(locs, lens, strict=True)):
                return self._staged_sync(handle, op, locs, rems, lens)
        bid = self.allocate_batch_id(n)
        try:
            # Columns straight to the native queue: no per-request Python objects.
            self._submit_lists(
                bid, [_NATIVE_OP[op]] * n, locs, [handle.id] * n, rems, lens, lambda: [int(op)] * n
            )
            st = self.wait_batch(bid)
            if st.state == TransferState.COMPLETED:  # the per-request scan only when something failed
                return st.transferred_bytes
            self._raise_failures(bid, n)
            return self.get_batch_status(bid).transferred_bytes
        finally:
            try:
                self.free_batch_id(bid)
            except KvpoolError:
                pass

    def _staged_sync(
        self, handle: SegmentHandle, op: OpCode, locs: list[int], rems: list[int], lens: list[int]
    ) -> int:
        """batch_transfer_sync with GPU-memory local ranges: rounds that fit the staging pool.

        GPU ranges bigger than the pool are cut into pool-sized pieces; each round is one batch whose
        staged bytes fit the pool (waiting up to ``timeout_s`` for staging other transfers hold).
        """
        pool = self._staging_pool()
        cap = pool.size
        pieces: list[tuple[int, int, int, int]] = []  # (local, remote, length, staged bytes)
        for a, r, n in zip(locs, rems, lens, strict=True):
            if self._dev_region(a, n) is None:
                pieces.append((a, r, n, 0))
                continue
            for off in range(0, n, cap):
                k = min(cap, n - off)
                pieces.append((a + off, r + off, k, pool.rounded(k)))
        total = 0
        i = 0
        while i < len(pieces):
            j, need = i, 0
            while j < len(pieces) and (j == i or need + pieces[j][3] <= cap):
                need += pieces[j][3]
                j += 1
            wave = pieces[i:j]
            m = len(wave)
            bid = self.allocate_batch_id(m)
            try:
                self._submit_lists(
                    bid,
                    [_NATIVE_OP[op]] * m,
                    [p[0] for p in wave],
                    [handle.id] * m,
                    [p[1] for p in wave],
                    [p[2] for p in wave],
                    lambda m=m: [int(op)] * m,
                    stage_wait_s=self.config.timeout_s,
                )
                st = self.wait_batch(bid)
                if st.state != TransferState.COMPLETED:
                    self._raise_failures(bid, m)
                total += st.transferred_bytes
            finally:
                try:
                    self.free_batch_id(bid)
                except KvpoolError:
                    pass
            i = j
        return total

    # ------------------------------------------------------------------ Mooncake-style aliases
    registerLocalMemory = register_local_memory  # noqa: N815
    unregisterLocalMemory = unregister_local_memory  # noqa: N815
    openSegment = open_segment  # noqa: N815
    closeSegment = close_segment  # noqa: N815
    allocateBatchID = allocate_batch_id  # noqa: N815
    submitTransfer = submit_transfer  # noqa: N815
    getTransferStatus = get_transfer_status  # noqa: N815
    freeBatchID = free_batch_id  # noqa: N815
    transferSync = transfer_sync  # noqa: N815
    batchTransferSync = batch_transfer_sync  # noqa: N815
