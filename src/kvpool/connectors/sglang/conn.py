"""kvpool transfer backend for SGLang prefill/decode disaggregation.

Built on SGLang's ``CommonKVManager``/``CommonKVSender``/``CommonKVReceiver``/
``CommonKVBootstrapServer`` (bootstrap registration, ZMQ control sockets, status bookkeeping,
heartbeats and aborts come from them); kvpool adds the data path:

* each manager registers its KV buffers (per layer K then V), aux (metadata) buffers and state
  buffers with a :class:`kvpool.TransferEngine` (``KVPOOL_*`` environment variables configure it);
* the decode side registers its buffer addresses with every prefill rank once
  (:mod:`kvpool.connectors.sglang.peers`), then sends each request's destination pages;
* the prefill side pushes (RDMA-style WRITE): for every chunk one transfer batch holding every
  layer's K and V, contiguous page runs merged into single requests (runs contiguous on both
  sides), plus the aux rows on the last chunk; the status (with the failure reason) goes back to
  the decode over the control socket;
* transfers run on background worker threads; ``poll()`` only reads status;
* with a cluster secret (``KVPOOL_SECRET``) every control message is signed and checked
  (:mod:`kvpool.connectors.sglang.control_auth`): unsigned, forged, stale and replayed ones are
  dropped, never acted on; so are the prefill's registrations with the bootstrap server
  (:mod:`kvpool.connectors.sglang.bootstrap_auth`: others are refused with HTTP 401/403);
* what a prefill keeps per room is bounded (:mod:`kvpool.connectors.sglang.rooms`): metadata
  beyond the bounds is refused and its decode rank told so;
* a chunk whose pages the decode's destination list does not cover fails the room (a transfer
  never reports success with pages missing).

Equal attention-TP sizes are required on both sides for non-MLA models (no head slicing): a
mismatch fails the request with a message saying so. State buffers (Mamba/SWA/DSA) are not
transferred: requests that carry state indices fail with a clear reason.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any

import msgpack
import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AckTarget,
    CommonKVManager,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs

from kvpool.config import TransferConfig
from kvpool.connectors.sglang.acks import AbortAcks
from kvpool.connectors.sglang.bootstrap_server import SignedRegistration
from kvpool.connectors.sglang.control_auth import ControlAuth, endpoint_id, endpoint_of
from kvpool.connectors.sglang.peers import REG_TAG, parse_registration, registration_message
from kvpool.connectors.sglang.plan import Chunk, TransferInfo, aux_columns, buffers, page_columns
from kvpool.connectors.sglang.rooms import LateRooms, PeerTable, RoomTable, Unsettled, writing_key
from kvpool.errors import KvpoolError, ProtocolUnavailable, TransferTimeout, late_batch
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.types import OpCode

log = logging.getLogger("kvpool.connectors.sglang")

META_TAG = b"KVPOOL_META"
_NO_CHUNK: Any = object()  # a transfer worker's queue get timed out


def _engine(local_ip: str) -> TransferEngine:
    cfg = TransferConfig.from_env(hostname=local_ip)
    return TransferEngine(config=cfg)


class KvpoolKVManager(AbortAcks, SignedRegistration, CommonKVManager):
    """Registers SGLang's KV/aux/state buffers with a kvpool transfer engine and moves pages."""

    kv_status_msg_carries_reason = True
    # A decode that aborts a room keeps its pages until every prefill rank acks that no WRITE of
    # the room is still in flight (SGLang's deferred decode KV release): no late write lands in
    # pages given to another request. The ack is sent when the room's running chunk finished.
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool = False,
    ) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.engine = _engine(self.local_ip)
        self.session_id = self.engine.segment_name
        # KVPOOL_SECRET also signs the control messages; accepted: those sealed for this endpoint.
        me = endpoint_id(self.local_ip, self.rank_port)  # what it registers and sends as its own
        self.control_auth = ControlAuth(self.engine.config.secret, receiver=me)
        self._registered: list[int] = []
        self.register_buffer_to_engine()
        self.transfer_calls = 0
        # Prefill: rooms with a chunk being written (or its GPU copies still running past the
        # timeout), and the abort acks that wait for them to drain. Empty on a decode.
        self._in_flight: dict[int, int] = {}
        self._concluding = threading.local()  # the decode endpoints conclude_transfer sends to
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.peers = PeerTable()  # session -> PeerArgs, bounded (KVPOOL_SGLANG_MAX_PEERS)
            self._room_lock = threading.Lock()
            self._late_rooms: set[int] = set()  # parked by their worker (LateRooms)
            self._unsettled = Unsettled()  # the decode rank a timed-out WRITE of a room may still write
            self._acks_waiting: dict[int, dict[tuple[str, int], AckTarget]] = {}
            self._aborted_at: dict[int, float] = {}  # when the first of those acks was asked
            # How long an aborting decode keeps a room's pages without an ack (SGLang's decode
            # setting, read here with the same default): past it, late copies may hit reused pages.
            self._release_timeout_s = float(
                envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
            )
            waited = max(self.bootstrap_timeout, envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
            self.rooms = RoomTable.from_env(self.transfer_infos, self._drop_room, waited)
            n = max(1, int(os.environ.get("KVPOOL_SGLANG_WORKERS", "2")))
            self._queues: list[queue.Queue[Chunk | None]] = [queue.Queue() for _ in range(n)]
            threading.Thread(target=self._prefill_control, name="kvpool-sgl-ctl", daemon=True).start()
            for i, q in enumerate(self._queues):
                threading.Thread(
                    target=self._transfer_worker, args=(q,), name=f"kvpool-sgl-xfer{i}", daemon=True
                ).start()
        elif disaggregation_mode == DisaggregationMode.DECODE:
            threading.Thread(target=self._decode_control, name="kvpool-sgl-ctl", daemon=True).start()
            self._start_heartbeat_checker_thread()
        else:
            raise ValueError(f"unsupported disaggregation mode {disaggregation_mode}")

    # ------------------------------------------------------------------ status
    def check_status(self, bootstrap_room: int) -> KVPoll:
        """SGLang's sender and receiver ``poll()`` (the scheduler's event loop; never blocks): the
        room's status, but a Failed room of which a chunk is still written (GPU copies may outlive
        the timeout) reads Transferring until the write ended: Failed lets SGLang free the room's
        prefill pages (reused by other requests), and an abort marks it Failed at once."""
        return self._held(bootstrap_room, super().check_status(bootstrap_room))

    def check_status_pp_consensus(self, bootstrap_room: int) -> KVPoll:
        """:meth:`check_status` over pipeline stages (SGLang's sender with PP, on stage 0): held
        while any stage writes a chunk of the room (each says so in its PPConsensusStore)."""
        status = super().check_status_pp_consensus(bootstrap_room)
        if status == KVPoll.Failed and any(self.request_status.collect(writing_key(bootstrap_room))):
            return KVPoll.Transferring
        return self._held(bootstrap_room, status)

    def _held(self, room: int, status: KVPoll) -> KVPoll:
        if status == KVPoll.Failed and self._in_flight.get(room):
            return KVPoll.Transferring
        return status

    def conclude_transfer(
        self,
        *,
        bootstrap_room: int,
        status: KVPoll,
        targets: list[tuple[str, int]] | None = None,
        failure_reason: str | None = None,
    ) -> KVPoll | None:
        """SGLang's (called through ``conclude_failure`` by the transfer workers and the control
        thread, and on a room's last chunk): the room's status goes to its decode ranks. Under
        SGLang's ``prefill_complete`` policy its marking the room Failed also sends the deferred
        bootstrap's Failed notice ("Prefill bootstrap failed") to the decode endpoint that this
        Failed status, with its reason, goes to next: that notice is left out (one Failed each)."""
        if targets is None:
            targets = self._room_notify_targets(bootstrap_room)
        self._concluding.targets = targets
        try:
            return super().conclude_transfer(
                bootstrap_room=bootstrap_room, status=status, targets=targets, failure_reason=failure_reason
            )
        finally:
            self._concluding.targets = None

    def _notify_bootstrap(self, room: int, notification: Any) -> None:
        """SGLang's deferred bootstrap notice (``prefill_complete``), sent by ``update_status``;
        a Failed one is left out when :meth:`conclude_transfer` sends the room's Failed status
        to the same endpoint on this thread."""
        sending = getattr(self._concluding, "targets", None)
        if notification is not None and notification[1] and sending and tuple(notification[0]) in sending:
            return
        super()._notify_bootstrap(room, notification)

    # ------------------------------------------------------------------ memory
    def register_buffer_to_engine(self) -> None:
        """Register every KV, aux and state buffer (SGLang calls this again after a memory resume).

        Decode buffers are written by prefill peers (remote-accessible); prefill buffers are only
        sources of local WRITEs. GPU buffers that peers must write are reachable by same-host peers
        through CUDA IPC (when the CUDA driver loads) and by other hosts with ``KVPOOL_PROTOCOL=rdma``.
        """
        remote = self.disaggregation_mode == DisaggregationMode.DECODE
        for ptr, n, loc in buffers(self.kv_args, self.server_args):
            if ptr in self._registered:
                continue
            try:
                self.engine.register_local_memory(ptr, n, location=loc, remote_accessible=remote)
            except ProtocolUnavailable as exc:
                raise ProtocolUnavailable(
                    f"kvpool SGLang backend: {exc}. A decode instance with GPU KV buffers needs the "
                    "CUDA driver (same-host prefills: CUDA IPC) or KVPOOL_PROTOCOL=rdma; see docs/gpu.md"
                ) from None
            self._registered.append(ptr)

    def deregister_buffer_to_engine(self) -> None:
        """Unregister (SGLang calls this before releasing memory occupation)."""
        for ptr in self._registered:
            try:
                self.engine.unregister_local_memory(ptr)
            except KvpoolError:
                pass
        self._registered = []

    # ------------------------------------------------------------------ decode -> prefill messages
    def build_receiver_registration_message(self) -> list[bytes]:
        """Called by SGLang's receiver once per prefill rank (:mod:`kvpool.connectors.sglang.peers`)."""
        return registration_message(self)

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: Any,
        aux_index: Any,
        state_indices: Any,
        decode_prefix_len: Any,
        is_dummy: bool,
        device_kv_indices: Any = None,
    ) -> list[bytes]:
        body = {
            "room": int(bootstrap_room),
            "ip": self.local_ip,
            "port": self.rank_port,
            "session": self.session_id,
            "dummy": bool(is_dummy),
            "kv": b"" if is_dummy else np.asarray(kv_indices, dtype=np.int32).tobytes(),
            "aux": None if is_dummy or aux_index is None else int(aux_index),
            "need": int(required_dst_info_num),
            "prefix": int(decode_prefix_len or 0),
        }
        return [META_TAG, msgpack.packb(body)]

    # ------------------------------------------------------------------ prefill: control thread
    def _control_recv(self) -> Any:
        """The control threads' recv: SGLang's (polling with role switching, so that a teardown is
        seen), the signature check, SGLang's deferred-bootstrap hook; None: nothing to act on."""
        sock, auth, wait = self.server_socket, self.control_auth, self.server_args.enable_pd_role_switch
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)

        def recv() -> list[bytes] | None:
            msg = auth.open(sock.recv_multipart()) if not wait or poller.poll(500) else None
            hook = msg is not None and self.deferred_bootstrap is not None
            return None if hook and self._handle_bootstrap_message(msg) else msg

        return recv

    def _send_multipart_locked(self, endpoint: str, parts: list[bytes], is_ipv6: bool = False) -> None:
        """SGLang's send of a status/ABORT_ACK/CHUNK_READY message, signed for ``endpoint`` under
        the socket's lock (so the counters on one socket increase)."""
        sock = self._connect(endpoint, is_ipv6=is_ipv6)
        with self._socket_send_locks[endpoint]:
            sock.send_multipart(self.control_auth.seal(parts, endpoint_of(endpoint)))

    def _prefill_control(self) -> None:
        recv = self._control_recv()
        while True:
            try:
                msg = recv()
                if msg is None:
                    continue
                if msg[0] == ABORT_TAG:
                    self._on_abort(msg)
                elif msg[0] == REG_TAG:
                    self._on_register(msgpack.unpackb(msg[1]))
                elif msg[0] == META_TAG:
                    self._on_metadata(msgpack.unpackb(msg[1]))
                else:
                    log.warning("kvpool prefill: unknown control message %r", msg[0][:32])
            except Exception:  # noqa: BLE001 - a bad message must not kill the control thread
                log.exception("kvpool prefill: control message failed")

    def _on_register(self, b: Any) -> None:
        """A decode rank's registration (:mod:`kvpool.connectors.sglang.peers`): kept whole when
        this rank can serve it, else refused, only its session and the reason kept."""
        peer = parse_registration(b, self)
        if peer is None:
            log.error("kvpool prefill: a decode registration without a usable session dropped")
            return
        self.peers.put(peer.session, peer)
        if peer.incompatible:
            log.error("kvpool prefill: decode %s refused: %s", peer.session, peer.incompatible)

    def _on_metadata(self, b: dict[str, Any]) -> None:
        room = int(b["room"])
        info = TransferInfo(
            room=room,
            endpoint=str(b["ip"]),
            dst_port=int(b["port"]),
            session=str(b["session"]),
            dst_kv_indices=np.frombuffer(b["kv"], dtype=np.int32),
            dst_aux_index=b["aux"],
            required_dst_info_num=int(b["need"]),
            decode_prefix_len=int(b["prefix"]),
            is_dummy=bool(b["dummy"]),
        )
        refused = self.rooms.admit(room, info.session, info.required_dst_info_num)
        if refused:
            self._refuse(info, refused)
            return
        peer = self.peers.get(info.session)
        if peer is not None and peer.incompatible and not info.is_dummy:
            info.refused = peer.incompatible  # a sender created later fails with it (refusal())
            self.transfer_infos.setdefault(room, {})[info.session] = info
            if room not in self.request_status:  # no request holds it yet: no conclusion sent
                target, why = [(info.endpoint, info.dst_port)], peer.incompatible
                self.send_kv_status_message(
                    targets=target, bootstrap_room=room, status=KVPoll.Failed, failure_reason=why
                )
            self.conclude_failure(bootstrap_room=room, failure_reason=peer.incompatible)
            return
        infos = self.transfer_infos.setdefault(room, {})
        infos[info.session] = info
        if len(infos) == info.required_dst_info_num:
            self.req_to_decode_prefix_len[room] = info.decode_prefix_len
            self.update_status(room, KVPoll.WaitingForInput)

    def refusal(self, room: int) -> str | None:
        """Why ``room`` cannot be served (a decode rank of it was refused at registration), or None.
        Called by :class:`~kvpool.connectors.sglang.endpoints.KvpoolKVSender` when created: its
        metadata may have come first."""
        for info in list(self.transfer_infos.get(room, {}).values()):
            if info.refused:
                return info.refused
        return None

    def _drop_room(self, room: int) -> None:
        """What SGLang keeps for a room no sender holds (metadata made it WaitingForInput), when
        :class:`RoomTable` drops it for its age (control thread)."""
        self.transfer_infos.pop(room, None)
        self.req_to_decode_prefix_len.pop(room, None)
        self.request_status.pop(room, None)
        with self.failure_lock:
            self.failure_records.pop(room, None)

    def _refuse(self, info: TransferInfo, reason: str) -> None:
        """Metadata the room bounds refused (:mod:`kvpool.connectors.sglang.rooms`): its decode rank
        fails the room with the reason (and so does this prefill when a request of it holds a room
        it could not store)."""
        reason = f"kvpool: metadata refused: {reason}"
        target = [(info.endpoint, info.dst_port)]
        if info.room not in self.transfer_infos and info.room in self.request_status:
            self.conclude_failure(bootstrap_room=info.room, failure_reason=reason, targets=target)
        else:
            self.send_kv_status_message(
                targets=target, bootstrap_room=info.room, status=KVPoll.Failed, failure_reason=reason
            )

    # ------------------------------------------------------------------ prefill: transfers
    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: Any = None,
        num_kv_tokens: Any = None,
        **_: Any,
    ) -> None:
        """Queue one chunk (called by the ``send`` of
        :class:`~kvpool.connectors.sglang.endpoints.KvpoolKVSender`); the worker moves it."""
        if self.request_status.get(bootstrap_room, KVPoll.Failed) == KVPoll.Failed:
            return
        chunk = Chunk(
            bootstrap_room,
            np.asarray(kv_indices, dtype=np.int64).reshape(-1),
            index_slice,
            bool(is_last_chunk),
            aux_index,
            state_indices,
        )
        # One queue per room: chunks of a room stay in order.
        self._queues[hash(bootstrap_room) % len(self._queues)].put(chunk)

    def _transfer_worker(self, q: queue.Queue[Chunk | None]) -> None:
        """One transfer worker thread: the chunks of the rooms hashed to its queue, in order. A
        room whose GPU copies outlive the timeout is parked (:class:`LateRooms`): the worker goes
        on with the rooms behind it and ends it (:meth:`_late_ended`) on the first turn of its
        loop after those copies ended (it looks at least every 0.5 s)."""
        late = LateRooms(self.engine.batch_settled)
        while True:
            try:
                chunk = q.get(timeout=late.wait_s())
            except queue.Empty:
                chunk = _NO_CHUNK
            for room, reason in late.ended():
                try:
                    self._late_ended(room, reason)
                except Exception:  # noqa: BLE001 - the worker lives on
                    log.exception("kvpool prefill: room %s not concluded after its late copies", room)
            if chunk is None:
                return
            if chunk is _NO_CHUNK:
                continue
            try:
                self._send_chunk(chunk, late)
            except Exception as exc:  # noqa: BLE001 - the room fails, the worker lives on
                log.exception("kvpool prefill: chunk of room %s failed", chunk.room)
                self.conclude_failure(bootstrap_room=chunk.room, failure_reason=f"kvpool: {exc}")

    def _send_chunk(self, chunk: Chunk, late: LateRooms) -> None:
        room = chunk.room
        with self._room_lock:
            if self.request_status.get(room, KVPoll.Failed) == KVPoll.Failed or room in self._late_rooms:
                return
            self._in_flight[room] = self._in_flight.get(room, 0) + 1
            if hasattr(self.request_status, "collect"):  # PP: replicated to stage 0
                self.request_status[writing_key(room)] = 1
        # Ended, or failed but for a timeout (a decode gone, a refused range, a plan error): the
        # engine raises only once nothing of the batch runs, so nothing of the room can still land.
        # A batch of which any request timed out raises TransferTimeout, whatever else failed: its
        # decode rank is Unsettled (_write_chunk), its abort unacked; the room's others are acked.
        parked = False
        try:
            self._write_chunk(chunk)
        except TransferTimeout as exc:
            bid = late_batch(exc)
            if bid is None:  # a stalled decode may still apply WRITEs it received (TCP)
                raise
            # GPU copies outlived the timeout (a hung stream): they may still read the prefill's
            # pages and write the decode's. The room stays in flight, unconcluded (neither side
            # frees its pages), an abort unacked until they ended; no later chunk of it starts.
            # Parked, it holds up no other room of this worker.
            log.warning("kvpool prefill: room %s waits for GPU copies past the timeout: %s", room, exc)
            with self._room_lock:
                self._late_rooms.add(room)
                waiting = self._acks_waiting.get(room, {})
                settled = [k for k, t in waiting.items() if not self._unsettled.holds(room, t.ip, t.port)]
                acks = [waiting.pop(k) for k in settled]
                if not waiting:  # no abort left that waits for the late copies
                    self._acks_waiting.pop(room, None)
                    self._aborted_at.pop(room, None)
            late.park(room, bid, f"kvpool: {exc}")
            parked = True
            self._ack(room, acks)  # the decode ranks no late copy writes
        finally:
            if not parked:
                self._write_ended(room)

    def _write_chunk(self, chunk: Chunk) -> None:
        room = chunk.room
        if (
            chunk.state_indices is not None
            and len(chunk.state_indices)
            and any(len(s) if hasattr(s, "__len__") else 1 for s in chunk.state_indices)
        ):
            self.conclude_failure(
                bootstrap_room=room,
                failure_reason="kvpool backend does not transfer state (Mamba/SWA/DSA) buffers",
            )
            return
        plan = []
        for info in list(self.transfer_infos.get(room, {}).values()):
            if info.is_dummy:
                continue
            peer = self.peers.get(info.session)
            if peer is None:
                raise KvpoolError(
                    f"decode {info.session} is not registered (metadata before its buffers' registration, "
                    "or evicted beyond KVPOOL_SGLANG_MAX_PEERS)"
                )
            if peer.incompatible:
                self.conclude_failure(bootstrap_room=room, failure_reason=peer.incompatible)
                return
            dst = info.dst_kv_indices[chunk.index_slice]
            if len(dst) != len(chunk.kv_indices):
                # Writing fewer pages and reporting success would let the decode compute with
                # missing KV: the room fails before anything of this chunk is written.
                self.conclude_failure(
                    bootstrap_room=room,
                    failure_reason=(
                        f"kvpool: decode {info.session} gave {len(info.dst_kv_indices)} destination pages "
                        f"for room {room}, too few for the prefill's chunk of {len(chunk.kv_indices)} "
                        f"pages ({len(dst)} destinations for it)"
                    ),
                )
                return
            plan.append((info, peer, dst))
        targets = []
        for info, peer, dst in plan:
            cols = page_columns(self.kv_args, peer, chunk.kv_indices, dst)
            if chunk.is_last and chunk.aux_index is not None and info.dst_aux_index is not None:
                aux_columns(self.kv_args, peer, chunk.aux_index, info.dst_aux_index, cols)
            if cols[0]:
                try:
                    self._run(peer.session, cols)
                except TransferTimeout:
                    with self._room_lock:  # before the room is acked or parked (_send_chunk)
                        self._unsettled.add(room, (info.endpoint, info.dst_port))
                    raise
            targets.append((info.endpoint, info.dst_port))
        if chunk.is_last:
            if self.request_status.get(room) in (None, KVPoll.Failed):
                return  # aborted (and maybe cleared) while this chunk was written: no Success
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success, targets=targets or None)
            self.transfer_infos.pop(room, None)

    def _run(self, session: str, cols: tuple[list, list, list]) -> None:
        """One transfer batch to a decode rank; raises a typed error when any part failed."""
        self.engine.batch_transfer_sync(session, cols[0], cols[1], cols[2], OpCode.WRITE)
        self.transfer_calls += 1

    # ------------------------------------------------------------------ decode: control thread
    def _decode_control(self) -> None:
        recv = self._control_recv()
        while True:
            try:
                msg = recv()
                if msg is None or self.handle_abort_ack_message(msg):
                    continue
                parsed = self.parse_kv_status_message(msg)
                if parsed is None:
                    continue
                room, status, prefill_rank, reason = parsed
                self.apply_prefill_status(
                    bootstrap_room=room, status=status, prefill_rank=prefill_rank, failure_reason=reason
                )
            except Exception:  # noqa: BLE001
                log.exception("kvpool decode: control message failed")
