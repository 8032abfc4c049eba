"""One typed configuration object per layer.

Each config accepts keyword arguments, and can be loaded from a JSON file
(:meth:`TransferConfig.from_json`) or from ``KVPOOL_*`` environment variables
(:meth:`TransferConfig.from_env`). Invalid values raise :class:`kvpool.errors.ConfigError`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from kvpool._sizes import coerce_size
from kvpool._urls import redact_url
from kvpool.errors import ConfigError

_C = TypeVar("_C", bound="_ConfigBase")

Bytes = Annotated[int, BeforeValidator(coerce_size)]
"""An ``int`` field in bytes that also takes ``"256M"``-style text (keyword, JSON or KVPOOL_* variable)."""


#: Fields holding a URL that may carry a password (``http://user:pw@...``, ``?token=``): shown
#: redacted by reprs and config errors.
_URL_FIELDS = ("metadata", "master")


def _one_line(exc: ValidationError) -> str:
    """``field = value: what is wrong; ...`` for every error in ``exc``."""
    parts = []
    for e in exc.errors(include_url=False):
        where = ".".join(str(x) for x in e["loc"]) or "value"
        msg = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "missing" or "secret" in where:  # a secret's value is never repeated
            parts.append(f"{where}: {msg}")
        elif where in _URL_FIELDS and isinstance(e["input"], str):
            parts.append(f"{where} = {redact_url(e['input'])!r}: {msg}")
        else:
            parts.append(f"{where} = {e['input']!r}: {msg}")
    return "; ".join(parts)


class _ConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    def __repr_args__(self) -> Any:
        """What ``repr()``/``str()`` show (logs, tracebacks): URL fields with passwords redacted."""
        for name, value in super().__repr_args__():
            yield name, redact_url(value) if name in _URL_FIELDS and isinstance(value, str) else value

    def __init__(self, **kwargs: Any) -> None:
        try:
            super().__init__(**kwargs)
        except ValidationError as exc:
            raise ConfigError(f"invalid {type(self).__name__}: {_one_line(exc)}") from None

    @classmethod
    def from_json(cls: type[_C], path: str | os.PathLike[str], **overrides: Any) -> _C:
        """Load from a JSON object in ``path``; keyword ``overrides`` win over the file."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a JSON object")
        data.update(overrides)
        return cls(**data)

    @classmethod
    def from_env(
        cls: type[_C], prefix: str = "KVPOOL_", environ: dict[str, str] | None = None, **overrides: Any
    ) -> _C:
        """Load from ``{prefix}{FIELD}`` variables (e.g. ``KVPOOL_TIMEOUT_S=5``).

        ``KVPOOL_CONFIG=/path.json`` loads a JSON file first; variables then override it,
        and keyword ``overrides`` override both. List fields take JSON or comma-separated values.
        """
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        cfg_file = env.get(f"{prefix}CONFIG")
        if cfg_file:
            try:
                data.update(json.loads(Path(cfg_file).read_text()))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read {prefix}CONFIG={cfg_file}: {exc}") from None
        for field_name, field in cls.model_fields.items():
            raw = env.get(prefix + field_name.upper())
            if raw is None:
                continue
            if "list" in str(field.annotation) and not raw.startswith("["):
                data[field_name] = [x for x in raw.split(",") if x]
            else:
                data[field_name] = raw
        data.update(overrides)
        return cls(**data)

    def replace(self: _C, **changes: Any) -> _C:
        """Return a copy with ``changes`` applied (validated)."""
        data = self.model_dump()
        data.update(changes)
        return type(self)(**data)


class TransferConfig(_ConfigBase):
    """Configuration of a :class:`kvpool.TransferEngine`.

    Attributes:
        hostname: address the engine listens on and publishes (only this address is bound).
        port: TCP port to listen on; 0 picks a free one.
        metadata: ``"p2p"`` (default, no server), ``http://host:port/metadata``,
            ``etcd://host:2379`` or ``redis://host:6379``.
        protocol: ``"auto"`` (same-host path when the peer is on this host, else TCP),
            ``"tcp"`` or ``"rdma"``.
        devices: RDMA device allow-list (unused by TCP).
        name: segment name published through a metadata server (default ``host:port``).
        secret: cluster secret: peers prove it by HMAC challenge-response before any memory is
            touched, descriptors are signed with it (None: trusted networks only).
        lanes: TCP connections per peer; one request's slices spread over them.
        slice_size: bytes per slice; bigger requests are cut into slices of this size.
        timeout_s: seconds a transfer may wait on a peer before it becomes TIMEOUT.
        connect_timeout_s: seconds to connect and handshake with a peer.
        max_frame: biggest single frame (bytes) the server accepts.
        server_threads: event-loop threads of the engine's TCP server (fixed at start).
        max_connections: connections the server keeps open in total; more are refused at accept.
        max_connections_per_peer: connections the server keeps open per peer address.
        idle_timeout_s: an authenticated connection idle this long is closed by the server.
        same_host: allow the same-host single-copy path under ``protocol="auto"``.
        rdma_slice_size: RDMA slice size; slices of one request spread over the chosen NICs.
        rdma_topology: NIC topology matrix (Mooncake JSON: a file path or a JSON string);
            None discovers it from sysfs. ``devices`` filters it.
        rdma_gid_index: GID table index to use (None: the RoCE v2 IPv4-mapped entry).
        rdma_mtu: path MTU in bytes (None: the smaller of both ports' active MTU).
        rdma_max_endpoints: endpoints (QPs to one remote NIC) kept; SIEVE evicts beyond it.
        rdma_retry_limit: attempts per slice on other paths before its request fails.
        rdma_nic_pause_s: a NIC that failed is avoided this long, then probed again.
        rdma_chain: work requests linked into one ``post_send``.
        rdma_sq_depth: outstanding work requests per QP.
        device_runtime: CUDA runtime used for ``cuda:N`` memory: ``"auto"`` (the CUDA driver, else
            torch.cuda, else cupy), ``"driver"``, ``"torch"`` or ``"cupy"``.
        cuda_driver: path of the CUDA driver library to load instead of ``libcuda.so.1`` (also
            ``KVPOOL_CUDA_DRIVER``); with a driver that loads and sees a device, same-host GPU
            memory moves through CUDA IPC (``kvpool.transfer.cuda_ipc``).
        staging_pool_size: pinned host bytes used to stage GPU memory through TCP/same-host
            transfers (allocated on first use; bounds the staged bytes in flight).
    """

    hostname: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    metadata: str = "p2p"
    protocol: Literal["auto", "tcp", "rdma"] = "auto"
    devices: list[str] | None = None
    name: str | None = None
    secret: str | None = Field(default=None, repr=False)  # never in logs or tracebacks
    lanes: int = Field(default=2, ge=1, le=64)
    slice_size: Bytes = Field(default=1 << 20, ge=4096, le=1 << 30)
    timeout_s: float = Field(default=30.0, gt=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    max_frame: Bytes = Field(default=256 << 20, ge=1 << 16)
    server_threads: int = Field(default=2, ge=1, le=64)
    max_connections: int = Field(default=16384, ge=1)
    max_connections_per_peer: int = Field(default=256, ge=1)
    idle_timeout_s: float = Field(default=120.0, gt=0)
    same_host: bool = True
    rdma_slice_size: Bytes = Field(default=64 << 10, ge=4096, le=1 << 30)
    rdma_topology: str | None = None
    rdma_gid_index: int | None = Field(default=None, ge=0, le=255)
    rdma_mtu: int | None = None
    rdma_max_endpoints: int = Field(default=256, ge=1)
    rdma_retry_limit: int = Field(default=4, ge=0, le=64)
    rdma_nic_pause_s: float = Field(default=5.0, ge=0)
    rdma_chain: int = Field(default=32, ge=1, le=1024)
    rdma_sq_depth: int = Field(default=256, ge=1, le=16384)
    device_runtime: Literal["auto", "driver", "torch", "cupy"] = "auto"
    cuda_driver: str | None = None
    staging_pool_size: Bytes = Field(default=64 << 20, ge=1 << 16)

    @field_validator("rdma_mtu")
    @classmethod
    def _check_mtu(cls, v: int | None) -> int | None:
        if v is not None and v not in (256, 512, 1024, 2048, 4096):
            raise ValueError("rdma_mtu must be 256, 512, 1024, 2048 or 4096")
        return v

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, v: str) -> str:
        if v != "p2p" and not v.startswith(("http://", "https://", "etcd://", "redis://")):
            raise ValueError("metadata must be 'p2p' or an http://, etcd:// or redis:// URL")
        return v


class MasterConfig(_ConfigBase):
    """Configuration of the store master (``kvpool master``).

    Attributes:
        host, port: RPC address (msgpack over TCP); port 0 picks a free one.
        metrics_port: Prometheus text metrics over HTTP on ``host``; None disables, 0 picks a free port.
        eviction_high_watermark: fraction of pool capacity above which eviction starts.
        eviction_ratio: fraction of pool capacity each eviction round frees.
        lease_ttl_ms: how long a read lease protects an object's space from being freed (longer
            than the clients' ``transfer_timeout_s``; a read that takes longer is checked again).
        client_ttl_s: a client silent for this long is dead: its segments are unmounted.
        put_timeout_s: an uncommitted put older than this is revoked (writers stop starting writes
            into an allocation after half of it).
        quarantine_s: space taken back from a writer that did not finish is not reused for this
            long (at least the clients' ``transfer_timeout_s``), nor before the writer confirms it
            no longer writes there.
        fence_hold_s: space of a writer that never confirms is reused after this, for checksummed
            objects only.
        task_timeout_s: a task handed to a storage client (hot-key replica, SSD spill) that is not
            reported done within this counts as failed (its reply may have been lost); the client
            does not start a task this old.
        max_batch: most keys one request may carry (a bigger one is refused; clients split).
        evict_batch: most objects one eviction step looks at (bounds the master's stalls).
        secret: shared secret every RPC must carry (same as the transfer engines').
        hot_key_replication: raise the replica count of the hottest keys automatically.
        hot_window_s, hot_interval_s: the policy counts the gets of the last ``hot_window_s``
            and runs every ``hot_interval_s`` (the window's granularity).
        hot_max_replicas: replica count given to hot keys (capped by the number of segments).
        alignment: allocation alignment in bytes inside segments.
        max_message: biggest RPC message accepted from an authenticated client (bytes).
        idle_timeout_s: an RPC connection with no traffic for this long is closed (clients reconnect).
        max_connections: open RPC connections the master keeps (beyond: unauthenticated ones first).
        change_log: key changes (commits, drops) the master keeps for readers of its ``changes``
            feed (a router's store index, ``kvpool proxy --store-master``); 0 turns the feed off.
    """

    host: str = "127.0.0.1"
    port: int = Field(default=50051, ge=0, le=65535)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    eviction_high_watermark: float = Field(default=0.95, gt=0, le=1)
    eviction_ratio: float = Field(default=0.05, gt=0, le=1)
    lease_ttl_ms: int = Field(default=15000, ge=1)
    client_ttl_s: float = Field(default=10.0, gt=0)
    put_timeout_s: float = Field(default=30.0, gt=0)
    quarantine_s: float = Field(default=40.0, ge=0)
    fence_hold_s: float = Field(default=120.0, ge=0)
    task_timeout_s: float = Field(default=30.0, gt=0)
    max_batch: int = Field(default=1024, ge=1)
    evict_batch: int = Field(default=1024, ge=1)
    secret: str | None = Field(default=None, repr=False)  # never in logs or tracebacks
    hot_key_replication: bool = False
    hot_window_s: float = Field(default=10.0, gt=0)
    hot_interval_s: float = Field(default=1.0, gt=0)
    hot_max_replicas: int = Field(default=3, ge=1)
    alignment: Bytes = Field(default=64, ge=1)
    max_message: Bytes = Field(default=2 << 20, ge=1 << 16)
    idle_timeout_s: float = Field(default=600.0, gt=0)
    max_connections: int = Field(default=4096, ge=16)
    change_log: int = Field(default=1 << 16, ge=0)


class StoreConfig(_ConfigBase):
    """Configuration of a store client (:class:`kvpool.Store`).

    Attributes:
        master: ``host:port`` of the master; None starts an embedded in-process master.
        hostname: address of this client's transfer engine.
        segment_size: bytes of DRAM this client contributes to the pool (0 = use the pool only).
        buffer_size: registered staging buffer for put/get of Python bytes.
        protocol, metadata, secret: passed to the transfer engine (secret also guards master RPC).
        ssd_dir: directory this client contributes as the SSD tier (None = none).
        ssd_sweep_s: how often (from its start) the client removes the files of ``ssd_dir`` no
            SSD copy has, once older than twice the master's ``task_timeout_s`` (left by a spill
            whose report was lost, or by a client that used the directory before); 0: never.
        promote_on_hit: copy an object read from the SSD tier back into memory.
        rpc_timeout_s: master RPC timeout; heartbeat_s: heartbeat period.
        transfer_timeout_s: transfer engine timeout (at most the master's ``quarantine_s``).
        checksum: give every object an xxh3-64 checksum, checked on every read (objects up to
            64 KiB, and objects the master places in suspect space, always have one).
        location_cache: objects whose location this client keeps, to read them without asking
            the master (checked by header and checksum; 0 turns it off): every object up to
            64 KiB, bigger ones after their second read (see docs/store.md).
        location_cache_ttl_s: a cached location is used for this long. Until then a get may
            return a value that was removed (but never another key's or a torn one).
        get_retries: times a read whose object changed under it is looked up and read again.
    """

    master: str | None = None
    hostname: str = "127.0.0.1"
    segment_size: Bytes = Field(default=64 << 20, ge=0)
    buffer_size: Bytes = Field(default=64 << 20, ge=1 << 16)
    protocol: Literal["auto", "tcp", "rdma"] = "auto"
    metadata: str = "p2p"
    secret: str | None = Field(default=None, repr=False)  # never in logs or tracebacks
    ssd_dir: str | None = None
    ssd_sweep_s: float = Field(default=600.0, ge=0)
    promote_on_hit: bool = True
    rpc_timeout_s: float = Field(default=5.0, gt=0)
    heartbeat_s: float = Field(default=1.0, gt=0)
    transfer_timeout_s: float = Field(default=10.0, gt=0)
    checksum: bool = False
    location_cache: int = Field(default=1 << 17, ge=0)
    location_cache_ttl_s: float = Field(default=60.0, ge=0)
    get_retries: int = Field(default=2, ge=0)
