"""A store client's data plane: writes and reads of whole objects (header + value) through the
transfer engine, with the checks that make a read return the right object or a typed error.

The master is never asked here: the caller (:class:`kvpool.store.client.Store`) gets allocations
and locations from it, describes them as :class:`WriteJob` / :class:`ReadJob`, and handles what
comes back (commit, lease release, a fresh lookup for a read that must be retried).

A read is accepted only when

* its bytes landed before the read's deadline (the end of the lease the master granted, measured
  from before the lookup was sent: until then the object's space cannot have been freed), and
* the header names this object (epoch, generation, key hash, length; :mod:`kvpool.store.layout`),
* and, where the object has a checksum, the value matches it.

A replica that cannot be reached is reported to the master and the next one is tried; a replica
whose bytes fail the checksum is reported as corrupt (the master drops it) and the next one is
tried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpool import _native
from kvpool.errors import (
    KvpoolError,
    ObjectChanged,
    ObjectCorrupt,
    RegistrationError,
    RemoteAccessError,
    StoreError,
    TransferError,
    late_batch,
)
from kvpool.store.layout import (
    CHECKSUM_ALWAYS_MAX,
    HEADER_SIZE,
    checksum,
    header_mismatch,
    key_hash,
    pack_header,
    pack_header_into,
)
from kvpool.store.staging import DIRECT_MIN, Staging, copy_out, host_view
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.transport import READ, WRITE, Requests
from kvpool.transfer.types import OpCode, TransferRequest, TransferState

log = logging.getLogger("kvpool.store")

# report(segment, kind, fields): tell the master a segment is unreachable or a replica corrupt;
# ``fields`` name what the reader saw or the writer was granted (:func:`_seen`, :func:`_granted`),
# so that a late report does not hit a later mount of the segment, or a later replica there.
Report = Callable[[str, str, dict[str, Any]], None]


def _seen(epoch: int, rep: list[Any]) -> dict[str, Any]:
    """What a report says of replica ``rep`` ([segment, address, host, replica id, mount id] of a
    get reply): the master's epoch, the segment's mount and the replica's id. An older master's
    replica ([segment, address, host]) has none: the report names the segment (and address)."""
    if len(rep) < 5:
        return {}
    return {"epoch": epoch, "replica": rep[3], "mount": rep[4]}


def _granted(epoch: int, mount: int | None) -> dict[str, Any]:
    """What a writer's report says of a segment: the master's epoch and the segment's mount the
    allocation was granted on (put replies' ``mounts``; an older master's name none)."""
    return {"epoch": epoch} if mount is None else {"epoch": epoch, "mount": mount}


@dataclass
class WriteJob:
    """One object to write into the allocations the master granted (``replicas``: [[seg, addr]])."""

    key: str
    size: int
    src: memoryview | tuple[int, int]  # the value, or (address, size) of registered memory
    gen: int
    verify: bool
    replicas: list[list[Any]]
    csum: int | None = None  # filled in: the value's checksum, when computed
    written: list[str] = field(default_factory=list)  # filled in: segments written completely
    mounts: dict[str, int] = field(default_factory=dict)  # segment -> mount id, as granted


@dataclass
class ReadJob:
    """One object to read from its replicas ([[seg, addr, ...]], the preferred one first)."""

    key: str
    size: int
    gen: int
    csum: int | None
    replicas: list[list[Any]]
    dest: tuple[int, int] | None  # (address, capacity) of registered memory, or None for bytes
    deadline: float  # monotonic time the bytes must have landed by (inf: no lease, e.g. cached)
    result: bytes | int | None = None  # filled in: the value, or its size when read into ``dest``
    error: KvpoolError | None = None
    retry: bool = False  # the error means: look the object up again and read again
    served_by: str | None = None
    local_csum: bool = False  # ``csum`` is the reading client's own (not in the header)
    # read through a cached location, (segment, address) only: nothing is reported (a report
    # could not say which mount or replica it read); the caller asks the master, whose
    # replicas the next read reports by their ids
    cached: bool = False
    oom: bool = False  # the value could not be allocated here: no other replica or copy is tried


def _no_room(j: ReadJob) -> StoreError:
    """The error of a read whose value could not be allocated (MemoryError): that key fails
    with a kvpool error, its batch goes on."""
    j.oom = True
    return StoreError(f"no memory for the {j.size} bytes of {j.key!r} on this client")


class _Handles:
    """Segment name -> handle id for one batch: each segment opened once (None: cannot be)."""

    __slots__ = ("engine", "ids", "names")

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self.ids: dict[str, int | None] = {}
        self.names: dict[int, str] = {}

    def get(self, seg: str) -> int | None:
        hid = self.ids.get(seg, -1)
        if hid == -1:
            try:
                hid = self.engine.open_segment(seg).id
                self.names[hid] = seg
            except KvpoolError:
                hid = None
            self.ids[seg] = hid
        return hid

    def name(self, hid: int) -> str:
        return self.names[hid]


class DataPath:
    """Object reads and writes of one store client (thread-safe: staging regions per call)."""

    def __init__(self, engine: TransferEngine, staging: Staging, report: Report, checksum_all: bool) -> None:
        self.engine = engine
        self.staging = staging
        self.report = report
        self.checksum_all = checksum_all

    def _value(self, job: WriteJob) -> memoryview:
        """The value as the CPU sees it: GPU memory is copied to host when the CPU needs its
        bytes (checksum, small values staged with their header); else a view that is not read."""
        if not isinstance(job.src, tuple):
            return job.src
        addr, size = job.src
        cpu_needs = size <= DIRECT_MIN or job.verify or size <= CHECKSUM_ALWAYS_MAX or self.checksum_all
        if cpu_needs or not self.engine.is_gpu_memory(addr, size):
            return host_view(self.engine, addr, size)
        return memoryview(b"")  # a big GPU value: moved by the engine from where it is, never read here

    # ------------------------------------------------------------------ transfers
    def req(self, op: OpCode, local: int, segment: str, remote: int, size: int) -> TransferRequest:
        """A transfer request (SegmentNotFound when the segment cannot be opened)."""
        return TransferRequest(op, local, self.engine.open_segment(segment), remote, size)

    def run(self, reqs: list[TransferRequest]) -> list[bool]:
        """Do requests (one batch; in this thread one after the other when there is one, or two
        over the same-host path, where a batch costs more than it saves); per-request success."""
        if not reqs:
            return []
        if len(reqs) == 1 or (
            len(reqs) == 2 and all(self.engine.uses_same_host_path(r.target_id) for r in reqs)  # type: ignore[arg-type]
        ):
            return [self._one(r) for r in reqs]
        eng = self.engine
        bid = eng.allocate_batch_id(len(reqs))
        try:
            try:
                eng.submit_transfer(bid, reqs)
            except KvpoolError as exc:  # one failed validation: find which, do the rest
                return self._settled(bid, len(reqs), exc, lambda i: self._one(reqs[i]))
            if eng._wait_sync(bid).state == TransferState.COMPLETED:  # TransferTimeout: a hung GPU stream
                return [True] * len(reqs)
            return [eng.get_transfer_status(bid, i).ok for i in range(len(reqs))]
        finally:
            eng.batches.free_when_done(bid)  # later, when a hung GPU stream still copies

    def run_columns(self, cols: Requests, handles: _Handles) -> list[bool]:
        """Do request columns (segment handles from ``handles``) as one batch, or in this
        thread when :meth:`run` would; per-request success."""
        ops, locs, peers, rems, lens = cols
        n = len(ops)
        if not n:
            return []
        eng = self.engine
        if n == 1 or (n == 2 and all(eng.uses_same_host_path(p) for p in peers)):
            return [self._sync_col(cols, handles, i) for i in range(n)]
        bid = eng.allocate_batch_id(n)
        try:
            try:
                eng._submit(bid, cols)  # the columns as they are: type-correct by construction
            except KvpoolError as exc:  # one failed validation: find which, do the rest
                return self._settled(bid, n, exc, lambda i: self._sync_col(cols, handles, i))
            if eng._wait_sync(bid).state == TransferState.COMPLETED:  # TransferTimeout: a hung GPU stream
                return [True] * n
            return [eng.get_transfer_status(bid, i).ok for i in range(n)]
        finally:
            eng.batches.free_when_done(bid)  # later, when a hung GPU stream still copies

    def _settled(self, bid: int, n: int, exc: KvpoolError, redo: Callable[[int], bool]) -> list[bool]:
        """After a submit of :meth:`run` / :meth:`run_columns` raised ``exc``: the runs queued
        before the failing one (another transport's, submitted first) may still copy. Wait for
        them (bounded by the engine's ``timeout_s``; still pending then: TransferTimeout, the
        batch freed once they finish), then do in this thread, one by one, every request that
        did not complete in the batch (``redo(i)``): none runs twice at once, and each request
        is done once when it completed."""
        eng = self.engine
        eng._settle(bid, exc)
        return [eng.get_transfer_status(bid, i).state == TransferState.COMPLETED or redo(i) for i in range(n)]

    def _sync_col(self, cols: Requests, handles: _Handles, i: int) -> bool:
        op = OpCode.READ if cols.ops[i] == READ else OpCode.WRITE
        return self.sync(handles.name(cols.peers[i]), cols.locs[i], cols.rems[i], cols.lens[i], op)

    def _one(self, r: TransferRequest) -> bool:
        return self.sync(r.target_id.name, r.source, r.target_offset, r.length, r.opcode)  # type: ignore[union-attr]

    def sync(self, segment: str, local: int, remote: int, length: int, op: OpCode) -> bool:
        """One transfer in this thread; False on failure (the caller reports or fails over)."""

        def call() -> None:
            if not (op is OpCode.WRITE and self.engine.write_inline(segment, local, remote, length)):
                self.engine.transfer_sync(segment, local, remote, length, op)

        return self._retried(segment, call)

    def sync_ranges(self, segment: str, locs: list[int], rems: list[int], lens: list[int], op: OpCode,
                    scratch: tuple[int, int, bool] | None = None) -> bool:  # fmt: skip
        """A few ranges of one segment, in order, in this thread when a lane is free (one frame
        exchange over TCP); False on failure (the caller reports or fails over). ``scratch``:
        unregistered host memory the ranges use, registered for the call alone (see
        :meth:`TransferEngine.batch_transfer_sync`); a RegistrationError for it raises."""
        call = lambda: self.engine.batch_transfer_sync(segment, locs, rems, lens, op, scratch)  # noqa: E731
        return self._retried(segment, call, scratch is not None)

    def _retried(self, segment: str, call: Callable[[], Any], scratch: bool = False) -> bool:
        """``call`` (a synchronous transfer to ``segment``), again once on a stale descriptor
        (the owner mounted fresh memory); False on failure. Raises a TransferTimeout whose GPU
        copies may still run (its ``batch_id`` set: the caller neither reuses the memory nor
        reads into it again before ``batch_settled``), and a RegistrationError when ``scratch``."""
        for attempt in (0, 1):
            try:
                call()
                return True
            except RemoteAccessError:
                if attempt:
                    return False
                self.refresh(segment)  # fetch its descriptor again
            except KvpoolError as exc:
                if late_batch(exc) is not None or (scratch and isinstance(exc, RegistrationError)):
                    raise
                return False
        return False

    def refresh(self, segment: str) -> None:
        """Forget a segment's cached descriptor (it is fetched again on next use)."""
        try:
            self.engine.close_segment(self.engine.open_segment(segment))
        except KvpoolError:
            pass

    def _regions(
        self, jobs: list[WriteJob] | list[ReadJob], tokens: list[Any]
    ) -> list[tuple[int, memoryview]]:
        """Staging for a batch: (address, view) of one region for the small objects with their
        headers side by side, and one for the headers of the big ones (empty when none); their
        tokens are appended to ``tokens``."""
        small = sum(HEADER_SIZE + j.size for j in jobs if j.size <= DIRECT_MIN)
        nbig = sum(1 for j in jobs if j.size > DIRECT_MIN)
        out = []
        for size in (small, HEADER_SIZE * nbig):
            if not size:
                out.append((0, memoryview(b"")))
                continue
            addr, view, token = self.staging.take(size)
            tokens.append(token)
            out.append((addr, view))
        return out

    # ------------------------------------------------------------------ writes
    def write(self, epoch: int, jobs: list[WriteJob]) -> None:
        """Write header + value of every job into all its replicas, in one batch. Fills
        ``csum`` and ``written`` (segments whose copy landed completely); unreachable segments
        are reported; raises the engine's TransferTimeout whose copies may still run (``batch_id``).

        The batch is built as request columns (no per-request objects): the small values with
        their headers side by side in one staging region, the headers of big values side by side
        in another, each segment opened once."""
        if len(jobs) == 1 and len(jobs[0].replicas) == 1:
            self._write_one(epoch, jobs[0])  # the common case, without the lists
            return
        checksum_all = self.checksum_all
        cols = Requests([], [], [], [], [])
        ops, locs, peers, rems, lens = cols
        owner: list[int] = []  # per request: its index in ``pairs``
        pairs: list[tuple[WriteJob, str]] = []  # (job, segment) of every replica to write
        good: list[bool] = []  # per pair
        handles = _Handles(self.engine)
        tokens: list[Any] = []
        try:
            (sbase, sview), (hbase, hview) = self._regions(jobs, tokens)
            spos = hpos = 0
            last_seg, last_hid = None, None
            for job in jobs:
                size = job.size
                value = job.src if not isinstance(job.src, tuple) else self._value(job)
                if job.verify or size <= CHECKSUM_ALWAYS_MAX or checksum_all:
                    job.csum = checksum(value)
                if size <= DIRECT_MIN:
                    mid, end = spos + HEADER_SIZE, spos + HEADER_SIZE + size
                    pack_header_into(sview, epoch, job.gen, key_hash(job.key), size, job.csum, spos)
                    sview[mid:end] = value
                    parts: tuple[tuple[int, int, int], ...] = ((sbase + spos, 0, HEADER_SIZE + size),)
                    spos = end
                else:
                    hdr = pack_header(epoch, job.gen, key_hash(job.key), size, job.csum)
                    if isinstance(job.src, tuple):
                        vaddr = job.src[0]
                    else:
                        vaddr, token = self.staging.source(value)
                        tokens.append(token)
                    hview[hpos : hpos + HEADER_SIZE] = hdr
                    parts = ((vaddr, HEADER_SIZE, size), (hbase + hpos, 0, HEADER_SIZE))
                    hpos += HEADER_SIZE
                for seg, raddr in job.replicas:
                    if seg != last_seg:  # most jobs of a batch go to the segment of the one before
                        last_seg, last_hid = seg, handles.get(seg)
                    hid = last_hid
                    k = len(pairs)
                    pairs.append((job, seg))
                    good.append(hid is not None)
                    if hid is None:
                        continue
                    for local, off, n in parts:
                        ops.append(WRITE)
                        locs.append(local)
                        peers.append(hid)
                        rems.append(raddr + off)
                        lens.append(n)
                        owner.append(k)
            ok = self.run_columns(cols, handles)
        finally:
            for t in tokens:
                self.staging.give(t)
        if not all(ok):
            for k, fine in zip(owner, ok, strict=True):
                if not fine:
                    good[k] = False
        bad: set[tuple[str, int | None]] = set()  # (segment, mount granted on): reported once each
        for (job, seg), fine in zip(pairs, good, strict=True):
            if fine:
                job.written.append(seg)
            else:
                bad.add((seg, job.mounts.get(seg)))
        for seg, mount in bad:
            self.report(seg, "unreachable", _granted(epoch, mount))

    def write_small(self, epoch: int, key: str, gen: int, value: memoryview, seg: str, raddr: int,
                    mount: int | None = None) -> int | None:  # fmt: skip
        """Write one small host ``value`` (at most ``DIRECT_MIN`` bytes) with its header to one
        replica, in this thread: :meth:`write` of that one job with fewer layers, for the
        reserved put (its most common caller, once per put). Returns the value's checksum, or
        None when the write failed (the segment is reported, naming ``mount``: the grant's)."""
        size = value.nbytes
        csum = checksum(value)
        n = HEADER_SIZE + size
        addr, region, token = self.staging.take(n)
        try:
            pack_header_into(region, epoch, gen, key_hash(key), size, csum)
            region[HEADER_SIZE:] = value
            ok = self.sync(seg, addr, raddr, n, OpCode.WRITE)
        finally:
            self.staging.give(token)
        if ok:
            return csum
        self.report(seg, "unreachable", _granted(epoch, mount))
        return None

    def _write_one(self, epoch: int, job: WriteJob) -> None:
        """One object to one replica, in this thread: a small one as header + value from
        staging (:meth:`write_small`), a big one from where it is, then its header."""
        value = self._value(job)
        size = job.size
        seg, raddr = job.replicas[0][0], job.replicas[0][1]
        if size <= DIRECT_MIN:  # checksummed always (DIRECT_MIN <= CHECKSUM_ALWAYS_MAX)
            job.csum = self.write_small(epoch, job.key, job.gen, value, seg, raddr, job.mounts.get(seg))
            if job.csum is not None:
                job.written.append(seg)
            return
        if job.verify or size <= CHECKSUM_ALWAYS_MAX or self.checksum_all:
            job.csum = checksum(value)
        tokens: list[Any] = []
        try:
            haddr, hregion, token = self.staging.take(HEADER_SIZE)
            tokens.append(token)
            pack_header_into(hregion, epoch, job.gen, key_hash(job.key), size, job.csum)
            # the value, then its header: in this order, in one exchange
            rems, lens = [raddr + HEADER_SIZE, raddr], [size, HEADER_SIZE]
            if isinstance(job.src, tuple):
                ok = self.sync_ranges(seg, [job.src[0], haddr], rems, lens, OpCode.WRITE)
            else:
                # the value where it is, registered read-only for the call by the native call
                vaddr = _native.buffer_address(value, True)[0]
                try:
                    scratch = (vaddr, size, True)
                    ok = self.sync_ranges(seg, [vaddr, haddr], rems, lens, OpCode.WRITE, scratch)
                except RegistrationError:  # e.g. the same value is being put by another thread
                    vaddr, token = self.staging.source(value)
                    tokens.append(token)
                    ok = self.sync_ranges(seg, [vaddr, haddr], rems, lens, OpCode.WRITE)
        finally:
            for t in tokens:
                self.staging.give(t)
        if ok:
            job.written.append(seg)
        else:
            self.report(seg, "unreachable", _granted(epoch, job.mounts.get(seg)))

    # ------------------------------------------------------------------ reads
    def read(self, epoch: int, jobs: list[ReadJob]) -> None:
        """Read every job from its first replica in one batch, then fail over one by one (other
        replicas) where that did not give the right object. Fills ``result`` or ``error``; raises
        the engine's TransferTimeout whose copies may still land (``batch_id``), failing nothing over."""
        first = [j for j in jobs if j.replicas]
        for j in jobs:
            if not j.replicas:
                j.error = TransferError(f"no replica of {j.key!r} to read")
        if len(first) == 1:
            self._read_one(epoch, first[0], 0)  # the common case, without the lists
        else:
            self._attempt(epoch, first, 0)
        for j in first:
            i = 1
            while j.error is not None and not j.retry and not j.oom and i < len(j.replicas):
                j.error = None
                self._read_one(epoch, j, i)
                i += 1

    def _read_one(self, epoch: int, j: ReadJob, idx: int) -> None:
        """One object from replica ``idx``, in this thread (see :meth:`_attempt`)."""
        seg, raddr = j.replicas[idx][0], j.replicas[idx][1]
        tokens: list[Any] = []
        try:
            if j.size <= DIRECT_MIN:
                addr, region, token = self.staging.take(HEADER_SIZE + j.size)
                tokens.append(token)
                good = self.sync(seg, addr, raddr, HEADER_SIZE + j.size, OpCode.READ)
                sink: Any = ("small", region)
            else:
                scratch = None
                if j.dest is not None:
                    vaddr, out = j.dest[0], None
                else:
                    # a fresh bytes object, registered for the call by the native call itself
                    try:
                        out, vaddr = _native.new_bytes(j.size)
                    except MemoryError:
                        j.error = _no_room(j)
                        return
                    scratch = (vaddr, j.size, False)
                haddr, hregion, token = self.staging.take(HEADER_SIZE)
                tokens.append(token)
                rems, lens = [raddr + HEADER_SIZE, raddr], [j.size, HEADER_SIZE]
                good = self.sync_ranges(seg, [vaddr, haddr], rems, lens, OpCode.READ, scratch)
                sink = ("big", hregion, vaddr, out)
            self._check(epoch, j, j.replicas[idx], sink, good, time.monotonic())
        except KvpoolError as exc:
            if late_batch(exc) is not None:
                raise  # its copies may still land in the destination: no other replica is read there
            j.error = TransferError(f"reading {j.key!r} from {seg}: {exc}")
        finally:
            for t in tokens:
                self.staging.give(t)

    def _attempt(self, epoch: int, jobs: list[ReadJob], idx: int) -> None:
        """Every job from its replica ``idx`` in one batch of request columns: small objects
        (header + value) side by side in one staging region, the headers of big ones in
        another, big values straight into their destination; then each is checked. The headers
        of big ones go after every other request: a batch of values into GPU memory is then one
        run of GPU copies (CUDA IPC: one kernel) and one of host copies, not two runs per value."""
        cols = Requests([], [], [], [], [])
        ops, locs, peers, rems, lens = cols
        plan: list[tuple[ReadJob, list[Any], Any, int, int]] = []  # job, replica, sink, request, header's
        hpeers: list[int] = []  # big values' headers (segment, address): after the loop, after the values
        hrems: list[int] = []
        handles = _Handles(self.engine)
        tokens: list[Any] = []
        try:
            (sbase, sview), (hbase, hview) = self._regions(jobs, tokens)
            spos = hpos = 0
            for j in jobs:
                rep = j.replicas[idx]
                seg, raddr = rep[0], rep[1]
                hid = handles.get(seg)
                if hid is None:
                    j.error = TransferError(f"reading {j.key!r} from {seg}: segment cannot be opened")
                    if not j.cached:
                        self.report(seg, "unreachable", _seen(epoch, rep))
                    continue
                if j.size <= DIRECT_MIN:
                    n = HEADER_SIZE + j.size
                    ops.append(READ)
                    locs.append(sbase + spos)
                    peers.append(hid)
                    rems.append(raddr)
                    lens.append(n)
                    sink: Any = ("small", sview[spos : spos + n])
                    spos += n
                    plan.append((j, rep, sink, len(ops) - 1, -1))
                    continue
                if j.dest is not None:
                    vaddr, out = j.dest[0], None
                else:
                    try:
                        vaddr, out, token = self.staging.sink(j.size)
                    except MemoryError:
                        j.error = _no_room(j)
                        continue
                    tokens.append(token)
                ops.append(READ)
                locs.append(vaddr)
                peers.append(hid)
                rems.append(raddr + HEADER_SIZE)
                lens.append(j.size)
                plan.append(
                    (j, rep, ("big", hview[hpos : hpos + HEADER_SIZE], vaddr, out), len(ops) - 1, len(hrems))
                )
                hrems.append(raddr)
                hpeers.append(hid)
                hpos += HEADER_SIZE
            nbody, nh = len(ops), len(hrems)
            ops += [READ] * nh
            locs += range(hbase, hbase + nh * HEADER_SIZE, HEADER_SIZE)  # header k at hbase + k * HEADER_SIZE
            peers += hpeers
            rems += hrems
            lens += [HEADER_SIZE] * nh
            ok = self.run_columns(cols, handles)
            done = time.monotonic()
            for j, rep, sink, i, h in plan:
                good = ok[i] if h < 0 else ok[i] and ok[nbody + h]
                self._check(epoch, j, rep, sink, good, done)
        finally:
            for t in tokens:
                self.staging.give(t)

    def _check(self, epoch: int, j: ReadJob, rep: list[Any], sink: Any, good: bool, done: float) -> None:
        seg = rep[0]
        if not good:
            j.error = TransferError(f"reading {j.key!r} from {seg} failed")
            if not j.cached:
                self.report(seg, "unreachable", _seen(epoch, rep))
            return
        if done > j.deadline:
            j.error, j.retry = ObjectChanged(f"reading {j.key!r} outlived its lease; read again"), True
            return
        if sink[0] == "small":
            region = sink[1]
            hdr, value = region[:HEADER_SIZE], region[HEADER_SIZE:]
        else:
            hdr, value = sink[1], None
        why = header_mismatch(hdr, epoch, j.gen, key_hash(j.key), j.size, None if j.local_csum else j.csum)
        if why is not None:
            j.error, j.retry = ObjectChanged(f"{j.key!r} at {seg}: {why}"), True
            return
        if j.csum is not None:
            if value is None:
                value = host_view(self.engine, sink[2], j.size)
            if checksum(value) != j.csum:
                if j.local_csum:
                    # Not the bytes this client read under a lease before: changed under a read
                    # without the master (space reused), or corrupt. The caller asks the master.
                    j.error, j.retry = (
                        ObjectChanged(f"{j.key!r} at {seg}: bytes differ from the last read"),
                        True,
                    )
                    return
                j.error = ObjectCorrupt(f"{j.key!r} at {seg}: bytes do not match the object's checksum")
                if not j.cached:
                    self.report(
                        seg, "corrupt", {"key": j.key, "gen": j.gen, "addr": rep[1], **_seen(epoch, rep)}
                    )
                return
        j.served_by = seg
        if sink[0] == "small":
            if j.dest is not None:
                copy_out(self.engine, j.dest[0], value)  # type: ignore[arg-type]
                j.result = j.size
            else:
                j.result = bytes(value)  # type: ignore[arg-type]
        else:
            j.result = j.size if j.dest is not None else sink[3]
