"""CUDA TEST DOUBLE: :class:`FakeCudaRuntime` implements :class:`kvpool.transfer.device.DeviceRuntime`
on CPU memory. Nothing here touches a GPU.

It hands out "device" allocations (anonymous mmaps it tracks per simulated device), answers
``pointer_device`` for addresses inside them (None for everything else, as the real runtime does for
host memory), "pins" host memory with a plain mmap and copies with ``ctypes.memmove``, counting
bytes and calls so tests can see that staging happened. Tests inject it:
``TransferEngine(device_runtime=fake_cuda.runtime())``; production code never selects it. What it
cannot tell: anything about real CUDA streams, copy speed,
pointer-attribute semantics on a real driver, or GPUDirect RDMA.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import threading
from typing import Any


class FakeDeviceBuffer:
    """A fake device allocation: ``ptr``, ``nbytes``, ``device``; ``__cuda_array_interface__`` like cupy."""

    def __init__(self, rt: FakeCudaRuntime, ptr: int, nbytes: int, device: int, mem: mmap.mmap) -> None:
        self.rt = rt
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self._mem = mem

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def read(self, offset: int = 0, n: int | None = None) -> bytes:
        """Test helper ("cudaMemcpy D2H" without counting): bytes of the allocation."""
        n = self.nbytes - offset if n is None else n
        return ctypes.string_at(self.ptr + offset, n)

    def write(self, data: bytes, offset: int = 0) -> None:
        """Test helper: put bytes into the allocation."""
        ctypes.memmove(self.ptr + offset, data, len(data))

    def free(self) -> None:
        self.rt.free(self)


class FakeCudaRuntime:
    """The CUDA runtime test double (see the module docstring)."""

    name = "fake"

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._allocs: list[FakeDeviceBuffer] = []
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.d2h_calls = 0
        self.h2d_calls = 0
        self.pinned_bytes = 0
        self.fail_next_h2d: str | None = None  # inject: the next copy_h2d raises RuntimeError(text)

    # -- allocation ("cudaMalloc")
    def alloc(self, nbytes: int, device: int = 0) -> FakeDeviceBuffer:
        if not 0 <= device < self.devices:
            raise RuntimeError(f"fake cuda: invalid device ordinal {device}")
        mem = mmap.mmap(-1, nbytes)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
        buf = FakeDeviceBuffer(self, ptr, nbytes, device, mem)
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            self._starts.insert(i, ptr)
            self._allocs.insert(i, buf)
        return buf

    def free(self, buf: FakeDeviceBuffer) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, buf.ptr)
            if i < len(self._starts) and self._starts[i] == buf.ptr:
                self._starts.pop(i)
                self._allocs.pop(i)

    # -- DeviceRuntime
    def device_count(self) -> int:
        return self.devices

    def pointer_device(self, addr: int) -> int | None:
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i >= 0 and addr < self._allocs[i].ptr + self._allocs[i].nbytes:
                return self._allocs[i].device
        return None

    def alloc_pinned(self, n: int) -> tuple[int, Any]:
        mem = mmap.mmap(-1, n)
        self.pinned_bytes += n
        return ctypes.addressof(ctypes.c_char.from_buffer(mem)), mem

    def _check(self, addr: int, n: int, what: str) -> None:
        dev = self.pointer_device(addr)
        if dev is None or self.pointer_device(addr + n - 1) != dev:
            raise RuntimeError(f"fake cuda: {what} {addr:#x}+{n} is not inside one device allocation")

    def copy_d2h(self, dst: int, src: int, n: int) -> None:
        self._check(src, n, "source")
        ctypes.memmove(dst, src, n)
        self.d2h_bytes += n
        self.d2h_calls += 1

    def copy_h2d(self, dst: int, src: int, n: int) -> None:
        if self.fail_next_h2d is not None:
            msg, self.fail_next_h2d = self.fail_next_h2d, None
            raise RuntimeError(msg)
        self._check(dst, n, "destination")
        ctypes.memmove(dst, src, n)
        self.h2d_bytes += n
        self.h2d_calls += 1

    def synchronize(self) -> None:
        pass

    def dmabuf_fd(self, addr: int, n: int) -> tuple[int, int] | None:
        return None  # the double exports no DMA-BUF; tests inject one where needed

    def reset_counters(self) -> None:
        self.d2h_bytes = self.h2d_bytes = self.d2h_calls = self.h2d_calls = 0


_RUNTIME: FakeCudaRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> FakeCudaRuntime:
    """The process-wide double (one per process, so tests and engines see the same allocations)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = FakeCudaRuntime()
        return _RUNTIME
