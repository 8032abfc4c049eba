"""Same-host transport: one kernel copy instead of a socket when the peer runs on this host.

When the peer's descriptor carries our ``host_id`` (boot id + PID namespace), the native data path
copies each slice with one ``process_vm_writev/readv`` call into the peer's pid, or straight into
the peer's shared-memory buffers (``alloc_shared_buffer``: memfds mapped here through
``/proc/<pid>/fd/<fd>``, non-temporal stores for big copies). Bounds are checked against the
descriptor at submit. A peer the kernel does not let us reach (ptrace restrictions: EPERM, ENOSYS,
EACCES) is switched to TCP for good inside the native path, slice by slice, without failing
requests. Batches, validation and completion are those of :class:`~kvpool.transfer.tcp.TcpTransport`.
"""

from __future__ import annotations

from typing import Any

from kvpool.transfer.tcp import TcpTransport
from kvpool.transfer.types import SegmentDescriptor, host_id


class SameHostTransport(TcpTransport):
    """Requests to a segment on this host go by single kernel copies (see the module docstring)."""

    name = "same_host"

    def reaches(self, desc: SegmentDescriptor, local: str = "cpu", remote: str = "cpu") -> bool:
        return local == remote == "cpu" and "same_host" in desc.protocols and desc.host_id == host_id()

    def describe(self) -> dict[str, Any]:
        """Our fence table (csrc/fence.h): same-host initiators copy only inside its pins."""
        return {"fence_fd": self.native.fence_fd}

    def attach(self, handle: int, name: str, desc: SegmentDescriptor) -> None:
        self.native.update_peer(handle, desc.incarnation, desc.pid, desc.remote_regions())
        shm = [(b.addr, b.length, b.shm_fd) for b in desc.buffers if b.shm_fd >= 0 and b.remote_accessible]
        self.native.set_peer_shm(handle, desc.pid, shm)
        # The target's fence (csrc/fence.h): without it no same-host copy runs, TCP decides.
        fence = [(b.addr, b.length, b.fence_slot, b.fence_gen) for b in desc.buffers if b.remote_accessible]
        self.native.set_peer_fence(handle, desc.pid, desc.fence_fd, fence)

    def detach(self, handle: int) -> None:
        try:
            self.native.set_peer_shm(handle, 0, [])  # unmap; the peer may stay open on another route
            self.native.set_peer_fence(handle, 0, -1, [])
        except Exception:  # noqa: BLE001 - the peer is already gone from the native table
            pass
