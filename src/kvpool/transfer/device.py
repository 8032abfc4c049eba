"""GPU (``cuda:N``) memory support: one small runtime interface and buffer inspection.

Everything CUDA-specific the transfer engine needs goes through :class:`DeviceRuntime`:

- ``device_count()``; ``pointer_device(addr)`` -> the ordinal of the device whose memory ``addr`` is,
  or None (host memory, unknown pointer);
- ``alloc_pinned(n)`` -> ``(addr, keepalive)`` of page-locked host memory; ``free_pinned(addr,
  keepalive)`` gives it back (called once, when nothing uses it any more);
- ``copy_d2h(dst, src, n)`` / ``copy_h2d(dst, src, n)``: synchronous copies (return when done);
- ``synchronize()``; ``dmabuf_fd(addr, n)`` -> ``(fd, offset)`` of a DMA-BUF covering the range, or None.

Implementations: :class:`TorchCudaRuntime` (torch.cuda), :class:`CupyCudaRuntime` (cupy.cuda.runtime),
both using the CUDA driver (``libcuda.so.1`` through ctypes) for pointer attributes and DMA-BUF
export when it loads. :func:`get_runtime` selects one lazily (``TransferConfig.device_runtime``).
:class:`kvpool.transfer.cuda_driver.DriverRuntime` implements it on the CUDA driver alone. Tests
inject a DriverRuntime over the fake driver library (:mod:`kvpool.testing.fakecuda`) as an object
(``TransferEngine(device_runtime=...)``); nothing here names it. Pinned staging of GPU memory for
transports that move host memory only is in :mod:`kvpool.transfer.staging`.

**Not verified on hardware**: this project's machine has no GPU; the torch/cupy implementations
are written against those libraries' documented APIs and exercised only through the double.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

from kvpool.errors import InvalidArgument, ProtocolUnavailable


class DeviceRuntime(Protocol):
    """What the engine needs from CUDA (see the module docstring)."""

    name: str

    def device_count(self) -> int: ...

    def pointer_device(self, addr: int) -> int | None: ...

    def alloc_pinned(self, n: int) -> tuple[int, Any]: ...

    def free_pinned(self, addr: int, keep: Any) -> None: ...

    def copy_d2h(self, dst: int, src: int, n: int) -> None: ...

    def copy_h2d(self, dst: int, src: int, n: int) -> None: ...

    def synchronize(self) -> None: ...

    def dmabuf_fd(self, addr: int, n: int) -> tuple[int, int] | None: ...


# ----------------------------------------------------------------------------- CUDA driver (ctypes)
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE = 2
_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


class CudaDriver:
    """The few CUDA driver calls used directly: pointer attributes and DMA-BUF export."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuInit.argtypes = [ctypes.c_uint]
        self.lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        if self.lib.cuInit(0) != 0:
            raise OSError("cuInit failed")

    def pointer_device(self, addr: int) -> int | None:
        mtype = ctypes.c_uint(0)
        rc = self.lib.cuPointerGetAttribute(ctypes.byref(mtype), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)
        if rc != 0 or mtype.value != _CU_MEMORYTYPE_DEVICE:
            return None  # CUDA_ERROR_INVALID_VALUE for plain host memory; pinned host memory is HOST
        ordinal = ctypes.c_int(-1)
        rc = self.lib.cuPointerGetAttribute(ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)
        return ordinal.value if rc == 0 and ordinal.value >= 0 else None

    def dmabuf_fd(self, addr: int, n: int) -> tuple[int, int] | None:
        """``cuMemGetHandleForAddressRange`` (CUDA >= 11.7, page-aligned range): (fd, offset of addr)."""
        fn = getattr(self.lib, "cuMemGetHandleForAddressRange", None)
        if fn is None:
            return None
        import mmap

        page = mmap.PAGESIZE
        start = addr & ~(page - 1)
        end = (addr + n + page - 1) & ~(page - 1)
        fd = ctypes.c_int(-1)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_ulonglong]
        rc = fn(ctypes.byref(fd), start, end - start, _CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
        if rc != 0 or fd.value < 0:
            return None
        return fd.value, addr - start


def _driver() -> CudaDriver | None:
    try:
        return CudaDriver()
    except (OSError, AttributeError):
        return None


class _CudaArray:
    """A bare ``__cuda_array_interface__`` (v3) over ``n`` bytes of device memory at ``addr``."""

    def __init__(self, addr: int, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "|u1",
            "data": (addr, False),
            "strides": None,
            "version": 3,
        }


def _host_bytes(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_uint8 * n).from_address(addr)).cast("B")


# ----------------------------------------------------------------------------- torch
class TorchCudaRuntime:
    """torch.cuda: pinned tensors for staging, ``Tensor.copy_`` for copies (synchronous, current stream)."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ProtocolUnavailable(
                f"CUDA is not available to torch {torch.__version__} (CPU build, no driver or no GPU)"
            )
        self.torch = torch
        self.driver = _driver()

    def device_count(self) -> int:
        return int(self.torch.cuda.device_count())

    def pointer_device(self, addr: int) -> int | None:
        if self.driver is not None:
            return self.driver.pointer_device(addr)
        try:  # torch asks cudaPointerGetAttributes (at::cuda::getDeviceFromPtr) when it wraps a pointer
            return int(self.torch.as_tensor(_CudaArray(addr, 1)).device.index)
        except (RuntimeError, TypeError, ValueError):
            return None

    def alloc_pinned(self, n: int) -> tuple[int, Any]:
        t = self.torch.empty(n, dtype=self.torch.uint8, pin_memory=True)
        return int(t.data_ptr()), t

    def free_pinned(self, addr: int, keep: Any) -> None:
        """Nothing to call: the caller drops the tensor, which gives it back to torch's host allocator."""

    def _views(self, host: int, dev: int, n: int) -> tuple[Any, Any]:
        torch = self.torch
        return torch.frombuffer(_host_bytes(host, n), dtype=torch.uint8), torch.as_tensor(_CudaArray(dev, n))

    def copy_d2h(self, dst: int, src: int, n: int) -> None:
        h, d = self._views(dst, src, n)
        h.copy_(d)  # non_blocking=False: returns once the bytes are in host memory

    def copy_h2d(self, dst: int, src: int, n: int) -> None:
        h, d = self._views(src, dst, n)
        d.copy_(h)
        self.torch.cuda.current_stream(d.device).synchronize()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def dmabuf_fd(self, addr: int, n: int) -> tuple[int, int] | None:
        return self.driver.dmabuf_fd(addr, n) if self.driver is not None else None


# ----------------------------------------------------------------------------- cupy
class CupyCudaRuntime:
    """cupy.cuda.runtime: ``pointerGetAttributes``, ``alloc_pinned_memory``, ``memcpy`` (synchronous)."""

    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.rt = cupy.cuda.runtime
        try:
            count = self.rt.getDeviceCount()
        except Exception as exc:  # noqa: BLE001 - CUDARuntimeError
            raise ProtocolUnavailable(f"cupy cannot use CUDA: {exc}") from None
        if count <= 0:
            raise ProtocolUnavailable("cupy sees no CUDA device")
        self.driver = _driver()

    def device_count(self) -> int:
        return int(self.rt.getDeviceCount())

    def pointer_device(self, addr: int) -> int | None:
        try:
            attrs = self.rt.pointerGetAttributes(addr)
        except Exception:  # noqa: BLE001 - CUDARuntimeError for unknown pointers (CUDA < 11)
            return None
        if attrs.type != getattr(self.rt, "memoryTypeDevice", 2):
            return None
        return int(attrs.device)

    def alloc_pinned(self, n: int) -> tuple[int, Any]:
        mem = self.cupy.cuda.alloc_pinned_memory(n)
        return int(mem.ptr), mem

    def free_pinned(self, addr: int, keep: Any) -> None:
        """Nothing to call: the caller drops the pointer, which gives it back to cupy's pinned pool."""

    def copy_d2h(self, dst: int, src: int, n: int) -> None:
        self.rt.memcpy(dst, src, n, getattr(self.rt, "memcpyDeviceToHost", 2))

    def copy_h2d(self, dst: int, src: int, n: int) -> None:
        self.rt.memcpy(dst, src, n, getattr(self.rt, "memcpyHostToDevice", 1))

    def synchronize(self) -> None:
        self.rt.deviceSynchronize()

    def dmabuf_fd(self, addr: int, n: int) -> tuple[int, int] | None:
        return self.driver.dmabuf_fd(addr, n) if self.driver is not None else None


# ----------------------------------------------------------------------------- selection
def get_runtime(kind: str = "auto", driver_path: str | None = None) -> DeviceRuntime:
    """The runtime for ``kind`` (``auto``, ``driver``, ``torch``, ``cupy``); ProtocolUnavailable
    saying why not.

    ``auto`` tries the CUDA driver (``driver_path``, ``KVPOOL_CUDA_DRIVER`` or ``libcuda.so.1``),
    then torch.cuda, then cupy.
    """
    why: list[str] = []
    if kind in ("auto", "driver"):
        from kvpool.transfer.cuda_driver import DriverRuntime, load_driver

        drv = load_driver(driver_path)
        if drv is not None:
            return DriverRuntime(drv)
        why.append("the CUDA driver does not load or sees no device")
    for name, cls in (("torch", TorchCudaRuntime), ("cupy", CupyCudaRuntime)):
        if kind not in ("auto", name):
            continue
        try:
            return cls()
        except ImportError as exc:
            why.append(f"{name} is not importable ({exc})")
        except ProtocolUnavailable as exc:
            why.append(str(exc))
    if kind not in ("auto", "driver", "torch", "cupy"):
        raise ProtocolUnavailable(f"unknown device runtime {kind!r} (use auto, driver, torch or cupy)")
    raise ProtocolUnavailable(
        "GPU memory (cuda:N) needs a CUDA runtime: " + "; ".join(why) + " - run on a machine with an "
        "NVIDIA GPU and driver (or install a CUDA build of torch or cupy), or register host memory"
    )


def parse_location(location: Any) -> tuple[str, int | None]:
    """``cpu``/``cpu:N``/``cuda``/``cuda:N`` -> (kind, index or None); InvalidArgument otherwise."""
    if isinstance(location, str):
        kind, sep, idx = location.partition(":")
        if kind in ("cpu", "cuda") and (not sep or idx.isdigit()):
            return kind, int(idx) if sep else None
    raise InvalidArgument(f"location must be 'cpu', 'cpu:N', 'cuda' or 'cuda:N', got {location!r}")


def device_buffer(obj: Any, length: int | None) -> tuple[int, int, Any, int | None] | None:
    """(addr, length, keepalive, device index) for a CUDA torch tensor or a ``__cuda_array_interface__``
    object; None for anything else (host buffers, ints)."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and hasattr(obj, "device"):
        if obj.device.type != "cuda":
            return None
        if not obj.is_contiguous():
            raise InvalidArgument("tensor must be contiguous")
        n = obj.numel() * obj.element_size()
        idx = obj.device.index
        addr = int(obj.data_ptr())
    elif hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        strides = cai.get("strides")
        itemsize = int(cai["typestr"][2:])
        n = itemsize
        for d in cai["shape"]:
            n *= int(d)
        if strides is not None:  # C-contiguous strides are allowed, anything else is not
            expect, s = [], itemsize
            for d in reversed(cai["shape"]):
                expect.insert(0, s)
                s *= int(d)
            if list(strides) != expect:
                raise InvalidArgument("CUDA array must be C-contiguous")
        addr, idx = int(cai["data"][0]), None
        if cai["data"][1]:
            raise InvalidArgument("CUDA array is read-only")
    else:
        return None
    if length is not None:
        if not 0 < length <= n:
            raise InvalidArgument(f"length {length} outside the buffer's {n} bytes")
        n = int(length)
    if n <= 0 or addr <= 0:
        raise InvalidArgument("cannot register an empty buffer")
    return addr, n, obj, idx


def device_index(
    rt: DeviceRuntime, dev: tuple[int, int, Any, int | None], index: int | None
) -> tuple[int, int, Any, int]:
    """Check a device range ``(addr, length, keepalive, index the object names or None)`` against
    the ``cuda:index`` a caller asked for (None: any) and the runtime: one existing device holds all
    of it. Returns ``(addr, length, keepalive, device ordinal)``; InvalidArgument otherwise."""
    addr, n, keep, tindex = dev
    if index is not None and tindex is not None and index != tindex:
        raise InvalidArgument(f"tensor is on cuda:{tindex}, location says cuda:{index}")
    index = tindex if index is None else index
    count = rt.device_count()
    actual = rt.pointer_device(addr)
    if index is None:
        index = actual
    if index is None:
        raise InvalidArgument(f"address {addr:#x} is not CUDA device memory")
    if not 0 <= index < count:
        raise InvalidArgument(f"cuda:{index} does not exist: the {rt.name} runtime sees {count} device(s)")
    if actual != index or rt.pointer_device(addr + n - 1) != index:
        where = "not CUDA device memory" if actual is None else f"memory of cuda:{actual}"
        raise InvalidArgument(f"range {addr:#x}+{n} is not all memory of cuda:{index} ({where})")
    return addr, n, keep, index
