"""Registration bookkeeping of a transfer engine: buffers -> address ranges, and the sorted table of
this process's registrations (host and GPU) that the engine, the GPU staging layer and request
validation look up. The native registry (what the C++ server lets peers touch) is kept by the
engine beside it; this table is the Python side's view."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool import _native
from kvpool.errors import (
    AddressNotRegistered,
    InvalidArgument,
    InvalidType,
    ProtocolUnavailable,
    RegistrationError,
    RemoteAccessError,
    SegmentNotFound,
)
from kvpool.transfer.transport import Requests
from kvpool.transfer.types import BufferDescriptor, SegmentDescriptor


def buffer_range(obj: Any, length: int | None = None, allow_read_only: bool = False) -> tuple[int, int, Any]:
    """Return (address, length, keepalive) for an int address, a buffer or a CPU torch tensor.

    Buffers must be writable unless ``allow_read_only``.
    """
    if isinstance(obj, bool):
        raise InvalidArgument("expected an address or a buffer, got a bool")
    if isinstance(obj, int):
        if obj <= 0:
            raise InvalidArgument("address must be a positive integer")
        if length is None or length <= 0:
            raise InvalidArgument("length must be a positive integer when passing a raw address")
        return obj, int(length), None
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor, no torch import
        if not obj.is_contiguous():
            raise InvalidArgument("tensor must be contiguous")
        if obj.device.type != "cpu":
            raise ProtocolUnavailable(
                f"tensor on {obj.device}: GPU memory is not supported by the TCP/same-host transports yet"
            )
        n = obj.numel() * obj.element_size()
        return obj.data_ptr(), n if length is None else int(length), obj
    try:
        view = memoryview(obj)  # pins resizable buffers (bytearray) while registered
    except TypeError:
        raise InvalidType(
            f"addr_or_buffer must be an int address (with length), a writable buffer (bytearray, "
            f"memoryview, numpy array) or a tensor, not {type(obj).__name__}"
        ) from None
    addr, n = _native.buffer_address(view, allow_read_only)
    if length is not None:
        if not 0 < length <= n:
            raise InvalidArgument(f"length {length} outside the buffer's {n} bytes")
        n = int(length)
    if n <= 0:
        raise InvalidArgument("cannot register an empty buffer")
    return addr, n, view


@dataclass(frozen=True)
class Registration:
    """One registered range: its published form, what keeps it alive, and how it may be used."""

    desc: BufferDescriptor
    keep: Any
    read_only: bool = False

    @property
    def start(self) -> int:
        return self.desc.addr

    @property
    def end(self) -> int:
        return self.desc.addr + self.desc.length

    @property
    def gpu(self) -> bool:
        return self.desc.location.startswith("cuda")


class LocalRegistry:
    """Sorted, copy-on-write table of registrations: lookups need no lock (registrations are rare)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: tuple[int, ...] = ()
        self._regs: tuple[Registration, ...] = ()
        self._cols: tuple[tuple[Registration, ...], Any] | None = None  # see columns()
        self.gpu_count = 0

    def add(self, reg: Registration) -> None:
        """Insert; RegistrationError if it overlaps a registration of the same kind (host overlaps
        are refused by the native registry first, with its own message)."""
        with self._lock:
            starts, regs = list(self._starts), list(self._regs)
            i = bisect.bisect_right(starts, reg.start)
            if (i and regs[i - 1].end > reg.start) or (i < len(starts) and starts[i] < reg.end):
                raise RegistrationError(
                    f"range {reg.start:#x}+{reg.desc.length} overlaps registered {reg.desc.location} memory"
                )
            starts.insert(i, reg.start)
            regs.insert(i, reg)
            self._starts, self._regs = tuple(starts), tuple(regs)
            self.gpu_count += reg.gpu

    def remove(self, addr: int) -> Registration | None:
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            if i == len(self._starts) or self._starts[i] != addr:
                return None
            reg = self._regs[i]
            self._starts = self._starts[:i] + self._starts[i + 1 :]
            self._regs = self._regs[:i] + self._regs[i + 1 :]
            self.gpu_count -= reg.gpu
            return reg

    def columns(self) -> tuple[tuple[Registration, ...], Any]:
        """The table and, as numpy columns, its starts, ends, read-only and GPU flags (built once
        per version of the table, for vectorised lookups of many requests)."""
        regs = self._regs
        cached = self._cols
        if cached is not None and cached[0] is regs:
            return cached
        cols = (
            np.array([r.start for r in regs], dtype=np.uint64),
            np.array([r.end for r in regs], dtype=np.uint64),
            np.array([r.read_only for r in regs], dtype=bool),
            np.array([r.gpu for r in regs], dtype=bool),
        )
        self._cols = (regs, cols)
        return self._cols

    def get(self, addr: int) -> Registration | None:
        """The registration starting exactly at ``addr``."""
        starts, regs = self._starts, self._regs
        i = bisect.bisect_left(starts, addr)
        return regs[i] if i < len(starts) and starts[i] == addr else None

    def find(self, addr: int, length: int) -> Registration | None:
        """The registration holding all of ``[addr, addr+length)``, or None."""
        starts, regs = self._starts, self._regs
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr + length <= regs[i].end:
            return regs[i]
        return None

    def gpu_region(self, addr: int, length: int) -> Registration | None:
        """The GPU registration holding ``[addr, addr+length)``; None when ``addr`` is not in GPU
        memory; AddressNotRegistered when the range starts in GPU memory and runs past it."""
        starts, regs = self._starts, self._regs
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or not regs[i].gpu or addr >= regs[i].end:
            return None
        if addr + length > regs[i].end:
            raise AddressNotRegistered(
                f"local range {addr:#x}+{length} runs past registered {regs[i].desc.location} memory"
            )
        return regs[i]

    def any_gpu(self, locs: Sequence[int], lens: Sequence[int]) -> bool:
        """Whether one of these local ranges is GPU memory (:meth:`gpu_region`: its errors too);
        no work without GPU registrations."""
        return bool(self.gpu_count) and any(
            self.gpu_region(a, n) is not None for a, n in zip(locs, lens, strict=True)
        )

    def published(self) -> list[BufferDescriptor]:
        """Descriptors of the remote-accessible registrations (what the segment descriptor lists)."""
        return [r.desc for r in self._regs if r.desc.remote_accessible]

    def __iter__(self):  # noqa: ANN204 - iterator over a snapshot
        return iter(self._regs)


def check_requests(registry: LocalRegistry, descs: dict[int, SegmentDescriptor], reqs: Requests) -> None:
    """Validate requests against our registrations and the peers' descriptors (``descs`` by
    segment handle), as every transport does for its own requests: used before a submit that
    spans several transports, so that nothing is sent unless every request is valid."""
    for i, (op, a, p, r, n) in enumerate(zip(*reqs, strict=True)):
        reg = registry.find(a, n)
        if reg is None:
            raise AddressNotRegistered(
                f"local range {a:#x}+{n} is not inside registered memory; call register_local_memory "
                f"first (request {i})"
            )
        if op == _native.OP_READ and reg.read_only:
            raise AddressNotRegistered(
                f"local range is registered read-only: it cannot receive a READ (request {i})"
            )
        desc = descs.get(p)
        if desc is None:
            raise SegmentNotFound(f"unknown segment handle (request {i})")
        if not any(b.addr <= r and r + n <= b.addr + b.length for b in desc.buffers if b.remote_accessible):
            raise RemoteAccessError(
                f"remote range is outside the segment's remote-accessible buffers (request {i})"
            )
