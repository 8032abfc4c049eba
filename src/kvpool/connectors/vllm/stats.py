"""Connector statistics through vLLM's own hooks (``get_kv_connector_stats``,
``build_kv_connector_stats``, ``build_prom_metrics``).

Who records what (each an O(1) append per transfer or per lookup, never per block):

- the P/D worker (``KvpoolConnector``): one transfer per loaded request (seconds, bytes, blocks) or
  one failure with its reason (the kvpool error type);
- the store worker (``KvpoolStoreConnector``): one transfer per load batch, blocks saved, and store
  misses found at load time (``evicted``: the object is gone; ``size_mismatch``; ``load_error``);
- the store scheduler: store hits and misses per lookup (``not_stored``; ``master_unreachable``
  when a lookup failed or the circuit breaker is open; ``unkeyable`` when the request's block-hash
  extra keys have no deterministic encoding).

vLLM collects the worker's and the scheduler's objects every step
(``KVConnectorOutput.kv_connector_stats``, ``Scheduler`` aggregation), logs ``reduce()`` and feeds
``to_dict()`` to :class:`KvpoolPromMetrics.observe` for ``/metrics``:
``vllm:kvpool_xfer_time_seconds``, ``vllm:kvpool_bytes_transferred`` (histograms, one
observation per transfer), ``vllm:kvpool_num_failed_transfers{reason}``,
``vllm:kvpool_store_hit_blocks``, ``vllm:kvpool_store_miss_blocks{reason}``,
``vllm:kvpool_store_saved_blocks`` (counters).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

_LISTS = ("transfer_duration", "bytes_transferred", "num_blocks")
_COUNTS = ("failures", "store_misses")  # reason -> count
_TOTALS = ("store_hits", "store_saved")


def _empty() -> dict[str, Any]:
    return {**{k: [] for k in _LISTS}, **{k: {} for k in _COUNTS}, **{k: 0 for k in _TOTALS}}


@dataclass
class KvpoolKVConnectorStats(KVConnectorStats):
    """Observations of one interval (serializable: lists, counts by reason, totals)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        self._lock = threading.Lock()
        self._dirty = not self._empty_locked()  # anything recorded since the last clone

    def reset(self) -> None:
        self.data = _empty()
        self._dirty = False

    # ------------------------------------------------------------------ recording (any thread)
    def record_transfer(self, seconds: float, nbytes: int, nblocks: int) -> None:
        with self._lock:
            self.data["transfer_duration"].append(float(seconds))
            self.data["bytes_transferred"].append(int(nbytes))
            self.data["num_blocks"].append(int(nblocks))
            self._dirty = True

    def record_failure(self, reason: str) -> None:
        self._count("failures", reason, 1)

    def record_hits(self, nblocks: int) -> None:
        with self._lock:
            self.data["store_hits"] += int(nblocks)
            self._dirty = True

    def record_misses(self, reason: str, nblocks: int) -> None:
        if nblocks > 0:
            self._count("store_misses", reason, nblocks)

    def record_saved(self, nblocks: int) -> None:
        with self._lock:
            self.data["store_saved"] += int(nblocks)
            self._dirty = True

    def _count(self, key: str, reason: str, n: int) -> None:
        with self._lock:
            d = self.data[key]
            d[reason] = d.get(reason, 0) + int(n)
            self._dirty = True

    def clone_and_reset(self) -> KvpoolKVConnectorStats | None:
        """This interval's observations (None when there are none), and a fresh interval. Called
        by vLLM's model runner after every step: when nothing was recorded (most steps) it reads
        one flag, without the lock or a scan of the fields."""
        if not self._dirty:
            return None
        with self._lock:
            self._dirty = False
            if self._empty_locked():
                return None
            old = KvpoolKVConnectorStats(data=self.data)
            self.data = _empty()
        return old

    # ------------------------------------------------------------------ vLLM's interface
    def is_empty(self) -> bool:
        return self._empty_locked()

    def _empty_locked(self) -> bool:
        d = self.data
        return not any(d.get(k) for k in (*_LISTS, *_COUNTS, *_TOTALS))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        o = other.data
        for k in _LISTS:
            self.data.setdefault(k, []).extend(o.get(k, ()))
        for k in _COUNTS:
            mine = self.data.setdefault(k, {})
            for reason, n in o.get(k, {}).items():
                mine[reason] = mine.get(reason, 0) + n
        for k in _TOTALS:
            self.data[k] = self.data.get(k, 0) + o.get(k, 0)
        self._dirty = not self._empty_locked()
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        t = np.asarray(d.get("transfer_duration", ()), dtype=float)
        mb = np.asarray(d.get("bytes_transferred", ()), dtype=float) / 2**20
        out: dict[str, int | float] = {"Num successful transfers": len(t)}
        if len(t):
            out.update({
                "Avg xfer time (ms)": round(float(t.mean()) * 1e3, 3),
                "P90 xfer time (ms)": round(float(np.percentile(t, 90)) * 1e3, 3),
                "Avg MB per transfer": round(float(mb.mean()), 3),
                "Throughput (MB/s)": round(float(mb.sum() / t.sum()), 3) if t.sum() > 0 else 0.0,
            })  # fmt: skip
        out["Num failed transfers"] = sum(d.get("failures", {}).values())
        out["Store hit blocks"] = d.get("store_hits", 0)
        for reason, n in sorted(d.get("store_misses", {}).items()):
            out[f"Store miss blocks ({reason})"] = n
        out["Store saved blocks"] = d.get("store_saved", 0)
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> KvpoolKVConnectorStats:
        return KvpoolKVConnectorStats(data=copy.deepcopy(self.data, memo))

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data = state["data"]
        self._lock = threading.Lock()
        self._dirty = not self._empty_locked()


class DisabledStats(KvpoolKVConnectorStats):
    """``stats: false`` in the connector config: records nothing and reports nothing (vLLM gets
    None each step): the baseline for measuring what the stats cost."""

    def record_transfer(self, seconds: float, nbytes: int, nblocks: int) -> None:
        pass

    def record_failure(self, reason: str) -> None:
        pass

    def record_hits(self, nblocks: int) -> None:
        pass

    def record_misses(self, reason: str, nblocks: int) -> None:
        pass

    def record_saved(self, nblocks: int) -> None:
        pass

    def clone_and_reset(self) -> None:
        return None


def make_stats(enabled: bool) -> KvpoolKVConnectorStats:
    """A connector half's stats object (``VllmConnectorConfig.stats``)."""
    return KvpoolKVConnectorStats() if enabled else DisabledStats()


class KvpoolPromMetrics(KVConnectorPromMetrics):
    """kvpool's series on vLLM's ``/metrics`` (see the module docstring)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per = self.per_engine_labelvalues

        def hist(name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
            return create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames), per
            )

        def counter(name: str, doc: str) -> dict[int, Any]:
            return create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames), per
            )

        self.xfer_time = hist(
            "vllm:kvpool_xfer_time_seconds",
            "Duration of kvpool KV transfers (one per loaded request or store load batch).",
            [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
        )
        self.bytes = hist(
            "vllm:kvpool_bytes_transferred",
            "Bytes per kvpool KV transfer.",
            [float(2 ** (10 + i)) for i in range(1, 25, 2)],
        )
        self.hits = counter("vllm:kvpool_store_hit_blocks", "KV blocks found in the kvpool store by lookups.")
        self.saved = counter("vllm:kvpool_store_saved_blocks", "KV blocks saved to the kvpool store.")
        reason_labels = [*labelnames, "reason"]
        self._failed = self._counter_cls(
            name="vllm:kvpool_num_failed_transfers",
            documentation="Failed kvpool KV transfers, by reason (the kvpool error type).",
            labelnames=reason_labels,
        )
        self._misses = self._counter_cls(
            name="vllm:kvpool_store_miss_blocks",
            documentation="KV blocks not served by the kvpool store, by reason (not_stored, evicted, "
            "size_mismatch, master_unreachable, unkeyable, load_error).",
            labelnames=reason_labels,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for s in d.get("transfer_duration", ()):
            self.xfer_time[engine_idx].observe(s)
        for b in d.get("bytes_transferred", ()):
            self.bytes[engine_idx].observe(b)
        if d.get("store_hits"):
            self.hits[engine_idx].inc(d["store_hits"])
        if d.get("store_saved"):
            self.saved[engine_idx].inc(d["store_saved"])
        labels = list(self.per_engine_labelvalues.get(engine_idx, []))
        for reason, n in d.get("failures", {}).items():
            self._failed.labels(*labels, reason).inc(n)
        for reason, n in d.get("store_misses", {}).items():
            self._misses.labels(*labels, reason).inc(n)


# ---------------------------------------------------------------------------- KV cache events
STORE_MEDIUM = "kvpool"
"""``medium`` of kvpool's store-tier events (vLLM's own blocks say ``GPU``/``CPU``), so a router
that consumes vLLM's KV events (``--kv-events-config``) sees which prefixes the pool holds."""


class StoreEvents:
    """Store-tier ``BlockStored`` events, kept by the store connector's scheduler half.

    ``saving`` (``request_finished``, once per request handed to the worker for saving) builds
    one event for the request's blocks — vLLM's own block hashes, so they match the events of
    vLLM's prefix cache — and holds it until ``sent`` (``update_connector_output``, each step)
    sees the request among ``finished_sending``, i.e. every TP rank's worker is done with it;
    ``take`` (vLLM's ``take_events``, each step) hands the ready ones over. O(1) Python per
    request (one slice of hashes and tokens); nothing at all when KV events are off.

    A save the worker could not complete (master unreachable, a failed put) is still announced:
    the worker reports a request finished either way, and a consumer learns of the gap from the
    next lookup's miss (``vllm:kvpool_store_miss_blocks``)."""

    def __init__(self, vllm_config: Any) -> None:
        kec = getattr(vllm_config, "kv_events_config", None)
        self.enabled = bool(kec is not None and getattr(kec, "enable_kv_cache_events", False))
        self._pending: dict[str, Any] = {}
        self._ready: list[Any] = []

    def saving(self, request: Any, first: int, n: int, block_size: int) -> None:
        """Blocks ``first..n-1`` of ``request`` are being saved to the store."""
        if not self.enabled or n <= first:
            return
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        hashes = list(getattr(request, "block_hashes", ()) or ())
        if len(hashes) < n:
            return  # vLLM hashes at another granularity: no event rather than a wrong one
        lora = getattr(request, "lora_request", None)
        tokens = list(request.all_token_ids[first * block_size : n * block_size])
        self._pending[request.request_id] = BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:n]],
            parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None,
            token_ids=tokens,
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=STORE_MEDIUM,
            lora_name=lora.name if lora else None,
        )

    def sent(self, req_ids: Any) -> None:
        """Requests whose saves every worker finished."""
        for rid in req_ids:
            ev = self._pending.pop(rid, None)
            if ev is not None:
                self._ready.append(ev)

    def take(self) -> list[Any]:
        ready, self._ready = self._ready, []
        return ready
