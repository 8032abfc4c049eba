"""GPU memory through transports that move host memory only: pinned staging.

GPU memory is a location, not a transport. A transport that cannot touch ``cuda:N`` memory itself
(``"cuda"`` not in :attr:`~kvpool.transfer.transport.Transport.locations`: TCP, same-host) still
moves it through :class:`GpuStaging`, which wraps any such transport:

* submit (caller's thread): a pinned range of the :class:`StagingPool` replaces each GPU local
  address; WRITEs are filled by a device-to-host copy first; the requests go to the inner transport
  in a private batch, and the caller's batch slots are reserved (PENDING).
* completion (the staging thread): once the private batch is done, READs are copied host-to-device,
  staging ranges go back to the pool, and the caller's slots are finished with the inner result —
  a slot is COMPLETED only when its bytes are in GPU memory.

Pipelined WRITEs: a staged WRITE of at least ``2 * PIPE_CHUNK`` bytes is cut into ``PIPE_CHUNK``
pieces, each sent as soon as its device-to-host copy is done, so the copy of piece k+1 (caller's
thread, GIL released by the driver call) overlaps the inner transport sending piece k (its own
threads). The whole submit is validated first (``check``), so nothing is sent unless every request
is valid; a caller slot completes when all its pieces did.

The pool bounds the staged bytes in flight: a submit that does not fit raises InvalidArgument (or,
with a wait, TransferTimeout) before anything is sent; ``batch_transfer_sync`` goes in rounds that
fit (:meth:`GpuStaging.rounds`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvpool.errors import (
    AddressNotRegistered,
    BatchInFlight,
    InvalidArgument,
    KvpoolError,
    TransferError,
    TransferTimeout,
)
from kvpool.transfer.batch import Batches
from kvpool.transfer.device import DeviceRuntime
from kvpool.transfer.memory import LocalRegistry
from kvpool.transfer.transport import READ, WRITE, Requests, Transport
from kvpool.transfer.types import TransferState, TransferStatus

log = logging.getLogger("kvpool.transfer")
_STAGE_ALIGN = 4096
PIPE_CHUNK = 2 << 20  # bytes per pipelined piece of a large staged WRITE


class StagingPool:
    """Pinned host memory carved first-fit into 4 KiB-aligned ranges; bounded by its size.

    ``alloc(sizes)`` takes all ranges or none (no partial holds, so callers cannot deadlock each other).
    """

    def __init__(self, rt: DeviceRuntime, size: int) -> None:
        self.size = size
        self._rt = rt
        self.base, self._keep = rt.alloc_pinned(size)
        self.freed = False  # set by GpuStaging (under its lock) once nothing can use the pool again
        self.freeing: threading.Thread | None = None  # the thread giving it back (see free)
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted
        self._cond = threading.Condition()
        self.in_use = 0
        self.peak = 0

    @staticmethod
    def rounded(n: int) -> int:
        return (n + _STAGE_ALIGN - 1) // _STAGE_ALIGN * _STAGE_ALIGN

    def _take(self, n: int) -> int | None:
        for i, (off, ln) in enumerate(self._free):
            if ln >= n:
                self._free[i : i + 1] = [(off + n, ln - n)] if ln > n else []
                return off
        return None

    def _give(self, off: int, n: int) -> None:
        free = self._free
        free.append((off, n))
        free.sort()
        merged: list[tuple[int, int]] = []
        for o, ln in free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((o, ln))
        self._free = merged

    def try_alloc(self, sizes: list[int]) -> list[int] | None:
        """Addresses for every size, or None (nothing held) when they do not all fit now."""
        with self._cond:
            got: list[tuple[int, int]] = []
            for n in sizes:
                r = self.rounded(n)
                off = self._take(r)
                if off is None:
                    for o, ln in got:
                        self._give(o, ln)
                    return None
                got.append((off, r))
            self.in_use += sum(r for _, r in got)
            self.peak = max(self.peak, self.in_use)
            return [self.base + o for o, _ in got]

    def alloc(self, sizes: list[int], timeout_s: float) -> list[int] | None:
        """As :meth:`try_alloc`, waiting up to ``timeout_s`` for other transfers to release staging."""
        with self._cond:
            return self._cond.wait_for(lambda: self.try_alloc(sizes), timeout_s)

    def release(self, addr: int, n: int) -> None:
        r = self.rounded(n)
        with self._cond:
            self._give(addr - self.base, r)
            self.in_use -= r
            self._cond.notify_all()

    @property
    def free_bytes(self) -> int:
        with self._cond:
            return self.size - self.in_use

    def free(self) -> None:
        """Give the pinned memory back (``DeviceRuntime.free_pinned``) on a thread of its own: it may
        wait for the whole device, and a stream hung elsewhere must not hang close. Called once by
        GpuStaging after close, when no staged copy nor submit can use it any more."""
        keep, self._keep = self._keep, None
        free = getattr(self._rt, "free_pinned", None)  # a runtime written before it: dropped only
        if keep is not None and free is not None:
            self.freeing = threading.Thread(target=free, args=(self.base, keep), daemon=True)
            self.freeing.start()


class _Entry:
    """One staged request: slot ``index`` of its submit, GPU range ``dev``, pinned range ``stage``."""

    __slots__ = ("index", "op", "dev", "stage", "n", "done")

    def __init__(self, index: int, op: int, dev: int, stage: int, n: int) -> None:
        self.index = index
        self.op = op
        self.dev = dev
        self.stage = stage
        self.n = n
        self.done = False


class _Record:
    """One staged submit: its private inner batch and the caller's slots it finishes. ``owner``
    maps private slots to caller slots when WRITEs were cut into pieces (None: one to one);
    private slots from ``sent`` on were never submitted (``unsent``: why)."""

    __slots__ = ("private", "batch_id", "base", "n", "entries", "owner", "sent", "unsent", "seen")

    def __init__(
        self,
        private: int,
        batch_id: int,
        base: int,
        n: int,
        entries: list[_Entry],
        owner: list[int] | None = None,
        sent: int | None = None,
        unsent: str = "",
    ) -> None:
        self.private = private
        self.batch_id = batch_id
        self.base = base
        self.n = n
        self.entries = entries
        self.owner = owner
        self.sent = n if sent is None else sent
        self.unsent = unsent
        self.seen = -1  # GpuStaging._progress when unbounded last saw it wait for our copies only


class GpuStaging:
    """Pinned staging for GPU local memory over host-only transports (see the module docstring).

    Args:
        runtime: returns the CUDA runtime (called on first use).
        pool_size: bytes of pinned host memory (allocated on first use).
        batches: the engine's batch table.
        registry: the engine's registrations (which local ranges are GPU memory).
        pin: registers the pool's range with the native registry as local-only memory.
        check: validates a whole submit (raises, sends nothing) before pipelined WRITEs are sent
            piece by piece; without it large WRITEs are staged whole.
    """

    def __init__(
        self,
        runtime: Callable[[], DeviceRuntime],
        pool_size: int,
        batches: Batches,
        registry: LocalRegistry,
        pin: Callable[[int, int], None],
        check: Callable[[Requests], None] | None = None,
    ) -> None:
        self._runtime = runtime
        self._check = check
        self._pool_size = pool_size
        self._batches = batches
        self._registry = registry
        self._pin = pin
        self._pool: StagingPool | None = None
        self._cond = threading.Condition()
        self._records: list[_Record] = []
        self._submitting: list[tuple[int, list[int]]] = []  # (batch id, local addresses) mid-submit
        self._closing: list[tuple[int, int]] = []  # GPU ranges being unregistered: submits refused
        self._thread: threading.Thread | None = None
        self._closed = False
        self._progress = 0  # copies and submits the completion thread finished (see unbounded)

    @property
    def pool(self) -> StagingPool:
        """The pinned pool (allocated and registered on first use)."""
        with self._cond:
            if self._pool is None:
                if self._closed:
                    raise TransferError("GPU staging: the engine is closed")
                pool = StagingPool(self._runtime(), self._pool_size)
                self._pin(pool.base, pool.size)
                self._pool = pool
            return self._pool

    @property
    def check(self) -> Callable[[Requests], None] | None:
        """The engine's whole-submit validation (raises, sends nothing), or None. Called by
        CudaIpcTransport before it queues the first part of a mixed submit."""
        return self._check

    @property
    def pool_if_made(self) -> StagingPool | None:
        """The pool, or None when nothing was staged yet."""
        return self._pool

    def needed(self, locs: list[int], lens: list[int]) -> bool:
        """Whether any local range is GPU memory (AddressNotRegistered if one runs past its region)."""
        gpu = self._registry.gpu_region
        return any(gpu(a, n) is not None for a, n in zip(locs, lens, strict=True))

    # ------------------------------------------------------------------ submit (caller's thread)
    def submit(self, inner: Transport, batch_id: int, reqs: Requests, wait_s: float | None = None) -> None:
        """Submit through ``inner`` with GPU local ranges staged. Without room in the pool,
        ``wait_s`` None raises InvalidArgument, else waits that long (TransferTimeout). The
        local ranges count as :meth:`busy` from here on (a pipelined WRITE copies from its
        source long before its record is tracked). A local range that :meth:`close_range` closed
        raises AddressNotRegistered: this is the point that orders a submit against unregister
        (the registrations are read only after it)."""
        token = (batch_id, list(reqs.locs))
        with self._cond:
            if self._closed:
                raise TransferError("GPU staging: the engine is closed")
            for lo, hi in self._closing:
                a = next((a for a in token[1] if lo <= a < hi), None)
                if a is not None:
                    raise AddressNotRegistered(f"GPU memory at {a:#x} is being unregistered")
            self._submitting.append(token)
        try:
            self._submit(inner, batch_id, reqs, wait_s)
        finally:
            with self._cond:
                self._submitting.remove(token)
                pool = self._idle_pool()
            if pool is not None:  # the engine closed during this submit, which tracked nothing
                pool.free()

    def _submit(self, inner: Transport, batch_id: int, reqs: Requests, wait_s: float | None) -> None:
        ops, locs, _, _, lens = reqs
        n = len(ops)
        gpu = self._registry.gpu_region
        todo = [i for i in range(n) if gpu(locs[i], lens[i]) is not None]
        pool = self.pool
        sizes = [lens[i] for i in todo]
        stages = pool.try_alloc(sizes) if wait_s is None else pool.alloc(sizes, wait_s)
        if stages is None:
            need = sum(pool.rounded(k) for k in sizes)
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
        try:
            base = self._batches.reserve(batch_id, lens)
        except BaseException:
            for st, k in zip(stages, sizes, strict=True):
                pool.release(st, k)
            raise
        entries: list[_Entry] = []
        local = list(locs)
        private = None
        what = "GPU staging copy (device to host)"
        big = [i for i in todo if ops[i] == WRITE and lens[i] >= 2 * PIPE_CHUNK] if self._check else []
        try:
            if big:
                self._check(reqs)  # type: ignore[misc]  # all or nothing before the first piece goes
            rt = self._runtime()
            bigset = set(big)
            for i, st in zip(todo, stages, strict=True):
                if ops[i] == WRITE and i not in bigset:
                    rt.copy_d2h(st, locs[i], lens[i])
                local[i] = st
                entries.append(_Entry(i, ops[i], locs[i], st, lens[i]))
            if big:
                what = ""
                private = self._batches.alloc(n + sum((lens[i] - 1) // PIPE_CHUNK for i in big))
                self._submit_pipelined(inner, private, reqs._replace(locs=local), big, locs, batch_id, base,
                                       entries)  # fmt: skip
                return
            what = ""
            private = self._batches.alloc(n)
            inner.submit(private, reqs._replace(locs=local))  # validates all, then queues
        except BaseException as exc:
            for st, k in zip(stages, sizes, strict=True):
                pool.release(st, k)
            if private is not None:
                self._batches.free(private)
            reason = f"{what} failed: {exc}" if what else str(exc)
            for k in range(n):  # nothing was sent: the reserved slots end FAILED with the reason
                self._batches.finish(batch_id, base + k, 0, f"not submitted: {reason}")
            if what and not isinstance(exc, KvpoolError):
                raise TransferError(reason) from exc
            raise
        self._track(_Record(private, batch_id, base, n, entries))

    def _submit_pipelined(
        self,
        inner: Transport,
        private: int,
        staged: Requests,
        big: list[int],
        dev: list[int],
        batch_id: int,
        base: int,
        entries: list[_Entry],
    ) -> None:
        """Send the small requests and the first piece of each large WRITE, then each further piece
        as soon as its device-to-host copy is done (the inner transport sends the earlier ones
        meanwhile). Called by :meth:`submit` after the whole submit was validated."""
        ops, locs, peers, rems, lens = staged
        n = len(ops)
        rt = self._runtime()
        bigset = set(big)
        owner: list[int] = []
        first = Requests([], [], [], [], [])
        for i in range(n):  # the first round: every request, large WRITEs by their first piece
            k = PIPE_CHUNK if i in bigset else lens[i]
            if i in bigset:
                try:
                    rt.copy_d2h(locs[i], dev[i], k)
                except KvpoolError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the runtime's own error, typed here
                    raise TransferError(f"GPU staging copy (device to host) failed: {exc}") from exc
            for col, v in zip(first, (ops[i], locs[i], peers[i], rems[i], k), strict=True):
                col.append(v)
            owner.append(i)
        inner.submit(private, first)  # validated as a whole above; raises only if nothing was queued
        sent = n
        unsent = ""
        rec = _Record(private, batch_id, base, n, entries, owner, sent)
        try:
            for i in big:
                for off in range(PIPE_CHUNK, lens[i], PIPE_CHUNK):
                    k = min(PIPE_CHUNK, lens[i] - off)
                    rt.copy_d2h(locs[i] + off, dev[i] + off, k)  # overlaps the sending of earlier pieces
                    inner.submit(
                        private, Requests([WRITE], [locs[i] + off], [peers[i]], [rems[i] + off], [k])
                    )
                    owner.append(i)
                    sent += 1
        except Exception as exc:  # noqa: BLE001 - the rest of the pieces end their slots FAILED
            unsent = f"not sent: {exc}"
            log.warning("GPU staging: a pipelined WRITE stopped after %d pieces: %s", sent, exc)
        rec.sent = sent
        rec.unsent = unsent
        for i in big:  # pieces never submitted: their caller slots fail (private slots stay WAITING)
            total = len(range(0, lens[i], PIPE_CHUNK))
            while owner.count(i) < total:
                owner.append(i)
        self._track(rec)

    def busy(self, start: int, end: int) -> int | None:
        """The caller's batch id of an unfinished staged request on GPU range [start, end), or None."""
        with self._cond:
            return self._busy(start, end)

    def _busy(self, start: int, end: int) -> int | None:
        for rec in self._records:
            if any(not e.done and start <= e.dev < end for e in rec.entries):
                return rec.batch_id
        for bid, addrs in self._submitting:
            if any(start <= a < end for a in addrs):
                return bid
        return None

    def unbounded(self, batch_id: int) -> bool:
        """Whether a staged submit of the caller's batch ``batch_id`` waited for nothing but our
        completion thread's GPU copies (its inner transfer finished) at the previous call for this
        batch and still does, and that thread finished no copy nor submit in between: a
        host-to-device copy on a hung stream, which never ends. A submit queued behind other
        submits' copies that keep finishing is not. Called by the engine's synchronous transfers,
        every ``timeout_s`` their wait outlives (as a transport's ``unbounded``): the first call
        that sees a submit waiting only notes the thread's position in it (``_Record.seen``), so
        both answers are about the same submit."""
        with self._cond:
            recs = [r for r in self._records if r.batch_id == batch_id]
            now = self._progress
        stuck = False
        for rec in recs:
            try:
                waiting = not self._batches.pending(rec.private)
            except KvpoolError:
                continue  # completed and freed meanwhile (its completion moved the position)
            if waiting:
                stuck = stuck or rec.seen == now
                rec.seen = now
        return stuck

    def close_range(self, start: int, end: int) -> None:
        """Called by unregister of GPU memory [start, end) before it goes: BatchInFlight while a
        staged transfer touches it (a submit in progress or a staged request not finished), else
        closed to submits until :meth:`reopen`. One step under the lock :meth:`submit` takes to
        enter, so a submit is either seen here or refused: none stages into memory whose unregister
        returned. Nothing is waited for (no lock across copies or I/O)."""
        with self._cond:
            bid = self._busy(start, end)
            if bid is not None:
                raise BatchInFlight(
                    f"batch {bid} still stages transfers for GPU memory at {start:#x}; wait for it first"
                )
            self._closing.append((start, end))

    def reopen(self, start: int, end: int) -> None:
        """Called by unregister once it finished (the registration is gone) or failed (it stays)."""
        with self._cond:
            self._closing.remove((start, end))

    def rounds(self, locs: list[int], rems: list[int], lens: list[int]) -> list[tuple[list[int], ...]]:
        """Split a synchronous transfer into rounds whose staged bytes fit the pool: GPU ranges
        bigger than the pool are cut into pool-sized pieces. Returns ``(locs, rems, lens)`` per round."""
        pool = self.pool
        cap = pool.size // _STAGE_ALIGN * _STAGE_ALIGN or pool.size  # a piece, rounded up, fits
        gpu = self._registry.gpu_region
        pieces: list[tuple[int, int, int, int]] = []  # (local, remote, length, staged bytes)
        for a, r, n in zip(locs, rems, lens, strict=True):
            if gpu(a, n) is None:
                pieces.append((a, r, n, 0))
                continue
            for off in range(0, n, cap):
                k = min(cap, n - off)
                pieces.append((a + off, r + off, k, pool.rounded(k)))
        out = []
        i = 0
        while i < len(pieces):
            j, need = i, 0
            while j < len(pieces) and (j == i or need + pieces[j][3] <= cap):
                need += pieces[j][3]
                j += 1
            wave = pieces[i:j]
            out.append(([p[0] for p in wave], [p[1] for p in wave], [p[2] for p in wave]))
            i = j
        return out

    # ------------------------------------------------------------------ completion (staging thread)
    def _track(self, rec: _Record) -> None:
        with self._cond:
            self._records.append(rec)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-staging", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _idle_pool(self) -> StagingPool | None:
        """Under ``_cond``: the pool to free now (marked freed), when closed and nothing can use it
        again (no staged submit tracked or in progress, no staging thread), else None."""
        pool = self._pool
        if pool is None or pool.freed or not self._closed:
            return None
        if self._records or self._submitting or self._thread is not None:
            return None
        pool.freed = True
        return pool

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._records and not self._closed:
                    self._cond.wait()
                if not self._records:  # closed with every staged copy ended: the pool goes
                    self._thread = None  # a submit that entered before close and tracks later starts another
                    pool = self._idle_pool()
                    break
                recs = list(self._records)
            try:
                done = [r for r in recs if not self._batches.pending(r.private)]
                if not done:
                    self._batches.wait(recs[0].private, 0.02)  # GIL released
                    continue
                for r in done:
                    self._complete(r)
            except Exception:  # noqa: BLE001 - never leave the thread: slots would hang
                log.exception("GPU staging completion failed")
                done = recs
                for r in recs:
                    self._abandon(r)
            with self._cond:
                self._records = [r for r in self._records if r not in done]
        if pool is not None:  # outside the lock: freeing pinned memory may wait for the device
            pool.free()

    def _complete(self, rec: _Record) -> None:
        """READs: staging -> device; ranges back to the pool; then the caller's slots."""
        staged = {e.index: e for e in rec.entries}
        results = self._results(rec)
        for k in range(rec.n):
            st = results[k]
            error = None if st.ok else st.error
            state = st.state if error else TransferState.FAILED
            e = staged.get(k)
            if e is not None:
                if st.ok and e.op == READ:
                    try:
                        self._runtime().copy_h2d(e.dev, e.stage, e.n)
                    except Exception as exc:  # noqa: BLE001 - runtime errors become the slot's reason
                        error = f"GPU staging copy (host to device) failed: {exc}"
                        state = TransferState.FAILED
                    self._progress += 1  # only this thread writes it
                self._release(e)
            nbytes = st.transferred_bytes if error is None or e is None else 0
            self._batches.finish(rec.batch_id, rec.base + k, nbytes, error, state)
        self._progress += 1
        self._batches.free(rec.private)

    def _results(self, rec: _Record) -> list[TransferStatus]:
        """The inner result per caller slot: pieces of one WRITE summed, the first failure wins."""
        if rec.owner is None:
            return [self._batches.status(rec.private, k) for k in range(rec.n)]
        nbytes = [0] * rec.n
        fail: list[TransferStatus | None] = [None] * rec.n
        for j, k in enumerate(rec.owner):
            if fail[k] is not None:
                continue
            if j >= rec.sent:
                fail[k] = TransferStatus(TransferState.FAILED, 0, rec.unsent or "not sent")
                continue
            st = self._batches.status(rec.private, j)
            if st.ok:
                nbytes[k] += st.transferred_bytes
            else:
                fail[k] = st
        return [
            f if f is not None else TransferStatus(TransferState.COMPLETED, nbytes[k])
            for k, f in enumerate(fail)
        ]

    def _abandon(self, rec: _Record) -> None:
        for e in rec.entries:
            if not e.done:
                self._release(e)
        for k in range(rec.n):
            try:
                self._batches.finish(rec.batch_id, rec.base + k, 0, "GPU staging failed (see the log)")
            except KvpoolError:
                pass  # already finished

    def _release(self, e: _Entry) -> None:
        if not e.done:
            e.done = True
            assert self._pool is not None
            self._pool.release(e.stage, e.n)

    def close(self, timeout_s: float = 5.0) -> None:
        """Called by TransferEngine.close after the inner transports canceled their queues: waits
        for the staging thread to finish what is in flight while its copies keep finishing, then
        the pinned pool is freed (by the thread as it ends, or here when none runs; a submit in
        progress frees it when it ends instead); later submits raise TransferError. None finished
        for ``timeout_s`` (a host-to-device copy on a hung GPU): TransferTimeout; the thread
        finishes its copies and slots when they end and frees the pool then, never under a copy."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            t = self._thread
            pool = self._idle_pool()
        if pool is not None:
            pool.free()
        seen, deadline = -1, 0.0
        while t is not None and t.is_alive():
            if seen != self._progress:
                seen, deadline = self._progress, time.monotonic() + timeout_s
            left = deadline - time.monotonic()
            if left <= 0:
                with self._cond:
                    n = len(self._records)
                raise TransferTimeout(
                    f"GPU staging: {n} staged submits did not finish within {timeout_s:g} s of the last "
                    "copy (a hung GPU copy?); their pinned staging stays until they end"
                )
            t.join(min(left, 0.05))
