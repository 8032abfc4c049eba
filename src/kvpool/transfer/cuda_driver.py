"""The CUDA driver, loaded at run time: ``pip install kvpool`` needs no CUDA toolkit.

:class:`CudaDriver` opens ``libcuda.so.1`` (or the library named by ``TransferConfig.cuda_driver``
/ the ``KVPOOL_CUDA_DRIVER`` environment variable: a path) with ctypes and wraps the few entry
points kvpool uses: devices and primary contexts, pointer attributes, pinned and registered host
memory, copies on streams, events, IPC handles, and one kernel module (the gather copy of
:mod:`kvpool.transfer.cuda_ipc`). ctypes releases the GIL around every call. Every failure raises
a :mod:`kvpool.errors` type naming the call and the driver's message.

:class:`DriverRuntime` implements :class:`kvpool.transfer.device.DeviceRuntime` on it, so GPU
staging needs neither torch nor cupy. :func:`load_driver` returns None when no driver loads (a
machine without a GPU keeps every CPU behaviour).

**Not verified on hardware** in this repository's CI: the tests load the fake driver of
:mod:`kvpool.testing.fakecuda`; ``pytest -m gpu`` runs the same code on a real GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
from typing import Any

from kvpool.errors import InvalidArgument, KvpoolError, ProtocolUnavailable, TransferError

log = logging.getLogger("kvpool.transfer")

CUresult = c_int
CUdeviceptr = c_ulonglong

ENV = "KVPOOL_CUDA_DRIVER"
NOT_READY = 600
_INVALID_VALUE = 1
_ATTR_MEMORY_TYPE = 2
_ATTR_DEVICE_ORDINAL = 9
_MEMORYTYPE_HOST = 1
_MEMORYTYPE_DEVICE = 2
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_DEVICEMAP = 2
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_EVENT_DISABLE_TIMING = 2
_STREAM_NON_BLOCKING = 1


class CudaError(TransferError):
    """A CUDA driver call failed (``code`` is the CUresult)."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.code = code


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


# name -> argtypes (restype is CUresult for all)
_SIGS: dict[str, list[Any]] = {
    "cuInit": [c_uint],
    "cuDriverGetVersion": [POINTER(c_int)],
    "cuDeviceGetCount": [POINTER(c_int)],
    "cuDeviceGet": [POINTER(c_int), c_int],
    "cuDeviceGetUuid": [POINTER(_Uuid), c_int],
    "cuDeviceCanAccessPeer": [POINTER(c_int), c_int, c_int],
    "cuDevicePrimaryCtxRetain": [POINTER(c_void_p), c_int],
    "cuCtxSetCurrent": [c_void_p],
    "cuCtxEnablePeerAccess": [c_void_p, c_uint],
    "cuPointerGetAttribute": [c_void_p, c_int, CUdeviceptr],
    "cuMemGetAddressRange_v2": [POINTER(CUdeviceptr), POINTER(c_size_t), CUdeviceptr],
    "cuMemAlloc_v2": [POINTER(CUdeviceptr), c_size_t],
    "cuMemFree_v2": [CUdeviceptr],
    "cuMemHostAlloc": [POINTER(c_void_p), c_size_t, c_uint],
    "cuMemFreeHost": [c_void_p],
    "cuMemHostRegister_v2": [c_void_p, c_size_t, c_uint],
    "cuMemHostUnregister": [c_void_p],
    "cuMemcpy": [CUdeviceptr, CUdeviceptr, c_size_t],
    "cuMemcpyAsync": [CUdeviceptr, CUdeviceptr, c_size_t, c_void_p],
    "cuStreamCreate": [POINTER(c_void_p), c_uint],
    "cuStreamSynchronize": [c_void_p],
    "cuStreamDestroy_v2": [c_void_p],
    "cuEventCreate": [POINTER(c_void_p), c_uint],
    "cuEventRecord": [c_void_p, c_void_p],
    "cuEventQuery": [c_void_p],
    "cuEventSynchronize": [c_void_p],
    "cuEventDestroy_v2": [c_void_p],
    "cuIpcGetMemHandle": [POINTER(IpcHandle), CUdeviceptr],
    "cuIpcOpenMemHandle_v2": [POINTER(CUdeviceptr), IpcHandle, c_uint],
    "cuIpcCloseMemHandle": [CUdeviceptr],
    "cuModuleLoadData": [POINTER(c_void_p), c_char_p],
    "cuModuleGetFunction": [POINTER(c_void_p), c_void_p, c_char_p],
    "cuLaunchKernel": [
        c_void_p,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_void_p,
        POINTER(c_void_p),
        POINTER(c_void_p),
    ],  # fmt: skip
    "cuGetErrorString": [c_int, POINTER(c_char_p)],
}


class CudaDriver:
    """ctypes bindings of the CUDA driver entry points kvpool uses (see the module docstring).

    Thread-safe: every call first makes the device's primary context current on the calling
    thread (cached per thread).
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path or os.environ.get(ENV) or "libcuda.so.1"
        try:
            lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise ProtocolUnavailable(f"cannot load the CUDA driver {self.path!r}: {exc}") from None
        for name, args in _SIGS.items():
            fn = getattr(lib, name, None)
            if fn is None:
                raise ProtocolUnavailable(f"the CUDA driver {self.path!r} lacks {name} (driver too old?)")
            fn.argtypes = args
            fn.restype = CUresult
        self.lib = lib
        self._check(lib.cuInit(0), "cuInit", ProtocolUnavailable)
        n = c_int(0)
        self._check(lib.cuDeviceGetCount(byref(n)), "cuDeviceGetCount", ProtocolUnavailable)
        self.count = n.value
        self._ctx: dict[int, int] = {}
        self._uuids: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self._tls = threading.local()

    # ------------------------------------------------------------------ errors, contexts
    def error(self, rc: int, what: str) -> CudaError:
        """The CudaError for a nonzero CUresult ``rc`` of the call ``what`` (named by the driver),
        e.g. one the native side got (``_native.ipc_enqueue``, ``IpcCompleter``)."""
        s = c_char_p()
        self.lib.cuGetErrorString(rc, byref(s))
        return CudaError(f"{what} failed: CUDA error {rc} ({(s.value or b'?').decode()})", rc)

    def _check(self, rc: int, what: str, cls: type[KvpoolError] = CudaError) -> None:
        if rc == 0:
            return
        err = self.error(rc, what)
        if cls is CudaError:
            raise err
        raise cls(str(err))

    def use(self, device: int) -> None:
        """Make ``device``'s primary context current on this thread (cheap when it already is)."""
        if getattr(self._tls, "dev", None) == device:
            return
        if not 0 <= device < self.count:
            raise InvalidArgument(
                f"cuda:{device} does not exist: the CUDA driver sees {self.count} device(s)"
            )
        with self._lock:
            ctx = self._ctx.get(device)
            if ctx is None:
                c = c_void_p()
                self._check(self.lib.cuDevicePrimaryCtxRetain(byref(c), device), "cuDevicePrimaryCtxRetain")
                ctx = self._ctx[device] = c.value or 0
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._tls.dev = device

    def uuid(self, device: int) -> bytes:
        """The device's UUID (16 bytes; asked of the driver once per device)."""
        got = self._uuids.get(device)
        if got is None:
            u = _Uuid()
            self._check(self.lib.cuDeviceGetUuid(byref(u), device), "cuDeviceGetUuid")
            got = self._uuids[device] = ctypes.string_at(byref(u), 16)  # raw: u.bytes stops at a 0
        return got

    def enable_peer(self, device: int, peer: int) -> bool:
        """Let ``device``'s context access ``peer``'s memory (kernels reading IPC-mapped peer memory)."""
        if device == peer:
            return True
        can = c_int(0)
        self._check(self.lib.cuDeviceCanAccessPeer(byref(can), device, peer), "cuDeviceCanAccessPeer")
        if not can.value:
            return False
        self.use(peer)
        ctx = self._ctx[peer]
        self.use(device)
        rc = self.lib.cuCtxEnablePeerAccess(ctx, 0)
        return rc in (0, 704)  # 704: already enabled

    # ------------------------------------------------------------------ pointers and memory
    def pointer_device(self, addr: int) -> int | None:
        """Device ordinal of device memory at ``addr``; None for host memory or unknown pointers."""
        mtype = c_uint(0)
        if self.lib.cuPointerGetAttribute(byref(mtype), _ATTR_MEMORY_TYPE, addr) != 0:
            return None
        if mtype.value != _MEMORYTYPE_DEVICE:
            return None
        ordinal = c_int(-1)
        if self.lib.cuPointerGetAttribute(byref(ordinal), _ATTR_DEVICE_ORDINAL, addr) != 0:
            return None
        return ordinal.value if ordinal.value >= 0 else None

    def address_range(self, addr: int) -> tuple[int, int]:
        """(base, size) of the device allocation holding ``addr``."""
        base, size = CUdeviceptr(0), c_size_t(0)
        self._check(self.lib.cuMemGetAddressRange_v2(byref(base), byref(size), addr), "cuMemGetAddressRange")
        return int(base.value), int(size.value)

    def alloc(self, n: int, device: int = 0) -> int:
        self.use(device)
        p = CUdeviceptr(0)
        self._check(self.lib.cuMemAlloc_v2(byref(p), n), f"cuMemAlloc({n})")
        return int(p.value)

    def free(self, addr: int) -> None:
        self._check(self.lib.cuMemFree_v2(addr), "cuMemFree")

    def host_alloc(self, n: int) -> int:
        """Page-locked host memory, mapped for every context (portable)."""
        self.use(getattr(self._tls, "dev", None) or 0)
        p = c_void_p()
        self._check(self.lib.cuMemHostAlloc(byref(p), n, _HOST_REGISTER_PORTABLE), f"cuMemHostAlloc({n})")
        return int(p.value or 0)

    def free_host(self, addr: int) -> None:
        self._check(self.lib.cuMemFreeHost(addr), "cuMemFreeHost")

    def host_register(self, addr: int, n: int) -> bool:
        """Page-lock existing host memory for DMA; False when the driver refuses (it stays pageable)."""
        self.use(getattr(self._tls, "dev", None) or 0)
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_DEVICEMAP
        return self.lib.cuMemHostRegister_v2(addr, n, flags) == 0

    def host_unregister(self, addr: int) -> None:
        self.lib.cuMemHostUnregister(addr)

    # ------------------------------------------------------------------ copies, streams, events
    def current(self, *addrs: int) -> None:
        """Make a context current on this thread when none is yet (callers on threads that never
        called :meth:`use`, such as the staging thread): the primary context of the device holding
        the first device pointer among ``addrs``, else device 0. Cheap once the thread has one."""
        if getattr(self._tls, "dev", None) is not None:
            return
        for a in addrs:
            dev = self.pointer_device(a)
            if dev is not None:
                self.use(dev)
                return
        self.use(0)

    def memcpy(self, dst: int, src: int, n: int) -> None:
        """Synchronous copy between any two addresses (unified addressing); makes a context
        current on the calling thread first when it has none (the driver needs one). cuMemcpy
        alone may return before a device -> device copy, or the DMA of a pageable host -> device
        copy, has ended (CUDA's "API synchronization behavior"): the legacy stream it ran on is
        synchronised, so the bytes are in place on return (a peer's copy on another stream, or a
        host read, sees them)."""
        self.current(dst, src)
        self._check(self.lib.cuMemcpy(dst, src, n), "cuMemcpy")
        self._check(self.lib.cuStreamSynchronize(None), "cuStreamSynchronize")

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        self._check(self.lib.cuMemcpyAsync(dst, src, n, stream), "cuMemcpyAsync")

    def stream(self, device: int) -> int:
        self.use(device)
        s = c_void_p()
        self._check(self.lib.cuStreamCreate(byref(s), _STREAM_NON_BLOCKING), "cuStreamCreate")
        return int(s.value or 0)

    def stream_sync(self, stream: int) -> None:
        self._check(self.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def stream_destroy(self, stream: int) -> None:
        self.lib.cuStreamDestroy_v2(stream)

    def event(self) -> int:
        e = c_void_p()
        self._check(self.lib.cuEventCreate(byref(e), _EVENT_DISABLE_TIMING), "cuEventCreate")
        return int(e.value or 0)

    def record(self, event: int, stream: int) -> None:
        self._check(self.lib.cuEventRecord(event, stream), "cuEventRecord")

    def query(self, event: int) -> bool:
        """True when the event completed, False while pending; raises on a failed stream."""
        rc = self.lib.cuEventQuery(event)
        if rc == NOT_READY:
            return False
        self._check(rc, "cuEventQuery")
        return True

    def event_sync(self, event: int) -> None:
        self._check(self.lib.cuEventSynchronize(event), "cuEventSynchronize")

    def event_destroy(self, event: int) -> None:
        self.lib.cuEventDestroy_v2(event)

    # ------------------------------------------------------------------ IPC
    def ipc_handle(self, base: int) -> bytes:
        """The 64-byte IPC handle of the device allocation starting at ``base``."""
        h = IpcHandle()
        self._check(self.lib.cuIpcGetMemHandle(byref(h), base), "cuIpcGetMemHandle")
        return ctypes.string_at(byref(h), 64)

    def ipc_open(self, handle: bytes, device: int) -> int:
        """Map another process's allocation into ``device``'s context; its base address here."""
        self.use(device)
        h = IpcHandle()
        ctypes.memmove(byref(h), handle, 64)
        p = CUdeviceptr(0)
        self._check(
            self.lib.cuIpcOpenMemHandle_v2(byref(p), h, _IPC_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle"
        )
        return int(p.value)

    def ipc_close(self, base: int) -> None:
        """Unmap an :meth:`ipc_open` mapping by the base address it returned (CudaError if not)."""
        self._check(self.lib.cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")

    # ------------------------------------------------------------------ kernels
    def function(self, image: bytes, name: str, device: int) -> int:
        """Load a PTX/cubin image into ``device``'s context and return the kernel ``name``."""
        self.use(device)
        m, f = c_void_p(), c_void_p()
        self._check(self.lib.cuModuleLoadData(byref(m), image), "cuModuleLoadData")
        self._check(self.lib.cuModuleGetFunction(byref(f), m, name.encode()), f"cuModuleGetFunction({name})")
        return int(f.value or 0)


_loaded: dict[str, CudaDriver | None] = {}
_load_lock = threading.Lock()


def load_driver(path: str | None = None) -> CudaDriver | None:
    """The process-wide driver for ``path`` (None: ``KVPOOL_CUDA_DRIVER`` or ``libcuda.so.1``), or
    None when the default library does not load or sees no device (a CPU machine). A driver
    named explicitly (``path``, ``KVPOOL_CUDA_DRIVER``) that does not load raises
    :class:`~kvpool.errors.InvalidArgument`: GPU paths are never turned off silently. Cached per path."""
    explicit = path or os.environ.get(ENV)
    key = explicit or "libcuda.so.1"
    with _load_lock:
        if key not in _loaded:
            try:
                drv: CudaDriver | None = CudaDriver(key)
                if drv is not None and drv.count <= 0:
                    drv = None
            except ProtocolUnavailable as exc:
                if explicit:
                    raise InvalidArgument(
                        f"cuda_driver / {ENV} names {key!r}, which does not work: {exc} "
                        "(fix the path, or leave it unset for libcuda.so.1)"
                    ) from None
                drv = None
            _loaded[key] = drv
        return _loaded[key]


class DriverRuntime:
    """:class:`~kvpool.transfer.device.DeviceRuntime` over :class:`CudaDriver` (no torch/cupy)."""

    name = "driver"

    def __init__(self, driver: CudaDriver) -> None:
        self.driver = driver

    def device_count(self) -> int:
        return self.driver.count

    def pointer_device(self, addr: int) -> int | None:
        return self.driver.pointer_device(addr)

    def alloc_pinned(self, n: int) -> tuple[int, Any]:
        addr = self.driver.host_alloc(n)
        return addr, _PinnedBlock(self.driver, addr)

    def free_pinned(self, addr: int, keep: Any) -> None:
        """``cuMemFreeHost`` now (not when the block is garbage-collected)."""
        keep.free()

    def copy_d2h(self, dst: int, src: int, n: int) -> None:
        self.driver.memcpy(dst, src, n)

    def copy_h2d(self, dst: int, src: int, n: int) -> None:
        self.driver.memcpy(dst, src, n)

    def synchronize(self) -> None:
        """Copies here are synchronous (cuMemcpy): nothing to wait for."""

    def dmabuf_fd(self, addr: int, n: int) -> tuple[int, int] | None:
        return None


class _PinnedBlock:
    """Page-locked memory of a staging pool: freed by :meth:`free` (the pool's close), else when
    the pool drops it."""

    def __init__(self, driver: CudaDriver, addr: int) -> None:
        self.driver, self.addr = driver, addr

    def free(self) -> None:
        """``cuMemFreeHost`` once; a failure is logged (the memory stays: nothing else to do)."""
        addr, self.addr = self.addr, 0
        if addr:
            try:
                self.driver.free_host(addr)
            except Exception as exc:  # noqa: BLE001 - a close goes on
                log.warning("cuMemFreeHost of a staging pool at %#x failed: %s", addr, exc)

    def __del__(self) -> None:
        addr, self.addr = self.addr, 0
        if addr:
            try:
                self.driver.free_host(addr)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
