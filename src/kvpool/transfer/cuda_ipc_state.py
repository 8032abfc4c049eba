"""The records of :mod:`kvpool.transfer.cuda_ipc`: our exported GPU registrations, the peers
reached through CUDA IPC with their buffers (opened GPU allocations, mapped shared host buffers),
the queued runs of GPU copies the transport's completion thread settles, and the gate that orders
our submits against the unregister of local memory."""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvpool import _native
from kvpool.errors import AddressNotRegistered, KvpoolError, MetadataError, RemoteAccessError, SegmentNotFound
from kvpool.transfer.cuda_driver import CudaDriver
from kvpool.transfer.memory import LocalRegistry, Registration

_U64 = np.uint64
log = logging.getLogger("kvpool.transfer.cuda_ipc")


@dataclass
class _Export:
    """One of our GPU registrations as peers see it."""

    addr: int
    length: int
    device: int
    handle: bytes
    offset: int  # of addr in its allocation
    slot: int
    gen: int


@dataclass
class _RemoteBuf:
    """A remote buffer the GPU can reach: GPU memory (IPC) or a shared host buffer."""

    addr: int
    length: int
    gpu: bool
    slot: int
    gen: int
    handle: bytes = b""
    offset: int = 0
    uuid: bytes = b""
    shm_fd: int = -1
    mapped: int = 0  # base of the mapping here (0: not opened yet)
    keep: Any = None
    handed: bool = False  # its mapping went to the next record of the same attachment (attach)


def _gpu_buf(entry: Any) -> _RemoteBuf:
    """A GPU buffer of a peer's descriptor, ``[addr, length, device uuid, IPC handle, offset,
    fence slot, fence generation]``, checked (the descriptor is the peer's word): MetadataError
    for another shape, a field of the wrong type or a range past 2**64. Called by attach."""
    try:
        addr, length, uuid, h, off, slot, gen = entry
    except (TypeError, ValueError):
        raise MetadataError(f"malformed CUDA IPC GPU buffer in a peer's descriptor: {entry!r:.200}") from None
    ints = (addr, length, off, slot, gen)
    if not (
        all(type(v) is int for v in ints)
        and isinstance(h, bytes) and len(h) == 64 and isinstance(uuid, bytes) and len(uuid) == 16
        and 0 <= addr and 0 < length and addr + length < 1 << 64 and 0 <= off < 1 << 63
        and -1 <= slot < 1 << 31 and 0 <= gen < 1 << 64
    ):  # fmt: skip
        raise MetadataError(f"malformed CUDA IPC GPU buffer in a peer's descriptor: {entry!r:.200}")
    return _RemoteBuf(addr, length, True, slot, gen, h, off, uuid)


def _gpu_bufs(cuda_ipc: Any) -> list[_RemoteBuf]:
    """The GPU buffers of a descriptor's ``cuda_ipc`` field (None: none), each :func:`_gpu_buf`."""
    entries = (cuda_ipc or {}).get("bufs", []) if isinstance(cuda_ipc or {}, dict) else None
    if not isinstance(entries, list):
        raise MetadataError(f"malformed CUDA IPC GPU buffer list in a peer's descriptor: {cuda_ipc!r:.200}")
    return [_gpu_buf(e) for e in entries]


class _Lineage:
    """What the records of one process's attachments share (a re-attach keeps mappings and
    pidfd): how many of our submits to them are between taking the record and queuing their run
    (CudaIpcTransport._hold/_let_go, under its ``_cond``). A retired record's mappings are closed
    only when none is, and no run to the lineage is queued (CudaIpcTransport._retire)."""

    __slots__ = ("submits",)

    def __init__(self) -> None:
        self.submits = 0


@dataclass
class _Peer:
    pid: int
    incarnation: int
    bufs: list[_RemoteBuf]
    starts: np.ndarray
    ends: np.ndarray
    gpu: np.ndarray
    fence: Any  # _native.FenceMap or None
    pidfd: int
    inflight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    gone: bool = False  # its exit was reported to a caller: the next open_segment re-fetches
    # shared by the records of one process's attachments (a re-attach keeps mappings and pidfd):
    # what one of them retires waits for the runs and submits of all (CudaIpcTransport._retire)
    lineage: _Lineage = field(default_factory=_Lineage)
    retired: bool = False  # let go (detach, release_exited, re-attach): maps nothing more (open)
    all_reachable: bool = False  # every remote-accessible buffer of it is one of ``bufs`` (attach)

    def open(self, b: _RemoteBuf, device: int, driver: CudaDriver, uuids: dict[bytes, int]) -> int:
        """Base address here of a remote buffer's mapping (opened on first use, for a run on
        ``device``; ``uuids``: our devices by UUID). Called by CudaIpcTransport before it queues a run.
        A record already retired opens nothing (its mappings are being closed, and one opened
        now would never be): SegmentNotFound, the caller opens the segment again. A GPU buffer
        whose published offset and length run past the allocation its handle opens:
        RemoteAccessError (copies through it would reach past the mapping)."""
        if b.mapped:
            return b.mapped
        with self.lock:
            if b.mapped:
                return b.mapped
            if self.retired:
                raise SegmentNotFound(
                    f"the segment of pid {self.pid} was let go or re-attached while this transfer was "
                    "submitted; open (refetch) the segment and retry"
                )
            if b.gpu:
                dev = uuids.get(b.uuid, device)
                base = driver.ipc_open(b.handle, dev)
                size = driver.address_range(base)[1]  # the descriptor is the peer's word: check it
                if not 0 <= b.offset <= size - b.length:
                    driver.ipc_close(base)
                    raise RemoteAccessError(
                        f"the peer's GPU buffer {b.addr:#x}+{b.length} at offset {b.offset} runs past "
                        f"its allocation ({size} bytes): refused, nothing copied"
                    )
                b.mapped = base + b.offset
                driver.enable_peer(device, dev)
            else:
                try:  # the descriptor is the peer's word: a length past its file, a bad fd
                    fd = os.open(f"/proc/{self.pid}/fd/{b.shm_fd}", os.O_RDWR | os.O_CLOEXEC)
                    try:
                        m = mmap.mmap(fd, b.length)
                    finally:
                        os.close(fd)
                except (OSError, ValueError, OverflowError) as exc:
                    raise RemoteAccessError(
                        f"cannot map the peer's shared buffer {b.addr:#x}+{b.length} ({exc})"
                    ) from None
                base = ctypes.addressof(ctypes.c_char.from_buffer(m))
                driver.host_register(base, b.length)
                b.keep, b.mapped = _Shm(m), base
            return b.mapped

    def close(self, driver: CudaDriver, bufs: list[_RemoteBuf], pidfd: bool) -> None:
        """Close these buffers' mappings here (GPU IPC, shared host buffers), and the pidfd when
        ``pidfd``. Called by CudaIpcTransport only while no run or submit of ours to this peer is
        in flight: a queued copy still reads or writes the mappings, and the completion thread
        asks the pidfd whether the peer exited during the copy."""
        for b in bufs:
            if not b.mapped or b.handed:
                continue
            if b.gpu:
                try:  # the mapping's own base (b.mapped points b.offset into it)
                    driver.ipc_close(b.mapped - b.offset)
                except KvpoolError as exc:
                    log.warning("CUDA IPC: closing a mapping of pid %d failed: %s", self.pid, exc)
            else:
                driver.host_unregister(b.mapped)
                b.keep.close()
            b.mapped, b.keep = 0, None
        if pidfd and self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def alive(self) -> bool:
        """Whether the peer's process still runs (its pidfd is not readable)."""
        if self.pidfd < 0:
            return True  # no pidfd (old kernel): the fence pin decides
        # a poll object per call: one shared by threads raises RuntimeError when two poll at once
        p = select.poll()  # not select(): it refuses descriptors >= 1024
        p.register(self.pidfd, select.POLLIN)
        return not p.poll(0)  # readable = exited

    def device_of(self, used: list[int], uuids: dict[bytes, int]) -> int:
        """Our device of the first GPU buffer among ``used`` (0 when none is GPU memory)."""
        for k in used:
            if self.bufs[k].gpu:
                return uuids.get(self.bufs[k].uuid, 0)
        return 0

    def pin(self, used: list[int]) -> list[tuple[int, int]]:
        """Pin the owner's fence slot of every remote buffer used (indices into ``bufs``), at its
        published generation; RemoteAccessError (nothing left pinned) once one was unregistered.
        Called by CudaIpcTransport before it queues a run; :meth:`unpin` when the run ended."""
        pins: list[tuple[int, int]] = []
        for k in used:
            b = self.bufs[k]
            if self.fence is None or b.slot < 0 or not self.fence.pin(b.slot, b.gen):
                self.unpin(pins)
                raise RemoteAccessError(
                    f"remote buffer {b.addr:#x}+{b.length} is no longer registered by its owner "
                    "(unregistered or re-registered); refetch the segment and retry"
                )
            pins.append((b.slot, b.gen))
        return pins

    def unpin(self, pins: list[tuple[int, int]]) -> None:
        for slot, _ in pins:
            self.fence.unpin(slot)


@dataclass
class _Run:
    """A queued run of GPU copies: its slots, pins and resources, completed by one event."""

    event: int
    batch_id: int
    first: int
    lens: np.ndarray
    peer: _Peer
    pins: list[tuple[int, int]]
    table: tuple[int, int, int] | None  # (device table, pinned host table, bytes) to give back
    dev: int
    lo: int = 0  # the local address range the copies touch: [lo, hi)
    hi: int = 0
    seen: int = 0  # runs completed when it was queued or last asked about (CudaIpcTransport.unbounded)
    error: str | None = None  # a run a CUDA call failed to queue whole: its slots fail with it


@dataclass
class _Prepared:
    """What CudaIpcTransport._prepare_gpu took for a run before it is queued (pins first)."""

    pins: list[tuple[int, int]]
    dev: int = 0
    bases: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=_U64))
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=_U64))
    stream: int = 0
    kernel: bool = False
    func: int = 0
    table: tuple[int, int, int] | None = None
    event: int | None = None


def _pick(c: Any, idx: np.ndarray) -> Any:
    """The entries ``idx`` of a request column (a list or a numpy array), as a list."""
    return c[idx].tolist() if isinstance(c, np.ndarray) else [c[i] for i in idx.tolist()]


_NO_OPS = np.zeros(0, dtype=np.uint8)
_PLAN_ERRORS = {
    1: "is not inside registered memory; call register_local_memory first",
    2: "is registered read-only: it cannot receive a READ",
    3: "runs past registered GPU memory",
}


class Plan(NamedTuple):
    """Where a submit's requests lie (``_native.ipc_classify``, one C++ pass over the columns):
    ``local_gpu`` (bool[n]: the local range is GPU memory), ``ridx`` (int64[n]: the peer buffer
    holding the remote range's start, -1: none), ``ipc`` (bool[n]: a GPU copy does it — GPU memory
    on one side, memory the copy reaches on the other), ``staged`` (a local GPU range goes to a peer
    range no GPU copy reaches), ``all_inside`` (every remote range lies in a published buffer),
    ``n_ipc`` (how many are ``ipc``)."""

    local_gpu: np.ndarray
    ridx: np.ndarray
    ipc: np.ndarray
    staged: bool
    all_inside: bool
    n_ipc: int


def _plan(
    registry: LocalRegistry, peer: _Peer, ops: np.ndarray | None, locs: np.ndarray, rems: np.ndarray,
    lens: np.ndarray,
) -> Plan:  # fmt: skip
    """Classify request columns (uint64; ``ops`` uint8) against our registrations and ``peer``'s
    buffers. With ``ops`` (a submit): AddressNotRegistered for a local range outside registered
    memory or a READ into read-only memory; without (CudaIpcTransport.needs_staging, before a
    synchronous transfer is cut into rounds): only for a range that starts in GPU memory and runs
    past it. Called on every CUDA IPC submit: no per-request Python."""
    _regs, (starts, ends, ro, gpu) = registry.columns()
    code, bad, local_gpu, ridx, ipc, staged, all_inside, n_ipc = _native.ipc_classify(
        _NO_OPS if ops is None else ops, locs, rems, lens, starts, ends, ro, gpu,
        peer.starts, peer.ends, peer.gpu, ops is not None,
    )  # fmt: skip
    if code:
        raise AddressNotRegistered(f"local range {int(locs[bad]):#x}+{int(lens[bad])} {_PLAN_ERRORS[code]} "
                                   f"(request {bad})")  # fmt: skip
    return Plan(local_gpu, ridx, ipc, staged, all_inside, n_ipc)


def _col(c: Any) -> np.ndarray:
    """A request column as a uint64 array (free for arrays, one C-speed pass for lists)."""
    if isinstance(c, np.ndarray):
        return c.astype(_U64, copy=False)
    a = _native.u64_column(c)  # a list of ints in one native pass
    return np.fromiter(c, dtype=_U64, count=len(c)) if a is None else a


class _Shm:
    """A peer's shared host buffer mapped here (closed with the peer)."""

    def __init__(self, m: mmap.mmap) -> None:
        self.m = m

    def close(self) -> None:
        try:
            self.m.close()
        except BufferError:
            pass  # a ctypes view still points into it: the mapping goes with the process


class _Spares:
    """Device address tables (device table, pinned host table, bytes) and events of finished
    runs, per device (an event records only on a stream of the context it was made in), for the
    next runs to reuse: a run takes them, its completion (or its failure to queue) gives them
    back; :meth:`close` frees them with the transport."""

    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver
        self._lock = threading.Lock()
        self._tables: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)
        self._events: dict[int, list[int]] = collections.defaultdict(list)

    def table(self, dev: int, need: int) -> tuple[int, int, int]:
        size = 1 << max(16, (need - 1).bit_length())
        with self._lock:
            free = self._tables[dev]
            for i, t in enumerate(free):
                if t[2] == size:
                    return free.pop(i)
        d = self._driver.alloc(size, dev)
        try:
            return d, self._driver.host_alloc(size), size
        except BaseException:
            self._driver.free(d)
            raise

    def event(self, dev: int) -> int:
        """A spare event of ``dev`` or a new one (made in the caller's current context: ``dev``'s)."""
        with self._lock:  # two submitters could both see the last one
            if self._events[dev]:
                return self._events[dev].pop()
        return self._driver.event()

    def give_back(self, dev: int, table: tuple[int, int, int] | None, event: int | None) -> None:
        """A run's address table and event (its copies ran, or failed and were settled)."""
        with self._lock:
            if event is not None:
                self._events[dev].append(event)
            if table is not None:
                self._tables[dev].append(table)

    def close(self) -> None:
        for events in self._events.values():
            for e in events:
                self._driver.event_destroy(e)
        for tables in self._tables.values():
            for d, h, _ in tables:
                self._driver.free(d)
                self._driver.free_host(h)


class _PeerAccess:
    """Peer access of a run's device to the device of a peer's GPU buffer, enabled once per pair
    (CudaIpcTransport._prepare_gpu): a gather kernel reaches another device's memory only then
    (copies need none); False where the devices cannot (the run goes by copies)."""

    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver
        self._known: dict[tuple[int, int], bool] = {}

    def ok(self, dev: int, other: int) -> bool:
        got = dev == other or self._known.get((dev, other))
        if got is None:  # enabling twice is harmless (already enabled: True)
            got = self._known[dev, other] = self._driver.enable_peer(dev, other)
        return bool(got)


class _Gate:
    """Our submits against the unregister of local memory (CUDA IPC runs copy into or out of it).

    A submit :meth:`enter` s with its local range *before* it checks the registrations and
    :meth:`leave` s once its runs are queued (or it failed); :meth:`drain` (unregister) closes the
    registration's range (submits entering from then on are refused) and waits until no submit
    in the gate and no queued run overlaps it. A range stays closed while its registration is in
    the registry, so a submit that checked before unregister began is waited for and one after
    it is refused: none queues a run into memory unregister already returned. ``cond`` guards
    ``runs`` (notified when a run is popped)."""

    def __init__(
        self, cond: threading.Condition, runs: collections.deque[_Run], registry: LocalRegistry
    ) -> None:
        self._cond = cond
        self._runs = runs
        self._registry = registry
        self._inside: list[tuple[np.ndarray, np.ndarray]] = []  # (starts, ends) per submit in the gate
        self._closed: list[Registration] = []

    def _prune(self) -> None:  # ranges whose registration left the registry are checked by it
        self._closed = [r for r in self._closed if self._registry.get(r.start) is r]

    def enter(self, locs: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Called by submit before its checks, with its local ranges; AddressNotRegistered if one
        of them is being unregistered."""
        token = (locs, lens)  # the ends only when an unregister looks (_overlaps)
        with self._cond:
            if self._closed:
                self._prune()
                for r in self._closed:
                    if _overlaps(token, r.start, r.end):
                        raise AddressNotRegistered(f"local memory at {r.start:#x} is being unregistered")
            self._inside.append(token)
        return token

    def leave(self, token: tuple[np.ndarray, np.ndarray]) -> None:
        with self._cond:
            self._inside = [t for t in self._inside if t is not token]
            self._cond.notify_all()

    def drain(self, reg: Registration, timeout_s: float) -> bool:
        """Called by unregister: close ``reg``'s range, wait for our submits and runs touching it;
        False when some still do after ``timeout_s`` (the range stays closed)."""
        deadline = time.monotonic() + timeout_s
        lo, hi = reg.start, reg.end
        with self._cond:
            self._prune()
            if all(r is not reg for r in self._closed):  # identity: keep may be an array
                self._closed.append(reg)
            while any(_overlaps(t, lo, hi) for t in self._inside) or any(
                r.lo < hi and lo < r.hi for r in self._runs
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True


def _overlaps(token: tuple[np.ndarray, np.ndarray], lo: int, hi: int) -> bool:
    """Whether one of a submit's local ranges (starts, lengths) overlaps [lo, hi)."""
    starts, lens = token
    return bool(np.any((starts < hi) & (starts + lens > lo)))
