"""Typed errors raised by kvpool.

Every error derives from :class:`KvpoolError` and its message says what to do about it.
"""

from __future__ import annotations


class KvpoolError(Exception):
    """Base class of every error kvpool raises."""


class InvalidArgument(KvpoolError, ValueError):
    """An argument is malformed or out of range (zero length, bad opcode, wrong type...)."""


class InvalidType(InvalidArgument, TypeError):
    """An argument has the wrong type (the message names the parameter and the type expected)."""


class ConfigError(InvalidArgument):
    """A configuration value is invalid; fix the keyword, JSON file or KVPOOL_* variable named."""


class AddressNotRegistered(KvpoolError):
    """A local address range is not inside memory registered with ``register_local_memory``."""


class RegistrationError(KvpoolError):
    """Memory could not be registered (overlap with an existing registration, bad buffer)."""


class RemoteAccessError(KvpoolError):
    """A remote range is outside the buffers the target registered as remote-accessible."""


class SegmentNotFound(KvpoolError):
    """No segment with that name is published, or its owner cannot be reached."""


class MetadataError(KvpoolError):
    """The metadata backend (http, etcd, redis) failed or returned bad data."""


class AuthenticationError(KvpoolError):
    """A peer refused our shared secret, or presented a wrong one."""


class TransferError(KvpoolError):
    """A transfer failed; the message carries the per-request reason."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not complete within the configured timeout (peer gone or stalled). A
    synchronous call raises it where any of its requests timed out, even when others failed
    otherwise: a stalled peer may still apply what it received of the call (TCP WRITE frames).

    ``batch_id``: set where copies of the call may still run after it raised (a synchronous
    call's batch whose GPU copies outlived ``timeout_s``: a hung stream); they may still write
    the local memory until :meth:`~kvpool.transfer.engine.TransferEngine.batch_settled` answers
    True for it. None where nothing of the call is still in flight."""

    batch_id: int | None = None


class SubmitIncomplete(TransferError):
    """``submit_transfer`` failed after part of it was already queued (a CUDA call failing
    while a run of GPU copies was queued, the staging pool full for a later part, a later
    transport's run refused): the message names the failure (the original exception is its
    ``__cause__``). The requests queued before it run on (their slots in the batch are PENDING,
    then COMPLETED or FAILED; the refused ones took no slot or end FAILED): they may still read
    or write the local memory until ``wait_batch`` / ``batch_settled`` says the batch
    ``batch_id`` is no longer pending. A failure found before anything was queued raises the
    plain error instead (nothing of the submit runs)."""

    batch_id: int | None = None


def late_batch(exc: BaseException | None) -> int | None:
    """The ``batch_id`` of a TransferTimeout or SubmitIncomplete whose copies may still run
    (see :class:`TransferTimeout`), else None: what a caller holding the memory waits on
    (``TransferEngine.batch_settled``) before handing it to anyone else."""
    return exc.batch_id if isinstance(exc, (TransferTimeout, SubmitIncomplete)) else None


class BatchInFlight(KvpoolError):
    """A batch still has transfers in flight; wait for it before freeing it."""


class ProtocolError(KvpoolError):
    """A peer sent bytes that are not a valid kvpool frame."""


class ProtocolUnavailable(KvpoolError):
    """The requested transport cannot be used here (e.g. RDMA without pyverbs or a device)."""


class RdmaConnectError(KvpoolError):
    """An RDMA queue pair could not be connected (QP state transition, GID index, MTU, peer RPC)."""


class StoreError(KvpoolError):
    """Base class of errors from the distributed store."""


class ObjectNotFound(StoreError, KeyError):
    """No committed object under that key (never put, removed, evicted, or its replicas were lost)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "object not found"


class ObjectExists(StoreError):
    """The key is already committed or being put; objects are immutable - remove it first."""


class ObjectBusy(StoreError):
    """The object is leased by a reader or not yet committed; retry after the lease expires."""


class StoreFull(StoreError):
    """No mounted segment has room for the object, even after eviction; add segments or free space."""


class MasterUnavailable(StoreError):
    """The store master did not answer within rpc_timeout_s; check that `kvpool master` is running."""


class BatchTooLarge(InvalidArgument):
    """A request carries more keys than the master handles in one request (``max_batch``): split it
    (the :class:`kvpool.Store` batch calls do this by themselves)."""


class Fenced(StoreError):
    """An allocation, reservation or cached location is no longer current (the master restarted, or
    ``put_timeout_s`` passed, or it belongs to another client): start the put or get over."""


class ObjectChanged(StoreError):
    """The object was removed, evicted or replaced while it was being read (its header or lease no
    longer matched after the bytes landed, on every try): get it again."""


class ObjectCorrupt(StoreError):
    """Every readable copy of the object failed its checksum (damaged in its segment); the copies
    were reported to the master and dropped: put the object again."""


__all__ = [
    "KvpoolError",
    "InvalidArgument",
    "InvalidType",
    "ConfigError",
    "AddressNotRegistered",
    "RegistrationError",
    "RemoteAccessError",
    "SegmentNotFound",
    "MetadataError",
    "AuthenticationError",
    "TransferError",
    "TransferTimeout",
    "SubmitIncomplete",
    "BatchInFlight",
    "ProtocolError",
    "ProtocolUnavailable",
    "RdmaConnectError",
    "StoreError",
    "ObjectNotFound",
    "ObjectExists",
    "ObjectBusy",
    "StoreFull",
    "MasterUnavailable",
    "BatchTooLarge",
    "Fenced",
    "ObjectChanged",
    "ObjectCorrupt",
]
