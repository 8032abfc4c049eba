"""Role dispatch shared by the kvpool vLLM connectors.

vLLM builds each connector twice: once with the SCHEDULER role (in the engine core) and once with
the WORKER role (next to the KV cache; another process under multiprocess executors). Each kvpool
connector supplies a scheduler half and a worker half; this base class routes vLLM's calls to them.

Scheduler half: ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_meta()``,
``request_finished -> (delay_free, kv_transfer_params)``, ``loads_done(req_ids)``, ``close()``.
Worker half: ``register_kv_caches``, ``unregister_kv_caches()``, ``start(meta)``,
``get_finished() -> (sending, recving)``, ``take_load_errors()``, ``close()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool.connectors.vllm.common import VllmConnectorConfig, check_vllm, setup_logging

check_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KvpoolConnectorBase(KVConnectorBase_V1):
    """Routes vLLM's connector calls to a scheduler half or a worker half (see module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        setup_logging()
        self.cfg = VllmConnectorConfig.from_vllm(vllm_config)
        self._scheduler: Any = None
        self._worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config)
        else:
            self._worker = self._make_worker(vllm_config, kv_cache_config)

    def _make_scheduler(self, vllm_config: Any) -> Any:
        raise NotImplementedError

    def _make_worker(self, vllm_config: Any, kv_cache_config: Any) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.loads_done(connector_output.finished_recving or ())
            sent = getattr(self._scheduler, "sends_done", None)
            if sent is not None:
                sent(connector_output.finished_sending or ())

    def take_events(self) -> Any:
        """vLLM's scheduler, each step: kvpool's KV cache events since the last call (the store
        connector's store-tier ``BlockStored``; see ``stats.StoreEvents``)."""
        take = getattr(self._scheduler, "take_events", None)
        return take() if take is not None else ()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self, *args: Any, **kwargs: Any) -> None:
        """vLLM 0.33 sleep mode: the KV cache memory is about to be released."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self, kv_caches: dict[str, torch.Tensor] | None = None, *a: Any, **kw: Any) -> None:
        """vLLM 0.33 sleep mode: KV cache memory is back (possibly at new addresses)."""
        if self._worker is not None and kv_caches is not None:
            self._worker.register_kv_caches(kv_caches)

    @classmethod
    def supports_sleep_mode(cls, *args: Any, **kwargs: Any) -> bool:
        """vLLM 0.33: KV caches may be unregistered and restored."""
        return True

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads finish before their request is scheduled, or inside start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # nothing moves per layer: P/D pulls, the store saves finished requests

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    # ------------------------------------------------------------------ stats (stats.py)
    def get_kv_connector_stats(self) -> Any:
        """vLLM's worker (model runner) after each step, and its scheduler each step: this half's
        observations since the last call, or None when there are none."""
        half = self._worker if self._worker is not None else self._scheduler
        stats = getattr(half, "stats", None)
        return stats.clone_and_reset() if stats is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        """vLLM's logger: a stats object over aggregated ``to_dict()`` data."""
        from kvpool.connectors.vllm.stats import KvpoolKVConnectorStats

        return KvpoolKVConnectorStats(data=data) if data is not None else KvpoolKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """vLLM's Prometheus logger, once: kvpool's series on ``/metrics``."""
        from kvpool.connectors.vllm.stats import KvpoolPromMetrics

        return KvpoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for half in (self._worker, self._scheduler):
            if half is not None:
                half.close()
