"""Endpoint and connection management of the RDMA transport (a mixin of
:class:`~kvpool.transfer.rdma.transport.RdmaTransport`): making endpoints on demand (the QP
handshake over the peer's RPC port), pausing NICs, breaking, evicting and closing endpoints,
dropping a restarted or closed peer, and the passive side's RPC handler. Everything here runs on
the progress thread, except the connect and disconnect RPCs (a few :class:`Strands` threads, one
RPC at a time per peer: a peer that never answers delays only its own slices) and
:meth:`Connections._handle_rpc` (the RPC server's thread)."""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any

from kvpool.errors import AuthenticationError, MasterUnavailable, ObjectBusy, ProtocolError
from kvpool.transfer.rdma.endpoints import SievePool
from kvpool.transfer.rdma.nics import Nic, make_qp, qp_connect
from kvpool.transfer.rdma.passive import PassiveQps
from kvpool.transfer.rdma.state import Endpoint, Peer, Req, Slice
from kvpool.transfer.rdma.strands import Strands
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
    _rpcs: Strands  # connect and disconnect RPCs, one at a time per peer, off the progress thread
    _connecting: dict[tuple, list[Slice]]  # endpoint key -> slices waiting for its connect
    _connected: collections.deque[tuple[tuple, Peer, Any, Any, str]]  # connects done, for _on_connected
    _wake: threading.Event
    _closed: bool

    if TYPE_CHECKING:  # RdmaTransport's slice hooks

        def _fail_slice(self, s: Slice, reason: str) -> None: ...

        def _fail_req(self, req: Req, reason: str, state: TransferState = TransferState.FAILED) -> None: ...

        def _slice_dropped(self, s: Slice) -> None: ...

        def _stale(self, s: Slice) -> bool: ...

    def _endpoint(self, s: Slice) -> Endpoint | None:
        """The endpoint ``s`` goes to (its pair, to the incarnation its request was planned
        for); None when ``s`` now waits for a connect (it is dispatched again when the connect
        ends) or was failed. A connect runs on the RPC threads (:meth:`_start_connect`)."""
        peer, inst = s.req.peer, s.req.instance
        key = (s.lnic, peer.hid, s.rnic)
        ep = self._pool.get(key)
        if ep is not None:
            if ep.instance == inst:
                return ep
            self._break(ep, f"{peer.name} restarted", penalize=False)  # an older instance's QP
        parked = self._connecting.get(key)
        if parked is not None:
            parked.append(s)  # bounded: slices of submitted batches
        elif self._start_connect(key, peer, inst):
            self._connecting[key] = [s]
        else:
            self._fail_slice(s, f"too many RPCs queued to {peer.name}")
        return None

    def _start_connect(self, key: tuple, peer: Peer, inst: Any) -> bool:
        """Hand the connect of endpoint ``key`` to the RPC threads (one RPC at a time per peer);
        its result comes back through ``_connected`` to :meth:`_on_connected`."""
        nic, rnic = self.nics[key[0]], key[2]
        addr, rname = peer.rpc_addr, peer.nic_names[rnic]  # as the progress thread sees them now

        def job() -> None:
            res: Endpoint | Exception
            down = peer.rpc_down
            if down is not None and down[0] == addr and time.monotonic() < down[1]:
                res = down[2]  # it just timed out or refused: not another connect_timeout_s
            else:
                try:
                    res = self._connect(nic, peer, addr, rname, rnic, inst)
                except Exception as exc:  # noqa: BLE001 - handed to the progress thread
                    res = exc
                    if isinstance(exc, _RPC_DOWN):
                        peer.rpc_down = (addr, time.monotonic() + self.cfg.rdma_nic_pause_s, exc)
            self._connected.append((key, peer, inst, res, rname))
            self._wake.set()
            if self._closed:  # the progress thread is gone
                self._discard_connected()
                self._rpc_done(peer)

        return self._rpcs.submit(peer.hid, job)

    def _on_connected(self) -> None:
        """Progress thread: install the endpoints the RPC threads made, or fail the slices that
        waited for them (they go to other paths as any failed slice)."""
        while self._connected:
            key, peer, inst, res, rname = self._connected.popleft()
            parked = self._connecting.pop(key, [])
            if isinstance(res, Endpoint):
                if peer.closed or res.instance != peer.instance or self._pool.get(key) is not None:
                    self._close_ep(res)  # closed or restarted meanwhile: its slices end at dispatch
                    self._retry.extend(parked)
                    continue
                self._pool.put(key, res)
                self.stats["connects"] += 1
                for s in parked:  # to the endpoint at once: busy, it is not evicted by the next put
                    if self._stale(s):
                        self._slice_dropped(s)
                    elif s.req.instance != res.instance:
                        self._retry.append(s)
                    else:
                        res.pending.append(s)
                if res.pending:
                    self._active.append(res)
                continue
            if isinstance(res, PeerRestarted):
                self._suspect.add(peer.hid)
                for s in parked:  # those planned for a newer instance connect again
                    if s.req.instance == inst:
                        self._fail_req(s.req, f"{RESTARTED} ({peer.name}: a new instance answered)")
                        self._slice_dropped(s)
                    else:
                        self._retry.append(s)
                continue
            if isinstance(res, _RPC_DOWN):
                self._suspect.add(peer.hid)
                peer.paused[key[2]] = time.monotonic() + self.cfg.rdma_nic_pause_s  # not our NIC's fault
            else:
                self._pause(key[0], peer, key[2])
            reason = f"connecting {self.nics[key[0]].name} -> {peer.name}/{rname}: {res}"
            for s in parked:
                self._fail_slice(s, reason)

    def _rpc_client(self, peer: Peer, addr: str) -> Any:
        """``peer``'s RPC connection (RPC threads: one at a time per peer)."""
        if peer.rpc is None or peer.rpc.address != addr:
            from kvpool._rpc import RpcClient

            if peer.rpc is not None:
                peer.rpc.close()
            peer.rpc = RpcClient(addr, self.cfg.connect_timeout_s, self.cfg.secret)
        return peer.rpc

    def _rpc_done(self, peer: Peer) -> None:
        """Close ``peer``'s RPC connection (RPC threads, after the transport or the peer closed)."""
        if peer.rpc is not None:
            peer.rpc.close()

    def _discard_connected(self) -> None:
        """Close the QPs of connects that ended after the progress thread stopped (``close``)."""
        while self._connected:
            res = self._connected.popleft()[3]
            if isinstance(res, Endpoint):
                try:
                    res.qp.close()
                except Exception:  # noqa: BLE001
                    pass

    def _connect(self, nic: Nic, peer: Peer, addr: str, rname: str, rnic: int, inst: Any) -> Endpoint:
        """The QP handshake with remote NIC ``rname`` of ``peer`` at ``addr`` (RPC threads)."""
        qp = make_qp(self.V, nic, self.sq_depth)
        psn = random.getrandbits(24)
        try:
            reply = self._rpc_client(peer, addr).call(
                "connect",
                nic=rname,
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
        """Close our QP; the peer's end is closed by a ``disconnect`` RPC on the RPC threads
        (dropped when too many wait for that peer: its passive caps bound what it keeps)."""
        qpn, gid, peer, addr = ep.qp.qp_num, ep.nic.gid, ep.peer, ep.peer.rpc_addr
        try:
            ep.qp.close()
        except Exception:  # noqa: BLE001
            pass

        def job() -> None:
            try:
                self._rpc_client(peer, addr).call("disconnect", initiator=self.instance, gid=gid, qpn=qpn)
            except Exception as exc:  # noqa: BLE001 - the peer may be gone
                log.debug("disconnect of %s failed: %s", ep.key, exc)
            if self._closed:
                self._rpc_done(peer)

        if not self._rpcs.submit(peer.hid, job):
            log.debug("disconnect of %s not sent: too many RPCs queued to %s", ep.key, peer.name)

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
        for key in [k for k in self._connecting if k[1] == peer.hid]:
            keep = []  # the connect's own result comes back later
            for s in self._connecting[key]:
                if self._stale(s):
                    self._slice_dropped(s)
                else:
                    keep.append(s)
            self._connecting[key] = keep
        if peer.closed:
            self._rpcs.submit(peer.hid, lambda: self._rpc_done(peer))  # after its disconnects

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
