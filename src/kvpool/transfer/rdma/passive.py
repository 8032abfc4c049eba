"""Target side of the RDMA QP handshake: the passive ends of initiators' queue pairs, bounded.

An initiator's ``connect`` RPC (served on the RDMA transport's RPC server threads) makes one RC QP
here, connected to the initiator's QP; its ``disconnect`` closes it. An initiator that dies without
``disconnect`` would leave its QPs forever and a hostile one could ask for any number, so they are
capped per initiator instance and in total (over a cap the connect is refused with ``BUSY``:
:class:`~kvpool.errors.ObjectBusy` at the initiator, which tries another path), and a connect from a
new instance of the same initiator (same ``origin``: its segment name) closes the old instance's.
"""

from __future__ import annotations

import random
import threading
from typing import Any

from kvpool.errors import ObjectBusy, RdmaConnectError
from kvpool.transfer.rdma.nics import Nic, make_qp, qp_connect


class PassiveQps:
    """The passive QPs of one RDMA transport, keyed by (initiator instance, initiator QP number).

    Args:
        verbs: the transport's verbs layer.
        nics: the transport's NICs (a connect names one of them).
        sq_depth: send-queue depth of each QP.
        instance: this engine's incarnation (sent back: the initiator checks it).
        per_initiator: QPs one initiator instance may hold here.
        total: QPs held here for all initiators together.
    """

    def __init__(
        self, verbs: Any, nics: list[Nic], sq_depth: int, instance: int, per_initiator: int, total: int
    ) -> None:
        self.V = verbs
        self.nics = nics
        self.names = [n.name for n in nics]
        self.sq_depth = sq_depth
        self.instance = instance
        self.per_initiator = per_initiator
        self.total = total
        self._lock = threading.Lock()  # never held across a verbs call
        self._qps: dict[int, dict[int, Any]] = {}  # initiator instance -> its QP number -> our QP
        self._origins: dict[str, int] = {}  # initiator origin -> its current instance
        self._count = 0
        self._closed = False

    def __len__(self) -> int:
        return self._count

    def accept(self, req: dict[str, Any]) -> dict[str, Any]:
        """Serve a ``connect`` RPC (RPC server thread): make and connect our end of the QP."""
        name = req["nic"]
        if name not in self.names:
            raise RdmaConnectError(f"no NIC {name!r} here")
        ini, qpn, origin = int(req["initiator"]), int(req["qpn"]), str(req.get("origin") or "")
        self._close_all(self._replace(origin, ini))
        self._check_room(ini)
        nic = self.nics[self.names.index(name)]
        qp = make_qp(self.V, nic, self.sq_depth)
        psn = random.getrandbits(24)
        try:
            qp_connect(self.V, nic, qp, req, psn)
            with self._lock:
                self._check_room(ini)  # another thread may have taken the room meanwhile
                old = self._qps.setdefault(ini, {}).pop(qpn, None)
                self._qps[ini][qpn] = qp
                self._count += old is None
        except Exception:
            qp.close()
            raise
        self._close_all([old] if old is not None else [])
        return {
            "qpn": qp.qp_num,
            "psn": psn,
            "gid": nic.gid,
            "lid": nic.lid,
            "mtu": nic.mtu,
            "ethernet": nic.ethernet,
            "instance": self.instance,
        }

    def disconnect(self, req: dict[str, Any]) -> None:
        """Serve a ``disconnect`` RPC: close our end of the initiator's QP, if we hold it."""
        ini, qpn = int(req["initiator"]), int(req["qpn"])
        with self._lock:
            mine = self._qps.get(ini)
            qp = mine.pop(qpn, None) if mine is not None else None
            if qp is not None:
                self._count -= 1
                if not mine:
                    del self._qps[ini]
        self._close_all([qp] if qp is not None else [])

    def close(self) -> None:
        """Close every QP (the transport shuts down); later connects are refused."""
        with self._lock:
            self._closed = True
            qps = [qp for mine in self._qps.values() for qp in mine.values()]
            self._qps.clear()
            self._count = 0
        self._close_all(qps)

    def _check_room(self, ini: int) -> None:
        if self._closed:
            raise RdmaConnectError("the RDMA transport is shut down")
        held = len(self._qps.get(ini, ()))
        if held >= self.per_initiator:
            raise ObjectBusy(f"initiator holds {held} QPs here, the most one initiator may (refused)")
        if self._count >= self.total:
            raise ObjectBusy(f"{self._count} passive QPs held here, the most this target keeps (refused)")

    def _replace(self, origin: str, ini: int) -> list[Any]:
        """A connect from a new instance of ``origin``: take the old instance's QPs (to close)."""
        if not origin:
            return []
        with self._lock:
            prev = self._origins.pop(origin, None)
            self._origins[origin] = ini  # the most recent last
            if len(self._origins) > self.total:  # bounded: forget the least recent origin
                del self._origins[next(iter(self._origins))]
            if prev is None or prev == ini:
                return []
            old = list(self._qps.pop(prev, {}).values())
            self._count -= len(old)
            return old

    @staticmethod
    def _close_all(qps: list[Any]) -> None:
        for qp in qps:
            try:
                qp.close()
            except Exception:  # noqa: BLE001 - already in error / device gone
                pass
