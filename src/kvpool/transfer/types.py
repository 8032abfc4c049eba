"""Plain data types of the transfer engine API: opcodes, states, requests, segment descriptors."""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from functools import lru_cache
from typing import Any

import msgpack

from kvpool.errors import AuthenticationError, MetadataError

#: Marker of a signed descriptor envelope: {SIGNED: 1, "body": descriptor bytes, "mac": HMAC}.
SIGNED = "kvpool-signed"


def descriptor_mac(secret: str, body: bytes) -> bytes:
    """HMAC-SHA256 of a descriptor's bytes under the cluster secret."""
    return hmac.new(
        secret.encode("utf-8", "surrogatepass"), b"kvpool-descriptor" + body, hashlib.sha256
    ).digest()


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
    # Same-host fence slot and generation of this registration (csrc/fence.h); -1: TCP only.
    fence_slot: int = -1
    fence_gen: int = 0
    # The owner's id of this registration: its server refuses a request naming another id for the
    # range (unregistered and registered again since the descriptor was read). 0: not checked.
    reg_id: int = 0


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
    # memfd (in the owner) of the same-host fence table; -1: no same-host path into this segment.
    fence_fd: int = -1
    # CUDA IPC side, when the engine's CUDA driver loads: {"bufs": [[addr, length, device uuid,
    # IPC handle, offset in the allocation, fence slot, fence generation], ...]}
    cuda_ipc: dict[str, Any] | None = None

    def to_bytes(self, secret: str | None = None) -> bytes:
        """Serialize with msgpack; with ``secret``, inside a signed envelope (HMAC-SHA256)."""
        body = msgpack.packb(asdict(self), use_bin_type=True)
        if not secret:
            return body
        return msgpack.packb(
            {SIGNED: 1, "body": body, "mac": descriptor_mac(secret, body)}, use_bin_type=True
        )

    @classmethod
    def from_bytes(cls, data: bytes, secret: str | None = None) -> SegmentDescriptor:
        """Parse a descriptor; malformed data raises :class:`MetadataError`.

        With ``secret`` the descriptor must be signed with it, or :class:`AuthenticationError` is
        raised before anyone acts on it (a forged pid, buffers or port would otherwise steer our
        writes). Without a secret a signed descriptor is read unverified (trusted networks only).
        """
        try:
            raw: Any = msgpack.unpackb(data, raw=False)
        except Exception as exc:  # noqa: BLE001 - any decode problem is bad metadata
            raise MetadataError(
                f"malformed segment descriptor ({exc}); is the peer a kvpool engine?"
            ) from None
        signed = isinstance(raw, dict) and raw.get(SIGNED) == 1
        if signed:
            body, mac = raw.get("body"), raw.get("mac")
            if not isinstance(body, bytes) or not isinstance(mac, bytes):
                raise MetadataError("malformed signed segment descriptor; is the peer a kvpool engine?")
            if secret and not hmac.compare_digest(mac, descriptor_mac(secret, body)):
                raise AuthenticationError(
                    "segment descriptor is not signed with this cluster's secret (forged, or from another "
                    "cluster); refusing it before any transfer: check who writes the metadata store and "
                    "that every engine has the same `secret`"
                )
            data = body
        elif secret:
            raise AuthenticationError(
                "segment descriptor is unsigned but this engine has a secret; refusing it before any "
                "transfer (forged, or published by an engine without the secret: set the same `secret` "
                "on every engine)"
            )
        try:
            raw = msgpack.unpackb(data, raw=False) if signed else raw
            bknown = BufferDescriptor.__dataclass_fields__
            bufs = [
                BufferDescriptor(**{k: v for k, v in b.items() if k in bknown})
                for b in raw.pop("buffers", [])
            ]
            known = cls.__dataclass_fields__  # keys a newer peer added are ignored
            desc = cls(buffers=bufs, **{k: v for k, v in raw.items() if k in known})
            if not isinstance(desc.port, int) or not isinstance(desc.hostname, str):
                raise TypeError("bad field types")
            return desc
        except Exception as exc:  # noqa: BLE001 - any decode problem is bad metadata
            raise MetadataError(
                f"malformed segment descriptor ({exc}); is the peer a kvpool engine?"
            ) from None

    def remote_regions(self) -> list[tuple[int, int, int]]:
        """(address, length, registration id) of the buffers peers may access."""
        return [(b.addr, b.length, b.reg_id) for b in self.buffers if b.remote_accessible]


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
