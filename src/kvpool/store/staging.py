"""A store client's registered staging memory: regions for headers and small values, and
zero-copy registration of big values for the duration of one call."""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Any

from kvpool import _native
from kvpool.errors import KvpoolError
from kvpool.store.allocator import RangeAllocator
from kvpool.store.layout import HEADER_SIZE
from kvpool.transfer.engine import TransferEngine

DIRECT_MIN = 64 << 10  # values above this move without a staging copy (header staged separately)
SMALL_SLOT = (64 << 10) + HEADER_SIZE  # staging slot kept for one small object at a time


class Staging:
    """A registered local-only buffer carved into regions for put/get of Python bytes."""

    def __init__(self, engine: TransferEngine, size: int) -> None:
        self.engine = engine
        self.mem = mmap.mmap(-1, size)
        self.view = memoryview(self.mem)
        self.base = engine.register_local_memory(self.view, remote_accessible=False)
        self.alloc = RangeAllocator(size, 64)
        self.lock = threading.Lock()
        # A fixed region for one small object at a time: no allocator on the common small path.
        self.small_off = self.alloc.allocate(SMALL_SLOT)
        self.small_lock = threading.Lock()

    def take(self, size: int) -> tuple[int, memoryview, Any]:
        """(address, view, token) of ``size`` bytes; a temporary registration when it does not fit."""
        if size <= SMALL_SLOT and self.small_off is not None and self.small_lock.acquire(blocking=False):
            off = self.small_off
            return self.base + off, self.view[off : off + size], "small"
        with self.lock:
            off = self.alloc.allocate(size)
        if off is not None:
            return self.base + off, self.view[off : off + size], off
        tmp = mmap.mmap(-1, size)
        view = memoryview(tmp)
        addr = self.engine.register_local_memory(view, remote_accessible=False)
        return addr, view[:size], (tmp, view)

    def source(self, value: memoryview) -> tuple[int, Any]:
        """(address, token) to WRITE a big ``value`` from: registered in place for the call
        (read-only, local: no copy), or copied into staging when that fails."""
        try:
            addr = _native.buffer_address(value, True)[0]
            self.engine.register_host_scratch(addr, value.nbytes, read_only=True)
            return addr, ("scratch", addr)
        except KvpoolError:
            pass  # e.g. the same object is being put by another thread: copy it
        addr, view, token = self.take(value.nbytes)
        view[:] = value
        return addr, token

    def sink(self, size: int) -> tuple[int, bytes, Any]:
        """(address, result, token) to READ a big value into: a fresh ``bytes`` object filled in place."""
        obj, addr = _native.new_bytes(size)
        self.engine.register_host_scratch(addr, size)
        return addr, obj, ("scratch", addr)

    def give(self, token: Any) -> None:
        """Return a region taken with :meth:`take`, :meth:`source` or :meth:`sink`."""
        if token is None:
            return
        if token == "small":
            self.small_lock.release()
            return
        if isinstance(token, int):
            with self.lock:
                self.alloc.free(token)
            return
        if token[0] == "scratch":
            self.engine.unregister_host_scratch(token[1])
            return
        _tmp, view = token
        self.engine.unregister_local_memory(addr_of(view))  # the mapping goes with its last view


def addr_of(view: memoryview) -> int:
    """Address of a buffer's first byte."""
    return _native.buffer_address(view)[0]


def _mem(addr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")


def copy_out(engine: TransferEngine, dst: int, data: bytes | bytearray | memoryview) -> None:
    """Copy host bytes to ``dst``: GPU memory (registered as cuda:N) through the CUDA runtime,
    host memory with memmove."""
    n = len(data)
    if engine.is_gpu_memory(dst, n):
        src = data if isinstance(data, bytes) else bytes(data)
        engine.device_runtime.copy_h2d(dst, _native.buffer_address(src, True)[0], n)
    else:
        ctypes.memmove(dst, bytes(data) if isinstance(data, memoryview) else data, n)  # type: ignore[arg-type]


def host_view(engine: TransferEngine, addr: int, size: int) -> memoryview:
    """The bytes at ``addr`` readable by the CPU: GPU memory is copied to host first."""
    if engine.is_gpu_memory(addr, size):
        buf = bytearray(size)
        engine.device_runtime.copy_d2h(_native.buffer_address(buf)[0], addr, size)
        return memoryview(buf)
    return _mem(addr, size)
