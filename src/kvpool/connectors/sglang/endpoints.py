"""SGLang's per-request endpoints of the kvpool P/D backend: the prefill's sender and the
decode's receiver, built on SGLang's ``CommonKVSender``/``CommonKVReceiver``. SGLang's scheduler
creates one per request (the plugin's ``get_kv_class`` hook returns these classes); the data path
and the control threads are the manager's (:mod:`kvpool.connectors.sglang.conn`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver, CommonKVSender

from kvpool.connectors.sglang.bootstrap_server import SignedDpRank
from kvpool.connectors.sglang.control_auth import SigningSocket, endpoint_id

if TYPE_CHECKING:
    from kvpool.connectors.sglang.conn import KvpoolKVManager


class KvpoolKVSender(SignedDpRank, CommonKVSender):
    """SGLang's common sender; chunks go to
    :meth:`~kvpool.connectors.sglang.conn.KvpoolKVManager.add_transfer_request`."""

    def __init__(self, mgr: KvpoolKVManager, *args: Any, **kwargs: Any) -> None:
        """Created by SGLang's prefill scheduler for each request: the room is held (its
        destinations are never dropped for their age). A room whose decode rank was refused before
        (its metadata came first: nothing would conclude it) fails now with the refusal's reason,
        as SGLang's own failures at creation do (its decode rank was told when the metadata came)."""
        super().__init__(mgr, *args, **kwargs)
        room = self.bootstrap_room
        mgr.rooms.claim(room)
        why = mgr.refusal(room)
        if why and mgr.request_status.get(room) not in (None, KVPoll.Failed):
            mgr.record_failure(room, why)
            mgr.update_status(room, KVPoll.Failed)

    def clear(self) -> None:
        """Called by SGLang's prefill scheduler when the request is done: SGLang drops what it kept
        for the room; so does the room table."""
        super().clear()
        self.kv_mgr.rooms.forget(self.bootstrap_room)


class KvpoolKVReceiver(CommonKVReceiver):
    """SGLang's common receiver (bootstrap lookup, metadata, heartbeats, abort); what it sends to a
    prefill rank (registration, metadata, BOOTSTRAP, ABORT) is signed with its manager's key, for
    that prefill rank's control endpoint."""

    def _connect_to_bootstrap_server(self, bootstrap_info: dict) -> tuple[Any, Any]:  # type: ignore[override]
        """Called by SGLang's receiver for every message to a prefill rank."""
        sock, lock = super()._connect_to_bootstrap_server(bootstrap_info)
        auth = getattr(self.kv_mgr, "control_auth", None)
        if auth is None or not auth.enabled:
            return sock, lock
        rank = endpoint_id(bootstrap_info["rank_ip"], bootstrap_info["rank_port"])
        return SigningSocket(sock, auth, rank), lock
