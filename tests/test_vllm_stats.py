"""kvpool's connector stats and Prometheus series through vLLM's own classes (vLLM 0.32's
KVConnectorStats / KVConnectorPromMetrics): recording, aggregation across workers and the
scheduler, reduce() for the log line, pickling (stats cross process boundaries), and /metrics
text from real prometheus_client metrics. The real-server side is in tests/test_vllm_e2e.py."""

from __future__ import annotations

import functools
import pickle
import types

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpool.connectors.vllm import KvpoolConnector, KvpoolStoreConnector
from kvpool.connectors.vllm.stats import KvpoolKVConnectorStats, KvpoolPromMetrics


def test_record_aggregate_reduce_and_pickle() -> None:
    worker = KvpoolKVConnectorStats()
    assert worker.is_empty() and worker.clone_and_reset() is None
    worker.record_transfer(0.002, 4 << 20, 16)
    worker.record_transfer(0.004, 2 << 20, 8)
    worker.record_failure("TransferTimeout")
    worker.record_misses("evicted", 3)
    worker.record_saved(5)
    sched = KvpoolKVConnectorStats()
    sched.record_hits(40)
    sched.record_misses("not_stored", 7)
    sched.record_misses("evicted", 0)  # nothing to count: no key appears
    sent = pickle.loads(pickle.dumps(worker.clone_and_reset()))  # worker -> scheduler process
    assert worker.is_empty()
    total = KvpoolConnector.build_kv_connector_stats(sent.data).aggregate(sched)
    assert total.data["store_misses"] == {"evicted": 3, "not_stored": 7}
    r = total.reduce()
    assert r["Num successful transfers"] == 2 and r["Num failed transfers"] == 1
    assert r["Avg xfer time (ms)"] == 3.0 and r["Throughput (MB/s)"] == 1000.0  # 6 MiB in 6 ms
    assert r["Store hit blocks"] == 40 and r["Store miss blocks (not_stored)"] == 7
    assert r["Store saved blocks"] == 5
    empty = KvpoolStoreConnector.build_kv_connector_stats()
    assert empty.is_empty() and empty.reduce()["Num successful transfers"] == 0


def test_every_kind_of_record_is_reported_once_by_the_per_step_clone() -> None:
    """The per-step ``clone_and_reset`` reads a flag when nothing was recorded; every recording
    sets it, so each observation is handed to vLLM exactly once."""
    st = KvpoolKVConnectorStats()
    records = [
        lambda: st.record_transfer(0.001, 1 << 20, 4),
        lambda: st.record_failure("TransferError"),
        lambda: st.record_hits(2),
        lambda: st.record_misses("evicted", 1),
        lambda: st.record_saved(3),
    ]
    for record in records:
        assert st.clone_and_reset() is None
        record()
        got = st.clone_and_reset()
        assert got is not None and not got.is_empty()
        assert st.clone_and_reset() is None and st.is_empty()
    st.record_misses("evicted", 0)  # counts nothing
    assert st.clone_and_reset() is None
    # Built from data (the scheduler's side, or unpickled): reported too.
    st.record_saved(1)
    again = pickle.loads(pickle.dumps(st))
    assert again.clone_and_reset() is not None and again.clone_and_reset() is None
    built = KvpoolConnector.build_kv_connector_stats({"store_saved": 2})
    assert built.clone_and_reset() is not None


def test_stats_can_be_switched_off_in_the_connector_config() -> None:
    """``stats: false`` (the baseline of the stats-overhead benchmark): the halves record nothing
    and hand vLLM None every step; the key is validated like every other."""
    from types import SimpleNamespace

    import pytest

    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.stats import make_stats
    from kvpool.errors import ConfigError

    def cfg(extra: dict) -> VllmConnectorConfig:
        ktc = SimpleNamespace(kv_connector_extra_config=extra)
        return VllmConnectorConfig.from_vllm(SimpleNamespace(kv_transfer_config=ktc))

    assert cfg({}).stats is True and cfg({"stats": False}).stats is False
    with pytest.raises(ConfigError):
        cfg({"stats": "sometimes"})
    on, off = make_stats(True), make_stats(False)
    for st in (on, off):
        st.record_transfer(0.002, 4 << 20, 16)
        st.record_failure("TransferTimeout")
        st.record_hits(3)
        st.record_misses("evicted", 2)
        st.record_saved(1)
    assert off.clone_and_reset() is None and off.is_empty()
    got = on.clone_and_reset()
    assert got is not None and got.reduce()["Num successful transfers"] == 1


def test_prom_metrics_observe() -> None:
    reg = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}
    cfg = types.SimpleNamespace(kv_transfer_config=None)
    prom = KvpoolConnector.build_prom_metrics(cfg, kinds, ["model_name", "engine"], {0: ["m", "0"]})
    assert isinstance(prom, KvpoolPromMetrics)
    st = KvpoolKVConnectorStats()
    st.record_transfer(0.0003, 1 << 20, 4)
    st.record_failure("RemoteAccessError")
    st.record_hits(12)
    st.record_misses("master_unreachable", 2)
    prom.observe(st.data, 0)
    prom.observe(st.data, 0)
    text = generate_latest(reg).decode()
    assert 'vllm:kvpool_xfer_time_seconds_count{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:kvpool_xfer_time_seconds_bucket{engine="0",le="0.0005",model_name="m"} 2.0' in text
    assert 'vllm:kvpool_store_hit_blocks_total{engine="0",model_name="m"} 24.0' in text
    assert (
        'vllm:kvpool_num_failed_transfers_total{engine="0",model_name="m",reason="RemoteAccessError"} 2.0'
        in text
    )
    assert (
        'vllm:kvpool_store_miss_blocks_total{engine="0",model_name="m",reason="master_unreachable"} 4.0'
        in text
    )


def test_interface_check_script_passes_on_the_installed_vllm() -> None:
    """scripts/check_vllm_interface.py (what scripts/check_vllm033.sh runs against vLLM 0.33)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "check_vllm_interface.py")],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kvpool connectors match vLLM" in out.stdout


def _request(rid: str, n_tokens: int, block_size: int):  # a real vLLM Request with vLLM's block hasher
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(rid, list(range(1000, 1000 + n_tokens)), SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(block_size, sha256))  # fmt: skip


def test_store_events_announce_saved_blocks_with_vllms_hashes_once_sent() -> None:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

    from kvpool.connectors.vllm.stats import STORE_MEDIUM, StoreEvents

    on = types.SimpleNamespace(kv_events_config=types.SimpleNamespace(enable_kv_cache_events=True))
    ev = StoreEvents(on)
    req = _request("r1", 16 * 5 + 3, 16)
    assert len(req.block_hashes) == 5
    ev.saving(req, 2, 5, 16)  # blocks 0-1 were in the store already (found by the lookup)
    ev.saving(_request("r2", 40, 16), 0, 2, 16)
    assert ev.take() == []  # nothing until the workers report the saves finished
    ev.sent(["r1", "unknown"])
    (got,) = ev.take()
    assert isinstance(got, BlockStored) and got.medium == STORE_MEDIUM
    assert got.block_hashes == [ext(h) for h in req.block_hashes[2:5]]  # what vLLM's own events carry
    assert got.parent_block_hash == ext(req.block_hashes[1])
    assert got.token_ids == list(range(1000 + 32, 1000 + 80)) and got.block_size == 16
    assert ev.take() == []
    ev.sent(["r2"])
    (r2,) = ev.take()
    assert r2.parent_block_hash is None and len(r2.block_hashes) == 2
    # KV events off (vLLM's default): nothing is built at all.
    off = StoreEvents(types.SimpleNamespace(kv_events_config=None))
    off.saving(req, 0, 5, 16)
    off.sent(["r1"])
    assert off.take() == []
