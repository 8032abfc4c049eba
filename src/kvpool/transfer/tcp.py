"""TCP transport: the native data path (``kvpool._native``) over per-peer lanes.

Bytes move in C++ on the peer's lane threads with the GIL released: requests are cut into
``slice_size`` slices, pipelined in same-opcode groups with one gather ``sendmsg`` each, and every
slice completes its batch slot with atomics (see docs/architecture.md). The engine's
``NativeEngine`` is also the server peers reach, the registry it checks and the batch table, so
this transport only routes: it is the fallback every engine can use.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool import _native
from kvpool.transfer.transport import Requests, Transport
from kvpool.transfer.types import SegmentDescriptor, TransferState, TransferStatus

_OK = TransferStatus(TransferState.COMPLETED, 0)
_ST_STALE = _native.ST_STALE


class TcpTransport(Transport):
    """Requests to a segment go over its TCP lanes (see the module docstring)."""

    name = "tcp"

    def __init__(self, native: _native.NativeEngine) -> None:
        self.native = native

    def reaches(self, desc: SegmentDescriptor, local: str = "cpu", remote: str = "cpu") -> bool:
        return local == remote == "cpu" and "tcp" in desc.protocols

    takes_arrays = True

    def submit(
        self, batch_id: int, reqs: Requests, stage_wait_s: float | None = None, waited: bool = False
    ) -> None:
        ops, locs, peers, rems, lens = reqs
        if isinstance(locs, np.ndarray):
            n = len(lens)
            if ops.count(ops[0]) == n and peers.count(peers[0]) == n:
                # one op, one segment: the columns go over in one copy each
                self.native.submit_cols(batch_id, ops[0], locs, peers[0], rems, lens)
                return
            locs, rems, lens = locs.tolist(), rems.tolist(), lens.tolist()
        self.native.submit(batch_id, ops, locs, peers, rems, lens)  # validates all, then queues

    def transfer_inline(
        self,
        op: int,
        handle: int,
        locals_: Sequence[int],
        remotes: Sequence[int],
        lens: Sequence[int],
        scratch: tuple[int, int, bool] | None = None,
    ) -> TransferStatus | None:
        if scratch is not None:  # registered and unregistered around the transfer, natively
            err = self.native.transfer_sync_scratch(op, locals_, handle, remotes, lens, *scratch)
        elif len(lens) == 1:  # in this thread if a lane is idle
            err = self.native.transfer_sync(op, locals_[0], handle, remotes[0], lens[0])
        else:
            err = self.native.transfer_sync_ranges(op, locals_, handle, remotes, lens)
        return _status(err)

    def transfer_inline_parts(
        self, op: int, parts: Sequence[tuple[int, Sequence[int], Sequence[int], Sequence[int]]]
    ) -> TransferStatus | None:
        err, _ = self.native.transfer_sync_parts(op, parts)  # one native call, GIL given up once
        return _status(err)


def _status(err: int) -> TransferStatus | None:
    """A native transfer_sync's status as the transport's answer (None: stale descriptor, nothing
    moved by that call; the engine refreshes the descriptor and uses a batch)."""
    if not err:
        return _OK
    if err == _ST_STALE:
        return None
    state = TransferState.TIMEOUT if err == _native.ST_TIMEOUT else TransferState.FAILED
    return TransferStatus(state, 0, _native.status_text(err))
