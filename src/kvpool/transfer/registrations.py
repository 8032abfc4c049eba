"""Local memory of :class:`~kvpool.transfer.engine.TransferEngine`, mixed into it: register host
buffers, shared (memfd) buffers and GPU memory (validated against the CUDA runtime; served to TCP
peers by the C++ server, or staged), hand every registration to the transports that move its kind
of memory, and unregister it again - waiting for the copies in flight into it, or, where a peer or
a GPU stream outlives the engine's timeout, finishing anyway and keeping the memory referenced.
Called by any thread of the engine's users (a connector registers its KV cache once at start).
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Any

from kvpool import _native
from kvpool.errors import (
    InvalidArgument,
    ProtocolUnavailable,
    RegistrationError,
)
from kvpool.transfer.device import (
    CupyCudaRuntime,
    DeviceRuntime,
    TorchCudaRuntime,
    device_buffer,
    device_index,
    get_runtime,
    parse_location,
)
from kvpool.transfer.memory import LocalRegistry, Registration, buffer_range
from kvpool.transfer.types import BufferDescriptor

if TYPE_CHECKING:
    from kvpool.config import TransferConfig
    from kvpool.transfer.staging import GpuStaging
    from kvpool.transfer.transport import Transport

__all__ = ["MADV_POPULATE_WRITE", "Registrations"]

#: madvise(2) advice that maps pages writable at once (Linux 5.14; Python names it from 3.12 on).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class Registrations:
    """Registering and unregistering local memory; state set up by ``TransferEngine.__init__``."""

    config: TransferConfig
    _native: _native.NativeEngine
    _registry: LocalRegistry
    _transports: list[Transport]
    _staging: GpuStaging
    _served_gpu: set[int]
    _fenced: list[Any]
    _device_rt: DeviceRuntime | None

    def _publish(self) -> None:
        raise NotImplementedError  # the engine's: publish its descriptor again

    def register_local_memory(
        self,
        addr_or_buffer: Any,
        length: int | None = None,
        location: str = "cpu:0",
        remote_accessible: bool = True,
    ) -> int:
        """Register memory for transfers; returns its address.

        Accepts an int address (with ``length``), any writable Python buffer (bytearray,
        memoryview, numpy array) or a CPU torch tensor. GPU memory: a CUDA torch tensor, an object
        with ``__cuda_array_interface__`` (cupy) or an int address with ``location="cuda:N"``
        (validated: a CUDA runtime, N < device count, the range is memory of device N); transports
        that reach GPU memory register it directly (RDMA: GPUDirect), the others move it through
        pinned staging buffers, where it can only be local (``remote_accessible=False``). Only
        ``remote_accessible`` memory may be touched by peers. Overlapping registrations raise
        :class:`RegistrationError`. A read-only buffer (e.g. ``bytes``) may be registered with
        ``remote_accessible=False``: it can then be the source of WRITEs but never the destination
        of a READ.
        """
        kind, index = parse_location(location)
        dev = device_buffer(addr_or_buffer, length)
        if dev is not None or kind == "cuda":
            # a CUDA tensor/array with the default "cpu:0": the location comes from the object
            index = index if kind == "cuda" else None
            return self._register_device(addr_or_buffer, length, index, dev, bool(remote_accessible))
        addr, n, keep = buffer_range(addr_or_buffer, length, allow_read_only=not remote_accessible)
        read_only = isinstance(keep, memoryview) and keep.readonly
        slot, gen, rid = self._native.register_memory(addr, n, bool(remote_accessible), read_only)
        desc = BufferDescriptor(
            addr, n, location, bool(remote_accessible), fence_slot=slot, fence_gen=gen, reg_id=rid
        )
        reg = Registration(desc, keep, read_only)
        self._add_registration(reg, rollback=lambda: self._native.unregister_memory(addr))
        return addr

    def register_host_scratch(self, addr: int, length: int, read_only: bool = False) -> None:
        """Register ``length`` host bytes at ``addr`` local-only for one call: a READ destination,
        or with ``read_only`` a WRITE source only (e.g. an immutable ``bytes`` being put). It is
        :meth:`register_local_memory` with ``location="cpu:0"`` and ``remote_accessible=False``
        for an int address, without its argument parsing (same native registration, bookkeeping,
        overlap refusal and transports). Undo with :meth:`unregister_host_scratch`."""
        if length <= 0:
            raise InvalidArgument("cannot register an empty buffer")
        slot, gen, rid = self._native.register_memory(addr, length, False, read_only)
        desc = BufferDescriptor(addr, length, "cpu:0", False, fence_slot=slot, fence_gen=gen, reg_id=rid)
        reg = Registration(desc, None, read_only)
        self._add_registration(reg, rollback=lambda: self._native.unregister_memory(addr))

    def unregister_host_scratch(self, addr: int) -> None:
        """Undo :meth:`register_host_scratch` (host, local-only: nothing to publish)."""
        reg = self._registry.get(addr)
        if reg is None or reg.gpu or reg.desc.remote_accessible:
            self.unregister_local_memory(addr)  # not one of ours: the general path
            return
        self._native.unregister_memory(addr)  # waits for in-flight access to the range
        for t in self._transports:
            if "cpu" in t.locations:
                t.unregister(addr)
        self._registry.remove(addr)

    def is_gpu_memory(self, addr: int, length: int) -> bool:
        """Whether ``[addr, addr+length)`` starts in memory registered here as ``cuda:N`` (host
        code must not touch it directly; copy through :attr:`device_runtime`)."""
        return bool(self._registry.gpu_count) and self._registry.gpu_region(addr, length) is not None

    @property
    def device_runtime(self) -> DeviceRuntime:
        """The CUDA runtime: the one passed to the constructor, else selected on first use."""
        if self._device_rt is None:
            self._device_rt = get_runtime(self.config.device_runtime, self.config.cuda_driver)
        return self._device_rt

    def _register_device(
        self, obj: Any, length: int | None, index: int | None, dev: Any, remote: bool
    ) -> int:
        rt = self.device_runtime  # ProtocolUnavailable when there is no CUDA runtime
        if dev is None:
            if not isinstance(obj, int) or isinstance(obj, bool):
                raise InvalidArgument(
                    "GPU memory must be a CUDA tensor, a __cuda_array_interface__ object or an int address"
                )
            dev = (*buffer_range(obj, length), None)
        addr, n, keep, index = device_index(rt, dev, index)
        served = remote and self._server_stages_gpu(rt)
        if remote and not served and not any("cuda" in t.locations for t in self._transports):
            raise ProtocolUnavailable(
                f"cuda:{index} memory cannot be remote-accessible here: the CUDA driver does not load in "
                "the engine's server (TCP/same-host peers), and there is no RDMA. Run where the CUDA "
                "driver loads, use protocol='rdma' (GPUDirect), or register it with "
                "remote_accessible=False (source of WRITEs, destination of READs, staged)"
            )
        rollback = None
        rid = 0
        if served:  # TCP peers: the C++ server stages this region through pinned memory
            rid = self._native.register_memory(addr, n, True, False, index)[2]
            rollback = lambda: self._native.unregister_memory(addr)  # noqa: E731
        reg = Registration(BufferDescriptor(addr, n, f"cuda:{index}", remote, reg_id=rid), keep)
        self._add_registration(reg, rollback=rollback, dmabuf=lambda: rt.dmabuf_fd(addr, n))
        if served:
            self._served_gpu.add(addr)
        return addr

    def _server_stages_gpu(self, rt: DeviceRuntime) -> bool:
        """Whether the C++ server can serve GPU memory of ``rt`` to TCP peers: the CUDA driver loads
        in it (the same driver the runtime's memory belongs to: a real CUDA runtime)."""
        from kvpool.transfer.cuda_driver import ENV, DriverRuntime

        if not isinstance(rt, (DriverRuntime, TorchCudaRuntime, CupyCudaRuntime)):
            return False
        return bool(_native.cuda_init(self.config.cuda_driver or os.environ.get(ENV, "")))

    def _add_registration(self, reg: Registration, rollback: Any = None, dmabuf: Any = None) -> None:
        """Bookkeeping, then every transport that moves this kind of memory; all or nothing."""
        d = reg.desc
        done: list[Transport] = []
        try:
            self._registry.add(reg)
            kind = d.location.partition(":")[0]
            for t in self._transports:
                if kind in t.locations:
                    t.register(d.addr, d.length, d.location, d.remote_accessible, not reg.read_only, dmabuf)
                    done.append(t)
        except BaseException:
            for t in done:
                t.unregister(d.addr)
            if self._registry.get(d.addr) is reg:
                self._registry.remove(d.addr)
            if rollback is not None:
                rollback()
            raise
        if d.remote_accessible:  # local-only memory is not published: registering it is cheap
            self._publish()

    def alloc_shared_buffer(self, size: int, name: str = "kvpool") -> memoryview:
        """Allocate ``size`` bytes of shared memory (memfd), pre-faulted and registered as
        remote-accessible. Same-host peers map it and copy with plain (non-temporal) stores instead
        of ``process_vm_writev``; everyone else reaches it like any registered buffer.
        Unregister with :meth:`unregister_local_memory`."""
        if not isinstance(size, int) or size <= 0:
            raise InvalidArgument("size must be a positive integer")
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mem = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except OSError as exc:
            os.close(fd)
            raise InvalidArgument(f"cannot allocate {size} bytes of shared memory: {exc}") from None
        try:  # every page mapped writable now (MAP_POPULATE maps a shared mapping read-only,
            mem.madvise(MADV_POPULATE_WRITE)  # and each first write would still fault)
        except OSError:
            pass  # Linux < 5.14: pages come on first use
        view = memoryview(mem)
        addr = _native.buffer_address(view)[0]
        slot, gen, rid = self._native.register_memory(addr, size, True, False)
        desc = BufferDescriptor(addr, size, "cpu:0", True, fd, fence_slot=slot, fence_gen=gen, reg_id=rid)
        reg = Registration(desc, (mem, view, fd))
        self._add_registration(reg, rollback=lambda: (self._native.unregister_memory(addr), os.close(fd)))
        return view

    def unregister_local_memory(self, addr_or_buffer: Any) -> None:
        """Unregister memory previously registered at this address (or buffer).

        Once this returns, no peer lands bytes in the range. A same-host peer stopped inside a copy
        into it (its fence pin not released within ``timeout_s``) raises
        :class:`RegistrationError`: the range is then unregistered and unpublished all the same
        and no new copy starts, but the caller must not free or reuse the memory until that peer
        continues or exits (registering the range again raises :class:`RegistrationError` until
        then). So do our own CUDA IPC copies of GPU memory still running after
        ``timeout_s`` (a hung stream): free it only once they finished. GPU memory that a staged
        transfer still touches (a submit in progress, a staged request not finished) raises
        :class:`BatchInFlight` and stays registered; a staged submit starting meanwhile is refused
        (:class:`AddressNotRegistered`)."""
        dev = None if isinstance(addr_or_buffer, int) else device_buffer(addr_or_buffer, None)
        addr = (
            addr_or_buffer
            if isinstance(addr_or_buffer, int)
            else dev[0]
            if dev is not None
            else buffer_range(addr_or_buffer, allow_read_only=True)[0]
        )
        reg = self._registry.get(addr)
        if reg is not None and reg.gpu:
            self._staging.close_range(reg.start, reg.end)  # BatchInFlight while staging touches it
            try:
                if addr in self._served_gpu:
                    try:
                        self._native.unregister_memory(addr)  # waits for the server's staging copies
                    except RegistrationError:
                        # as for host memory below: unregistered natively, but still pinned
                        self._served_gpu.discard(addr)
                        self._fenced.append(reg.keep)
                        self._forget(addr, reg)
                        raise
                    self._served_gpu.discard(addr)
                self._forget(addr, reg)
            finally:
                self._staging.reopen(reg.start, reg.end)  # gone (or kept after a failure) by now
            return
        try:
            self._native.unregister_memory(addr)  # waits for in-flight remote access to the range
        except RegistrationError:
            # Unregistered and fenced natively (no new copy starts), but a stopped same-host peer
            # still pins the range: finish unregistering here too (unpublished, gone from the
            # transports), keep the memory referenced, then raise.
            if reg is None:
                raise
            self._fenced.append(reg.keep)
            self._forget(addr, reg)
            raise
        self._forget(addr, reg)

    def _forget(self, addr: int, reg: Registration | None) -> None:
        """After the native unregister of ``addr``: transports, bookkeeping, the published
        descriptor and a shared buffer's fd (called by :meth:`unregister_local_memory`)."""
        kind = reg.desc.location.partition(":")[0] if reg is not None else "cpu"
        failed = None
        for t in self._transports:
            if kind in t.locations:
                try:
                    t.unregister(addr)
                except RegistrationError as exc:  # our copies outlived the timeout: finish, keep, raise
                    failed = exc
        self._registry.remove(addr)
        if reg is None or reg.desc.remote_accessible:
            self._publish()
        if reg is not None and reg.desc.shm_fd >= 0:
            os.close(reg.desc.shm_fd)  # peers' mappings keep the pages alive; ours goes with the view
        if failed is not None:
            if reg is not None:
                self._fenced.append(reg.keep)
            raise failed
