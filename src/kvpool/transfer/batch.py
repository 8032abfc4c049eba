"""Batches: a fixed-size array of request slots per batch, completed by transports.

The slots live in the native extension (``kvpool._native``): per slot a state, a byte count, the
number of completions still due and the first error, updated with atomics. Native transports (TCP,
same-host) complete them from their C++ worker threads; transports written in Python (RDMA, the
GPU staging wrapper) take slots with :meth:`Batches.reserve` and complete them with
:meth:`Batches.finish` from their own threads. Readers poll (:meth:`status`, cheap) or wait
(:meth:`wait`, a condition variable, GIL released): no transport-specific code on either side.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvpool import _native
from kvpool.errors import BatchInFlight, InvalidArgument, KvpoolError
from kvpool.transfer.types import TransferState, TransferStatus

_STATE = list(TransferState)
_FINISH_CODE = {
    TransferState.FAILED: _native.ST_TRANSPORT,
    TransferState.TIMEOUT: _native.ST_TIMEOUT,
    TransferState.CANCELED: _native.ST_CANCELED,
}


class Batches:
    """The engine's batch table, shared with its transports (see the module docstring)."""

    def __init__(self, native: _native.NativeEngine) -> None:
        self._native = native
        self._reasons: dict[int, dict[int, str]] = {}  # batch -> slot -> reason given to finish()
        self._lock = threading.Lock()
        self._deferred: set[int] = set()  # batches to free once no slot is PENDING (free_when_done)

    def alloc(self, size: int) -> int:
        """A new batch of ``size`` slots, all WAITING; first frees the deferred batches that
        finished meanwhile (:meth:`free_when_done`)."""
        if self._deferred:
            self._reap()
        return self._native.alloc_batch(size)

    def free_when_done(self, batch_id: int) -> None:
        """Free a batch now, or, while a slot is still PENDING, once none is (the next
        :meth:`alloc` after that frees it). Called by the engine's synchronous calls when they
        give up on a batch whose copies outlived ``timeout_s`` (a hung GPU stream): it stayed
        allocated for good. An unknown batch is ignored."""
        try:
            self.free(batch_id)
        except BatchInFlight:
            with self._lock:
                self._deferred.add(batch_id)
        except KvpoolError:
            pass

    def settled(self, batch_id: int) -> bool:
        """Whether no slot of the batch is PENDING any more: nothing of it still copies into or out
        of the local memory. A batch given up on by :meth:`free_when_done` is freed here once it
        settled (not only by the next :meth:`alloc`); a batch already freed (ids are never reused)
        is settled. Never blocks: one native call. Polled by whoever must not reuse the memory of
        a timed-out transfer before its late copies ended (the vLLM connector's load threads).
        InvalidArgument for a batch id that is no int (a TransferTimeout's ``batch_id`` is one)."""
        if type(batch_id) is not int:
            raise InvalidArgument(f"batch_id must be an int, not {type(batch_id).__name__}")
        try:
            if self.pending(batch_id):
                return False
        except KvpoolError:
            return True  # freed
        with self._lock:
            deferred = batch_id in self._deferred
        if deferred:
            try:
                self.free(batch_id)
            except KvpoolError:
                pass  # freed by another thread's reap meanwhile
            with self._lock:
                self._deferred.discard(batch_id)
        return True

    def deferred(self) -> int:
        """How many batches wait to be freed once their copies finish (:meth:`free_when_done`)."""
        return len(self._deferred)

    def _reap(self) -> None:
        with self._lock:
            ids = list(self._deferred)
        for bid in ids:
            try:
                self.free(bid)
            except BatchInFlight:
                continue  # still copying
            except KvpoolError:
                pass  # freed by another thread's reap meanwhile (batch ids are never reused)
            with self._lock:
                self._deferred.discard(bid)

    def free(self, batch_id: int) -> None:
        """Forget a batch; :class:`~kvpool.errors.BatchInFlight` while any slot is PENDING."""
        self._native.free_batch(batch_id)
        if self._reasons:
            with self._lock:
                self._reasons.pop(batch_id, None)

    # ------------------------------------------------------------------ for transports
    def reserve(self, batch_id: int, lens: Sequence[int]) -> int:
        """Take the next ``len(lens)`` free slots as PENDING; returns the first index.

        Called by a Python transport in ``submit`` after validating its requests; each slot must
        then be finished exactly once. Raises InvalidArgument when the batch is full.
        """
        return self._native.reserve_slots(batch_id, list(lens))

    def finish(
        self,
        batch_id: int,
        index: int,
        nbytes: int,
        error: str | None = None,
        state: TransferState = TransferState.FAILED,
    ) -> None:
        """Complete a reserved slot: COMPLETED with ``nbytes`` when ``error`` is None, else ``state``
        (FAILED, TIMEOUT or CANCELED) with ``error`` as its reason. Any thread; never blocks."""
        if error is None:
            self._native.finish_slot(batch_id, index, nbytes, 0)
            return
        with self._lock:  # the reason is in place before the slot can be seen finished
            self._reasons.setdefault(batch_id, {})[index] = error
        self._native.finish_slot(batch_id, index, nbytes, _FINISH_CODE[TransferState(state)])

    # ------------------------------------------------------------------ for readers
    def status(self, batch_id: int, index: int) -> TransferStatus:
        """Status of one slot (reason text for FAILED/TIMEOUT/CANCELED)."""
        state, nbytes = self._native.status(batch_id, index)
        if state <= TransferState.COMPLETED:
            return TransferStatus(_STATE[state], nbytes)
        reason = self._reasons.get(batch_id, {}).get(index) if self._reasons else None
        if reason is None:
            reason = _native.status_text(self._native.slot_error(batch_id, index))
        return TransferStatus(_STATE[state], nbytes, reason)

    def batch_status(self, batch_id: int) -> TransferStatus:
        """PENDING while any slot is; else COMPLETED, TIMEOUT when any slot timed out (it may still
        land), or the first failure state; bytes so far."""
        state, nbytes = self._native.batch_status(batch_id)
        return TransferStatus(_STATE[state], nbytes)

    def wait(self, batch_id: int, timeout_s: float | None = None) -> TransferStatus:
        """Block (GIL released) until no slot of the batch is PENDING, or ``timeout_s``."""
        ms = -1 if timeout_s is None else max(0, int(timeout_s * 1000))
        state, nbytes = self._native.wait(batch_id, ms)  # the batch's status, one pass over its slots
        return TransferStatus(_STATE[state], nbytes)

    def pending(self, batch_id: int) -> bool:
        """True while any slot of the batch is PENDING (one native call)."""
        return self._native.batch_status(batch_id)[0] == TransferState.PENDING
