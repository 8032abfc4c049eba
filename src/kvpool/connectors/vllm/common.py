"""Parts shared by the vLLM connectors: version check, configuration, KV cache layout."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from kvpool.config import Bytes, _ConfigBase
from kvpool.errors import ConfigError, InvalidArgument

log = logging.getLogger("kvpool.connectors.vllm")

#: vLLM releases whose KV connector v1 interface these connectors were written against.
SUPPORTED_VLLM = ("0.32.", "0.33.")
_REQUIRED = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
    "register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
    "get_finished", "get_block_ids_with_load_errors", "bind_connector_metadata", "_get_connector_metadata",
)  # fmt: skip


def setup_logging() -> None:
    """Give kvpool's loggers a stderr handler inside vLLM processes (level ``KVPOOL_LOG_LEVEL``,
    default INFO): vLLM only configures its own ``vllm`` logger."""
    root = logging.getLogger("kvpool")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("KVPOOL_LOG_LEVEL", "INFO").upper())
    root.propagate = False


def check_vllm() -> str:
    """The installed vLLM version; raises ImportError when its connector interface does not fit."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    version = getattr(vllm, "__version__", "unknown")
    missing = [m for m in _REQUIRED if not hasattr(KVConnectorBase_V1, m)]
    if missing:
        raise ImportError(
            f"kvpool's vLLM connectors support vLLM {' and '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"vLLM {version} lacks {', '.join(missing)} in KVConnectorBase_V1"
        )
    if not version.startswith(SUPPORTED_VLLM):
        log.warning("kvpool connectors are tested with vLLM 0.32/0.33, this is vLLM %s", version)
    return version


class VllmConnectorConfig(_ConfigBase):
    """``kv_connector_extra_config`` of :class:`KvpoolConnector` and :class:`KvpoolStoreConnector`.

    Unknown keys are refused (a typo must not silently fall back to a default).

    Attributes:
        hostname: address this worker's transfer engine and side channel listen on and publish.
            Use the host's address reachable by the other instances for multi-host P/D.
        side_channel_port: base port of the P/D side channel (layout handshake and "done"
            notices); TP rank ``r`` listens on ``side_channel_port + r``. Prefill instances on one
            host need distinct ports; decode instances do not listen.
        protocol: transfer engine protocol: ``auto`` (same-host path when possible, else TCP),
            ``tcp`` or ``rdma``.
        metadata: transfer engine metadata backend (``p2p`` by default).
        secret: shared secret of transfer engines, side channel and store master.
        transfer_timeout_s: the transfer engine's socket timeout (a vanished peer fails a load
            after at most this long).
        abort_timeout_s: how long a prefill instance keeps a finished request's blocks for the
            decode instance to read; after that they are freed (a decode that never comes must not
            leak blocks).
        lanes: TCP connections per peer (None = the engine default).
        inline_load_bytes: P/D loads up to this size over the same-host path run inside the step
            that starts them instead of on the load thread (0 = always on the thread).
        master: store master ``host:port`` (store connector); None starts an embedded master
            (prefix reuse within this instance only).
        store_segment_size: bytes of DRAM this instance contributes to the store (0 = none).
        store_buffer_size: the store client's staging buffer.
        model_tag: model name used in store keys (default: the served model path/name).
        load_async: store connector: load hits between scheduler steps (True) or inside the
            forward pass (False).
        min_hit_blocks: store connector: ignore store hits shorter than this many blocks.
        lookup_timeout_s: store connector: a store lookup still unanswered after this long is
            given up (the request is computed locally) and the store is switched off for
            ``store_retry_s``. The scheduler hook never waits for a lookup: it answers "ask
            again" meanwhile.
        store_retry_s: store connector: after the master was unreachable, how long to serve
            without the store before one probe tries it again.
        store_rpc_timeout_s: store connector: the store client's master RPC timeout (None = the
            store's default).
        layerwise: store connector: move KV per attention layer inside the forward pass (saves
            while the next layer computes; in-forward loads per layer when ``load_async`` is
            false) instead of per request (see ``connectors/vllm/layerwise.py``).
        stats: report transfer and store statistics to vLLM (``KVConnectorStats``: its log lines
            and the ``vllm:kvpool_*`` series on ``/metrics``); false records nothing (the
            baseline for measuring what the stats cost).
    """

    hostname: str = "127.0.0.1"
    side_channel_port: int = Field(default=15600, ge=1, le=65535)
    protocol: Literal["auto", "tcp", "rdma"] = "auto"
    metadata: str = "p2p"
    secret: str | None = Field(default=None, repr=False)  # never in logs or tracebacks
    transfer_timeout_s: float = Field(default=30.0, gt=0)
    abort_timeout_s: float = Field(default=120.0, gt=0)
    lanes: int | None = Field(default=None, ge=1, le=64)
    inline_load_bytes: Bytes = Field(default=16 << 20, ge=0)
    master: str | None = None
    store_segment_size: Bytes = Field(default=0, ge=0)
    store_buffer_size: Bytes = Field(default=16 << 20, ge=1 << 16)
    model_tag: str | None = None
    load_async: bool = True
    min_hit_blocks: int = Field(default=1, ge=1)
    lookup_timeout_s: float = Field(default=1.0, gt=0)
    store_retry_s: float = Field(default=10.0, gt=0)
    store_rpc_timeout_s: float | None = Field(default=None, gt=0)
    layerwise: bool = False
    stats: bool = True

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> VllmConnectorConfig:
        """Read ``kv_transfer_config.kv_connector_extra_config`` (keys as documented above)."""
        ktc = vllm_config.kv_transfer_config
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        try:
            return cls(**extra)
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`kvpool.TransferEngine`."""
        kw: dict[str, Any] = dict(
            hostname=self.hostname, metadata=self.metadata, protocol=self.protocol,
            timeout_s=self.transfer_timeout_s,
        )  # fmt: skip
        if self.secret:
            kw["secret"] = self.secret
        if self.lanes:
            kw["lanes"] = self.lanes
        return kw


@dataclass(frozen=True)
class Region:
    """One block-indexed array inside a KV cache tensor.

    Block ``b`` occupies ``[addr + b * stride, addr + b * stride + block_bytes)``.
    """

    name: str
    addr: int
    stride: int
    block_bytes: int
    num_blocks: int

    def wire(self) -> list[Any]:
        """msgpack form."""
        return [self.name, self.addr, self.stride, self.block_bytes, self.num_blocks]

    @classmethod
    def from_wire(cls, w: list[Any]) -> Region:
        """Inverse of :meth:`wire`."""
        return cls(str(w[0]), int(w[1]), int(w[2]), int(w[3]), int(w[4]))


def kv_regions(kv_caches: dict[str, Any], num_blocks: int | None) -> tuple[list[Region], list[Any]]:
    """Block regions of vLLM's per-layer KV cache tensors, and the distinct tensors to register.

    Handles the layouts where the block index is the first dimension (CPU backend:
    ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``; FlashInfer-style) or the second
    dimension after a K/V plane dimension (FlashAttention: ``(2, num_blocks, ...)``). Layers
    that share one tensor are listed once.
    """
    regions: list[Region] = []
    tensors: list[Any] = []
    seen: set[int] = set()
    for layer, t in kv_caches.items():
        if isinstance(t, (list, tuple)):
            raise InvalidArgument(f"layer {layer}: KV cache as a list of tensors is not supported")
        ptr = int(t.data_ptr())
        if ptr in seen:
            continue
        seen.add(ptr)
        if not t.is_contiguous():
            raise InvalidArgument(f"layer {layer}: KV cache tensor is not contiguous")
        es = t.element_size()
        shape = tuple(t.shape)
        n = num_blocks if num_blocks is not None else shape[0]
        if shape[0] == n:
            regions.append(Region(layer, ptr, t.stride(0) * es, t.stride(0) * es, n))
        elif len(shape) >= 2 and shape[1] == n:
            for plane in range(shape[0]):
                regions.append(
                    Region(f"{layer}#{plane}", ptr + plane * t.stride(0) * es, t.stride(1) * es,
                           t.stride(1) * es, n)
                )  # fmt: skip
        else:
            raise InvalidArgument(
                f"layer {layer}: KV cache shape {shape} has no block dimension of size {n} in position 0 or 1"
            )
        tensors.append(t)
    return regions, tensors


def block_runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """Merge pairs ``(local[i], remote[i])`` into runs ``(local_start, remote_start, count)``
    where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote, strict=True):
        if runs:
            ls, rs, c = runs[-1]
            if lb == ls + c and rb == rs + c:
                runs[-1] = (ls, rs, c + 1)
                continue
        runs.append((lb, rb, 1))
    return runs
