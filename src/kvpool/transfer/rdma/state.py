"""Plain state of the RDMA data path: requests, slices, endpoints, peers; slicing. No verbs calls."""

from __future__ import annotations

import bisect
import collections
from typing import Any

from kvpool.transfer.rdma.nics import Nic
from kvpool.transfer.types import TransferState


def slice_plan(length: int, slice_size: int) -> list[tuple[int, int]]:
    """(offset, length) slices of a request; a tail shorter than half a slice joins the previous one."""
    if length <= slice_size:
        return [(0, length)]
    n, tail = divmod(length, slice_size)
    out = [(i * slice_size, slice_size) for i in range(n)]
    if tail:
        if tail < slice_size // 2:
            off, ln = out[-1]
            out[-1] = (off, ln + tail)
        else:
            out.append((n * slice_size, tail))
    return out


class Req:
    """One request: its batch slot, slices still due, bytes done, state and the NIC pairs it may use."""

    __slots__ = (
        "batch_id",
        "slot",
        "remaining",
        "done_bytes",
        "state",
        "error",
        "peer",
        "lpref",
        "rpref",
        "pairs",
        "attempts",
        "instance",
        "live",
    )

    def __init__(
        self, batch_id: int, slot: int, peer: Peer, instance: Any = None, live: list[bool] | None = None
    ) -> None:
        self.batch_id = batch_id
        self.slot = slot
        self.peer = peer
        self.instance = instance  # the peer incarnation its addresses and rkeys were planned for
        # the local registration's live flag (MemoryRegions): False once it was unregistered
        self.live = [True] if live is None else live
        self.remaining = 0
        self.done_bytes = 0
        self.state = TransferState.PENDING
        self.error: str | None = None
        self.pairs: list[tuple[int, int]] = []
        self.attempts = 0


class Slice:
    """One slice of a request, bound to a (local NIC, remote NIC) pair."""

    __slots__ = ("req", "op", "laddr", "raddr", "length", "lkeys", "rkeys", "lnic", "rnic", "attempts")

    def __init__(
        self,
        req: Req,
        op: int,
        laddr: int,
        raddr: int,
        length: int,
        lkeys: list[int],
        rkeys: list[int],
        lnic: int,
        rnic: int,
    ) -> None:
        self.req = req
        self.op = op
        self.laddr = laddr
        self.raddr = raddr
        self.length = length
        self.lkeys = lkeys
        self.rkeys = rkeys
        self.lnic = lnic
        self.rnic = rnic
        self.attempts = 0


class Endpoint:
    """A connected RC queue pair to one remote NIC: chains in flight and slices waiting to post."""

    __slots__ = (
        "key",
        "nic",
        "peer",
        "rnic",
        "qp",
        "remote_qpn",
        "instance",
        "inflight",
        "outstanding",
        "pending",
    )

    def __init__(
        self, key: tuple, nic: Nic, peer: Peer, rnic: int, qp: Any, remote_qpn: int, instance: Any = None
    ) -> None:
        self.key = key
        self.nic = nic
        self.peer = peer
        self.rnic = rnic
        self.qp = qp
        self.remote_qpn = remote_qpn
        self.instance = instance  # the peer incarnation that accepted the QP
        self.inflight: dict[int, list[Slice]] = {}
        self.outstanding = 0
        self.pending: collections.deque[Slice] = collections.deque()


class Peer:
    """What we know of a remote engine's RDMA side (from its segment descriptor)."""

    def __init__(self, hid: int, name: str, info: dict[str, Any], buffers: list[Any]) -> None:
        self.hid = hid
        self.name = name
        self.paused: dict[int, float] = {}
        self.rpc: Any = None
        self.closed = False  # set by remove_peer: its queued slices are canceled
        # (RPC address, until, error) of a connect RPC that found the peer's RPC server down: the
        # connects queued behind it fail at once with it until then (RPC threads only)
        self.rpc_down: tuple[str, float, Exception] | None = None
        self.update(info, buffers)

    def update(self, info: dict[str, Any], buffers: list[Any]) -> None:
        self.instance = info.get("instance")
        self.rpc_addr: str = info["rpc"]
        self.nics: list[dict[str, Any]] = info["nics"]
        self.nic_names = [n["name"] for n in self.nics]
        self.topology: dict[str, list[list[str]]] = info.get("topology") or {}
        loc = {b.addr: b.location for b in buffers}
        regs = sorted((int(a), int(a) + int(n), list(k), loc.get(int(a), "cpu:0")) for a, n, k in info["mrs"])
        self.starts = [r[0] for r in regs]
        self.regs = regs

    def region(self, addr: int, length: int) -> tuple[int, int, list[int], str] | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0:
            r = self.regs[i]
            if addr + length <= r[1]:
                return r
        return None
