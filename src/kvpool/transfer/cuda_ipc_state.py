"""The records of :mod:`kvpool.transfer.cuda_ipc`: our exported GPU registrations, the peers
reached through CUDA IPC with their buffers (opened GPU allocations, mapped shared host buffers),
and the queued runs of GPU copies the transport's completion thread settles."""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_U64 = np.uint64


@dataclass
class _Export:
    """One of our GPU registrations as peers see it."""

    addr: int
    length: int
    device: int
    handle: bytes
    offset: int  # of addr in its allocation
    slot: int
    gen: int


@dataclass
class _RemoteBuf:
    """A remote buffer the GPU can reach: GPU memory (IPC) or a shared host buffer."""

    addr: int
    length: int
    gpu: bool
    slot: int
    gen: int
    handle: bytes = b""
    offset: int = 0
    uuid: bytes = b""
    shm_fd: int = -1
    mapped: int = 0  # base of the mapping here (0: not opened yet)
    keep: Any = None


@dataclass
class _Peer:
    pid: int
    incarnation: int
    bufs: list[_RemoteBuf]
    starts: np.ndarray
    ends: np.ndarray
    gpu: np.ndarray
    fence: Any  # _native.FenceMap or None
    pidfd: int
    inflight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    gone: bool = False  # its exit was reported to a caller: the next open_segment re-fetches


@dataclass
class _Run:
    """A queued run of GPU copies: its slots, pins and resources, completed by one event."""

    event: int
    batch_id: int
    first: int
    lens: np.ndarray
    peer: _Peer
    pins: list[tuple[int, int]]
    table: tuple[int, int, int] | None  # (device table, pinned host table, bytes) to give back
    dev: int
    lo: int = 0  # the local address range the copies touch: [lo, hi)
    hi: int = 0


def _col(c: Any) -> np.ndarray:
    """A request column as a uint64 array (free for arrays, one C-speed pass for lists)."""
    if isinstance(c, np.ndarray):
        return c.astype(_U64, copy=False)
    return np.fromiter(c, dtype=_U64, count=len(c))


class _Shm:
    """A peer's shared host buffer mapped here (closed with the peer)."""

    def __init__(self, m: mmap.mmap) -> None:
        self.m = m

    def close(self) -> None:
        try:
            self.m.close()
        except BufferError:
            pass  # a ctypes view still points into it: the mapping goes with the process
