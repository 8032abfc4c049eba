"""Abort acknowledgements of a prefill rank of the SGLang P/D backend
(:mod:`kvpool.connectors.sglang.conn`), with SGLang's deferred decode KV release: a decode rank
that aborts a room keeps its pages until every prefill rank acks that no WRITE of the room can
still land in them. A prefill rank acks at once when no chunk of the room is written; else when
the chunk ended. A decode rank that a timed-out WRITE of the room may still write
(:class:`~kvpool.connectors.sglang.rooms.Unsettled`) is acked only once that WRITE's late GPU
copies ended, never after a TCP timeout (a stalled decode may apply frames it received); the
room's other decode ranks are acked meanwhile."""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_ACK_TAG, AbortAck, AbortNotification

from kvpool.connectors.sglang.rooms import writing_key

log = logging.getLogger("kvpool.connectors.sglang")

_NO_ACK = (
    "kvpool prefill: no ABORT_ACK for room %s to decode %s:%s: a WRITE to it timed out and may still "
    "land (it keeps the room's pages until SGLang's deferred decode KV release timeout)"
)


class AbortAcks:
    """The prefill manager's abort handling (a mixin of
    :class:`~kvpool.connectors.sglang.conn.KvpoolKVManager`, whose ``__init__`` sets what it uses:
    ``_room_lock`` guarding ``_in_flight`` (room -> chunks being written), ``_late_rooms`` (parked
    by their worker), ``_unsettled``, ``_acks_waiting`` and ``_aborted_at``; and
    ``_release_timeout_s``). Its control thread calls :meth:`_on_abort`, its transfer workers
    :meth:`_write_ended` and :meth:`_late_ended`."""

    _room_lock: Any
    _in_flight: dict[int, int]
    _late_rooms: set[int]
    _unsettled: Any
    _acks_waiting: dict[int, dict[tuple[str, int], Any]]
    _aborted_at: dict[int, float]
    _release_timeout_s: float
    request_status: Any
    enable_deferred_decode_kv_release: bool
    # SGLang's CommonKVManager's (the manager's other base)
    record_failure: Any
    update_status: Any
    conclude_failure: Any
    _prefill_unique_rank: Any
    _send_multipart_locked: Any

    def _on_abort(self, msg: list[bytes]) -> None:
        """An ABORT from a decode rank (the control thread): the room fails; the rank is acked
        now, when the room's chunk being written ended, or never (see the module's doc)."""
        n = AbortNotification.from_zmq(msg)
        if n is None:
            return
        target = n.deferred_ack_target() if self.enable_deferred_decode_kv_release else None
        with self._room_lock:
            # Failed first (under the lock _send_chunk checks it with): no chunk of the room starts
            # after this; one already writing is waited for before the ack.
            status = self.request_status.get(n.room)
            if status is not None and status != KVPoll.Success:
                self.record_failure(n.room, "Aborted by the decode instance")
                self.update_status(n.room, KVPoll.Failed)
            late = n.room in self._late_rooms
            if target is not None:
                # A chunk being written may write any decode rank of the room; once parked, only
                # the rank whose WRITE timed out (the others' completed or never start).
                unsettled = self._unsettled.holds(n.room, target.ip, target.port)
                if self._in_flight.get(n.room) and (not late or unsettled):
                    self._acks_waiting.setdefault(n.room, {})[(target.ip, target.port)] = target
                    self._aborted_at.setdefault(n.room, time.monotonic())
                    return
                if unsettled:  # a stalled decode may still apply the timed-out WRITE (TCP)
                    log.warning(_NO_ACK, n.room, target.ip, target.port)
                    return
        if late and target is None:
            log.error(
                "kvpool prefill: decode %s:%s aborted room %s without waiting for an ack while GPU "
                "copies into its pages still run (a hung stream): it may give those pages to another "
                "request, whose KV they then overwrite",
                n.decode_ip,
                n.decode_port,
                n.room,
            )
        if target is not None:
            self._ack(n.room, [target])
        elif n.decode_ip is not None and n.decode_port is not None:
            # A decode that does not wait for acks (SGLang's legacy format: room only).
            self._send_ack(n.room, n.decode_ip, n.decode_port, [ABORT_ACK_TAG, str(n.room).encode("ascii")])

    def _ack(self, room: int, targets: Any) -> None:
        """Tell each aborting decode rank that no WRITE of ``room`` from this rank is in flight."""
        for t in targets:
            self._send_ack(
                room, t.ip, t.port, AbortAck(room, self._prefill_unique_rank(), t.generation).to_zmq()
            )

    def _ack_settled(self, room: int, targets: Any) -> None:
        """Ack the aborting decode ranks ``targets`` of ``room`` (none of its chunks is written)
        that no timed-out WRITE may still write; the others get none (logged): the decode keeps
        those pages until SGLang's release timeout."""
        with self._room_lock:
            unsettled = [t for t in targets if self._unsettled.holds(room, t.ip, t.port)]
        for t in unsettled:
            log.warning(_NO_ACK, room, t.ip, t.port)
        self._ack(room, [t for t in targets if t not in unsettled])

    def _send_ack(self, room: int, ip: str, port: int, frames: list[bytes]) -> None:
        try:
            self._send_multipart_locked(f"tcp://{ip}:{port}", frames)
        except Exception as exc:  # noqa: BLE001 - best effort, as SGLang's own backends
            log.debug("ABORT_ACK for room %s not sent: %s", room, exc)

    def _late_ended(self, room: int, reason: str) -> None:
        """The GPU copies of parked ``room`` ended (its worker thread): the room fails (the decode
        is told), then it is no longer in flight (its sender polls Failed, an abort is acked)."""
        try:
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)
        finally:
            with self._room_lock:
                self._late_rooms.discard(room)
                self._unsettled.settled(room)
                aborted = self._aborted_at.get(room)
            waited = time.monotonic() - aborted if aborted is not None else 0.0
            if waited > self._release_timeout_s:
                # SGLang's decode frees an aborted room's pages this long after its abort even
                # without the ack; kvpool cannot hold it off (see docs/sglang.md).
                log.error(
                    "kvpool prefill: the GPU copies of room %s ended %.1f s after its decode aborted "
                    "it, past SGLang's deferred decode KV release timeout "
                    "(SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT, %g s): the decode may "
                    "have given those pages to another request, whose KV they then overwrote",
                    room,
                    waited,
                    self._release_timeout_s,
                )
            self._write_ended(room)

    def _write_ended(self, room: int) -> None:
        """A chunk of ``room`` is no longer written; the abort acks that waited for the room's
        last one are sent (:meth:`_ack_settled`), but to a decode rank that a timed-out WRITE of
        the room may still write (a stalled decode applying WRITEs it received): that one gets no
        ack (it releases its pages after SGLang's timeout)."""
        with self._room_lock:
            left = self._in_flight.pop(room) - 1
            if left:
                self._in_flight[room] = left
                waiting = None
            else:
                if hasattr(self.request_status, "collect"):
                    self.request_status.pop(writing_key(room), None)
                waiting = self._acks_waiting.pop(room, None)
                self._aborted_at.pop(room, None)
        if waiting:
            self._ack_settled(room, list(waiting.values()))
