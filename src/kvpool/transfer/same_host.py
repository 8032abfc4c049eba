"""Same-host transport: one kernel copy instead of a socket when the peer runs on this host.

When the peer's descriptor carries our ``host_id`` (boot id + PID namespace), the native data path
copies each slice with one ``process_vm_writev/readv`` call into the peer's pid, or straight into
the peer's shared-memory buffers (``alloc_shared_buffer``: memfds mapped here through
``/proc/<pid>/fd/<fd>``, non-temporal stores for big copies). Bounds are checked against the
descriptor at submit. A peer the kernel does not let us reach (ptrace restrictions: EPERM, ENOSYS,
EACCES) is switched to TCP for good inside the native path, slice by slice, without failing
requests. Batches, validation and completion are those of :class:`~kvpool.transfer.tcp.TcpTransport`.
A restarted peer (same segment name) is noticed without a connection: a request refused as outside
the descriptor we hold, while the peer's process has exited (pidfd), fails once with
``SegmentNotFound``; the next ``open_segment`` re-fetches (:meth:`peer_gone`).
"""

from __future__ import annotations

import os
import select
from collections.abc import Sequence
from typing import Any

from kvpool.errors import RemoteAccessError, SegmentNotFound
from kvpool.transfer.tcp import TcpTransport
from kvpool.transfer.transport import Requests
from kvpool.transfer.types import SegmentDescriptor, TransferStatus, host_id


def _has_exited(pidfd: int) -> bool:
    """Whether the process behind a pidfd exited (poll: pidfds may be past select's 1,024)."""
    if pidfd < 0:
        return False
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


class SameHostTransport(TcpTransport):
    """Requests to a segment on this host go by single kernel copies (see the module docstring)."""

    name = "same_host"

    def __init__(self, native: Any) -> None:
        super().__init__(native)
        # handle -> [pidfd of the peer's process, its exit already reported to a caller, its pid];
        # beside the native peer's own pidfd (which the native module does not expose); only
        # the engine's open/close (under its lock) attach and detach
        self._pids: dict[int, list[Any]] = {}

    def _pid_state(self, handle: int) -> list[Any] | None:
        return self._pids.get(handle)

    def _raise_if_exited(self, handles: Any) -> None:
        """A refused request may name a restarted peer's new memory (outside the descriptor we
        hold): when its process exited, say so once (SegmentNotFound), so the next open_segment
        re-fetches. Called where a RemoteAccessError is caught; returns when no peer exited."""
        gone = False
        for h in set(handles):
            st = self._pid_state(h)
            if st is not None and _has_exited(st[0]):
                st[1] = gone = True
        if gone:
            raise SegmentNotFound("the segment's process exited; open the segment again") from None

    def release_exited(self) -> list[int]:
        """Unmap the shared memory and fence of peers whose process exited: a mapping here keeps
        a dead peer's memory allocated (a storage server restarted under a new name would
        otherwise stay in every client that wrote to it). The next open re-fetches them."""
        out = [h for h, st in self._pids.items() if not st[1] and _has_exited(st[0])]
        for h in out:
            self._pids[h][1] = True
            self.native.set_peer_shm(h, 0, [])
            self.native.set_peer_fence(h, 0, -1, [])
        return out

    def peer_gone(self, handle: int) -> bool:
        st = self._pids.get(handle)
        return st is not None and st[1]

    def submit(
        self, batch_id: int, reqs: Requests, stage_wait_s: float | None = None, waited: bool = False
    ) -> None:
        try:
            super().submit(batch_id, reqs)
        except RemoteAccessError:
            self._raise_if_exited(reqs.peers)
            raise

    def transfer_inline(
        self,
        op: int,
        handle: int,
        locals_: Sequence[int],
        remotes: Sequence[int],
        lens: Sequence[int],
        scratch: tuple[int, int, bool] | None = None,
    ) -> TransferStatus | None:
        try:
            return super().transfer_inline(op, handle, locals_, remotes, lens, scratch)
        except RemoteAccessError:
            self._raise_if_exited([handle])
            raise

    def transfer_inline_parts(
        self, op: int, parts: Sequence[tuple[int, Sequence[int], Sequence[int], Sequence[int]]]
    ) -> TransferStatus | None:
        try:
            return super().transfer_inline_parts(op, parts)
        except RemoteAccessError:
            self._raise_if_exited([p[0] for p in parts])
            raise

    def reaches(self, desc: SegmentDescriptor, local: str = "cpu", remote: str = "cpu") -> bool:
        return local == remote == "cpu" and "same_host" in desc.protocols and desc.host_id == host_id()

    def describe(self) -> dict[str, Any]:
        """Our fence table (csrc/fence.h): same-host initiators copy only inside its pins."""
        return {"fence_fd": self.native.fence_fd}

    def peer_pid(self, desc: SegmentDescriptor) -> int:
        return desc.pid

    def attach(self, handle: int, name: str, desc: SegmentDescriptor) -> None:
        """The engine routes ``handle`` here (it already set the peer's pid: :meth:`peer_pid`)."""
        self.release_exited()  # a new peer is often a dead one's successor
        shm = [(b.addr, b.length, b.shm_fd) for b in desc.buffers if b.shm_fd >= 0 and b.remote_accessible]
        self.native.set_peer_shm(handle, desc.pid, shm)
        # The target's fence (csrc/fence.h): without it no same-host copy runs, TCP decides.
        fence = [(b.addr, b.length, b.fence_slot, b.fence_gen) for b in desc.buffers if b.remote_accessible]
        self.native.set_peer_fence(handle, desc.pid, desc.fence_fd, fence)
        st = self._pids.get(handle)
        if st is not None and st[2] == desc.pid and not st[1] and not _has_exited(st[0]):
            return  # a refresh of the same live process: keep its pidfd
        self._close_pid(handle)
        try:
            pidfd = os.pidfd_open(desc.pid)
        except OSError:
            pidfd = -1  # no pidfd (old kernel) or already gone: the native path decides
        self._pids[handle] = [pidfd, False, desc.pid]

    def close(self) -> None:
        for handle in list(self._pids):
            self._close_pid(handle)
        super().close()

    def _close_pid(self, handle: int) -> None:
        st = self._pids.pop(handle, None)
        if st is not None and st[0] >= 0:
            os.close(st[0])

    def detach(self, handle: int) -> None:
        self._close_pid(handle)
        try:
            self.native.set_peer_shm(handle, 0, [])  # unmap; the peer may stay open on another route
            self.native.set_peer_fence(handle, 0, -1, [])
        except Exception:  # noqa: BLE001 - the peer is already gone from the native table
            pass
