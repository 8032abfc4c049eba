"""Completion and close of :class:`~kvpool.transfer.cuda_ipc.CudaIpcTransport`'s runs (a mixin:
the transport's state lives in :mod:`kvpool.transfer.cuda_ipc`; see its module docstring)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np

from kvpool import _native
from kvpool.errors import KvpoolError, TransferTimeout
from kvpool.transfer.batch import Batches
from kvpool.transfer.cuda_driver import CudaDriver
from kvpool.transfer.cuda_ipc_state import _Peer, _Prepared, _Run, _Spares
from kvpool.transfer.types import TransferState

# how long a synchronous caller waits for its run in its own thread (_finish_here): this (min, max)
# in microseconds, the min plus 1 us per 10 KB of the run (about its copy time to or from host memory)
_SPIN_US = (200, 2000)

log = logging.getLogger(__name__)


class _Completion:
    """The completion thread's loop, a failed run's slots, ``unbounded`` and ``close``."""

    driver: CudaDriver
    batches: Batches
    timeout_s: float
    _cond: threading.Condition
    _runs: collections.deque[_Run]
    _completed: int
    _closed: bool
    _late: bool
    _submits: int
    _peers: dict[int, _Peer]
    _streams: dict[int, int]
    _spares: _Spares
    _completer: _native.IpcCompleter
    _thread: threading.Thread
    native: _native.NativeEngine
    finished_here: int

    def _ready(self) -> list[tuple[_Peer, bool]]:
        raise NotImplementedError

    def _retire(self, peer: _Peer, pidfd: bool = True) -> None:
        raise NotImplementedError

    def unbounded(self, batch_id: int) -> bool:
        """Whether a run of the batch is still queued or running on our streams (their copies end
        only when the GPU stream does) *and* no run completed since the previous call for this
        batch (the first: since the run was queued): a hung stream. A run behind a long queue
        whose runs ahead keep completing is not (runs complete in queue order)."""
        with self._cond:
            mine = [r for r in self._runs if r.batch_id == batch_id]
            stuck = bool(mine) and mine[0].seen == self._completed  # the first: the others wait for it
            for r in mine:
                r.seen = self._completed
            return stuck

    # ------------------------------------------------------------------ completion
    def _finish_here(self, run: _Run, lens: Any) -> None:
        """A synchronous caller's run (``waited``), just queued: wait for its event in this thread
        (up to ``_SPIN_US``, less for a small run) and, if it was reached, end the run here as the
        completion would (``_native.ipc_finish_here``: the pins dropped, the owner's pidfd asked,
        a successful run's slots completed, with no thread in between; then its failure and
        spares here); else push it to the completer (:meth:`_push`). The native call writes its
        outcome before it returns, and the ``finally`` acts on it, so a signal handler raising as
        it returns (KeyboardInterrupt) neither loses a run still in flight nor a failure. The run
        is never in ``_runs`` meanwhile: the submit holds the peer (``_hold``) and the gate until
        it returns, which keeps detach, unregister and close waiting for it as for a queued run."""
        out = np.zeros(3, dtype=np.int64)  # ended, CUresult, owner alive
        try:
            _native.ipc_finish_here(
                self.native, run.dev, run.event, run.batch_id, run.first, lens, run.peer.fence,
                [slot for slot, _ in run.pins], run.peer.pidfd, *_SPIN_US, out,
            )  # fmt: skip
        finally:
            ended, rc, alive = out.tolist()
            if not ended:
                self._push(run, lens)
            else:
                self.finished_here += 1
                peer = run.peer
                if rc:
                    why = f"CUDA IPC copy failed: {self.driver.error(rc, 'cuEventQuery')}"
                    self._fail(run.batch_id, run.first, lens, why)
                elif not alive:
                    peer.gone = True
                    why = f"the segment's process (pid {peer.pid}) exited during the copy"
                    self._fail(run.batch_id, run.first, lens, why)
                self._spares.give_back(run.dev, run.table, run.event)

    def _push(self, run: _Run, lens: Any) -> None:
        raise NotImplementedError

    def _release(self, peer: _Peer, run: _Prepared) -> None:
        raise NotImplementedError

    def _failed_run(
        self, batch_id: int, first: int, lens: Any, lo: int, hi: int, peer: _Peer,
        run: _Prepared, reason: str,
    ) -> None:  # fmt: skip
        """A CUDA call failed while a run was queued: the copies queued before it may still read
        and write the mappings and the local memory. The run's event is recorded behind them and
        the run goes to the completion queue like any other, its slots PENDING until the stream
        reached the event and then FAILED with ``reason``; the pins, mappings and spares stay
        until then. The submitter never waits for the stream (behind a hung run it would wait
        forever). Only where the event cannot be recorded (a broken stream, whose copies end
        with its error) is the stream waited for here."""
        try:
            self.driver.record(run.event, run.stream)
        except KvpoolError:
            self._settle(run.stream)
            self._release(peer, run)
            self._fail(batch_id, first, lens, reason)
            return
        self._push(
            _Run(run.event, batch_id, first, lens, peer, run.pins, run.table, run.dev, lo, hi, error=reason),
            lens[:0],  # the completer completes none of its slots: _complete_loop fails them
        )

    def _settle(self, stream: int | None) -> None:
        """Wait for what a failed run queued on ``stream`` before its pins and mappings go."""
        if stream is None:
            return
        try:
            self.driver.stream_sync(stream)
        except KvpoolError as exc:  # the stream's own error: its copies are over either way
            log.warning("CUDA IPC: the stream of a failed run reported: %s", exc)

    def _complete_loop(self) -> None:
        """Bookkeeping of the runs the native completer finished (it already unpinned them and,
        on success, completed their slots): a failed run's slots, spares, counters, and the
        mappings of retired peers whose last run this was."""
        while True:
            for _seq, rc, alive in self._completer.wait(-1):
                with self._cond:
                    run = self._runs[0]  # pushed in queue order, completed in queue order
                if rc == _native.IPC_TIMED_OUT:  # not waited for: its copies may still run
                    reason = (
                        f"CUDA IPC: the copies' end could not be waited for within {self.timeout_s:g} s "
                        f"(device {run.dev}'s context could not be made current?); they may still land"
                    )
                    self._fail(run.batch_id, run.first, run.lens, reason, TransferState.TIMEOUT)
                    continue  # still queued, pinned and mapped until a wait tells it ended
                error = run.error
                if error is not None:
                    pass  # a run that failed while it was queued (_failed_run)
                elif rc:
                    error = f"CUDA IPC copy failed: {self.driver.error(rc, 'cuEventSynchronize')}"
                elif not alive:
                    run.peer.gone = True
                    error = f"the segment's process (pid {run.peer.pid}) exited during the copy"
                if error is not None:
                    self._fail(run.batch_id, run.first, run.lens, error)
                self._spares.give_back(run.dev, run.table, run.event)
                with run.peer.lock:
                    run.peer.inflight -= 1
                with self._cond:
                    self._runs.popleft()
                    self._completed += 1
                    ready = self._ready()
                    self._cond.notify_all()
                for peer, pidfd in ready:  # the last run to their process ended (_retire)
                    peer.close(self.driver, peer.bufs, pidfd)
            with self._cond:
                if self._closed and not self._runs and not self._submits:
                    break
        if self._late:  # set under the lock with _closed, before the runs left emptied the queue
            self._teardown()

    def _fail(
        self, batch_id: int, first: int, lens: Any, reason: str, state: TransferState = TransferState.FAILED
    ) -> None:
        for i in range(len(lens)):
            try:
                self.batches.finish(batch_id, first + i, 0, reason, state)
            except KvpoolError:
                pass  # finished already

    def close(self) -> None:
        """Called by TransferEngine.close: refuses new submits, waits for those in flight and our
        queued runs while they keep completing, then closes the peers' mappings, our streams and
        spares. A queue in which no run completed for ``timeout_s`` (a hung stream):
        TransferTimeout, and what its runs use (mappings, streams, tables, events) stays until they
        end; the completion thread closes it then."""
        with self._cond:
            self._closed = True  # no new submit; those in flight queue their runs (waited for too)
            seen, deadline = None, 0.0
            while self._runs or self._submits:
                if seen != (self._completed, self._submits):
                    seen, deadline = (self._completed, self._submits), time.monotonic() + self.timeout_s
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
        peers = list(self._peers.values())
        self._peers.clear()
        for peer in peers:
            self._retire(peer)
        with self._cond:
            queued = len(self._runs) + self._submits
            self._late = queued > 0
            self._cond.notify_all()
        self._completer.kick()  # the completion thread looks at _closed
        if queued:
            raise TransferTimeout(
                f"CUDA IPC: {queued} queued GPU copy runs did not finish within {self.timeout_s:g} s of "
                "the last one (a hung GPU stream?); their mappings stay until they end"
            )
        self._thread.join(timeout=5)
        self._teardown()

    def _teardown(self) -> None:
        """Destroy our streams and spare tables and events: by close, or by the completion thread
        after the last run a timed-out close left behind."""
        self._completer.shutdown()  # no run is queued any more: joins its thread
        for s in self._streams.values():
            self.driver.stream_destroy(s)
        self._spares.close()
