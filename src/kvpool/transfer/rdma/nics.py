"""RDMA devices and memory: opening NICs (port, GID, MTU), queue pairs, memory regions.

Used by :mod:`kvpool.transfer.rdma.transport`; everything goes through the verbs layer it is given
(:class:`~kvpool.transfer.rdma.verbs.Verbs`: real pyverbs or an injected implementation).
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import resource
import threading
from typing import Any

from kvpool.errors import AddressNotRegistered, ProtocolUnavailable, RdmaConnectError, RegistrationError
from kvpool.transfer.rdma.verbs import Verbs

log = logging.getLogger("kvpool.transfer.rdma")

_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_MTU_ENUM = {v: k for k, v in _MTU_BYTES.items()}
_V4_PREFIX = "0000:0000:0000:0000:0000:ffff:"
MEMLOCK_HINT = (
    "the locked-memory limit (RLIMIT_MEMLOCK, `ulimit -l`) is too low for RDMA registration: raise it "
    "(`ulimit -l unlimited`, `LimitMEMLOCK=infinity` in a systemd unit, `memlock unlimited` in "
    "/etc/security/limits.conf, `docker run --ulimit memlock=-1`)"
)
GPU_REG_HINT = (
    "registering GPU memory needs GPUDirect RDMA: the nvidia-peermem kernel module (`modprobe "
    "nvidia-peermem`) or DMA-BUF support (Linux >= 5.12, rdma-core >= 34, an open NVIDIA kernel driver)"
)


def memlock_limit() -> int:
    """Soft RLIMIT_MEMLOCK in bytes (-1 = unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return -1 if soft == resource.RLIM_INFINITY else soft


class Nic:
    """One opened device port: context, PD, CQ and its address (GID/LID/MTU)."""

    def __init__(
        self,
        index: int,
        name: str,
        ctx: Any,
        pd: Any,
        cq: Any,
        port: int,
        gid_index: int,
        gid: str,
        lid: int,
        mtu: int,
        ethernet: bool,
    ) -> None:
        self.index = index
        self.name = name
        self.ctx = ctx
        self.pd = pd
        self.cq = cq
        self.port = port
        self.gid_index = gid_index
        self.gid = gid
        self.lid = lid
        self.mtu = mtu
        self.ethernet = ethernet

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gid": self.gid,
            "lid": self.lid,
            "port": self.port,
            "mtu": self.mtu,
            "gid_index": self.gid_index,
            "ethernet": self.ethernet,
        }


def open_nics(V: Verbs, cfg: Any) -> list[Nic]:
    """Open port 1 of every allowed device that is active (ProtocolUnavailable saying why when none is)."""
    E = V.enums
    try:
        devs = V.device.get_device_list()
    except Exception as exc:  # noqa: BLE001 - pyverbs raises PyverbsRDMAError when none
        raise ProtocolUnavailable(
            f"no RDMA device: listing devices failed ({exc}); check that an RDMA NIC and its "
            "provider (rdma-core, ibverbs-providers) are installed: `ibv_devices` should list it"
        ) from None
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs]
    if not names:
        raise ProtocolUnavailable("no RDMA device found (`ibv_devices` lists none)")
    if cfg.devices:
        missing = [d for d in cfg.devices if d not in names]
        if missing:
            log.warning("RDMA devices %s in the allow-list do not exist (have %s)", missing, names)
        names = [n for n in names if n in cfg.devices]
        if not names:
            raise ProtocolUnavailable(f"none of the allowed RDMA devices {cfg.devices} exists")
    nics: list[Nic] = []
    why: list[str] = []
    for name in names:
        try:
            ctx = V.device.Context(name=name)
            port = 1
            pattr = ctx.query_port(port)
            if pattr.state != E.IBV_PORT_ACTIVE:
                why.append(f"{name}: port {port} is not active")
                ctx.close()
                continue
            ethernet = pattr.link_layer == E.IBV_LINK_LAYER_ETHERNET
            gid_index = choose_gid_index(E, ctx, port, pattr, ethernet, cfg.rdma_gid_index)
            gid = str(ctx.query_gid(port, gid_index))
            mtu = pattr.active_mtu
            if cfg.rdma_mtu is not None:
                mtu = _MTU_ENUM[cfg.rdma_mtu]
            pd = V.pd.PD(ctx)
            cq = V.cq.CQ(ctx, max(1024, cfg.rdma_sq_depth * 16), None, None, 0)
            nics.append(Nic(len(nics), name, ctx, pd, cq, port, gid_index, gid, pattr.lid, mtu, ethernet))
        except ProtocolUnavailable as exc:
            why.append(f"{name}: {exc}")
        except Exception as exc:  # noqa: BLE001 - pyverbs errors
            why.append(f"{name}: {exc}")
    if not nics:
        raise ProtocolUnavailable("no usable RDMA device: " + "; ".join(why))
    for w in why:
        log.warning("RDMA device skipped: %s", w)
    return nics


def choose_gid_index(E: Any, ctx: Any, port: int, pattr: Any, ethernet: bool, override: int | None) -> int:
    """RoCE: the RoCE v2 entry with an IPv4-mapped address, else the first RoCE v2, else 0."""
    if override is not None:
        try:
            ctx.query_gid(port, override)
        except Exception as exc:  # noqa: BLE001
            raise ProtocolUnavailable(
                f"rdma_gid_index={override} is not valid on this port ({exc})"
            ) from None
        return override
    if not ethernet:
        return 0
    first_v2 = None
    for i in range(getattr(pattr, "gid_tbl_len", 16)):
        try:
            gid = str(ctx.query_gid(port, i))
            gtype = ctx.query_gid_type(port, i)
        except Exception:  # noqa: BLE001 - holes in the table
            continue
        if gid.replace("0", "").replace(":", "") == "":
            continue
        if gtype == E.IBV_GID_TYPE_ROCE_V2:
            if gid.startswith(_V4_PREFIX):
                return i
            if first_v2 is None:
                first_v2 = i
    if first_v2 is not None:
        return first_v2
    raise ProtocolUnavailable(
        "no RoCE v2 GID on this port: configure an IP address on the NIC's netdev, or set rdma_gid_index"
    )


def make_qp(V: Verbs, nic: Nic, sq_depth: int) -> Any:
    """An RC queue pair on ``nic`` in the INIT state."""
    E = V.enums
    cap = V.qp.QPCap(max_send_wr=sq_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    init = V.qp.QPInitAttr(qp_type=E.IBV_QPT_RC, scq=nic.cq, rcq=nic.cq, cap=cap, sq_sig_all=0)
    qp = V.qp.QP(nic.pd, init)
    attr = V.qp.QPAttr(qp_state=E.IBV_QPS_INIT)
    attr.port_num = nic.port
    attr.pkey_index = 0
    attr.qp_access_flags = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
    try:
        qp.to_init(attr)
    except Exception as exc:  # noqa: BLE001
        qp.close()
        raise RdmaConnectError(f"QP on {nic.name}: RESET->INIT failed ({exc})") from None
    return qp


def qp_connect(V: Verbs, nic: Nic, qp: Any, remote: dict[str, Any], psn: int) -> None:
    """INIT -> RTR -> RTS towards ``remote`` = {qpn, psn, gid, lid, mtu}."""
    E = V.enums
    mtu = min(nic.mtu, int(remote["mtu"]))
    attr = V.qp.QPAttr(qp_state=E.IBV_QPS_RTR)
    attr.path_mtu = mtu
    attr.dest_qp_num = int(remote["qpn"])
    attr.rq_psn = int(remote["psn"])
    attr.max_dest_rd_atomic = 16
    attr.min_rnr_timer = 12
    gr = V.addr.GlobalRoute(dgid=V.addr.GID(remote["gid"]), sgid_index=nic.gid_index, hop_limit=64)
    attr.ah_attr = V.addr.AHAttr(
        dlid=int(remote["lid"]),
        is_global=1 if nic.ethernet or remote.get("ethernet") else 0,
        port_num=nic.port,
        gr=gr,
    )
    try:
        qp.to_rtr(attr)
    except Exception as exc:  # noqa: BLE001
        mtus = (
            f"path MTU {_MTU_BYTES.get(mtu, mtu)} (local {_MTU_BYTES.get(nic.mtu, nic.mtu)}, remote "
            f"{_MTU_BYTES.get(int(remote['mtu']), remote['mtu'])})"
        )
        raise RdmaConnectError(
            f"QP on {nic.name}: INIT->RTR failed ({exc}); check the GID index (using {nic.gid_index}, "
            f"override with rdma_gid_index; `show_gids` lists RoCE v2 entries), the {mtus} - it must not "
            "exceed either port's active MTU (set rdma_mtu) - and that both NICs share a network"
        ) from None
    attr = V.qp.QPAttr(qp_state=E.IBV_QPS_RTS)
    attr.timeout = 14
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    attr.sq_psn = psn
    attr.max_rd_atomic = 16
    try:
        qp.to_rts(attr)
    except Exception as exc:  # noqa: BLE001
        raise RdmaConnectError(f"QP on {nic.name}: RTR->RTS failed ({exc})") from None


class MemoryRegions:
    """This engine's registrations as memory regions on every NIC (sorted; one lkey/rkey per NIC).

    Each entry carries ``live``, a one-element list set to False under :attr:`lock` when it is
    unregistered, before its MRs close. The progress thread posts a request's slices only under
    :attr:`lock` and only while the ``live`` of the local registration the request was planned on
    is True: a slice queued before an unregister is never posted with that registration's lkeys,
    which a later registration may be handed again (real HCAs reuse mkey indices).
    """

    def __init__(self, V: Verbs, nics: list[Nic]) -> None:
        self.V = V
        self.nics = nics
        self.lock = threading.Lock()  # held by the progress thread from the live check to post_send
        self._reg_starts: list[int] = []
        # (start, end, lkeys per NIC, rkeys per NIC, location, remote_accessible, MRs, writable, live)
        self._regs: list[tuple[int, int, list[int], list[int], str, bool, list[Any], bool, list[bool]]] = []

    def register(
        self,
        addr: int,
        length: int,
        location: str,
        remote: bool,
        writable: bool = True,
        dmabuf: Any = None,
    ) -> None:
        """Register [addr, addr+length) on every NIC.

        GPU memory (``location`` ``cuda:N``) is registered as is: a plain MR on the device pointer
        works when GPUDirect peer memory (nvidia-peermem) is loaded; otherwise, when ``dmabuf()``
        gives ``(fd, offset)`` of a DMA-BUF covering the range (``cuMemGetHandleForAddressRange``)
        and the verbs layer has a ``DmaBufMR`` that takes ``iova`` (the MR must be addressed by the
        virtual address, as the data path does), that is used. Failure: RegistrationError with
        :data:`GPU_REG_HINT`.
        """
        E = self.V.enums
        access = E.IBV_ACCESS_LOCAL_WRITE if writable else 0
        if remote:
            access |= E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
        mrs = []
        gpu = location.startswith("cuda")
        dma: list[Any] = []  # [(fd, offset)] once exported, or [None]
        try:
            for nic in self.nics:
                if gpu:
                    mrs.append(self._gpu_mr(nic, addr, length, access, dmabuf, dma))
                else:
                    mrs.append(self.V.mr.MR(nic.pd, length, access, address=addr))
        except Exception as exc:  # noqa: BLE001 - PyverbsRDMAError
            for m in mrs:
                m.close()
            code = getattr(exc, "error_code", None)
            if gpu:
                raise RegistrationError(
                    f"RDMA registration of {length} bytes of {location} failed ({exc}); {GPU_REG_HINT}"
                ) from None
            if code in (errno.ENOMEM, errno.EPERM, errno.EAGAIN) or "Cannot allocate memory" in str(exc):
                raise RegistrationError(
                    f"RDMA registration of {length} bytes failed ({exc}); {MEMLOCK_HINT}"
                ) from None
            raise RegistrationError(f"RDMA registration of {length} bytes failed: {exc}") from None
        finally:
            if dma and dma[0] is not None:
                os.close(dma[0][0])  # the MRs hold the dma-buf; our fd is not needed any more
        entry = (
            addr,
            addr + length,
            [m.lkey for m in mrs],
            [m.rkey for m in mrs],
            location,
            remote,
            mrs,
            writable,
            [True],
        )
        with self.lock:
            i = bisect.bisect_left(self._reg_starts, addr)
            self._reg_starts.insert(i, addr)
            self._regs.insert(i, entry)

    def _gpu_mr(self, nic: Nic, addr: int, length: int, access: int, dmabuf: Any, dma: list[Any]) -> Any:
        """MR on GPU memory: peer memory first (plain MR), then DMA-BUF (see :meth:`register`)."""
        try:
            return self.V.mr.MR(nic.pd, length, access, address=addr)
        except Exception as exc:  # noqa: BLE001 - PyverbsRDMAError
            first = exc
        cls = getattr(self.V.mr, "DmaBufMR", None)
        if cls is None or dmabuf is None:
            raise first
        if not dma:
            dma.append(dmabuf())
        if dma[0] is None:
            raise RegistrationError(f"{first}; no DMA-BUF export for this range either") from None
        fd, offset = dma[0]
        try:
            return cls(nic.pd, length, access, dmabuf=fd, offset=offset, iova=addr)
        except TypeError:  # pyverbs' DmaBufMR registers with iova = offset: not addressable by VA
            raise RegistrationError(
                f"{first}; DMA-BUF export worked but this verbs layer's DmaBufMR cannot set the iova"
            ) from None

    def unregister(self, addr: int) -> None:
        """Close the MRs at ``addr``; slices of requests planned on them are not posted any more
        (their requests fail at post), those already posted fail with a local protection error."""
        with self.lock:
            i = bisect.bisect_left(self._reg_starts, addr)
            if i >= len(self._reg_starts) or self._reg_starts[i] != addr:
                return
            self._reg_starts.pop(i)
            entry = self._regs.pop(i)
            entry[8][0] = False
        for m in entry[6]:
            m.close()

    def local(self, addr: int, length: int) -> tuple:
        """The entry of the registration holding ``[addr, addr+length)`` (AddressNotRegistered)."""
        with self.lock:  # starts and entries of one state (unregister pops both)
            i = bisect.bisect_right(self._reg_starts, addr) - 1
            r = self._regs[i] if i >= 0 else None
        if r is not None and addr + length <= r[1]:
            return r
        raise AddressNotRegistered(f"local range {addr:#x}+{length} is not inside registered memory")

    def published(self) -> list[list[Any]]:
        """``[addr, length, [rkey per NIC]]`` of the remote-accessible regions (for the descriptor)."""
        with self.lock:
            return [[r[0], r[1] - r[0], r[3]] for r in self._regs if r[5]]

    def close(self) -> None:
        with self.lock:
            regs, self._regs, self._reg_starts = self._regs, [], []
            for r in regs:
                r[8][0] = False
        for r in regs:
            for m in r[6]:
                m.close()
