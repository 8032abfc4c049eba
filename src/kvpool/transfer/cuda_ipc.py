"""CUDA IPC transport: GPU memory of a process on this host, copied by the GPU itself.

An engine whose CUDA driver loads (:mod:`kvpool.transfer.cuda_driver`) publishes, for every
remote-accessible GPU registration, the allocation's IPC handle, the offset of the range in it,
the owner's device UUID and a same-host fence slot (``SegmentDescriptor.cuda_ipc``). An initiator on
the same host (same ``host_id``) routes its requests to that segment here:

- a request whose remote range is GPU memory, or whose local range is GPU memory and whose remote
  range is one of the peer's shared host buffers (``alloc_shared_buffer``), is copied by the GPU:
  the peer's allocation is opened once (``cuIpcOpenMemHandle``, cached until the peer closes or
  restarts), its shared buffers mapped and page-locked once (``cuMemHostRegister``), and a whole
  run of such requests becomes **one launch** of the ``kvpool_gather`` kernel (kernels/gather.cu;
  the address table goes to the device in one copy) - or, for a few large ranges, one
  ``cuMemcpyAsync`` each - on this transport's stream per device, followed by one event;
- every other request goes to the same-host transport it wraps (through GPU staging when the
  local range is GPU memory), in order, so batch slots stay in request order.

**The owner decides.** Each GPU registration has a slot in the owner's fence table (csrc/fence.h).
Before a run is queued, the initiator pins the slot of every remote range it touches at the
generation its descriptor named; a pin fails once the owner unregistered the range (the run is
refused with RemoteAccessError), and unregistering waits for pinned copies to finish. The pins are
dropped when the run's event completed. A run whose owner exited while it was in flight fails
(TransferError) instead of reporting bytes that nobody holds; mappings of a peer are closed when
the engine detaches it (close, restart) or it exited, once our submits and copies to it ended: by
the completion thread or the last submit (detach and release_exited never wait for a GPU stream).

Completion: a native thread per transport (``_native.IpcCompleter``, csrc/ipc_complete.cpp) waits
on the runs' events in order (``cuEventSynchronize``), unpins, asks the owner's pidfd and
completes a successful run's slots at once, with no Python in between (a synchronous caller wakes
straight away); a Python thread then takes each result for the bookkeeping (spares, mappings,
counters) and completes a failed run's slots with the reason. A run it could not wait for (the
device's context could not be made current) keeps its pins and stays queued; past ``timeout_s``
its slots time out ("may still land").
A synchronous caller's run (``batch_transfer_sync``: ``waited``) skips both threads when it ends
within about its copy time at host-to-device speed (``_SPIN_US``: 200 us + 1 us per 10 KB, at most 2 ms):
the caller asks its event itself and ends it the same way in its own thread
(``_native.ipc_finish_here``); a longer one is pushed to the completer as above.

**Not verified on hardware**: CI runs this across real processes on the fake driver
(:mod:`kvpool.testing.fakecuda`); ``pytest -m gpu`` runs it on a real GPU.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from importlib import resources
from typing import Any

import numpy as np

from kvpool import _native
from kvpool.errors import (
    KvpoolError,
    ProtocolUnavailable,
    RegistrationError,
    SegmentNotFound,
)
from kvpool.transfer.batch import Batches
from kvpool.transfer.cuda_driver import CudaDriver
from kvpool.transfer.cuda_ipc_complete import _Completion
from kvpool.transfer.cuda_ipc_state import (
    _U64,
    _col,
    _Export,
    _Gate,
    _gpu_bufs,
    _Lineage,
    _Peer,
    _PeerAccess,
    _pick,
    _plan,
    _Prepared,
    _RemoteBuf,
    _Run,
    _Spares,
)
from kvpool.transfer.memory import LocalRegistry
from kvpool.transfer.staging import GpuStaging
from kvpool.transfer.transport import Requests, Transport
from kvpool.transfer.types import SegmentDescriptor

_KERNEL = "kvpool_gather"
_BLOCK = 256
_MAX_GRID = 1 << 16
_MEMCPY_MIN = 4 << 20  # ranges at least this big (or runs of <= 4) go by cuMemcpyAsync


class CudaIpcTransport(_Completion, Transport):
    """GPU copies to same-host peers, everything else through ``inner`` (see the module docstring)."""

    name = "cuda_ipc"
    locations = frozenset({"cuda"})
    takes_arrays = True  # request columns may be numpy uint64 arrays (see TransferEngine.batch_transfer_sync)

    def __init__(
        self,
        native: _native.NativeEngine,
        driver: CudaDriver,
        batches: Batches,
        registry: LocalRegistry,
        inner: Transport,
        staging: GpuStaging,
        timeout_s: float = 30.0,
    ) -> None:
        self.native = native
        self.timeout_s = timeout_s  # how long unregister waits for our copies of a range
        self.driver = driver
        self.batches = batches
        self.registry = registry
        self.inner = inner
        self.staging = staging
        self._exports: dict[int, _Export] = {}
        self._peers: dict[int, _Peer] = {}
        self._released: set[int] = set()  # handles whose exited peer release_exited let go
        self._doomed: list[tuple[_Peer, bool]] = []  # closed after their runs and submits (_retire)
        self._streams: dict[int, int] = {}
        self._kernels: dict[int, int] = {}
        self._spares = _Spares(driver)  # address tables and events of finished runs
        self._access = _PeerAccess(driver)  # of a run's device to a peer buffer's (kernels)
        self._uuids = {driver.uuid(d): d for d in range(driver.count)}
        self._runs: collections.deque[_Run] = collections.deque()
        self._completed = 0  # runs completed so far: the queue's position (see unbounded)
        self._cond = threading.Condition()
        self._gate = _Gate(self._cond, self._runs, registry)
        self._closed = False  # close() began: no new submit (_hold), the thread ends when all did
        self._submits = 0  # submits between _hold and _let_go (close waits for them, as for runs)
        self._late = False  # close() gave up on a hung stream: the completion thread tears down
        if not _native.cuda_init(driver.path) or _native.cuda_loaded_path() != driver.path:
            raise ProtocolUnavailable(
                f"CUDA IPC: the native side could not load the driver {driver.path!r} "
                f"(it loaded {_native.cuda_loaded_path()!r} for this process)"
            )
        self._completer = _native.IpcCompleter(native, int(timeout_s * 1000))
        self._pushed = 0  # runs handed to the completer (their sequence numbers)
        self._thread = threading.Thread(target=self._complete_loop, name="kvpool-cuda-ipc", daemon=True)
        self._thread.start()
        self.launches = 0  # kernel launches and cuMemcpyAsync runs, for tests and benchmarks
        self.memcpy_runs = 0
        self.finished_here = 0  # runs a synchronous caller ended in its own thread (_finish_here)

    # ------------------------------------------------------------------ owner side
    def describe(self) -> dict[str, Any]:
        exports = list(self._exports.values())
        return {
            "cuda_ipc": {
                "bufs": [
                    [e.addr, e.length, self.driver.uuid(e.device), e.handle, e.offset, e.slot, e.gen]
                    for e in exports
                ]
            }
        }

    def register(
        self, addr: int, length: int, location: str, remote: bool, writable: bool, dmabuf: Any = None
    ) -> None:
        if not remote:
            return
        device = int(location.partition(":")[2] or 0)
        try:
            base, _ = self.driver.address_range(addr)
            handle = self.driver.ipc_handle(base)
        except KvpoolError as exc:
            raise RegistrationError(
                f"cannot export {location} memory at {addr:#x} through CUDA IPC ({exc}); memory from "
                "cuMemCreate/VMM allocators (PyTorch expandable_segments) is not supported yet: "
                "allocate the KV cache with cudaMalloc, or register it with remote_accessible=False"
            ) from None
        slot, gen = self.native.fence_claim(addr, length)
        if slot < 0:
            raise RegistrationError("the same-host fence table is full: unregister unused GPU memory first")
        self._exports[addr] = _Export(addr, length, device, handle, addr - base, slot, gen)

    def unregister(self, addr: int) -> None:
        """Called by TransferEngine.unregister_local_memory before the registration goes: retires
        its export (same-host peers' new pins fail from now on), refuses our new copies into or
        out of the range, then waits for those submitted or queued (a READ's copies would land
        after the caller freed it) and for peers' copies already pinned, all within one
        ``timeout_s``. Our copies still running at the deadline (a hung stream), or a same-host
        peer stopped inside a copy (its fence pin held): RegistrationError after the export is
        retired and dropped (no new copy starts, nothing published); the engine then finishes
        unregistering and keeps the memory referenced."""
        deadline = time.monotonic() + self.timeout_s
        e = self._exports.pop(addr, None)
        if e is not None:
            self.native.fence_retire_begin(e.slot)  # no peer's copy starts from here on
        reg = self.registry.get(addr)
        drained = reg is None or self._gate.drain(reg, self.timeout_s)
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))  # what the drain left of it
        retired = e is None or self.native.fence_retire(e.slot, left_ms)  # waits for same-host copies
        why = [] if retired else ["a same-host peer is stopped inside a copy into or out of it"]
        if not drained:
            why.append(f"our CUDA IPC copies into or out of it did not finish within {self.timeout_s:g} s")
        if why:  # a retired slot takes no new pin, but the stopped peer or hung stream still copies
            raise RegistrationError(
                f"GPU memory at {addr:#x} is unregistered, but {' and '.join(why)}: do not free it "
                "until that peer continues or exits, or the GPU stream finishes"
            )

    # ------------------------------------------------------------------ initiator side: segments
    def reaches(self, desc: SegmentDescriptor, local: str = "cpu", remote: str = "cpu") -> bool:
        # every same-host peer: its shared host buffers are reachable by the GPU even when it
        # runs no CUDA itself; its GPU buffers only when it publishes them (desc.cuda_ipc)
        return self.inner.reaches(desc)

    def peer_pid(self, desc: SegmentDescriptor) -> int:
        """The inner transport's answer (the same-host one watches the owner's pid)."""
        return self.inner.peer_pid(desc)

    def attach(self, handle: int, name: str, desc: SegmentDescriptor) -> None:
        bufs = _gpu_bufs(desc.cuda_ipc)  # MetadataError for a malformed one, before anything
        self.inner.attach(handle, name, desc)  # releases the inner transport's exited peers
        self.release_exited()  # a new peer is often a dead one's successor
        self._released.discard(handle)
        for b in desc.buffers:
            if b.remote_accessible and b.shm_fd >= 0 and b.location.startswith("cpu"):
                bufs.append(_RemoteBuf(b.addr, b.length, False, b.fence_slot, b.fence_gen, shm_fd=b.shm_fd))
        bufs.sort(key=lambda b: b.addr)
        old = self._peers.get(handle)
        same = old is not None and old.pid == desc.pid and old.incarnation == desc.incarnation
        fence = (
            _native.FenceMap.map(desc.pid, desc.fence_fd, desc.incarnation) if desc.fence_fd >= 0 else None
        )
        if same and old is not None and old.pidfd >= 0:
            pidfd = old.pidfd  # the same process: its pidfd is kept (a new one per re-attach leaked)
        else:
            try:
                pidfd = os.pidfd_open(desc.pid)
            except OSError:
                pidfd = -1
        cols = (np.array([b.addr for b in bufs], dtype=_U64), np.array([b.addr + b.length for b in bufs],
                dtype=_U64), np.array([b.gpu for b in bufs], dtype=bool))  # fmt: skip
        lineage = old.lineage if same and old is not None else _Lineage()
        new = _Peer(desc.pid, desc.incarnation, bufs, *cols, fence, pidfd, lineage=lineage)
        # every remote-accessible buffer of the peer lies in one a GPU copy reaches (needs_staging)
        new.all_reachable = all(
            any(r.addr <= b.addr and b.addr + b.length <= r.addr + r.length for r in bufs)
            for b in desc.buffers
            if b.remote_accessible
        )
        if old is None:
            self._peers[handle] = new
            return
        with old.lock:  # an open through it in progress ends first, none starts after (retired)
            kept = {(b.addr, b.handle, b.shm_fd): b for b in old.bufs if b.mapped and same}
            for b in bufs:  # the same registration: keep its mapping
                k = kept.pop((b.addr, b.handle, b.shm_fd), None)
                if k is not None:
                    b.mapped, b.keep, k.handed = k.mapped, k.keep, True
            with self._cond:  # one step for _hold: a submit takes the old record (not retired) or the new
                old.retired = True
                self._peers[handle] = new
        self._retire(old, pidfd=not same)  # the same process: the new record keeps the pidfd

    def detach(self, handle: int) -> None:
        self.inner.detach(handle)
        self._released.discard(handle)
        peer = self._peers.pop(handle, None)
        if peer is not None:
            self._retire(peer)

    def release_exited(self) -> list[int]:
        """Close the mappings (GPU IPC, shared host buffers), fence and pidfd of peers whose process
        exited, after our copies in flight to them finished; with the inner transport's. Called
        by the engine (``release_exited_peers``: a store client's heartbeat) and by attach; never
        waits for the GPU (see :meth:`_retire`). The next open of a released handle re-fetches it
        (:meth:`peer_gone`)."""
        out = set(self.inner.release_exited())
        for h, peer in list(self._peers.items()):
            if peer.pidfd >= 0 and not peer.alive():
                del self._peers[h]
                self._retire(peer)
                self._released.add(h)
                out.add(h)
        return sorted(out)

    def peer_gone(self, handle: int) -> bool:
        """The owner's process exited and a caller was told so (a request failed with it): the
        engine re-fetches the segment on the next open (a restarted owner publishes new handles)
        and attach() retires the old mappings. As over TCP, the first request after a restart
        fails, so addresses of the old owner never reach the new one unnoticed."""
        peer = self._peers.get(handle)
        if handle in self._released:
            return True
        return (peer is not None and peer.gone) or self.inner.peer_gone(handle)

    def _retire(self, peer: _Peer, pidfd: bool = True) -> None:
        """Let go of a record taken out of ``_peers``: it maps nothing more (``retired``), and its
        mappings (those not handed to the next record) and its pidfd (when ``pidfd``) are closed
        now if no run or submit of ours to its process is in flight (through this record or
        another of the same attachment: ``lineage``), else by whoever ends the last of them (the
        completion thread after a run, :meth:`_let_go` after a submit). Never waits for the GPU
        (a hung stream must not stop a store client's heartbeat, which calls release_exited),
        only for an open in progress through the record; never unmaps memory a copy may use."""
        with peer.lock:
            peer.retired = True
        with self._cond:
            if peer.lineage.submits or any(r.peer.lineage is peer.lineage for r in self._runs):
                self._doomed.append((peer, pidfd))
                return
        peer.close(self.driver, peer.bufs, pidfd)

    def _hold(self, handle: int) -> _Peer:
        """The record a submit copies through, counted in flight (:meth:`_retire` closes nothing
        of its lineage until :meth:`_let_go`): taken under ``_cond``, so a detach either sees the
        count or retired the record first (then the submit is refused and queues nothing)."""
        with self._cond:
            peer = self._peers.get(handle)
            if peer is None or peer.retired or self._closed:
                raise SegmentNotFound("segment is not open on the CUDA IPC path (closed concurrently?)")
            peer.lineage.submits += 1
            self._submits += 1
        return peer

    def _let_go(self, peer: _Peer) -> None:
        """A submit through ``peer`` ended (its run queued, or it failed): closes what waited for it."""
        with self._cond:
            peer.lineage.submits -= 1
            self._submits -= 1
            ready = self._ready()
            self._cond.notify_all()  # close waits for submits too
        if self._closed:
            self._completer.kick()  # a timed-out close: the completion thread looks again
        for p, pidfd in ready:
            p.close(self.driver, p.bufs, pidfd)

    def _ready(self) -> list[tuple[_Peer, bool]]:
        """Under ``_cond``: the retired records no run or submit of ours uses any more, taken
        out of ``_doomed`` (the caller closes them, outside the lock)."""
        if not self._doomed:
            return []
        busy = {id(r.peer.lineage) for r in self._runs}
        ready = [d for d in self._doomed if id(d[0].lineage) not in busy and not d[0].lineage.submits]
        self._doomed = [d for d in self._doomed if all(d is not r for r in ready)]
        return ready

    # ------------------------------------------------------------------ initiator side: submit
    def submit(
        self, batch_id: int, reqs: Requests, stage_wait_s: float | None = None, waited: bool = False
    ) -> None:
        """Columns may be lists or numpy arrays (``batch_transfer_sync`` passes arrays through).
        Staged requests (see :meth:`needs_staging`) wait up to ``stage_wait_s`` for the staging
        pool (None: InvalidArgument when it is full). ``waited`` (a synchronous caller): a
        submit that is one run of GPU copies waits up to ``_SPIN_US`` for it here and ends it in
        this thread (:meth:`_finish_here`); a longer run goes to the completer as usual."""
        ops = reqs.ops
        if isinstance(ops, np.ndarray):
            ops = ops.astype(np.uint8, copy=False)
        elif ops.count(ops[0]) == len(ops):
            ops = np.full(len(ops), ops[0], dtype=np.uint8)
        else:
            ops = np.asarray(ops, dtype=np.uint8)
        locs, rems, lens = _col(reqs.locs), _col(reqs.rems), _col(reqs.lens)
        peers = reqs.peers
        if peers.count(peers[0]) != len(peers):  # several same-host segments: one run each
            start = 0
            for i in range(1, len(peers) + 1):
                if i == len(peers) or peers[i] != peers[start]:
                    self.submit(batch_id, reqs.part(start, i), stage_wait_s)  # not waited: all in flight
                    start = i
            return
        gate = self._gate.enter(locs, lens)  # before the checks
        try:
            peer = self._hold(reqs.peers[0])
            try:
                self._submit_one(batch_id, peer, reqs, ops, locs, rems, lens, stage_wait_s, gate, waited)
            finally:
                self._let_go(peer)
        finally:
            self._gate.leave(gate)

    def _submit_one(
        self, batch_id: int, peer: _Peer, reqs: Requests, ops: np.ndarray, locs: np.ndarray,
        rems: np.ndarray, lens: np.ndarray, stage_wait_s: float | None, gate: tuple[np.ndarray, np.ndarray],
        waited: bool = False,
    ) -> None:  # fmt: skip
        """:meth:`submit` to one segment, inside the gate (left before a staged wait with no run
        after), through ``peer`` held (:meth:`_hold`)."""
        plan = _plan(self.registry, peer, ops, locs, rems, lens)
        local_gpu, ridx, ipc = plan.local_gpu, plan.ridx, plan.ipc
        if not plan.all_inside and not peer.alive():
            # outside the descriptor we hold: maybe a restarted owner's new memory; say it exited
            # (the next open_segment re-fetches) rather than refuse the range forever
            peer.gone = True
            raise SegmentNotFound(f"the segment's process (pid {peer.pid}) exited; open the segment again")
        if not plan.n_ipc:
            self._gate.leave(gate)  # no run of ours: staging tracks its own copies (busy())
            self._inner_submit(batch_id, reqs, local_gpu, stage_wait_s)
            return
        if plan.n_ipc == len(ipc):
            run = self._prepare_gpu(peer, ops, locs, lens, ridx, local_gpu)
            self._enqueue_gpu(batch_id, peer, run, ops, locs, rems, lens, ridx, waited)
            return
        # Mixed GPU copies and other requests: every part is checked, and every GPU part pinned,
        # mapped and given its resources, before the first part is queued, so that a refusal
        # (an owner that unregistered a buffer, a range past every buffer) queues nothing.
        edges = np.flatnonzero(np.diff(ipc.astype(np.int8))) + 1
        bounds = [0, *edges.tolist(), len(ipc)]
        parts = list(zip(bounds, bounds[1:], strict=False))
        if self.staging.check is not None:  # the other requests, as the inner transport will
            rest = np.flatnonzero(~ipc)
            self.staging.check(Requests(*(_pick(c, rest) for c in reqs)))
        prepared: dict[int, _Prepared] = {}
        try:
            for a, b in parts:
                if ipc[a]:
                    prepared[a] = self._prepare_gpu(
                        peer, ops[a:b], locs[a:b], lens[a:b], ridx[a:b], local_gpu[a:b]
                    )
        except BaseException:
            for run in prepared.values():
                self._release(peer, run)
            raise
        for a, b in parts:
            try:
                if ipc[a]:
                    run = prepared.pop(a)
                    self._enqueue_gpu(
                        batch_id, peer, run, ops[a:b], locs[a:b], rems[a:b], lens[a:b], ridx[a:b]
                    )
                else:
                    if not ipc[a:].any():
                        self._gate.leave(gate)
                    self._inner_submit(batch_id, reqs.part(a, b), local_gpu[a:b], stage_wait_s)
            except BaseException:  # found only once queuing began: the engine says what was queued
                for run in prepared.values():
                    self._release(peer, run)
                raise

    def needs_staging(self, handle: int, locs: Any, rems: Any, lens: Any) -> bool:
        """Whether some of these requests go through GPU staging (a local GPU range to a peer range
        no GPU copy reaches). Called by the engine's synchronous transfers, which then cut them
        into rounds that fit the staging pool, as for the other transports."""
        peer = self._peers.get(handle)
        if peer is None or not len(locs) or peer.all_reachable:
            # all_reachable: a remote range outside the buffers a GPU copy reaches is outside every
            # buffer of the peer, and the submit refuses it whatever the staging (typed)
            return False
        return _plan(self.registry, peer, None, _col(locs), _col(rems), _col(lens)).staged

    def _inner_submit(
        self, batch_id: int, reqs: Requests, local_gpu: np.ndarray, wait_s: float | None
    ) -> None:
        reqs = Requests(*(c.tolist() if isinstance(c, np.ndarray) else c for c in reqs))
        if local_gpu.any():
            self.staging.submit(self.inner, batch_id, reqs, wait_s)
        else:
            self.inner.submit(batch_id, reqs)

    def _prepare_gpu(
        self, peer: _Peer, ops: np.ndarray, locs: np.ndarray, lens: np.ndarray, ridx: np.ndarray,
        local_gpu: np.ndarray,
    ) -> _Prepared:  # fmt: skip
        """Everything of one run of GPU copies that can refuse it, before anything is queued:
        its remote ranges inside the peer's buffers, the owner alive, the owner's fence slots
        pinned, the mappings opened, a stream, the kernel, an address table and an event.
        Raises (nothing held) or returns what :meth:`_enqueue_gpu` queues with (or
        :meth:`_release` gives back). The kernel reads and writes device-accessible memory
        only, so a run with pageable local host memory goes by one cuMemcpyAsync per request."""
        # every request of a GPU run lies in a peer buffer (the plan's ``ipc``; ipc_enqueue checks
        # again: RemoteAccessError, nothing queued): ridx >= 0
        n = len(lens)
        if len(peer.bufs) == 1 or n == 1:
            used = [int(ridx[0])]  # the common cases, without two numpy passes
        else:
            used = np.flatnonzero(np.bincount(ridx, minlength=len(peer.bufs))).tolist()
        if not peer.alive():
            peer.gone = True
            raise SegmentNotFound(f"the segment's process (pid {peer.pid}) exited; open the segment again")
        run = _Prepared(peer.pin(used))
        try:
            first_gpu = self.registry.gpu_region(int(locs[0]), int(lens[0]))
            dev = run.dev = (
                int(first_gpu.desc.location.partition(":")[2] or 0)
                if first_gpu
                else peer.device_of(used, self._uuids)
            )
            self.driver.use(dev)  # the mappings opened below are for dev's context
            run.bases = np.zeros(len(peer.bufs), dtype=_U64)
            run.starts = np.zeros(len(peer.bufs), dtype=_U64)
            reach = True  # the gather kernel on dev reaches every GPU buffer used
            for k in used:
                b = peer.bufs[k]
                run.bases[k] = peer.open(b, dev, self.driver, self._uuids)
                run.starts[k] = b.addr
                reach = reach and (not b.gpu or self._access.ok(dev, self._uuids.get(b.uuid, dev)))
            run.stream = self._stream(dev)
            run.kernel = reach and n > 4 and int(np.min(lens)) < _MEMCPY_MIN and bool(local_gpu.all())
            if run.kernel:
                run.func = self._kernel(dev)
                run.table = self._spares.table(dev, 24 * n)
            run.event = self._spares.event(dev)
        except BaseException:
            self._release(peer, run)
            raise
        return run

    def _release(self, peer: _Peer, run: _Prepared) -> None:
        """Give back what :meth:`_prepare_gpu` took for a run that was not queued."""
        self._spares.give_back(run.dev, run.table, run.event)
        peer.unpin(run.pins)

    def _enqueue_gpu(
        self, batch_id: int, peer: _Peer, run: _Prepared, ops: np.ndarray, locs: np.ndarray,
        rems: np.ndarray, lens: np.ndarray, ridx: np.ndarray, waited: bool = False,
    ) -> None:  # fmt: skip
        """Queue one prepared run: one native call (``_native.ipc_enqueue``) that reserves the
        slots and queues the copies and one event; the run goes to the completer, or with
        ``waited`` is ended here when it finishes within ``_SPIN_US`` (:meth:`_finish_here`). A
        CUDA call failing partway (copies queued before it may still run): see
        :meth:`_failed_run`."""
        dev = run.dev
        lens = np.ascontiguousarray(lens, dtype=_U64)
        dtab, htab, size = run.table or (0, 0, 0)
        out = np.zeros(5, dtype=_U64)  # reserved, first slot, lo, hi, rc: written as it happens
        interrupted: BaseException | None = None
        try:
            target = _native.IpcRunTarget(
                dev, run.stream, run.func, dtab, htab, size, _BLOCK, _MAX_GRID, run.event
            )
            what = _native.ipc_enqueue(
                self.native, batch_id, target, ops, locs, rems, lens, ridx, run.bases, run.starts, out
            )
        except BaseException as exc:
            if not out[0]:
                self._release(peer, run)  # nothing was queued
                raise
            # queued, and a signal handler raised as the call returned: the run goes on as queued
            # (its copies may run: pins and spares stay until it ends), then the exception
            interrupted, waited, what = exc, False, "a CUDA call"
        first, lo, hi, rc = (int(x) for x in out[1:])
        try:
            self._queued(batch_id, peer, run, lens, first, lo, hi, rc, what, waited)
        finally:
            if interrupted is not None:
                raise interrupted

    def _queued(
        self, batch_id: int, peer: _Peer, run: _Prepared, lens: np.ndarray, first: int, lo: int, hi: int,
        rc: int, what: str, waited: bool,
    ) -> None:  # fmt: skip
        """A run :meth:`_enqueue_gpu` queued (its slots reserved): failed partway (``rc``), ended
        here or pushed to the completer."""
        dev = run.dev
        if rc:
            exc = self.driver.error(rc, what)
            self._failed_run(batch_id, first, lens, lo, hi, peer, run, f"CUDA IPC copy not queued: {exc}")
            raise exc
        if run.kernel:
            self.launches += 1
        else:
            self.memcpy_runs += 1
        queued = _Run(run.event, batch_id, first, lens, peer, run.pins, run.table, dev, lo, hi)
        if waited:
            self._finish_here(queued, lens)  # or pushes it
        else:
            self._push(queued, lens)

    def _push(self, run: _Run, lens: np.ndarray) -> None:
        """Queue ``run`` for completion (the native completer completes ``lens`` of its slots on
        success, from ``run.first``)."""
        peer = run.peer
        with peer.lock:
            peer.inflight += 1
        slots = [slot for slot, _ in run.pins]
        with self._cond:  # queue order = completion order: appended and pushed under the lock
            run.seen = self._completed
            self._runs.append(run)
            self._pushed += 1
            self._completer.push(
                self._pushed, run.dev, run.event, run.batch_id, run.first, lens, peer.fence, slots,
                peer.pidfd,
            )  # fmt: skip

    def _stream(self, dev: int) -> int:
        s = self._streams.get(dev)
        if s is None:
            s = self._streams[dev] = self.driver.stream(dev)
        return s

    def _kernel(self, dev: int) -> int:
        """The gather kernel in ``dev``'s context (loaded on first use)."""
        func = self._kernels.get(dev)
        if func is None:
            ptx = resources.files("kvpool.transfer").joinpath("kernels/gather.ptx").read_bytes() + b"\0"
            func = self._kernels[dev] = self.driver.function(ptx, _KERNEL, dev)
        return func
