"""Test double of the pyverbs surface the RDMA transport uses ("fake verbs").

**This is not RDMA.** It lets the transport's logic (handshake, slicing, spreading, chained posting,
batched polling, failover, endpoint pool) run on a machine without an RDMA device. It mirrors the
names and call shapes of pyverbs (``device.Context``, ``pd.PD``, ``mr.MR``, ``cq.CQ``, ``qp.QP``,
``wr.SendWR``/``SGE``, ``addr.GID``/``AHAttr``/``GlobalRoute``, ``enums``) for exactly what
``kvpool.transfer.rdma`` calls, nothing more.

How it works:

* Every process is its own "host". Its NICs are named by ``KVPOOL_FAKE_VERBS_NICS``
  (comma-separated, default ``mlx5_0,mlx5_1``) and get random RoCE v2 GIDs.
* Shared state lives in a registry directory (``KVPOOL_FAKE_VERBS_DIR``): one small JSON file per
  NIC (``nic/<gid>``), memory region (``mr/<rkey>``) and queue pair (``qp/<gid>-<qpn>``), and marker
  files for dead NICs (``dead/<gid>``). Processes see each other's state through it.
* ``post_send`` only queues the chain of work requests; a per-context "NIC" thread executes them:
  it checks both NICs are alive, both QPs exist and are connected to each other, the lkey covers
  the local range and the rkey covers the remote range with the right access (else
  ``IBV_WC_REM_ACCESS_ERR``), copies the bytes with ``/proc/<pid>/mem`` (or ``memmove`` in-process)
  and posts a completion for signaled WRs. On an error the QP goes to the error state: the failing
  WR completes with the error and every later WR with ``IBV_WC_WR_FLUSH_ERR``.

Knobs: :func:`kill_nic` / :func:`revive_nic` (any process), :func:`inject_errors` (error
completions on this process's NIC), :func:`drop_qps` (lose endpoints on both sides),
:func:`configure` (sets the environment so child processes inherit it).
"""

from __future__ import annotations

import collections
import errno as _errno
import itertools
import os
import random
import threading
import types
from typing import Any

from kvpool.testing.fake_verbs_registry import (  # noqa: F401 (some are re-exported: pyverbs names, test knobs)
    ENV_DIR,
    ENV_MTU,
    ENV_NICS,
    E,
    PyverbsError,
    PyverbsRDMAError,
    _copy,
    _gid_key,
    _inject_lock,
    _injected,
    _kill_after,
    _path,
    _read,
    _write,
    configure,
    drop_qps,
    enums,
    inject_errors,
    kill_after,
    kill_nic,
    list_nics,
    nic_dead,
    pyverbs_error,
    registry_dir,
    revive_nic,
)


# ----------------------------------------------------------------------------- pyverbs-shaped objects
class GID:
    def __init__(self, val: str | None = None) -> None:
        self.gid = val or ""

    def __str__(self) -> str:
        return self.gid


class GlobalRoute:
    def __init__(
        self,
        dgid: GID | None = None,
        flow_label: int = 0,
        sgid_index: int = 0,
        hop_limit: int = 1,
        traffic_class: int = 0,
    ) -> None:
        self.dgid = dgid
        self.sgid_index = sgid_index
        self.hop_limit = hop_limit
        self.traffic_class = traffic_class


class AHAttr:
    def __init__(
        self,
        dlid: int = 0,
        sl: int = 0,
        src_path_bits: int = 0,
        static_rate: int = 0,
        is_global: int = 0,
        port_num: int = 1,
        gr: GlobalRoute | None = None,
    ) -> None:
        self.dlid = dlid
        self.is_global = is_global
        self.port_num = port_num
        self.gr = gr


class PortAttr:
    def __init__(self, mtu: int) -> None:
        self.state = E.IBV_PORT_ACTIVE
        self.active_mtu = mtu
        self.max_mtu = mtu
        self.lid = 0
        self.gid_tbl_len = 4
        self.link_layer = E.IBV_LINK_LAYER_ETHERNET


_MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}


class DeviceAttr:
    phys_port_cnt = 1
    max_qp_wr = 16384
    max_cqe = 1 << 20
    max_mr_size = 1 << 48


class _Device:
    def __init__(self, name: str) -> None:
        self.name = name.encode()


def get_device_list() -> list[_Device]:
    names = os.environ.get(ENV_NICS, "mlx5_0,mlx5_1")
    registry_dir()  # no registry configured -> same failure shape as "no devices"
    return [_Device(n) for n in names.split(",") if n]


class Context:
    """One fake NIC of this process; runs a thread that executes posted work requests."""

    def __init__(self, name: str | None = None, **_: Any) -> None:
        names = [d.name.decode() for d in get_device_list()]
        if name not in names:
            raise PyverbsRDMAError(f"Failed to open device {name}", _errno.ENODEV)
        self.name = name
        self.mtu = _MTU_ENUM[int(os.environ.get(ENV_MTU, "4096"))]
        ip = random.getrandbits(32)
        v4 = f"ffff:{ip >> 16:04x}:{ip & 0xFFFF:04x}"
        link = f"fe80:0000:0000:0000:{random.getrandbits(16):04x}:{ip >> 16:04x}:00ff:{ip & 0xFFFF:04x}"
        self._gids = [  # index -> (gid, type); RoCE v2 over IPv4 at index 3, as on many mlx5 ports
            (link, E.IBV_GID_TYPE_ROCE_V1),
            (link, E.IBV_GID_TYPE_ROCE_V2),
            (f"0000:0000:0000:0000:0000:{v4}", E.IBV_GID_TYPE_ROCE_V1),
            (f"0000:0000:0000:0000:0000:{v4}", E.IBV_GID_TYPE_ROCE_V2),
        ]
        self.gid = self._gids[3][0]
        self.num_comp_vectors = 1
        _write(_path("nic", _gid_key(self.gid)), {"pid": os.getpid(), "name": name, "gid": self.gid})
        self._work: collections.deque[tuple[QP, list[SendWR]]] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._qps: dict[int, QP] = {}
        self._mrs: dict[int, MR] = {}
        # held from a WR's local-key lookup through its copy, and by MR.close: once close returns
        # no WR touches the region (as ibv_dereg_mr promises)
        self._mr_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"fake-nic-{name}", daemon=True)
        self._thread.start()

    # -- queries
    def query_device(self) -> DeviceAttr:
        return DeviceAttr()

    def query_port(self, port_num: int) -> PortAttr:
        if port_num != 1:
            raise PyverbsRDMAError(f"Failed to query port {port_num}", _errno.EINVAL)
        pa = PortAttr(self.mtu)
        if nic_dead(self.gid):
            pa.state = E.IBV_PORT_DOWN
        return pa

    def query_gid(self, port_num: int, index: int) -> GID:
        if not 0 <= index < len(self._gids):
            raise PyverbsRDMAError(f"Failed to query gid {index} of port {port_num}", _errno.EINVAL)
        return GID(self._gids[index][0])

    def query_gid_type(self, port_num: int, index: int) -> int:
        if not 0 <= index < len(self._gids):
            raise PyverbsRDMAError(f"Failed to query gid type of index {index}", _errno.EINVAL)
        return self._gids[index][1]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        for qp in list(self._qps.values()):
            qp.close()
        for mr in list(self._mrs.values()):
            mr.close()
        try:
            os.unlink(_path("nic", _gid_key(self.gid)))
        except OSError:
            pass

    # -- the "NIC"
    def _queue(self, qp: QP, wrs: list[SendWR]) -> None:
        with self._cv:
            self._work.append((qp, wrs))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._work and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                qp, wrs = self._work.popleft()
            try:
                self._execute(qp, wrs)
            except Exception as exc:  # noqa: BLE001 - never let the fake NIC die silently
                qp._fail(wrs, 0, E.IBV_WC_RETRY_EXC_ERR, f"fake NIC crashed: {exc!r}")

    def _execute(self, qp: QP, wrs: list[SendWR]) -> None:
        if qp.state == E.IBV_QPS_ERR:
            qp._fail(wrs, 0, E.IBV_WC_WR_FLUSH_ERR)
            return
        if qp.state != E.IBV_QPS_RTS:
            qp._fail(wrs, 0, E.IBV_WC_WR_FLUSH_ERR)
            return
        dgid = qp.dest_gid
        # a dead NIC on either side or a lost QP on either side: retries exhausted
        if (
            nic_dead(self.gid)
            or nic_dead(dgid)
            or not os.path.exists(qp._file)
            or not os.path.exists(_path("qp", f"{_gid_key(dgid)}-{qp.dest_qpn}"))
        ):
            qp._fail(wrs, 0, E.IBV_WC_RETRY_EXC_ERR)
            return
        rmrs: dict[int, Any] = {}
        for i, wr in enumerate(wrs):
            with _inject_lock:
                inj = _injected.get(self.name)
                status = inj.pop(0) if inj else E.IBV_WC_SUCCESS
                left = _kill_after.get(self.name)
                if left is not None:
                    if left <= 0:
                        del _kill_after[self.name]
                        kill_nic(self.name, os.getpid())
                        status = E.IBV_WC_RETRY_EXC_ERR
                    else:
                        _kill_after[self.name] = left - 1
            if status != E.IBV_WC_SUCCESS:
                qp._fail(wrs, i, status)
                return
            sge = wr.sg_list[0]
            with self._mr_lock:
                if not self._one(qp, wrs, i, wr, sge, dgid, rmrs):
                    return
            if wr.send_flags & E.IBV_SEND_SIGNALED or qp.sq_sig_all:
                qp._complete(wr, E.IBV_WC_SUCCESS)

    def _one(self, qp: QP, wrs: list[SendWR], i: int, wr: SendWR, sge: SGE, dgid: str, rmrs: dict) -> bool:
        """Check WR ``i``'s keys and copy its bytes (under ``_mr_lock``); False: the chain failed."""
        lmr = self._mrs.get(sge.lkey)
        if lmr is None or not (lmr.addr <= sge.addr and sge.addr + sge.length <= lmr.addr + lmr.length):
            qp._fail(wrs, i, E.IBV_WC_LOC_PROT_ERR)
            return False
        rinfo = rmrs.get(wr.rkey)
        if rinfo is None:
            rinfo = _read(_path("mr", str(wr.rkey)))
            rmrs[wr.rkey] = rinfo
        need = E.IBV_ACCESS_REMOTE_WRITE if wr.opcode == E.IBV_WR_RDMA_WRITE else E.IBV_ACCESS_REMOTE_READ
        if (
            rinfo is None
            or rinfo["gid"] != dgid
            or not rinfo["access"] & need
            or not (rinfo["addr"] <= wr.remote_addr and wr.remote_addr + sge.length <= rinfo["end"])
        ):
            qp._fail(wrs, i, E.IBV_WC_REM_ACCESS_ERR)
            return False
        try:
            _copy(wr.opcode, sge.addr, rinfo["pid"], wr.remote_addr, sge.length)
        except OSError:
            qp._fail(wrs, i, E.IBV_WC_RETRY_EXC_ERR)
            return False
        return True


class PD:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def close(self) -> None:
        pass


_keys = itertools.count(random.randrange(1 << 20, 1 << 30))


class MR:
    """Registers [address, address+length) with ``access``; publishes the rkey in the registry."""

    def __init__(self, pd: PD, length: int, access: int, address: int | None = None, **_: Any) -> None:
        if address is None:
            raise PyverbsRDMAError("fake verbs: MR needs an address", _errno.EINVAL)
        if length <= 0:
            raise PyverbsRDMAError("Failed to register a MR", _errno.EINVAL)
        self.pd = pd
        self.addr = address
        self.length = length
        self.lkey = self.rkey = next(_keys) & 0xFFFFFFFF
        self._file = _path("mr", str(self.rkey))
        _write(
            self._file,
            {
                "pid": os.getpid(),
                "addr": address,
                "end": address + length,
                "access": access,
                "gid": pd.ctx.gid,
            },
        )
        with pd.ctx._mr_lock:
            pd.ctx._mrs[self.lkey] = self

    @property
    def buf(self) -> int:
        return self.addr

    def close(self) -> None:
        with self.pd.ctx._mr_lock:  # waits for a WR copying in it
            self.pd.ctx._mrs.pop(self.lkey, None)
        try:
            os.unlink(self._file)
        except OSError:
            pass


class WC:
    def __init__(self, wr_id: int, status: int, opcode: int, byte_len: int, qp_num: int) -> None:
        self.wr_id = wr_id
        self.status = status
        self.opcode = opcode
        self.byte_len = byte_len
        self.qp_num = qp_num
        self.vendor_err = 0


class CQ:
    def __init__(
        self, ctx: Context, cqe: int, cq_context: Any = None, channel: Any = None, comp_vector: int = 0
    ) -> None:
        self.ctx = ctx
        self.cqe = cqe
        self._q: collections.deque[WC] = collections.deque()

    def _push(self, wc: WC) -> None:
        self._q.append(wc)  # deque.append is atomic

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        out = []
        q = self._q
        while q and len(out) < num_entries:
            out.append(q.popleft())
        return len(out), out

    def close(self) -> None:
        pass


class QPCap:
    def __init__(
        self,
        max_send_wr: int = 1,
        max_recv_wr: int = 10,
        max_send_sge: int = 1,
        max_recv_sge: int = 1,
        max_inline_data: int = 0,
    ) -> None:
        self.max_send_wr = max_send_wr
        self.max_recv_wr = max_recv_wr


class QPInitAttr:
    def __init__(
        self,
        qp_type: int = E.IBV_QPT_RC,
        qp_context: Any = None,
        scq: CQ | None = None,
        rcq: CQ | None = None,
        srq: Any = None,
        cap: QPCap | None = None,
        sq_sig_all: int = 0,
    ) -> None:
        self.qp_type = qp_type
        self.scq = scq
        self.rcq = rcq
        self.cap = cap or QPCap()
        self.sq_sig_all = sq_sig_all


class QPAttr:
    def __init__(self, qp_state: int = E.IBV_QPS_INIT, cur_qp_state: int = E.IBV_QPS_RESET) -> None:
        self.qp_state = qp_state
        self.port_num = 1
        self.pkey_index = 0
        self.qp_access_flags = 0
        self.path_mtu = E.IBV_MTU_1024
        self.dest_qp_num = 0
        self.rq_psn = 0
        self.sq_psn = 0
        self.max_dest_rd_atomic = 0
        self.max_rd_atomic = 0
        self.min_rnr_timer = 0
        self.timeout = 0
        self.retry_cnt = 0
        self.rnr_retry = 0
        self.ah_attr: AHAttr | None = None


_qpns = itertools.count(random.randrange(0x100, 0x7FFFFF))


class QP:
    def __init__(self, pd: PD, init_attr: QPInitAttr, qp_attr: QPAttr | None = None) -> None:
        if init_attr.qp_type != E.IBV_QPT_RC:
            raise PyverbsRDMAError("fake verbs supports RC QPs only", _errno.EOPNOTSUPP)
        self.pd = pd
        self.ctx = pd.ctx
        self.scq = init_attr.scq
        self.sq_sig_all = init_attr.sq_sig_all
        self.max_send_wr = init_attr.cap.max_send_wr
        self.qp_num = next(_qpns) & 0xFFFFFF
        self.state = E.IBV_QPS_RESET
        self.dest_gid = ""
        self.dest_qpn = 0
        self._file = _path("qp", f"{_gid_key(self.ctx.gid)}-{self.qp_num}")
        self.ctx._qps[self.qp_num] = self

    @property
    def qp_state(self) -> int:
        return self.state

    def to_init(self, attr: QPAttr) -> None:
        if self.state != E.IBV_QPS_RESET:
            raise PyverbsRDMAError("Failed to modify QP state to init", _errno.EINVAL)
        self.state = E.IBV_QPS_INIT

    def to_rtr(self, attr: QPAttr) -> None:
        if self.state != E.IBV_QPS_INIT:
            raise PyverbsRDMAError("Failed to modify QP state to RTR", _errno.EINVAL)
        ah = attr.ah_attr
        if ah is None or not ah.is_global or ah.gr is None or ah.gr.dgid is None:
            raise PyverbsRDMAError("Failed to modify QP state to RTR (RoCE needs a GRH)", _errno.EINVAL)
        if not 0 <= ah.gr.sgid_index < 4:
            raise PyverbsRDMAError("Failed to modify QP state to RTR", _errno.EINVAL)
        if attr.path_mtu > self.ctx.mtu:
            raise PyverbsRDMAError("Failed to modify QP state to RTR", _errno.EINVAL)
        self.dest_gid = str(ah.gr.dgid)
        self.dest_qpn = attr.dest_qp_num
        self.state = E.IBV_QPS_RTR
        _write(self._file, {"pid": os.getpid(), "dgid": self.dest_gid, "dqpn": self.dest_qpn})

    def to_rts(self, attr: QPAttr) -> None:
        if self.state != E.IBV_QPS_RTR:
            raise PyverbsRDMAError("Failed to modify QP state to RTS", _errno.EINVAL)
        self.state = E.IBV_QPS_RTS

    def post_send(self, wr: SendWR, bad_wr: Any = None) -> None:
        if self.state not in (E.IBV_QPS_RTS, E.IBV_QPS_ERR):
            raise PyverbsRDMAError("Failed to post send", _errno.EINVAL)
        chain = []
        w: SendWR | None = wr
        while w is not None:
            chain.append(w)
            w = w.next_wr
        self.ctx._queue(self, chain)

    def _complete(self, wr: SendWR, status: int) -> None:
        op = E.IBV_WC_RDMA_WRITE if wr.opcode == E.IBV_WR_RDMA_WRITE else E.IBV_WC_RDMA_READ
        self.scq._push(WC(wr.wr_id, status, op, wr.sg_list[0].length if status == 0 else 0, self.qp_num))

    def _fail(self, wrs: list[SendWR], i: int, status: int, _why: str = "") -> None:
        self.state = E.IBV_QPS_ERR
        self._complete(wrs[i], status)
        for w in wrs[i + 1 :]:
            self._complete(w, E.IBV_WC_WR_FLUSH_ERR)

    def close(self) -> None:
        self.ctx._qps.pop(self.qp_num, None)
        self.state = E.IBV_QPS_ERR
        try:
            os.unlink(self._file)
        except OSError:
            pass


class SGE:
    __slots__ = ("addr", "length", "lkey")

    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr = addr
        self.length = length
        self.lkey = lkey


class SendWR:
    __slots__ = ("wr_id", "opcode", "num_sge", "sg_list", "send_flags", "next_wr", "rkey", "remote_addr")

    def __init__(
        self,
        wr_id: int = 0,
        opcode: int = 0,
        num_sge: int = 0,
        imm_data: int = 0,
        sg: list[SGE] | None = None,
        send_flags: int = E.IBV_SEND_SIGNALED,
        next_wr: SendWR | None = None,
    ) -> None:
        self.wr_id = wr_id
        self.opcode = opcode
        self.num_sge = num_sge
        self.sg_list = sg or []
        self.send_flags = send_flags
        self.next_wr = next_wr
        self.rkey = 0
        self.remote_addr = 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey = rkey
        self.remote_addr = addr


# module-shaped namespaces, as ``pyverbs.<module>``
device = types.SimpleNamespace(Context=Context, get_device_list=get_device_list)
pd = types.SimpleNamespace(PD=PD)
mr = types.SimpleNamespace(MR=MR)
cq = types.SimpleNamespace(CQ=CQ, WC=WC)
qp = types.SimpleNamespace(QP=QP, QPCap=QPCap, QPInitAttr=QPInitAttr, QPAttr=QPAttr)
wr = types.SimpleNamespace(SendWR=SendWR, SGE=SGE)
addr = types.SimpleNamespace(GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute)
