"""RDMA transport: RC queue pairs over every usable NIC, sliced requests, failover.

Data path (one progress thread per engine):

* ``submit`` (caller's thread) validates every request against local registrations and the peer's
  published MRs, cuts it into ``rdma_slice_size`` slices (a tail smaller than half a slice is merged
  into the previous one) and assigns each slice a (local NIC, remote NIC) pair: round-robin over the
  preferred NICs of the local memory's location and of the remote buffer's location (rail-aligned:
  slice k goes local pref[k % L] -> remote pref[k % R]); paused NICs are skipped while any preferred
  NIC is healthy, secondary NICs are used only when none is.
* endpoints are made on demand by a few RPC threads (QP handshake over the peer's RPC port, one
  RPC at a time per peer; the endpoint's slices wait meanwhile). The progress thread chains up to
  ``rdma_chain`` slices per ``post_send`` (linked ``SendWR`` list, only the last one signaled) and polls
  every CQ with ``poll(64)``. RC completes in order, so a chain's one completion covers it; an error
  completion at WR i means WRs before i succeeded.
* failures: an error completion or a broken endpoint drops the endpoint on both sides (re-made on
  next use), pauses both NICs for ``rdma_nic_pause_s`` and retries the unfinished slices on the next
  pair (preferred lists first, then secondary, then paused ones as probes) up to
  ``rdma_retry_limit`` attempts per slice. Remote-access errors are not retried. A request is FAILED
  only when a slice exhausts its attempts; the reason is kept.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from typing import Any

from kvpool.errors import (
    InvalidArgument,
    ProtocolUnavailable,
    RemoteAccessError,
    SegmentNotFound,
)
from kvpool.transfer.rdma.connections import RESTARTED, Connections
from kvpool.transfer.rdma.endpoints import SievePool
from kvpool.transfer.rdma.nics import (
    MEMLOCK_HINT,
    MemoryRegions,
    memlock_limit,
    open_nics,
)
from kvpool.transfer.rdma.passive import PassiveQps
from kvpool.transfer.rdma.state import Endpoint, Peer, Req, Slice, slice_plan
from kvpool.transfer.rdma.strands import Strands
from kvpool.transfer.rdma.topology import load_matrix, matrix_nics, nics_for
from kvpool.transfer.rdma.verbs import Verbs, as_verbs, load_verbs
from kvpool.transfer.transport import READ, Requests, Transport
from kvpool.transfer.types import SegmentDescriptor, TransferState

log = logging.getLogger("kvpool.transfer.rdma")
log_engine = logging.getLogger("kvpool.transfer")  # where protocol="auto" says why it skips RDMA

_CHAIN_SHIFT = 1024  # wr_id = chain_id * 1024 + index in chain
_RPC_THREADS = 4  # threads making connect/disconnect RPCs (one at a time per peer)
_RPCS_PER_PEER = 256  # RPCs that may wait for one peer (connects: one per endpoint key)
_WARNED_MEMLOCK = False
_AUTO_RDMA_SKIP: str | None = None  # why protocol="auto" does not use RDMA in this process (cached)


def start_rdma(
    cfg: Any, instance: int, batches: Any, verbs: Any = None, origin: str = ""
) -> RdmaTransport | None:
    """The RDMA transport of an engine with ``cfg.protocol`` "rdma" or "auto"; under "auto" None
    when it cannot run here (no device: logged once per process, and not probed again)."""
    global _AUTO_RDMA_SKIP
    auto = cfg.protocol == "auto"
    if auto and verbs is None:
        if _AUTO_RDMA_SKIP is not None:
            return None
        if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
            _AUTO_RDMA_SKIP = "no RDMA device in /sys/class/infiniband"
            log_engine.info(
                "protocol=auto: not using RDMA (%s); TCP and same-host paths only", _AUTO_RDMA_SKIP
            )
            return None
    try:
        return RdmaTransport(cfg, cfg.hostname, instance, batches, verbs=verbs, origin=origin)
    except ProtocolUnavailable as exc:
        if not auto:
            raise
        if verbs is None:
            _AUTO_RDMA_SKIP = str(exc)
        log_engine.info("protocol=auto: not using RDMA (%s); TCP and same-host paths only", exc)
        return None


class RdmaTransport(Connections, Transport):
    """RDMA data path of a :class:`~kvpool.transfer.engine.TransferEngine` (see the module docstring;
    endpoints and the connect RPC are in :class:`~kvpool.transfer.rdma.connections.Connections`).

    Args:
        cfg: the engine's :class:`~kvpool.config.TransferConfig` (``rdma_*`` fields, ``secret``...).
        hostname: address of the QP-connect RPC server.
        instance: the engine's incarnation (peers notice restarts by it).
        batches: the engine's batch table; requests complete their slots from the progress thread.
        verbs: the verbs layer (a :class:`~kvpool.transfer.rdma.verbs.Verbs` or a module with
            pyverbs' ``device, pd, mr, cq, qp, wr, addr, enums, pyverbs_error``); None = pyverbs.
            Tests pass :mod:`kvpool.testing.fake_verbs` here.
        origin: the engine's segment name, sent with each connect: a target closes the QPs of our
            previous instance when it sees a new one from the same origin.
    """

    name = "rdma"
    locations = frozenset({"cpu", "cuda"})

    def __init__(
        self, cfg: Any, hostname: str, instance: int, batches: Any, verbs: Any = None, origin: str = ""
    ) -> None:
        self.cfg = cfg
        self.origin = origin
        self.batches = batches
        self.V: Verbs = load_verbs() if verbs is None else as_verbs(verbs)
        self.E = self.V.enums
        self.instance = instance
        self.slice_size = cfg.rdma_slice_size
        self.chain_max = min(cfg.rdma_chain, _CHAIN_SHIFT)
        self.sq_depth = cfg.rdma_sq_depth
        self.nics = open_nics(self.V, cfg)
        self.nic_names = [n.name for n in self.nics]
        self.topology = self._topology(cfg)
        lim = memlock_limit()
        global _WARNED_MEMLOCK
        if self.V.kind == "pyverbs" and lim != -1 and lim < (64 << 20) and not _WARNED_MEMLOCK:
            _WARNED_MEMLOCK = True
            log.warning("RLIMIT_MEMLOCK is %d bytes: large registrations will fail; %s", lim, MEMLOCK_HINT)
        self.regions = MemoryRegions(self.V, self.nics)
        self._peers: dict[int, Peer] = {}
        self._suspect: set[int] = set()  # see peer_gone
        self._lock = threading.Lock()
        self._pool: SievePool[tuple, Endpoint] = SievePool(
            cfg.rdma_max_endpoints, self._on_evict, busy=lambda ep: ep.outstanding > 0 or bool(ep.pending)
        )
        self._chains: dict[int, Endpoint] = {}
        self._chain_ids = itertools.count(1)
        self._incoming: collections.deque[Slice] = collections.deque()
        self._retry: collections.deque[Slice] = collections.deque()
        # initiators' QP ends: per initiator at most 2x the endpoints it may want to us (its NICs,
        # assumed <= 16, x ours; or its endpoint cap), 16x our endpoint cap in all
        per_ini = 2 * min(cfg.rdma_max_endpoints, 16 * len(self.nics))
        self._passive = PassiveQps(
            self.V, self.nics, self.sq_depth, instance, per_ini, 16 * cfg.rdma_max_endpoints
        )
        self._paused: dict[int, float] = {}
        self._rr = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self.nic_bytes = [0] * len(self.nics)  # bytes completed per local NIC
        self._wake = threading.Event()
        self._closed = False
        self._calls: collections.deque[Any] = collections.deque()
        self._rpcs = Strands(_RPC_THREADS, _RPCS_PER_PEER)
        self._connecting: dict[tuple, list[Slice]] = {}
        self._connected: collections.deque[tuple[tuple, Peer, Any, Any, str]] = collections.deque()
        self._active: list[Endpoint] = []
        from kvpool._rpc_server import RpcServer

        self._rpc = RpcServer(hostname, 0, self._handle_rpc, lambda: None, tick_s=0.5, secret=cfg.secret)
        self._rpc_thread = threading.Thread(
            target=self._rpc.serve_forever, name="kvpool-rdma-rpc", daemon=True
        )
        self._rpc_thread.start()
        host = f"[{hostname}]" if ":" in hostname else hostname
        self.rpc_addr = f"{host}:{self._rpc.port}"
        self._thread = threading.Thread(target=self._progress, name="kvpool-rdma", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ devices
    def _topology(self, cfg: Any) -> dict[str, list[list[str]]]:
        matrix = load_matrix(cfg.rdma_topology, allowed=self.nic_names)
        if not set(matrix_nics(matrix)) & set(self.nic_names):
            matrix = {"cpu:0": [list(self.nic_names), []]}  # sysfs knows none of them (containers)
        return matrix

    # ------------------------------------------------------------------ descriptor
    def describe(self) -> dict[str, Any]:
        return {"rdma": self.descriptor_info()}

    def reaches(self, desc: SegmentDescriptor, local: str = "cpu", remote: str = "cpu") -> bool:
        return desc.rdma is not None  # GPU memory on either side is registered directly (GPUDirect)

    def attach(self, handle: int, name: str, desc: SegmentDescriptor) -> None:
        assert desc.rdma is not None
        self.add_peer(handle, name, desc.rdma, desc.buffers)

    def detach(self, handle: int) -> None:
        self.remove_peer(handle)

    def descriptor_info(self) -> dict[str, Any]:
        return {
            "rpc": self.rpc_addr,
            "instance": self.instance,
            "nics": [n.info() for n in self.nics],
            "mrs": self.regions.published(),
            "topology": self.topology,
        }

    def register(
        self, addr: int, length: int, location: str, remote: bool, writable: bool = True, dmabuf: Any = None
    ) -> None:
        """Memory regions on every NIC; GPU memory directly (see :meth:`MemoryRegions.register`)."""
        self.regions.register(addr, length, location, remote, writable, dmabuf)

    def unregister(self, addr: int) -> None:
        self.regions.unregister(addr)

    # ------------------------------------------------------------------ peers
    def add_peer(self, hid: int, name: str, info: dict[str, Any], buffers: list[Any]) -> None:
        """Called by the engine (``attach``) on every open/refresh of a segment. A new instance
        fails every slice planned for the old one (its addresses and rkeys mean nothing to the new
        process: posted there they would overwrite its memory)."""
        with self._lock:
            self._suspect.discard(hid)  # a fresh descriptor (see peer_gone)
            peer = self._peers.get(hid)
            if peer is None:
                self._peers[hid] = Peer(hid, name, info, buffers)
                return
            restarted = peer.instance != info.get("instance")
            peer.update(info, buffers)
        if restarted:
            reason = f"{RESTARTED} ({peer.name}: instance changed)"
            self._run_in_progress(lambda: self._drop_peer(peer, reason, TransferState.FAILED))

    def remove_peer(self, hid: int) -> None:
        """Called by the engine (``detach``) on close_segment: the peer's unfinished requests end
        CANCELED, as on the native path."""
        with self._lock:
            peer = self._peers.pop(hid, None)
            self._suspect.discard(hid)
            if peer is not None:
                peer.closed = True
        if peer is not None:
            reason = f"segment {peer.name} closed"
            self._run_in_progress(lambda: self._drop_peer(peer, reason, TransferState.CANCELED))

    def has_peer(self, hid: int) -> bool:
        return hid in self._peers

    def _run_in_progress(self, fn: Any) -> None:
        self._calls.append(fn)
        self._wake.set()

    # ------------------------------------------------------------------ submit
    def submit(
        self, batch_id: int, reqs: Requests, stage_wait_s: float | None = None, waited: bool = False
    ) -> None:
        """Validate every request, take its batch slot, queue its slices for the progress thread."""
        E = self.E
        now = time.monotonic()
        planned = []
        for i, (op, laddr, hid, raddr, length) in enumerate(zip(*reqs, strict=True)):
            with self._lock:  # the instance and the region from the same descriptor (add_peer)
                peer = self._peers.get(hid)
                if peer is None:
                    raise SegmentNotFound(f"request {i}: segment {hid} is not open over RDMA")
                inst = peer.instance
                rreg = peer.region(raddr, length)
            lreg = self.regions.local(laddr, length)
            if rreg is None:
                raise RemoteAccessError(
                    f"request {i}: remote range {raddr:#x}+{length} is outside the remote-accessible "
                    f"memory of {peer.name}"
                )
            if op == READ and not lreg[7]:
                raise InvalidArgument(f"request {i}: READ into read-only memory at {laddr:#x}")
            planned.append((op, laddr, peer, inst, raddr, length, lreg, rreg))
        base = self.batches.reserve(batch_id, reqs.lens) if planned else 0  # InvalidArgument when full
        slices: list[Slice] = []
        for k, (op, laddr, peer, inst, raddr, length, lreg, rreg) in enumerate(planned):
            req = Req(batch_id, base + k, peer, inst, lreg[8])
            wop = E.IBV_WR_RDMA_READ if op == READ else E.IBV_WR_RDMA_WRITE
            lpref, lsec = self._local_nics(lreg[4], now)
            rpref, rsec = self._remote_nics(peer, rreg[3], now)
            req.pairs = [(a, b) for a in lpref + lsec for b in rpref + rsec]
            plan = slice_plan(length, self.slice_size)
            req.remaining = len(plan)
            start = self._rr
            self._rr += len(plan)
            nl, nr = len(lpref), len(rpref)
            lk, rk = lreg[2], rreg[2]
            for k, (off, ln) in enumerate(plan):
                j = start + k
                slices.append(
                    Slice(req, wop, laddr + off, raddr + off, ln, lk, rk, lpref[j % nl], rpref[j % nr])
                )
        with self._lock:
            self._incoming.extend(slices)
        self.stats["slices"] += len(slices)
        self._wake.set()

    def _healthy_split(
        self, names: list[str], pref: list[str], sec: list[str], paused: dict[int, float], now: float
    ) -> tuple[list[int], list[int]]:
        idx = {n: i for i, n in enumerate(names)}
        p = [idx[n] for n in pref if n in idx]
        s = [idx[n] for n in sec if n in idx]
        hp = [i for i in p if paused.get(i, 0) <= now]
        hs = [i for i in s if paused.get(i, 0) <= now]
        if hp:
            return hp, [i for i in p if i not in hp] + s
        if hs:
            return hs, p + [i for i in s if i not in hs]
        return p or s, s if p else []

    def _local_nics(self, location: str, now: float) -> tuple[list[int], list[int]]:
        pref, sec = nics_for(self.topology, location, self.nic_names)
        return self._healthy_split(self.nic_names, pref, sec, self._paused, now)

    def _remote_nics(self, peer: Peer, location: str, now: float) -> tuple[list[int], list[int]]:
        pref, sec = nics_for(peer.topology, location, peer.nic_names)
        return self._healthy_split(peer.nic_names, pref, sec, peer.paused, now)

    # ------------------------------------------------------------------ progress thread
    def _progress(self) -> None:
        idle = 0
        while not self._closed:
            busy = False
            while self._calls:
                try:
                    self._calls.popleft()()
                except Exception:  # noqa: BLE001
                    log.exception("rdma progress call failed")
            if self._connected:
                busy = True
                self._on_connected()
            if self._incoming or self._retry:
                busy = True
                self._dispatch()
            for ep in list(self._active):
                if ep.pending and ep.outstanding < self.sq_depth:
                    self._post(ep)
                    busy = True
            self._active = [ep for ep in self._active if ep.pending]
            for nic in self.nics:
                n, wcs = nic.cq.poll(64)
                if n:
                    busy = True
                    self._on_completions(wcs)
            if busy:
                idle = 0
                continue
            idle += 1
            if self._chains:
                time.sleep(0 if idle < 50 else 0.0001)  # completions due: poll again soon
            else:
                self._wake.wait(0.05)
                self._wake.clear()

    def _dispatch(self) -> None:
        """Give new and retried slices to their endpoints (making endpoints on demand)."""
        for q in (self._incoming, self._retry):
            while q:
                s = q.popleft()
                if s.req.state != TransferState.PENDING or self._stale(s):
                    self._slice_dropped(s)
                    continue
                ep = self._endpoint(s)
                if ep is None:
                    continue  # waits for a connect (or was failed)
                if ep not in self._active:
                    self._active.append(ep)
                ep.pending.append(s)

    def _post(self, ep: Endpoint) -> None:
        """Post ``ep``'s pending slices in chains. Each chain is built and posted under the local
        registrations' lock: a slice whose local registration was unregistered since its submit is
        never posted (its lkeys may belong to a newer registration by then: real HCAs reuse mkey
        indices, and the bytes would land there); its request fails."""
        SendWR, SGE = self.V.wr.SendWR, self.V.wr.SGE
        signaled = self.E.IBV_SEND_SIGNALED
        pending = ep.pending
        while pending and ep.outstanding < self.sq_depth:
            n = min(len(pending), self.chain_max, self.sq_depth - ep.outstanding)
            chain = []
            broken = None
            with self.regions.lock:  # unregister marks a region dead under it, then closes its MRs
                for _ in range(n):
                    s = pending.popleft()
                    if s.req.state != TransferState.PENDING or self._stale(s):  # failed, or planned for
                        self._slice_dropped(s)  # an incarnation that is gone: never posted
                    elif not s.req.live[0]:
                        self._fail_req(
                            s.req,
                            f"local memory at {s.laddr:#x} was unregistered while the transfer was queued",
                        )
                        self._slice_dropped(s)
                    elif s.req.instance != ep.instance:  # a QP to an older incarnation: remade at dispatch
                        self._retry.append(s)
                    else:
                        chain.append(s)
                if not chain:
                    continue
                n = len(chain)
                cid = next(self._chain_ids)
                base = cid * _CHAIN_SHIFT
                li, ri = ep.nic.index, ep.rnic
                nxt = None
                keep = []
                for i in range(n - 1, -1, -1):
                    s = chain[i]
                    wr = SendWR(
                        wr_id=base + i,
                        opcode=s.op,
                        num_sge=1,
                        sg=[SGE(s.laddr, s.length, s.lkeys[li])],
                        send_flags=signaled if nxt is None else 0,
                        next_wr=nxt,
                    )
                    wr.set_wr_rdma(s.rkeys[ri], s.raddr)
                    keep.append(wr)
                    nxt = wr
                ep.inflight[cid] = chain
                ep.outstanding += n
                self._chains[cid] = ep
                try:
                    ep.qp.post_send(nxt)
                except Exception as exc:  # noqa: BLE001 - QP in a bad state, SQ full
                    broken = f"post_send on {ep.nic.name}: {exc}"
            if broken is not None:
                self._break(ep, broken)
                return
            self.stats["posts"] += 1

    def _on_completions(self, wcs: list[Any]) -> None:
        ok = self.E.IBV_WC_SUCCESS
        for wc in wcs:
            cid, idx = divmod(wc.wr_id, _CHAIN_SHIFT)
            ep = self._chains.pop(cid, None)
            if ep is None:
                continue  # flush of a chain already handled
            chain = ep.inflight.pop(cid)
            ep.outstanding -= len(chain)
            if wc.status == ok:
                nb = 0
                for s in chain:
                    nb += s.length
                    self._slice_ok(s)
                self.nic_bytes[ep.nic.index] += nb
                continue
            for s in chain[:idx]:  # RC: everything before the failed WR was executed
                self._slice_ok(s)
            reason = (
                f"{self._wc_text(wc.status)} on {ep.nic.name} -> {ep.peer.name}/{ep.peer.nic_names[ep.rnic]}"
            )
            self.stats["error_completions"] += 1
            if wc.status in (self.E.IBV_WC_REM_ACCESS_ERR, self.E.IBV_WC_LOC_PROT_ERR):
                # not a path problem (an rkey or bounds refused there; a local MR closed by
                # unregister here, while the slice was queued): no retry, no NIC paused
                if wc.status == self.E.IBV_WC_LOC_PROT_ERR:
                    reason += " (local memory unregistered while the transfer was in flight?)"
                else:
                    reason = f"remote access error: {reason}"
                self._fail_req(chain[idx].req, reason)
                self._slice_dropped(chain[idx])
                self._retry.extend(chain[idx + 1 :])
                self._break(ep, reason, penalize=False)
            elif wc.status == self.E.IBV_WC_WR_FLUSH_ERR:
                for s in chain[idx:]:
                    self._retry.append(s)  # flushed after another WR's error: not this slice's fault
                self._break(ep, reason, penalize=False)
            else:
                for s in chain[idx:]:
                    self._fail_slice(s, reason)
                self._break(ep, reason)

    def _wc_text(self, status: int) -> str:
        E = self.E
        names = {
            E.IBV_WC_RETRY_EXC_ERR: "transport retry counter exceeded (link or remote NIC down?)",
            E.IBV_WC_REM_ACCESS_ERR: "remote access error (rkey or bounds)",
            E.IBV_WC_WR_FLUSH_ERR: "work request flushed",
            E.IBV_WC_LOC_PROT_ERR: "local protection error",
        }
        return names.get(status, f"work completion status {status}")

    # ------------------------------------------------------------------ slices and requests
    def _slice_ok(self, s: Slice) -> None:
        req = s.req
        req.done_bytes += s.length
        req.remaining -= 1
        if req.remaining == 0 and req.state == TransferState.PENDING:
            self._finish(req, TransferState.COMPLETED, None)

    def _slice_dropped(self, s: Slice) -> None:
        s.req.remaining -= 1

    def _fail_slice(self, s: Slice, reason: str) -> None:
        """Retry ``s`` on the next path, or fail its request after ``rdma_retry_limit`` attempts."""
        req = s.req
        if req.state != TransferState.PENDING:
            self._slice_dropped(s)
            return
        s.attempts += 1
        self.stats["retries"] += 1
        if s.attempts > self.cfg.rdma_retry_limit:
            self._fail_req(req, f"every path failed ({s.attempts} attempts); last: {reason}")
            self._slice_dropped(s)
            return
        now = time.monotonic()
        cur = (s.lnic, s.rnic)
        pairs = req.pairs
        k = pairs.index(cur) + 1 if cur in pairs else 0
        order = pairs[k:] + pairs[:k]
        peer = req.peer
        healthy = [p for p in order if self._paused.get(p[0], 0) <= now and peer.paused.get(p[1], 0) <= now]
        nxt = healthy[0] if healthy else (next((p for p in order if p != cur), cur))
        s.lnic, s.rnic = nxt
        self._retry.append(s)

    def _fail_req(self, req: Req, reason: str, state: TransferState = TransferState.FAILED) -> None:
        if req.state == TransferState.PENDING:
            self._finish(req, state, reason)

    def _stale(self, s: Slice) -> bool:
        """Whether ``s`` was planned for an incarnation of its peer that is gone (restarted or
        closed); its request is then failed (canceled when closed). Progress thread."""
        req, peer = s.req, s.req.peer
        if peer.closed:
            self._fail_req(req, f"segment {peer.name} closed", TransferState.CANCELED)
            return True
        if req.instance != peer.instance:
            self._fail_req(req, f"{RESTARTED} ({peer.name}: instance changed)")
            return True
        return False

    def _finish(self, req: Req, state: TransferState, reason: str | None) -> None:
        req.error = reason
        req.state = state
        self.batches.finish(req.batch_id, req.slot, req.done_bytes, reason, state)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)
        self._rpcs.close()  # a running RPC ends by its deadline, then closes its connection
        self._cancel_pending()
        self._discard_connected()
        self._rpc.stop()
        for ep in self._pool.values():
            try:
                ep.qp.close()
            except Exception:  # noqa: BLE001
                pass
        self._passive.close()
        self.regions.close()
        for nic in self.nics:
            try:
                nic.ctx.close()
            except Exception:  # noqa: BLE001
                pass
        for peer in self._peers.values():
            if peer.rpc is not None:
                peer.rpc.try_close()  # not waiting for a call in flight (it closes it after)

    def _cancel_pending(self) -> None:
        """After the progress thread stopped: every unfinished request ends CANCELED."""
        queued = [self._incoming, self._retry, *self._connecting.values()]
        for ep in self._pool.values():
            queued.append(ep.pending)
            queued.extend(ep.inflight.values())
        reqs = {id(s.req): s.req for q in queued for s in q}
        for req in reqs.values():
            if req.state == TransferState.PENDING:
                self._finish(req, TransferState.CANCELED, "engine shut down")

    def __del__(self) -> None:  # pragma: no cover
        if os is not None and not getattr(self, "_closed", True):
            self._closed = True
