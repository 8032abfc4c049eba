"""The transfer engine: register memory, open segments, submit batches of READ/WRITE, poll, free.

The engine moves no bytes. It holds the configuration, the registration bookkeeping, descriptor
publishing and fetching, the segment cache, request validation and the batches, and for every
target segment picks one :class:`~kvpool.transfer.transport.Transport` — same-host when the peer
runs on this host, RDMA when both sides have it, else TCP — to which it dispatches requests.
Transports complete the batch slots from their own threads (:mod:`kvpool.transfer.batch`); GPU
local memory reaches host-only transports through pinned staging (:mod:`kvpool.transfer.staging`).
The blocking calls (``transfer_sync``, ``batch_transfer_sync``, ...) are in :mod:`kvpool.transfer.sync`,
opening, refreshing and closing segments in :mod:`kvpool.transfer.segments`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from kvpool import _native
from kvpool.config import TransferConfig
from kvpool.errors import (
    InvalidArgument,
    KvpoolError,
    RemoteAccessError,
    SubmitIncomplete,
    TransferError,
    TransferTimeout,
)
from kvpool.transfer.batch import Batches
from kvpool.transfer.device import DeviceRuntime
from kvpool.transfer.memory import LocalRegistry, buffer_range, check_requests
from kvpool.transfer.metadata import MetadataBackend, open_metadata
from kvpool.transfer.registrations import Registrations
from kvpool.transfer.same_host import SameHostTransport
from kvpool.transfer.segments import RefetchGate, Segments, split_host_port
from kvpool.transfer.staging import GpuStaging
from kvpool.transfer.sync import INLINE_MAX, SyncTransfers, native_op
from kvpool.transfer.tcp import TcpTransport
from kvpool.transfer.transport import Requests, Transport
from kvpool.transfer.types import (
    SegmentDescriptor,
    SegmentHandle,
    TransferRequest,
    TransferState,
    TransferStatus,
    host_id,
)

__all__ = ["INLINE_MAX", "TransferEngine", "buffer_range", "split_host_port"]

log = logging.getLogger("kvpool.transfer")


class TransferEngine(Registrations, Segments, SyncTransfers):
    """Batch transfer API over TCP, the same-host path and RDMA (one :class:`Transport` each).

    The engine starts serving at once on ``hostname`` (only that address is bound).
    ``segment_name`` is the name peers pass to :meth:`open_segment`: for p2p metadata always
    ``"host:port"``; with a metadata server ``name`` or, by default, ``"host:port"``.

    Args:
        hostname: address to listen on and publish.
        metadata: ``"p2p"``, ``http://host:port/metadata``, ``etcd://host:2379`` or ``redis://host:6379``.
        protocol: ``"auto"``, ``"tcp"`` or ``"rdma"``.
        devices: RDMA device allow-list.
        name: segment name to publish through a metadata server.
        config: a full :class:`TransferConfig`; keyword arguments override its fields.
        device_runtime: a CUDA runtime object (:class:`~kvpool.transfer.device.DeviceRuntime`) to
            use for ``cuda:N`` memory instead of the one ``config.device_runtime`` selects; a string
            sets that config field. Tests pass a driver runtime over the fake driver
            (:mod:`kvpool.testing.fakecuda`) here.
        verbs: the RDMA verbs layer to use instead of pyverbs (a module or namespace with pyverbs'
            surface); tests pass :mod:`kvpool.testing.fake_verbs`.
        **kwargs: any other :class:`TransferConfig` field (``secret``, ``timeout_s``, ``lanes`` ...).
    """

    def __init__(
        self,
        hostname: str | None = None,
        metadata: str | None = None,
        protocol: str | None = None,
        devices: list[str] | None = None,
        name: str | None = None,
        *,
        config: TransferConfig | None = None,
        device_runtime: DeviceRuntime | str | None = None,
        verbs: Any = None,
        **kwargs: Any,
    ) -> None:
        overrides = {
            k: v
            for k, v in dict(
                hostname=hostname, metadata=metadata, protocol=protocol, devices=devices, name=name
            ).items()
            if v is not None
        }
        if isinstance(device_runtime, str):
            overrides["device_runtime"] = device_runtime
            device_runtime = None
        overrides.update(kwargs)
        cfg = config.replace(**overrides) if config is not None else TransferConfig(**overrides)
        self.config = cfg
        self._lock = threading.RLock()
        self._meta: MetadataBackend | None = open_metadata(
            cfg.metadata, timeout_s=cfg.connect_timeout_s, secret=cfg.secret
        )
        self._native = _native.NativeEngine(
            host=cfg.hostname,
            port=cfg.port,
            secret=cfg.secret or "",
            lanes=cfg.lanes,
            slice_size=cfg.slice_size,
            timeout_ms=int(cfg.timeout_s * 1000),
            connect_timeout_ms=int(cfg.connect_timeout_s * 1000),
            max_frame=cfg.max_frame,
            server_threads=cfg.server_threads,
            max_connections=cfg.max_connections,
            max_connections_per_peer=cfg.max_connections_per_peer,
            idle_timeout_ms=int(cfg.idle_timeout_s * 1000),
        )
        self.port: int = self._native.port
        host = f"[{cfg.hostname}]" if ":" in cfg.hostname else cfg.hostname
        self.endpoint = f"{host}:{self.port}"
        self.segment_name: str = self.endpoint if self._meta is None else (cfg.name or self.endpoint)
        self._closed = False
        self.batches = Batches(self._native)
        self._registry = LocalRegistry()
        self._segments: dict[str, tuple[SegmentHandle, SegmentDescriptor]] = {}
        self._handles: dict[int, str] = {}
        self._routes: dict[int, Transport] = {}  # segment handle -> the transport that reaches it
        # one fetch of a peer's descriptor at a time; none for a while after a failed one
        self._refetch = RefetchGate(cfg.connect_timeout_s)
        self._served_gpu: set[int] = set()  # GPU registrations the C++ server stages for TCP peers
        # buffers a stopped same-host peer may still copy into after their unregister raised: kept
        # referenced for the engine's life (grows only by such failures)
        self._fenced: list[Any] = []
        self._device_rt: DeviceRuntime | None = device_runtime
        self._staging = GpuStaging(
            lambda: self.device_runtime,
            cfg.staging_pool_size,
            self.batches,
            self._registry,
            lambda addr, n: self._native.register_memory(addr, n, False, False),
            self._check_all,
        )
        # Transports this engine runs (published in its descriptor), and those it initiates with, in
        # order of preference.
        tcp = TcpTransport(self._native)
        same_host = SameHostTransport(self._native)
        self._rdma: Any = None
        if cfg.protocol in ("rdma", "auto"):
            from kvpool.transfer.rdma.transport import start_rdma  # pyverbs only when asked for

            try:
                self._rdma = start_rdma(
                    cfg, self._native.incarnation, self.batches, verbs, origin=self.segment_name
                )
            except BaseException:
                self._native.shutdown()
                raise
        rdma = [self._rdma] if self._rdma is not None else []
        self._transports: list[Transport] = [tcp, same_host, *rdma]
        local: Transport = same_host
        if cfg.protocol == "auto" and cfg.same_host:
            ipc = self._start_cuda_ipc(same_host)
            if ipc is not None:  # GPU memory of same-host peers: copied by the GPU
                self._transports.append(ipc)
                local = ipc
        if cfg.protocol == "tcp":
            self._preferred: list[Transport] = [tcp]
        elif cfg.protocol == "rdma":
            self._preferred = rdma
        else:  # auto: same host first, then RDMA when both sides run it, else TCP
            self._preferred = ([local] if cfg.same_host else []) + rdma + [tcp]
        self._publish()

    def _start_cuda_ipc(self, same_host: Transport) -> Transport | None:
        """The CUDA IPC transport when a CUDA driver loads and sees a device (else None: every
        CPU behaviour unchanged). With an injected device runtime (tests), only when the runtime
        is backed by that driver."""
        from kvpool.transfer.cuda_driver import DriverRuntime, load_driver

        if self._device_rt is not None and not isinstance(self._device_rt, DriverRuntime):
            return None
        driver = load_driver(self.config.cuda_driver)
        if driver is None:
            return None
        from kvpool.transfer.cuda_ipc import CudaIpcTransport

        if self._device_rt is None and self.config.device_runtime in ("auto", "driver"):
            self._device_rt = DriverRuntime(driver)
        try:
            reg = self._registry
            st = self._staging
            return CudaIpcTransport(
                self._native, driver, self.batches, reg, same_host, st, self.config.timeout_s
            )
        except KvpoolError as exc:
            log.warning("CUDA IPC path off: %s", exc)
            return None

    @property
    def rdma(self) -> Any:
        """The RDMA transport (:class:`kvpool.transfer.rdma.transport.RdmaTransport`) or None."""
        return self._rdma

    @property
    def staging(self) -> GpuStaging:
        """Pinned staging of GPU memory for host-only transports (:class:`GpuStaging`)."""
        return self._staging

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop serving, cancel queued transfers and withdraw the descriptor. A transport that
        could not close (CUDA IPC copies on a hung GPU stream, or staged copies on a hung GPU:
        TransferTimeout) does not stop the rest from closing; its error is raised at the end."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        failed: list[KvpoolError] = []
        for t in self._transports:
            try:
                t.close()
            except KvpoolError as exc:
                failed.append(exc)
        self._native.shutdown()
        try:
            self._staging.close(self.config.timeout_s)
        except KvpoolError as exc:
            failed.append(exc)
        if self._meta is not None:
            try:
                self._meta.delete(self.segment_name)
            except KvpoolError as exc:
                log.warning("could not withdraw descriptor of %s: %s", self.segment_name, exc)
            self._meta.close()
        if failed:
            raise failed[0]

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                if self._rdma is not None:
                    self._rdma.close()
                self._native.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def incarnation(self) -> int:
        """Random id of this engine instance; peers use it to notice restarts."""
        return self._native.incarnation

    def local_descriptor(self) -> SegmentDescriptor:
        """The descriptor this engine publishes."""
        fields: dict[str, Any] = {}
        for t in self._transports:
            fields.update(t.describe())
        return SegmentDescriptor(
            name=self.segment_name,
            hostname=self.config.hostname,
            port=self.port,
            host_id=host_id(),
            pid=os.getpid(),
            incarnation=self.incarnation,
            buffers=self._registry.published(),
            protocols=[t.name for t in self._transports],
            **fields,
        )

    def _publish(self) -> None:
        blob = self.local_descriptor().to_bytes(self.config.secret)  # signed when there is a secret
        self._native.set_descriptor(blob)
        if self._meta is not None:
            self._meta.put(self.segment_name, blob)

    # ------------------------------------------------------------------ batches
    def allocate_batch_id(self, batch_size: int) -> int:
        """Allocate a batch with ``batch_size`` request slots."""
        if not isinstance(batch_size, int) or batch_size <= 0 or batch_size >= 1 << 32:
            raise InvalidArgument("batch_size must be a positive integer")
        return self.batches.alloc(batch_size)

    def free_batch_id(self, batch_id: int) -> None:
        """Free a batch; raises :class:`BatchInFlight` while any of its transfers is pending."""
        self.batches.free(batch_id)

    def submit_transfer(self, batch_id: int, requests: Sequence[TransferRequest]) -> None:
        """Queue requests into the next free slots of a batch (all-or-nothing validation).

        Raises :class:`AddressNotRegistered`, :class:`RemoteAccessError`, :class:`SegmentNotFound`
        or :class:`InvalidArgument` before anything is sent: nothing of the submit runs. A
        failure found only after part of it was queued (a CUDA call failing while GPU copies
        were queued, no room in the staging pool for a later part, a later transport's run
        refused) raises :class:`SubmitIncomplete` instead (``batch_id``: this batch; the
        original error is its cause): the queued part runs on in the batch's slots, so wait
        for the batch before reusing or freeing the memory it names.
        """
        n = len(requests)
        ops = [0] * n
        locs = [0] * n
        peers = [0] * n
        rems = [0] * n
        lens = [0] * n
        try:
            for i, r in enumerate(requests):
                ops[i] = native_op(r.opcode)
                locs[i] = r.source
                peers[i] = int(r.target_id)
                rems[i] = r.target_offset
                lens[i] = r.length
                if r.length <= 0 or r.source < 0 or r.target_offset < 0:
                    raise ValueError(f"request {i}: length must be positive and addresses non-negative")
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            raise InvalidArgument(f"bad transfer request: {exc}") from None
        taken = self.batches.reserve(batch_id, [])  # slots in use before (unknown batch: raises)
        try:
            self._submit(batch_id, Requests(ops, locs, peers, rems, lens))
        except KvpoolError as exc:
            if isinstance(exc, SubmitIncomplete):
                raise
            # slots the failed submit took that run or ran (a refused part's end FAILED at once)
            live = (TransferState.PENDING, TransferState.COMPLETED)
            now = self.batches.reserve(batch_id, [])
            queued = sum(self.batches.status(batch_id, i).state in live for i in range(taken, now))
            if not queued:
                raise
            err = SubmitIncomplete(
                f"{exc} (raised after {queued} of the {n} requests were queued into batch {batch_id}: "
                "they run on and may still read or write their memory until the batch is no longer "
                "pending; wait_batch before reusing it)"
            )
            err.batch_id = batch_id
            raise err from exc

    def _check_all(self, reqs: Requests) -> None:
        """Validate requests against our registrations and the peers' descriptors (sends nothing)."""
        with self._lock:
            descs = {hid: self._segments[name][1] for hid, name in self._handles.items()}
        check_requests(self._registry, descs, reqs)

    def _submit(
        self, batch_id: int, reqs: Requests, stage_wait_s: float | None = None, again: bool = True,
        waited: bool = False,
    ) -> None:  # fmt: skip
        """Dispatch type-checked requests: each run of requests to the transport that reaches its
        segment, through GPU staging when a local range is GPU memory the transport cannot touch.
        A run is validated by its transport; with several runs, the engine checks every request
        first so that nothing is sent unless all are valid. ``waited``: the caller waits for the
        batch next (see Transport.submit); passed on when the requests are one transport's run."""
        peers = reqs.peers
        n = len(peers)
        if n == 0:
            self.batches.reserve(batch_id, [])  # nothing to queue; an unknown batch still raises
            return
        first = peers[0]
        one = peers.count(first) == n
        self._refresh_stale({first} if one else set(peers))
        if one:  # the common case: one segment, one transport, no per-request work
            runs = [(0, n, self._route(first))]
        else:
            routes = [self._route(p) for p in peers]
            runs = []
            start = 0
            for i in range(1, n + 1):
                if i == n or routes[i] is not routes[start]:
                    runs.append((start, i, routes[start]))
                    start = i
        taken = self.batches.reserve(batch_id, []) if again else 0  # the batch's slots in use
        try:
            if len(runs) > 1:
                self._check_all(reqs)
            self._submit_run(batch_id, reqs, *runs[0], stage_wait_s, waited and len(runs) == 1)
        except RemoteAccessError:
            # A range outside the cached descriptor: submit again only when nothing was queued
            # (a CUDA IPC part refused after another part of the run was queued: not twice) and
            # the owner's descriptor changed (it decides again, on the new one).
            if not again or self.batches.reserve(batch_id, []) != taken or not self._view_changed(set(peers)):
                raise
            self._submit(batch_id, reqs, stage_wait_s, again=False, waited=waited)
            return
        for a, b, t in runs[1:]:
            self._submit_run(batch_id, reqs, a, b, t, stage_wait_s)

    def _submit_run(
        self, batch_id: int, reqs: Requests, a: int, b: int, t: Transport, stage_wait_s: float | None,
        waited: bool = False,
    ) -> None:  # fmt: skip
        """Queue requests ``a`` to ``b`` (one transport's run) into the batch."""
        part = reqs if b - a == len(reqs.peers) else reqs.part(a, b)
        if (
            self._registry.gpu_count
            and "cuda" not in t.locations
            and self._staging.needed(part.locs, part.lens)
        ):
            self._staging.submit(t, batch_id, part, wait_s=stage_wait_s)
        else:
            t.submit(batch_id, part, stage_wait_s, waited)  # not None: a round of batch_transfer_sync

    def get_transfer_status(self, batch_id: int, index: int) -> TransferStatus:
        """Status of request ``index`` of a batch."""
        return self.batches.status(batch_id, index)

    def get_batch_status(self, batch_id: int) -> TransferStatus:
        """Whole-batch status: PENDING while any request is, else COMPLETED or the first failure."""
        return self.batches.batch_status(batch_id)

    def wait_batch(self, batch_id: int, timeout_s: float | None = None) -> TransferStatus:
        """Block (GIL released) until every submitted request of the batch finished, or timeout."""
        return self.batches.wait(batch_id, timeout_s)

    async def wait_batch_async(self, batch_id: int, timeout_s: float | None = None) -> TransferStatus:
        """Awaitable :meth:`wait_batch` for asyncio users (waits in a worker thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.wait_batch, batch_id, timeout_s)

    def _raise_failures(self, batch_id: int, n: int) -> None:
        """Raise the failures of a synchronous call's finished batch (its ``n`` requests):
        TransferTimeout where any request timed out, even when others failed otherwise (a
        stalled peer may still apply WRITE frames it received: a caller must not treat the
        batch as drained), else TransferError. The message names the first failure, and the
        first timeout where that is another request."""
        failed = []
        for i in range(n):
            st = self.get_transfer_status(batch_id, i)
            if not st.ok:
                failed.append((i, st))
        if failed:
            i, st = failed[0]
            msg = f"{len(failed)} of {n} requests failed; request {i}: {st.state.name}: {st.error}"
            timed_out = [(j, s) for j, s in failed if s.state == TransferState.TIMEOUT]
            if not timed_out:
                raise TransferError(msg)
            j, s = timed_out[0]
            if j != i:
                msg += f"; {len(timed_out)} timed out, request {j}: {s.error}"
            raise TransferTimeout(msg)

    # ------------------------------------------------------------------ Mooncake-style aliases
    registerLocalMemory = Registrations.register_local_memory  # noqa: N815
    unregisterLocalMemory = Registrations.unregister_local_memory  # noqa: N815
    openSegment = Segments.open_segment  # noqa: N815
    closeSegment = Segments.close_segment  # noqa: N815
    allocateBatchID = allocate_batch_id  # noqa: N815
    submitTransfer = submit_transfer  # noqa: N815
    getTransferStatus = get_transfer_status  # noqa: N815
    freeBatchID = free_batch_id  # noqa: N815
    transferSync = SyncTransfers.transfer_sync  # noqa: N815
    batchTransferSync = SyncTransfers.batch_transfer_sync  # noqa: N815
