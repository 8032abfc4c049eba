"""Scheduler half of :class:`~kvpool.connectors.vllm.pd.KvpoolConnector` and the metadata it
sends the workers once per step (:class:`KvpoolConnectorMetadata`: loads to start, blocks to hold).

Runs in vLLM's scheduler process: every hook returns at once (no I/O). A decode's load is one
:class:`RecvJob`; a prefill's finished request becomes ``kv_transfer_params`` naming its blocks and
side channel, and its blocks are held (``delay_free``) until the worker reports them sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpool.connectors.vllm.common import VllmConnectorConfig

log = logging.getLogger("kvpool.connectors.vllm")

_REMOTE_KEYS = ("remote_block_ids", "remote_host", "remote_port", "remote_request_id")


@dataclass
class RecvJob:
    """Decode side: read ``remote_block_ids`` of a prefill instance into ``local_block_ids``."""

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_engine_id: str | None = None
    remote_tp_size: int = 1


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: loads to start, blocks to hold for a decode."""

    recv: dict[str, RecvJob] = field(default_factory=dict)
    send: dict[str, float] = field(default_factory=dict)  # req id -> seconds to keep its blocks


def _tp(vllm_config: Any) -> tuple[int, int]:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank(), size
    except Exception:  # noqa: BLE001 - not initialised (scheduler process, tests)
        return 0, size


class _PdScheduler:
    def __init__(self, cfg: VllmConnectorConfig, vllm_config: Any, engine_id: str) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = int(vllm_config.cache_config.block_size)
        _, self.tp_size = _tp(vllm_config)
        self._recv: dict[str, RecvJob] = {}
        self._send: dict[str, float] = {}
        # Requests whose blocks a worker may still be writing: they are never freed before the
        # worker reports them in finished_recving (abort or failure included).
        self._loading: set[str] = set()

    def loads_done(self, req_ids: Any) -> None:
        self._loading.difference_update(req_ids)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            if not all(params.get(k) is not None for k in _REMOTE_KEYS):
                log.warning("request %s: incomplete kv_transfer_params %s; computing locally",
                            request.request_id, params)  # fmt: skip
                return 0, False
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if not all(params.get(k) is not None for k in _REMOTE_KEYS):
            return
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        remote = list(params["remote_block_ids"])
        if len(local) > len(remote):
            log.warning("request %s: %d local blocks for %d remote ones; computing locally",
                        request.request_id, len(local), len(remote))  # fmt: skip
            local = []
        # A local prefix-cache hit covers the leading blocks: read only the tail.
        remote = remote[len(remote) - len(local) :] if local else []
        if local:
            self._loading.add(request.request_id)
        self._recv[request.request_id] = RecvJob(
            req_id=request.request_id,
            local_block_ids=list(local),
            remote_block_ids=remote,
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            remote_request_id=str(params["remote_request_id"]),
            remote_engine_id=params.get("remote_engine_id"),
            remote_tp_size=int(params.get("tp_size") or 1),
        )

    def close(self) -> None:
        return None

    def build_meta(self) -> KvpoolConnectorMetadata:
        meta = KvpoolConnectorMetadata(recv=self._recv, send=self._send)
        self._recv, self._send = {}, {}
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        if request.request_id in self._loading:
            # Finished (aborted, or failed by vLLM's load-failure policy) while its blocks are being
            # written: they are freed when the worker reports the load finished.
            return True, None
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Aborted before its blocks were allocated: still tell the prefill to free its blocks.
            params["do_remote_prefill"] = False
            if all(params.get(k) is not None for k in _REMOTE_KEYS):
                self._recv[request.request_id] = RecvJob(
                    request.request_id, [], [], str(params["remote_host"]), int(params["remote_port"]),
                    str(params["remote_request_id"]),
                )  # fmt: skip
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted prefill: free at once, no decode will read
        if not block_ids:
            return False, None
        self._send[request.request_id] = self.cfg.abort_timeout_s
        return True, dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=list(block_ids),
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.cfg.hostname,
            remote_port=self.cfg.side_channel_port,
            remote_num_tokens=int(request.num_computed_tokens),
            tp_size=self.tp_size,
        )
