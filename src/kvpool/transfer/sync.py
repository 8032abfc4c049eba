"""The blocking transfer calls of :class:`~kvpool.transfer.engine.TransferEngine`, mixed into it:
:meth:`SyncTransfers.transfer_sync` and :meth:`SyncTransfers.batch_transfer_sync` (Mooncake's
``transferSync`` / ``batchTransferSync``), :meth:`SyncTransfers.batch_transfer_sync_multi` (one
gather from several segments, waited for together) and the store's :meth:`SyncTransfers.write_inline`.

A few host ranges (at most :data:`INLINE_MAX`) go in the calling thread through the cached
segment's transport (one native call, the GIL released); everything else is one batch on the
engine's transports, waited for. Either way the caller gets the byte count or a typed error, never
a partial result. Called by any thread that holds the engine, as often as it transfers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool import _native
from kvpool.errors import InvalidArgument, KvpoolError, RemoteAccessError, TransferError, TransferTimeout
from kvpool.transfer.transport import READ, WRITE, Requests, Transport
from kvpool.transfer.types import OpCode, TransferState, TransferStatus

if TYPE_CHECKING:
    from kvpool.config import TransferConfig
    from kvpool.transfer.batch import Batches
    from kvpool.transfer.memory import LocalRegistry
    from kvpool.transfer.staging import GpuStaging
    from kvpool.transfer.types import SegmentDescriptor, SegmentHandle

__all__ = ["INLINE_MAX", "SyncTransfers", "native_op"]

INLINE_MAX = 16  # requests a transfer_sync/batch_transfer_sync may do in the calling thread
_U64 = np.dtype(np.uint64)


def _int_columns(cols: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[int]]:
    """(locals, remotes, lengths) as lists of int, checked: lengths positive, addresses >= 0."""
    try:
        locs, rems, lens = (list(map(int, c)) for c in cols)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"bad transfer request: {exc}") from None
    if locs and (min(lens) <= 0 or min(locs) < 0 or min(rems) < 0):
        raise InvalidArgument("lengths must be positive and addresses non-negative")
    return locs, rems, lens


def _u64_columns(cols: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(locals, remotes, lengths) as contiguous uint64 arrays, checked like :func:`_int_columns`:
    free for uint64 arrays, one C-speed pass for lists and other integer arrays."""
    out = []
    for c in cols:
        try:
            if isinstance(c, np.ndarray):
                if c.dtype.kind not in "iu":
                    raise TypeError(f"columns must be integers, not {c.dtype}")
                a = c
            else:  # a list of ints in one native pass; anything else (and what is wrong) by numpy
                a = _native.u64_column(c)
                if a is None:
                    a = np.fromiter(c, dtype=np.int64, count=len(c))
        except (ValueError, TypeError, OverflowError) as exc:
            raise InvalidArgument(f"bad transfer request: {exc}") from None
        if a.dtype != _U64 and len(a) and a.min() < 0:
            raise InvalidArgument("lengths must be positive and addresses non-negative")
        out.append(np.ascontiguousarray(a, dtype=_U64))
    if len(out[2]) and out[2].min() == 0:
        raise InvalidArgument("lengths must be positive and addresses non-negative")
    return out[0], out[1], out[2]


def _failed(st: TransferStatus, what: str) -> KvpoolError:
    """The typed error of a failed in-thread transfer: TransferTimeout or TransferError."""
    cls = TransferTimeout if st.state == TransferState.TIMEOUT else TransferError
    return cls(f"{what}: {st.error}")


def _scratch(s: Any) -> tuple[int, int, bool]:
    """A ``scratch`` argument of :meth:`TransferEngine.batch_transfer_sync`, checked."""
    try:
        addr, n, read_only = s
    except (TypeError, ValueError):
        raise InvalidArgument(f"scratch must be (address, length, read_only), got {s!r}") from None
    if type(addr) is not int or type(n) is not int or addr <= 0 or n <= 0 or not isinstance(read_only, bool):
        raise InvalidArgument(f"scratch must be (positive int address, positive int length, bool), got {s!r}")
    return addr, n, read_only


_NATIVE_OP = {OpCode.READ: READ, OpCode.WRITE: WRITE}  # IntEnum keys: plain 0/1 find them too


def native_op(opcode: Any) -> int:
    """The native opcode (READ/WRITE) of an :class:`OpCode` or its int value; InvalidArgument else."""
    try:
        return _NATIVE_OP[opcode]  # a dict lookup: OpCode(opcode) would cost ~0.5 us per call
    except (KeyError, TypeError):
        raise InvalidArgument(f"opcode must be OpCode.READ or OpCode.WRITE, not {opcode!r}") from None


class SyncTransfers:
    """Blocking transfers on top of the engine's segment cache, routes, registry and batches.

    A mixin of :class:`~kvpool.transfer.engine.TransferEngine`; the attributes and methods it uses
    are the engine's.
    """

    config: TransferConfig
    batches: Batches
    _registry: LocalRegistry
    _segments: dict[str, tuple[SegmentHandle, SegmentDescriptor]]
    _routes: dict[int, Transport]
    _transports: list[Transport]
    _staging: GpuStaging

    def transfer_sync(
        self, target_name: str, local_addr: int, remote_addr: int, length: int, opcode: OpCode = OpCode.WRITE
    ) -> int:
        """Move one range and wait; returns the byte count or raises a typed error."""
        exact = type(local_addr) is type(remote_addr) is type(length) is int
        if not (exact and local_addr >= 0 <= remote_addr):
            # the common case above in one test; here the precise complaint (or an int subclass)
            if not isinstance(length, int) or length <= 0:
                raise InvalidArgument("length must be a positive integer")
            for name, v in (("local_addr", local_addr), ("remote_addr", remote_addr)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise InvalidArgument(f"{name} must be a non-negative int address, got {v!r}")
        if length <= 0:
            raise InvalidArgument("length must be a positive integer")
        op = WRITE if opcode is OpCode.WRITE else READ if opcode is OpCode.READ else native_op(opcode)
        if self._registry.any_gpu((local_addr,), (length,)):
            # GPU memory here: a batch moves it (CUDA IPC or staging); as uint64 columns, which
            # the CUDA IPC route takes straight through (no per-request Python on the way)
            try:
                cols = np.array([[local_addr], [remote_addr], [length]], dtype=_U64)
            except OverflowError:
                raise InvalidArgument("addresses and length must be below 2**64") from None
            return self.batch_transfer_sync(target_name, cols[0], cols[1], cols[2], opcode)
        st = self._inline_cached(target_name, op, (local_addr,), (remote_addr,), (length,))
        if st is None:
            return self.batch_transfer_sync(target_name, [local_addr], [remote_addr], [length], opcode)
        if not st.ok:
            raise _failed(st, f"{OpCode(opcode).name} of {length} bytes to {target_name}")
        return length

    def write_inline(self, target_name: str, local_addr: int, remote_addr: int, length: int) -> bool:
        """WRITE one host range (int arguments, checked by the caller) in this thread through the
        *cached* segment, with fewer checks than :meth:`transfer_sync`: True when it landed; False
        where this path does not apply, arguments it does not take included (the caller then uses
        :meth:`transfer_sync`, which opens the segment again or names what is wrong); a failure
        raises the typed error :meth:`transfer_sync` raises. For the store's small puts."""
        exact = type(local_addr) is type(remote_addr) is type(length) is int
        if not (exact and local_addr >= 0 <= remote_addr and length > 0):
            return False
        st = self._inline_cached(target_name, WRITE, (local_addr,), (remote_addr,), (length,))
        if st is None:
            return False
        if not st.ok:
            raise _failed(st, f"WRITE of {length} bytes to {target_name}")
        return True

    def _inline_cached(
        self,
        target_name: str,
        op: int,
        locs: Sequence[int],
        rems: Sequence[int],
        lens: Sequence[int],
        scratch: tuple[int, int, bool] | None = None,
    ) -> TransferStatus | None:
        """A few checked host ranges done in this thread by the transport of the *cached* segment,
        without open_segment's native freshness call: a stale descriptor makes the native transfer
        answer ST_STALE (nothing moved; the transport returns None). None wherever this path does
        not apply (segment not open yet, its peer gone, GPU memory here, no inline path): the
        caller then takes the batch path, which opens the segment again."""
        route = self._cached_route(target_name)
        if route is None:
            return None
        hid, t = route
        if self._registry.any_gpu(locs, lens):
            return None  # GPU memory here: a batch (staged or CUDA IPC) moves it
        try:
            return t.transfer_inline(op, hid, locs, rems, lens, scratch)
        except RemoteAccessError:
            if self._view_changed({hid}):
                return None  # the owner's descriptor changed: the batch path asks it again
            raise

    def _cached_route(self, target_name: str) -> tuple[int, Transport] | None:
        """(handle, transport) of a segment already open whose peer was not seen gone, without
        open_segment's freshness call; None otherwise (the caller then takes the batch path)."""
        cached = self._segments.get(target_name)
        if cached is None:
            return None
        hid = cached[0].id
        t = self._routes.get(hid)
        if t is None or t.peer_gone(hid):
            return None
        return hid, t

    def _inline(
        self, hid: int, op: int, locs: Sequence[int], rems: Sequence[int], lens: Sequence[int]
    ) -> TransferStatus | None:
        """A few host-memory requests to one segment in this thread (the transport's
        ``transfer_inline``), or None where a batch must do them (GPU memory here, a transport
        without the path, too many requests)."""
        if len(lens) > INLINE_MAX:
            return None
        if self._registry.any_gpu(locs, lens):
            return None
        t = self._routes.get(hid) or self._route(hid)
        try:
            return t.transfer_inline(op, hid, locs, rems, lens)
        except RemoteAccessError:
            if self._view_changed({hid}):
                return None  # a batch, on the owner's new descriptor
            raise

    def batch_transfer_sync(
        self,
        target_name: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        opcode: OpCode = OpCode.WRITE,
        scratch: tuple[int, int, bool] | None = None,
    ) -> int:
        """Move many ranges to/from one segment and wait; returns total bytes or raises.

        ``scratch``: (address, length, read_only) of host memory that local ranges lie in and
        that is not registered (a fresh result buffer, a value being put): it is registered
        local-only (read-only when asked) for this call alone, inside the native call where the
        ranges go in this thread (:meth:`register_host_scratch` otherwise). A RegistrationError
        (it overlaps a registration) raises before anything moves."""
        n = len(local_addrs)
        if len(remote_addrs) != n or len(lengths) != n:
            raise InvalidArgument("local_addrs, remote_addrs and lengths differ in length")
        if scratch is not None:
            scratch = _scratch(scratch)
        if n == 0:
            return 0
        op = native_op(opcode)
        gpu_here = False  # a few ranges given as lists, one of them in local GPU memory
        if n <= INLINE_MAX and not isinstance(lengths, np.ndarray):
            # a few ranges (e.g. a value and its header): in this thread on the cached segment
            locs, rems, lens = _int_columns((local_addrs, remote_addrs, lengths))
            gpu_here = self._registry.any_gpu(locs, lens)  # then the in-thread host path does not apply
            st = None if gpu_here else self._inline_cached(target_name, op, locs, rems, lens, scratch)
            if st is not None:
                if st.ok:
                    return sum(lens)
                raise _failed(st, f"{OpCode(opcode).name} of {n} ranges to {target_name}")
        if scratch is not None:
            self.register_host_scratch(*scratch)
            try:
                return self.batch_transfer_sync(target_name, local_addrs, remote_addrs, lengths, opcode)
            finally:
                self.unregister_host_scratch(scratch[0])
        handle = self.open_segment(target_name)
        t = self._route(handle.id)
        arrays = (local_addrs, remote_addrs, lengths)
        checked = (n > INLINE_MAX or gpu_here) and "cuda" in t.locations and self._registry.gpu_count
        if checked:
            arrays = _u64_columns(arrays)  # once: needs_staging and the run below take these
        # the CUDA IPC route stages local GPU ranges to peer ranges no GPU copy reaches: rounds too
        staged = "cuda" in t.locations and self._registry.gpu_count and t.needs_staging(handle.id, *arrays)
        gpu_ok = not staged and ("cuda" in t.locations or not self._registry.gpu_count)  # else lists
        cuda_cols = "cuda" in t.locations and all(isinstance(c, np.ndarray) for c in arrays)
        if t.takes_arrays and gpu_ok and (n > INLINE_MAX or cuda_cols):
            # columns straight through: no per-request Python objects
            return self._run_sync(handle.id, op, *(arrays if checked else _u64_columns(arrays)))  # type: ignore[arg-type]
        locs, rems, lens = _int_columns(arrays)
        st = self._inline(handle.id, op, locs, rems, lens)
        if st is not None:
            if st.ok:
                return sum(lens)
            raise _failed(st, f"{OpCode(opcode).name} of {n} ranges to {target_name}")
        if (
            self._registry.gpu_count
            and ("cuda" not in t.locations or staged)
            and self._staging.needed(locs, lens)
        ):
            # staged: rounds whose staged bytes fit the pool, waiting for staging others hold
            rounds = self._staging.rounds(locs, rems, lens)
            return sum(self._run_sync(handle.id, op, *r, stage_wait_s=self.config.timeout_s) for r in rounds)
        return self._run_sync(handle.id, op, locs, rems, lens)

    def batch_transfer_sync_multi(
        self,
        parts: Sequence[tuple[str, Sequence[int], Sequence[int], Sequence[int]]],
        opcode: OpCode = OpCode.READ,
    ) -> int:
        """Ranges to/from several segments, all in flight at once, waited for together: each part
        is ``(target_name, local_addrs, remote_addrs, lengths)``. Returns the total bytes, or
        raises when any range failed (after every submitted range finished). Used where one load
        gathers from several peers (a resharded KV load reads every prefill TP rank)."""
        if len(parts) == 1 or self._registry.gpu_count:  # GPU ranges may need staging rounds
            return sum(self.batch_transfer_sync(t, a, b, c, opcode) for t, a, b, c in parts)
        op = native_op(opcode)
        for _, local_addrs, remote_addrs, lengths in parts:
            if len(remote_addrs) != len(local_addrs) or len(lengths) != len(local_addrs):
                raise InvalidArgument("local_addrs, remote_addrs and lengths differ in length")
        if all(len(p[3]) <= INLINE_MAX for p in parts):
            done = self._inline_parts(op, parts)
            if done is not None:
                return done
        reqs = []
        for target, local_addrs, remote_addrs, lengths in parts:
            hid = self.open_segment(target).id
            if self._route(hid).takes_arrays:
                locs, rems, lens = _u64_columns((local_addrs, remote_addrs, lengths))
            else:
                locs, rems, lens = _int_columns((local_addrs, remote_addrs, lengths))
            reqs.append(Requests([op] * len(locs), locs, [hid] * len(locs), rems, lens))
        n = sum(len(r.locs) for r in reqs)
        if n == 0:
            return 0
        bid = self.allocate_batch_id(n)
        try:
            try:
                for r in reqs:
                    if len(r.locs):
                        self._submit(bid, r)
            except Exception as exc:
                self._settle(bid, exc)  # what was submitted finishes before anything is raised
                raise
            st = self._wait_sync(bid)
            if st.state != TransferState.COMPLETED:
                self._raise_failures(bid, n)
            return st.transferred_bytes
        finally:
            self.batches.free_when_done(bid)  # later, when a hung GPU stream still copies

    def _inline_parts(
        self, op: int, parts: Sequence[tuple[str, Sequence[int], Sequence[int], Sequence[int]]]
    ) -> int | None:
        """A few host ranges (columns checked equal in length by the caller) to each of several
        *cached* segments of one transport, in this thread, one native call (the transport's
        ``transfer_inline_parts``): the bytes moved, or raises the first failure. None where this
        path does not apply (a segment not open yet or its peer gone, segments on different
        transports, a stale descriptor): the caller then submits one batch, which opens the
        segments again."""
        transport = None
        calls = []
        for target, local_addrs, remote_addrs, lengths in parts:
            route = self._cached_route(target)
            if route is None or (transport is not None and route[1] is not transport):
                return None
            hid, transport = route
            cols = [
                c.tolist() if isinstance(c, np.ndarray) else c for c in (local_addrs, remote_addrs, lengths)
            ]
            calls.append((hid, *_int_columns(cols)))
        if transport is None:
            return 0
        try:
            st = transport.transfer_inline_parts(op, calls)
        except RemoteAccessError:
            if self._view_changed({c[0] for c in calls}):
                return None  # one batch, on the owners' new descriptors
            raise
        if st is None:
            return None
        if not st.ok:
            n = sum(len(c[3]) for c in calls)
            raise _failed(st, f"{'READ' if op == READ else 'WRITE'} of {n} ranges to {len(calls)} segments")
        return sum(sum(c[3]) for c in calls)

    def _run_sync(
        self,
        hid: int,
        op: int,
        locs: list[int],
        rems: list[int],
        lens: list[int],
        stage_wait_s: float | None = None,
    ) -> int:
        """One batch to one segment, waited for; returns its bytes or raises the failures."""
        n = len(locs)
        bid = self.allocate_batch_id(n)
        try:
            try:
                # Columns straight to the transport: no per-request Python objects.
                self._submit(bid, Requests([op] * n, locs, [hid] * n, rems, lens), stage_wait_s, waited=True)
            except Exception as exc:
                self._settle(bid, exc)
                raise
            st = self._wait_sync(bid)
            if st.state == TransferState.COMPLETED:  # the per-request scan only when something failed
                return st.transferred_bytes
            self._raise_failures(bid, n)
            return self.get_batch_status(bid).transferred_bytes
        finally:
            self.batches.free_when_done(bid)  # later, when a hung GPU stream still copies

    def _wait_sync(self, bid: int, exc: Exception | None = None) -> TransferStatus:
        """Wait for the batch of a synchronous call. The native and RDMA transports end each of
        their requests by their own deadlines (a big batch over a slow link may take longer than
        ``timeout_s`` and still succeed); GPU copies end only when their stream does. So a batch
        with a CUDA IPC run still queued or running ``timeout_s`` after the submit, or with a
        staged request waiting ``timeout_s`` more for its host-to-device copy alone, where the
        queue it waits in did not move meanwhile (a hung stream: a transport's or the staging's
        ``unbounded``, asked every ``timeout_s``; a run behind a long queue whose runs ahead keep
        completing is waited for), raises TransferTimeout (its ``batch_id``: this batch, for
        :meth:`batch_settled`); the caller frees it once those copies finish
        (``Batches.free_when_done``: freeing is refused while they run, and unregistering the
        memory waits for them or raises). ``exc``: the error of a submit that raised after part
        of the batch was queued (see :meth:`_settle`), named in the TransferTimeout."""
        timeout = self.config.timeout_s
        st = self.wait_batch(bid, timeout)
        while st.state == TransferState.PENDING:
            hung = self._staging.unbounded(bid)  # asked every time: it notes where it saw the batch
            hung = any(t.unbounded(bid) for t in self._transports) or hung
            if hung and self.batches.pending(bid):
                what = f"{exc}; and the requests queued before it" if exc else "GPU copies of this transfer"
                err = TransferTimeout(
                    f"{what} did not finish within {timeout:g} s (a hung GPU stream?): they may still "
                    "copy into or out of the local memory"
                )
                err.batch_id = bid  # the caller asks batch_settled(bid) before reusing that memory
                raise err from exc
            st = self.wait_batch(bid, timeout)
        return st

    def batch_settled(self, batch_id: int) -> bool:
        """Whether the copies of a synchronous call that raised TransferTimeout (its
        ``batch_id``) ended: True once none still writes or reads the local memory (the batch
        is then freed), False while a hung GPU stream still holds them. Never blocks (poll it).
        Called by a caller that must not hand that memory to anyone else before then (the vLLM
        connector's load threads, for the KV blocks a timed-out load read into)."""
        return self.batches.settled(batch_id)

    def wait_settled(self, batch_id: int) -> None:
        """Block until :meth:`batch_settled` answers True for ``batch_id`` (polled with backoff,
        10 ms to 0.5 s; no upper bound: while a hung stream holds the copies, the memory they
        read or write must not be handed to anyone else). Called only from a thread that may
        wait that long: a connector's transfer worker thread, or a hook inside an engine's
        forward pass whose own GPU work cannot pass the hung stream either; never from an event
        loop or scheduler."""
        delay = 0.01
        while not self.batches.settled(batch_id):
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _settle(self, bid: int, exc: Exception) -> None:
        """A submit of a synchronous call raised ``exc`` after part of its batch was queued (a
        CUDA IPC run before a staged part whose pool wait timed out, an earlier transport's run):
        wait for that part (:meth:`_wait_sync`) so that the batch is freed and nothing of this
        call still copies into or out of the caller's memory once it raised; TransferTimeout
        where a GPU run of it outlives ``timeout_s``."""
        self._wait_sync(bid, exc)
