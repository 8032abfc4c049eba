"""Plain data types of the transfer engine API: opcodes, states, requests, segment descriptors."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from functools import lru_cache
from typing import Any

import msgpack

from kvpool.errors import MetadataError


class OpCode(IntEnum):
    """Direction of a transfer, seen from the initiator (values as in Mooncake)."""

    READ = 0
    WRITE = 1


class TransferState(IntEnum):
    """State of one request slot (or of a whole batch)."""

    WAITING = 0
    PENDING = 1
    COMPLETED = 2
    FAILED = 3
    TIMEOUT = 4
    CANCELED = 5
    INVALID = 6


@dataclass(frozen=True)
class TransferStatus:
    """State and transferred byte count of a request (or a whole batch).

    ``error`` carries the reason when the state is FAILED, TIMEOUT or CANCELED.
    """

    state: TransferState
    transferred_bytes: int
    error: str | None = None

    @property
    def done(self) -> bool:
        """True once the request left PENDING/WAITING."""
        return self.state not in (TransferState.WAITING, TransferState.PENDING)

    @property
    def ok(self) -> bool:
        """True when the request completed."""
        return self.state == TransferState.COMPLETED


@dataclass(frozen=True)
class SegmentHandle:
    """An opened remote segment; pass it as ``TransferRequest.target_id``."""

    id: int
    name: str

    def __int__(self) -> int:
        return self.id

    def __index__(self) -> int:
        return self.id


@dataclass
class TransferRequest:
    """One READ or WRITE between local memory and a remote segment.

    ``source`` is the local address; ``target_offset`` is the remote virtual address published in
    the target segment's descriptor (as in Mooncake).
    """

    opcode: OpCode
    source: int
    target_id: SegmentHandle | int
    target_offset: int
    length: int


@dataclass(frozen=True)
class BufferDescriptor:
    """A registered buffer as published in a segment descriptor."""

    addr: int
    length: int
    location: str = "cpu:0"
    remote_accessible: bool = True
    shm_fd: int = -1  # memfd in the owner process: same-host peers may map it (see alloc_shared_buffer)


@dataclass
class SegmentDescriptor:
    """What a process exposes to peers: its buffers, endpoints and host identity."""

    name: str
    hostname: str
    port: int
    host_id: str
    pid: int
    incarnation: int
    buffers: list[BufferDescriptor] = field(default_factory=list)
    protocols: list[str] = field(default_factory=lambda: ["tcp"])
    version: int = 1
    # RDMA side, when the engine runs the RDMA transport: {"rpc": "host:port" of the QP-connect RPC,
    # "instance", "nics": [{name, gid, lid, port, mtu, gid_index, ethernet}],
    # "mrs": [[addr, length, [rkey per NIC]]], "topology": Mooncake-style matrix}
    rdma: dict[str, Any] | None = None

    def to_bytes(self) -> bytes:
        """Serialize with msgpack."""
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> SegmentDescriptor:
        """Parse a descriptor; malformed data raises :class:`MetadataError`."""
        try:
            raw: dict[str, Any] = msgpack.unpackb(data, raw=False)
            bufs = [BufferDescriptor(**b) for b in raw.pop("buffers", [])]
            known = cls.__dataclass_fields__  # keys a newer peer added are ignored
            desc = cls(buffers=bufs, **{k: v for k, v in raw.items() if k in known})
            if not isinstance(desc.port, int) or not isinstance(desc.hostname, str):
                raise TypeError("bad field types")
            return desc
        except Exception as exc:  # noqa: BLE001 - any decode problem is bad metadata
            raise MetadataError(
                f"malformed segment descriptor ({exc}); is the peer a kvpool engine?"
            ) from None

    def remote_regions(self) -> list[tuple[int, int]]:
        """(address, length) of the buffers peers may access."""
        return [(b.addr, b.length) for b in self.buffers if b.remote_accessible]


@lru_cache(maxsize=1)
def host_id() -> str:
    """Identity of this host's kernel and PID namespace: equal ids mean the same-host path can work."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = os.uname().nodename
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = "?"
    return f"{boot}/{pidns}"
