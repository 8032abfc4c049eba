"""The one interface every transport implements (tcp, same-host, rdma; cuda-ipc next).

A transport moves the bytes of READ/WRITE requests between this process's registered memory and a
peer segment, and reports each request's completion into the batch slot the engine gave it. The
:class:`~kvpool.transfer.engine.TransferEngine` owns everything around that: configuration,
registration bookkeeping, descriptor publish/fetch, the segment cache, request validation, picking
a transport per target (same host -> same-host; RDMA when both sides have it; else TCP) and the
batches themselves (:class:`~kvpool.transfer.batch.Batches`: a fixed array of slots per batch that
transports complete from their own threads; the engine only polls or waits on it).

GPU memory is a *location*, not a transport: a transport lists the memory kinds it moves directly in
:attr:`Transport.locations`; for one that moves host memory only, the engine wraps it in
:class:`~kvpool.transfer.staging.GpuStaging` (pinned staging on submit / completion).

Requests reach a transport as :class:`Requests`: columns of equal length, no per-request objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

from kvpool import _native
from kvpool.transfer.types import SegmentDescriptor, TransferStatus

READ: int = _native.OP_READ
"""Opcode of a READ in request columns (remote -> local)."""
WRITE: int = _native.OP_WRITE
"""Opcode of a WRITE in request columns (local -> remote)."""


class Requests(NamedTuple):
    """Request columns of equal length: ``ops`` (:data:`READ`/:data:`WRITE`), ``locs`` (local
    addresses), ``peers`` (segment handle ids), ``rems`` (remote addresses), ``lens`` (bytes).

    The engine type-checked every column (ints, positive lengths); addresses and lengths are not yet
    checked against registrations: that is the transport's job, all or nothing. ``locs``, ``rems``
    and ``lens`` are numpy uint64 arrays (not lists) only for a transport that
    :attr:`~Transport.takes_arrays`.
    """

    ops: list[int]
    locs: list[int]
    peers: list[int]
    rems: list[int]
    lens: list[int]

    def part(self, a: int, b: int) -> Requests:
        """Requests ``a`` to ``b - 1``."""
        return Requests(*(c[a:b] for c in self))


class Transport(ABC):
    """One way of moving bytes to peers (see the module docstring).

    Lifecycle: the engine constructs its transports when it starts, calls :meth:`register` /
    :meth:`unregister` for every registration, :meth:`reaches` and :meth:`attach` when a segment is
    opened (or re-opened after a restart), :meth:`submit` for each run of requests it routes here,
    :meth:`detach` when a segment is closed and :meth:`close` once, when the engine closes.
    Methods may be called from any user thread, concurrently; none may block on the network except
    :meth:`submit` waiting for queue room and :meth:`transfer_inline`.
    """

    name: ClassVar[str]
    """Protocol name published in the segment descriptor's ``protocols`` (``"tcp"`` ...)."""

    locations: ClassVar[frozenset[str]] = frozenset({"cpu"})
    """Memory kinds (``"cpu"``, ``"cuda"``) it reads and writes directly, locally and remotely."""

    takes_arrays: ClassVar[bool] = False
    """Whether :meth:`submit` accepts ``locs``/``rems``/``lens`` as contiguous numpy uint64 arrays
    (the engine then passes big batches as columns, with no per-request Python objects)."""

    def describe(self) -> dict[str, Any]:
        """Extra :class:`SegmentDescriptor` fields this transport publishes (e.g. ``{"rdma": ...}``).

        Called by the engine whenever it publishes its descriptor (each remote-accessible
        registration change). Cheap; must not do I/O.
        """
        return {}

    def register(  # noqa: B027 - optional hook
        self, addr: int, length: int, location: str, remote: bool, writable: bool, dmabuf: Any = None
    ) -> None:
        """Make ``[addr, addr+length)`` usable by this transport (e.g. an RDMA memory region).

        Called once per registration, after the engine's own bookkeeping accepted it, for host
        memory and for GPU memory when ``"cuda"`` is in :attr:`locations`. ``dmabuf()`` gives
        ``(fd, offset)`` of a DMA-BUF for GPU memory or None. Raises a :class:`~kvpool.errors.KvpoolError`
        to refuse (the engine rolls the registration back).
        """

    def unregister(self, addr: int) -> None:  # noqa: B027 - optional hook
        """Forget the registration starting at ``addr`` (called once per successful register)."""

    @abstractmethod
    def reaches(self, desc: SegmentDescriptor, local: str = "cpu", remote: str = "cpu") -> bool:
        """Whether this transport can move ``local``-kind memory here to ``remote``-kind memory of
        the peer described by ``desc``. Called by the engine when it picks a transport for a segment
        (in order of preference; the first that reaches wins). Pure; no I/O."""

    def peer_pid(self, desc: SegmentDescriptor) -> int:
        """The pid the native path copies into directly (same host), or 0 (over the wire). Called
        by the engine on open and on every refresh, once, before :meth:`attach`: its
        ``add_peer``/``update_peer`` is the only one per refresh (each pid change there reopens the
        native pidfd). Pure; no I/O."""
        return 0

    def attach(self, handle: int, name: str, desc: SegmentDescriptor) -> None:  # noqa: B027 - optional hook
        """The engine routes segment ``handle`` (already in the native peer table) through this
        transport from now on; ``desc`` is its current descriptor. Called on open and on every
        refresh after a restart; may connect lazily. Raises a typed error to refuse."""

    def detach(self, handle: int) -> None:  # noqa: B027 - optional hook
        """Segment ``handle`` is closed or routed elsewhere: drop its connections and state."""

    def peer_gone(self, handle: int) -> bool:
        """Whether this transport saw the process behind segment ``handle`` exit (a restart the
        native peer table cannot see, e.g. no connection was ever made). Called by
        ``open_segment`` on every cached open, so it must be cheap; True makes it re-fetch."""
        return False

    def needs_staging(self, handle: int, locs: Any, rems: Any, lens: Any) -> bool:
        """For a transport whose ``locations`` include "cuda": whether some of these requests
        still go through GPU staging (the engine's synchronous transfers then cut them into
        rounds that fit the pool). Called by ``batch_transfer_sync`` / ``transfer_sync``."""
        return False

    def release_exited(self) -> list[int]:
        """Let go of what this transport holds of peers whose process exited (e.g. a dead peer's
        shared memory, which stays allocated while it is mapped here); returns their handles,
        which ``open_segment`` re-fetches on their next use. Called by the engine under its lock
        when a segment is attached and by :meth:`TransferEngine.release_exited_peers` (a store
        client's heartbeat); cheap when nothing exited."""
        return []

    @abstractmethod
    def submit(
        self, batch_id: int, reqs: Requests, stage_wait_s: float | None = None, waited: bool = False
    ) -> None:
        """Queue requests into the next free slots of batch ``batch_id``, in order, and complete
        each slot when its bytes have moved (or failed) — from the transport's own threads, never
        by waiting in the caller.

        Validates every request first (local range registered, writable for READs; remote range
        inside the peer's remote-accessible buffers; peer known) and raises
        :class:`~kvpool.errors.AddressNotRegistered`, :class:`~kvpool.errors.RemoteAccessError`,
        :class:`~kvpool.errors.SegmentNotFound` or :class:`~kvpool.errors.InvalidArgument` (also
        for a full batch) before anything is sent. Called by the engine from the submitting thread,
        once per run of requests routed here; must not hold locks across network I/O.
        Python transports take their slots with ``Batches.reserve`` and complete them with
        ``Batches.finish``; native ones complete them in C++.

        ``stage_wait_s`` is set by the engine's synchronous transfers, for each round: a
        transport whose ``locations`` include "cuda" and that stages some GPU ranges itself
        (CUDA IPC to a peer's host memory) waits up to that long for room in the staging pool
        (TransferTimeout after) instead of raising InvalidArgument at once (None). Transports
        that do not stage ignore it.

        ``waited``: the caller waits for the batch right after this call (the engine's
        synchronous transfers, one segment per batch). A transport may then finish short
        requests in the caller's thread before it returns (CUDA IPC: a run whose copies end
        within microseconds), never for longer than a moment: what has not ended by then is
        completed by its own threads as usual. Others ignore it.
        """

    def unbounded(self, batch_id: int) -> bool:
        """Whether requests of batch ``batch_id`` that no deadline of this transport ends are
        still queued or running here (GPU copies: a hung stream never finishes them) *and* the
        queue they wait in did not move since the previous call for this batch (the first call:
        since they were queued); a queue whose requests ahead keep finishing is not hung. Called
        by the engine's synchronous transfers, each time their wait outlived ``timeout_s`` more:
        True makes them raise TransferTimeout instead of waiting on. Default False: the
        transport ends every request by its own deadlines (FAILED/TIMEOUT)."""
        return False

    def transfer_inline(
        self,
        op: int,
        handle: int,
        locals_: Sequence[int],
        remotes: Sequence[int],
        lens: Sequence[int],
        scratch: tuple[int, int, bool] | None = None,
    ) -> TransferStatus | None:
        """Optional fast path for a few requests of one opcode to one segment, done in the
        calling thread and waited for (``transfer_sync``, short ``batch_transfer_sync``).

        ``scratch``: (address, length, read_only) of host memory some local ranges lie in that
        is not registered yet; the transport registers it local-only for this call alone (or
        returns None). Returns the final status (the first failure's, if any), or None when the
        transport has no such path (the engine then uses a batch). Validation errors raise as in
        :meth:`submit`.
        """
        return None

    def transfer_inline_parts(
        self, op: int, parts: Sequence[tuple[int, Sequence[int], Sequence[int], Sequence[int]]]
    ) -> TransferStatus | None:
        """Optional: several ``(handle, locals, remotes, lengths)`` parts of one opcode, each a
        few requests as :meth:`transfer_inline` takes, done in the calling thread one after the
        other and waited for (a resharded KV load reads every source rank). Returns the first
        failure's status (later parts not started) or COMPLETED, or None when the transport has
        no such path or a descriptor was stale (the engine then uses a batch for every part;
        parts already done are moved again, which READs and WRITEs of the same bytes allow).
        Called by the engine's ``batch_transfer_sync_multi``."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop threads and release resources; pending requests end CANCELED or FAILED. Called once,
        by TransferEngine.close, which closes the rest and re-raises when this raises a kvpool
        error (memory a copy still uses, e.g. on a hung GPU stream, stays until the copy ends)."""
