"""CUDA TEST DOUBLE: builds the fake CUDA driver library (``fakecuda.c`` beside this file).

:func:`build` compiles it once with the system C compiler into a cache directory and returns the
path; tests point ``KVPOOL_CUDA_DRIVER`` (or ``TransferConfig.cuda_driver``) at it, so that
:mod:`kvpool.transfer.cuda_driver` loads it instead of ``libcuda.so.1``. Production code never
names it. :func:`stats` reads its counters (kernel launches, copies, bytes) in this process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("fakecuda.c")


def build(out_dir: str | os.PathLike[str] | None = None) -> str:
    """Path of the compiled fake driver (``libfakecuda-<hash>.so``); compiled when missing."""
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src).hexdigest()[:12]
    root = Path(out_dir) if out_dir is not None else Path(tempfile.gettempdir()) / "kvpool-fakecuda"
    root.mkdir(parents=True, exist_ok=True)
    lib = root / f"libfakecuda-{tag}.so"
    if not lib.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
        tmp = root / f".{lib.name}.{os.getpid()}"
        subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-Wall", "-o", str(tmp), str(SOURCE), "-lpthread"],
            check=True,
            capture_output=True,
        )
        os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written file
    return str(lib)


def stats(path: str) -> tuple[int, int, int]:
    """(kernel launches, copies, bytes moved) counted by the fake driver loaded from ``path`` here."""
    lib = ctypes.CDLL(path)
    a, b, c = ctypes.c_long(), ctypes.c_long(), ctypes.c_long()
    lib.fakecuda_stats(ctypes.byref(a), ctypes.byref(b), ctypes.byref(c))
    return a.value, b.value, c.value


COPY, LAUNCH = 0, 1  # kinds of fail_enqueue


def fail_enqueue(path: str, kind: int, after: int, rc: int, times: int = 1) -> None:
    """In this process's fake driver at ``path``: after ``after`` more calls of ``kind`` (COPY: the
    asynchronous copies, LAUNCH: kernel launches), the next ``times`` return ``rc`` and queue
    nothing (a CUDA call failing while a run is being queued)."""
    ctypes.CDLL(path).fakecuda_fail_enqueue(kind, ctypes.c_long(after), ctypes.c_long(times), rc)


def enqueue_faults_left(path: str, kind: int) -> int:
    """How many of the failures :func:`fail_enqueue` set up for ``kind`` have not happened yet."""
    lib = ctypes.CDLL(path)
    lib.fakecuda_enqueue_faults_left.restype = ctypes.c_long
    return int(lib.fakecuda_enqueue_faults_left(kind))


_context_faults: set[str] = set()  # driver paths fail_context set a fault in (release_holds)


def fail_context(path: str, rc: int, times: int = -1) -> None:
    """In this process's fake driver at ``path``: the next ``times`` (< 0: all, until called
    again) ``cuCtxSetCurrent`` calls of threads with no current context return ``rc`` (a
    context that cannot be made current on a new thread, e.g. a native completion thread's).
    ``times=0`` clears it; so does :func:`release_holds`."""
    ctypes.CDLL(path).fakecuda_fail_context(ctypes.c_long(times), rc)
    (_context_faults.add if times else _context_faults.discard)(path)


class SyncHold:
    """A GPU stream that stops, as the CUDA IPC completion sees it (the fake driver's
    ``cuEventSynchronize`` calls wait, before looking at their event, until :meth:`set`; its copies
    have run, so the bytes are right once let go). ``after``: syncs that still return first (a
    stream that stops after that many runs). ``driver``: a CudaDriver over the fake (its ``lib``).
    Named like ``threading.Event`` where tests used one to let a stopped stream go."""

    def __init__(self, driver: Any, after: int = 0) -> None:
        self._lib = driver.lib
        self._lib.fakecuda_hold_event_sync.argtypes = [ctypes.c_long]
        self._base = self._counts()[1]
        self._lib.fakecuda_hold_event_sync(after)
        _holds.append(self)

    def _counts(self) -> tuple[int, int, float | None]:
        w, r, first = ctypes.c_long(), ctypes.c_long(), ctypes.c_longlong()
        self._lib.fakecuda_event_sync_counts(ctypes.byref(w), ctypes.byref(r), ctypes.byref(first))
        return w.value, r.value, (first.value / 1e9 if first.value else None)

    def set(self) -> None:
        """Let the stream go (every waiting sync, and later ones, return)."""
        self._lib.fakecuda_hold_event_sync(-1)

    def stop_after(self, after: int) -> None:
        """Stop again once ``after`` more syncs returned."""
        self._lib.fakecuda_hold_event_sync(after)

    def clear(self) -> None:
        """Stop again now (the next sync waits)."""
        self.stop_after(0)

    def waiting(self) -> int:
        """Syncs waiting at the hold now."""
        return self._counts()[0]

    def landed(self) -> int:
        """Syncs that returned since the hold began (runs whose completion was seen)."""
        return self._counts()[1] - self._base

    def first_landed_at(self) -> float | None:
        """``time.monotonic()`` of the first sync that returned since the hold began (or last
        stopped again), None while none has."""
        return self._counts()[2]

    def wait_held(self, timeout: float) -> bool:
        """Whether a sync came to wait at the hold within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.waiting():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True


_holds: list[SyncHold] = []


def release_holds() -> None:
    """Let every stream a :class:`SyncHold` stopped go and clear :func:`fail_context` (tests'
    teardown: a test that failed while holding must not leave the process's completion threads
    waiting)."""
    while _holds:
        _holds.pop().set()
    while _context_faults:
        fail_context(next(iter(_context_faults)), 0, 0)


class DeviceBuffer:
    """Device memory of the fake driver for tests: ``ptr``, ``nbytes``, ``device`` and a
    ``__cuda_array_interface__`` like cupy. :meth:`read` / :meth:`write` copy through the driver
    (the CPU cannot touch the device pointer unless ``FAKECUDA_CPU_VISIBLE=1``)."""

    def __init__(self, driver: Any, nbytes: int, device: int = 0) -> None:
        self.driver, self.nbytes, self.device = driver, nbytes, device
        self.ptr = driver.alloc(nbytes, device)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def read(self, offset: int = 0, n: int | None = None) -> bytes:
        n = self.nbytes - offset if n is None else n
        buf = ctypes.create_string_buffer(n)
        self.driver.memcpy(ctypes.addressof(buf), self.ptr + offset, n)
        return buf.raw

    def write(self, data: bytes, offset: int = 0) -> None:
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        self.driver.memcpy(self.ptr + offset, ctypes.addressof(buf), len(data))

    def free(self) -> None:
        if self.ptr:
            self.driver.free(self.ptr)
            self.ptr = 0


def counting_runtime(path: str) -> Any:
    """The production :class:`~kvpool.transfer.cuda_driver.DriverRuntime` over the fake driver at
    ``path``, with what tests need on top: byte/call counters of the staging copies, one injected
    host-to-device or device-to-host failure (``fail_next_h2d``, ``fail_next_d2h``) and
    :meth:`alloc` of :class:`DeviceBuffer` s."""
    from kvpool.transfer.cuda_driver import CudaDriver, DriverRuntime

    class CountingRuntime(DriverRuntime):
        def __init__(self) -> None:
            super().__init__(CudaDriver(path))
            self.fail_next_h2d: str | None = None
            self.fail_next_d2h: str | None = None
            self.pinned_bytes = 0
            self.reset_counters()

        def reset_counters(self) -> None:
            self.d2h_bytes = self.h2d_bytes = self.d2h_calls = self.h2d_calls = 0

        def alloc(self, nbytes: int, device: int = 0) -> DeviceBuffer:
            return DeviceBuffer(self.driver, nbytes, device)

        def free(self, buf: DeviceBuffer) -> None:
            buf.free()

        def alloc_pinned(self, n: int) -> tuple[int, Any]:
            self.pinned_bytes += n
            return super().alloc_pinned(n)

        def copy_d2h(self, dst: int, src: int, n: int) -> None:
            if self.fail_next_d2h is not None:
                msg, self.fail_next_d2h = self.fail_next_d2h, None
                raise RuntimeError(msg)
            super().copy_d2h(dst, src, n)
            self.d2h_bytes += n
            self.d2h_calls += 1

        def copy_h2d(self, dst: int, src: int, n: int) -> None:
            if self.fail_next_h2d is not None:
                msg, self.fail_next_h2d = self.fail_next_h2d, None
                raise RuntimeError(msg)
            super().copy_h2d(dst, src, n)
            self.h2d_bytes += n
            self.h2d_calls += 1

    return CountingRuntime()
