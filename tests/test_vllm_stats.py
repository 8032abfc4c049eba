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
