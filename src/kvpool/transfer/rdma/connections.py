"""Endpoint and connection management of the RDMA transport (a mixin of
:class:`~kvpool.transfer.rdma.transport.RdmaTransport`): making endpoints on demand (the QP
handshake over the peer's RPC port), pausing NICs, breaking, evicting and closing endpoints,
dropping a restarted or closed peer, and the passive side's RPC handler. Everything here runs on
the progress thread, except :meth:`Connections._handle_rpc` (the RPC server's thread)."""

from __future__ import annotations

import collections
import logging
import random
import time
from typing import TYPE_CHECKING, Any

from kvpool.errors import AuthenticationError, MasterUnavailable, ObjectBusy, ProtocolError
from kvpool.transfer.rdma.endpoints import SievePool
from kvpool.transfer.rdma.nics import Nic, make_qp, qp_connect
from kvpool.transfer.rdma.passive import PassiveQps
from kvpool.transfer.rdma.state import Endpoint, Peer, Req, Slice
from kvpool.transfer.rdma.verbs import Verbs
from kvpool.transfer.types import TransferState

log = logging.getLogger("kvpool.transfer.rdma")

RESTARTED = "peer restarted since its descriptor was read; open the segment again"  # as the TCP path


class PeerRestarted(Exception):
    """A connect reached another incarnation of the peer than the slice was planned for."""


# a connect RPC that failed so: the peer's RPC server is gone, or another process has its port
# (not ObjectBusy or a verbs error, which a live peer of this incarnation causes)
_RPC_DOWN = (MasterUnavailable, ProtocolError, AuthenticationError)


class Connections:
    """Endpoints of an :class:`~kvpool.transfer.rdma.transport.RdmaTransport` (its state, set up
    by its ``__init__``; the slice hooks ``_fail_slice``, ``_fail_req``, ``_slice_dropped`` are its)."""

    cfg: Any
    V: Verbs
    nics: list[Nic]
    instance: int
    origin: str
    sq_depth: int
    stats: collections.Counter[str]
    _pool: SievePool[tuple, Endpoint]
    _passive: PassiveQps
    _paused: dict[int, float]
    _chains: dict[int, Endpoint]
    _retry: collections.deque[Slice]
    _active: list[Endpoint]
    _suspect: set[int]  # handles of peers whose connect RPC failed or a new instance answered

    if TYPE_CHECKING:  # RdmaTransport's slice hooks

        def _fail_slice(self, s: Slice, reason: str) -> None: ...

        def _fail_req(self, req: Req, reason: str, state: TransferState = TransferState.FAILED) -> None: ...

        def _slice_dropped(self, s: Slice) -> None: ...

    def _endpoint(self, lnic: int, peer: Peer, rnic: int, inst: Any) -> Endpoint | str | None:
        """The endpoint to instance ``inst`` of ``peer``; a reason string when the path is down;
        None when another instance answered (the peer restarted)."""
        key = (lnic, peer.hid, rnic)
        ep = self._pool.get(key)
        if ep is not None:
            if ep.instance == inst:
                return ep
            self._break(ep, f"{peer.name} restarted", penalize=False)  # an older instance's QP
        try:
            ep = self._connect(self.nics[lnic], peer, rnic, inst)
        except PeerRestarted:
            self._suspect.add(peer.hid)
            return None
        except Exception as exc:  # noqa: BLE001 - RPC or verbs failure: this path is down
            if isinstance(exc, _RPC_DOWN):
                self._suspect.add(peer.hid)
            self._pause(lnic, peer, rnic)
            return f"connecting {self.nics[lnic].name} -> {peer.name}/{peer.nic_names[rnic]}: {exc}"
        self._pool.put(key, ep)
        self.stats["connects"] += 1
        return ep

    def _rpc_client(self, peer: Peer) -> Any:
        if peer.rpc is None or peer.rpc.address != peer.rpc_addr:
            from kvpool._rpc import RpcClient

            peer.rpc = RpcClient(peer.rpc_addr, self.cfg.connect_timeout_s, self.cfg.secret)
        return peer.rpc

    def _connect(self, nic: Nic, peer: Peer, rnic: int, inst: Any) -> Endpoint:
        qp = make_qp(self.V, nic, self.sq_depth)
        psn = random.getrandbits(24)
        try:
            reply = self._rpc_client(peer).call(
                "connect",
                nic=peer.nic_names[rnic],
                qpn=qp.qp_num,
                psn=psn,
                gid=nic.gid,
                lid=nic.lid,
                mtu=nic.mtu,
                ethernet=nic.ethernet,
                initiator=self.instance,
                origin=self.origin,
            )
            if reply.get("instance") != inst:
                raise PeerRestarted()
            qp_connect(self.V, nic, qp, reply, psn)
        except Exception:
            qp.close()
            raise
        return Endpoint((nic.index, peer.hid, rnic), nic, peer, rnic, qp, int(reply["qpn"]), inst)

    def _pause(self, lnic: int, peer: Peer, rnic: int) -> None:
        until = time.monotonic() + self.cfg.rdma_nic_pause_s
        self._paused[lnic] = until
        peer.paused[rnic] = until

    def _break(self, ep: Endpoint, reason: str, penalize: bool = True) -> None:
        """Drop a failed endpoint on both sides; its unfinished slices go to other paths."""
        self.stats["broken_endpoints"] += 1
        if penalize:
            self._pause(ep.nic.index, ep.peer, ep.rnic)
        self._pool.pop(ep.key)
        self._close_ep(ep)
        for cid, chain in list(ep.inflight.items()):
            self._chains.pop(cid, None)
            for s in chain:
                self._fail_slice(s, reason) if penalize else self._retry.append(s)
        ep.inflight.clear()
        ep.outstanding = 0
        while ep.pending:
            self._retry.append(ep.pending.popleft())
        if ep in self._active:
            self._active.remove(ep)

    def _close_ep(self, ep: Endpoint) -> None:
        try:
            ep.qp.close()
        except Exception:  # noqa: BLE001
            pass
        try:
            self._rpc_client(ep.peer).call(
                "disconnect", initiator=self.instance, gid=ep.nic.gid, qpn=ep.qp.qp_num
            )
        except Exception as exc:  # noqa: BLE001 - the peer may be gone
            log.debug("disconnect of %s failed: %s", ep.key, exc)

    def _on_evict(self, key: tuple, ep: Endpoint) -> None:
        self.stats["evictions"] += 1
        self._close_ep(ep)

    def _drop_peer(self, peer: Peer, reason: str, state: TransferState) -> None:
        """Progress thread, after ``peer`` restarted or was closed: drop its endpoints on both
        sides and end every request with a slice in flight or waiting on them (``state``);
        queued and retried slices are ended at dispatch (:meth:`_stale`)."""
        for key in self._pool.keys():
            ep = self._pool.get(key) if key[1] == peer.hid else None
            if ep is None or (ep.instance == peer.instance and not peer.closed):
                continue  # another peer's, or already made to the new instance
            self._pool.pop(key)
            self._close_ep(ep)
            for cid in ep.inflight:
                self._chains.pop(cid, None)
            for s in [s for c in ep.inflight.values() for s in c] + list(ep.pending):
                self._fail_req(s.req, reason, state)
                self._slice_dropped(s)
            ep.inflight.clear()
            ep.pending.clear()
            ep.outstanding = 0
            if ep in self._active:
                self._active.remove(ep)

    def peer_gone(self, handle: int) -> bool:
        """Whether a connect to segment ``handle`` found its RPC server gone (refused, unreachable,
        timed out) or another instance of it answering: its descriptor (RPC port, instance, rkeys)
        is then likely stale, and ``open_segment``, which calls this on every cached open, fetches
        it again; ``add_peer`` (that refresh) clears the mark. One set lookup."""
        return handle in self._suspect

    def endpoint_count(self) -> int:
        return len(self._pool)

    # ------------------------------------------------------------------ passive side (RPC)
    def _handle_rpc(self, req: dict[str, Any]) -> dict[str, Any]:
        rid = req.get("id")  # the connection proved the secret (kvpool._rpc handshake)
        try:
            op = req.get("op")
            if op == "connect":
                return {"id": rid, "ok": True, **self._passive.accept(req)}
            if op == "disconnect":
                self._passive.disconnect(req)
                return {"id": rid, "ok": True}
            return {"id": rid, "ok": False, "err": "INVALID", "msg": f"unknown op {op!r}"}
        except ObjectBusy as exc:  # over a passive QP cap: the initiator tries another path
            return {"id": rid, "ok": False, "err": "BUSY", "msg": str(exc)}
        except Exception as exc:  # noqa: BLE001
            return {"id": rid, "ok": False, "err": "ERROR", "msg": str(exc)}
