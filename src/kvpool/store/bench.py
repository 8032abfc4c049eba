"""``kvpool bench store``: master, a storage client and this process, each its own process."""

from __future__ import annotations

import time
from typing import Any

from kvpool.store.client import Store
from kvpool.store.procs import MasterProcess, StorageProcess
from kvpool.transfer.bench import percentile


def _loop(fn: Any, n_max: int, duration_s: float) -> tuple[int, float, list[float]]:
    lat: list[float] = []
    t_end = time.perf_counter() + duration_s
    t0 = time.perf_counter()
    i = 0
    while i < n_max and time.perf_counter() < t_end:
        a = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - a)
        i += 1
    return i, time.perf_counter() - t0, sorted(lat)


def run_store_bench(
    value_size: int,
    duration_s: float = 5.0,
    protocol: str = "auto",
    segment_size: int = 1 << 30,
    batch_size: int = 32,
    progress: Any = None,
) -> dict[str, Any]:
    """put/get/batch/exists figures with the value stored in a segment owned by another process."""
    res: dict[str, Any] = {"value_size": value_size, "protocol": protocol}
    n_max = max(1, int(segment_size * 0.8) // value_size)
    with MasterProcess() as m, StorageProcess(m.address, segment_size, protocol=protocol):
        with Store.connect(master=m.address, segment_size=0, protocol=protocol, buffer_size=64 << 20) as st:
            value = bytes(range(256)) * (value_size // 256) + bytes(value_size % 256)
            n, el, lat = _loop(lambda i: st.put(f"k{i}", value), n_max, duration_s)
            res.update(put_ops_s=n / el, put_gbps=n * value_size / el / 1e9)
            res.update(put_p50_us=percentile(lat, 50) * 1e6, put_p99_us=percentile(lat, 99) * 1e6)
            if progress:
                progress(0.25)
            stored = n
            first = st.get("k0")
            if first != value:
                raise RuntimeError("read back other bytes than were put")
            n, el, lat = _loop(lambda i: st.get(f"k{i % stored}"), 10**9, duration_s)
            res.update(get_ops_s=n / el, get_gbps=n * value_size / el / 1e9)
            res.update(get_p50_us=percentile(lat, 50) * 1e6, get_p99_us=percentile(lat, 99) * 1e6)
            if progress:
                progress(0.5)
            st.remove_all()
            nb = max(1, min(batch_size, n_max // 2))
            values = [value] * nb
            n, el, _ = _loop(
                lambda i: st.batch_put([f"b{i}-{j}" for j in range(nb)], values),
                max(1, n_max // nb),
                duration_s / 2,
            )
            res.update(batch_put_gbps=n * nb * value_size / el / 1e9, batch_size=nb)
            batches = n
            n, el, _ = _loop(
                lambda i: st.batch_get([f"b{i % batches}-{j}" for j in range(nb)]), 10**9, duration_s / 2
            )
            res.update(batch_get_gbps=n * nb * value_size / el / 1e9)
            if progress:
                progress(0.75)
            keys = [f"b{i % batches}-{i // batches}" for i in range(1000)]
            n, el, _ = _loop(lambda i: st.batch_exists(keys), 10**9, min(2.0, duration_s / 2))
            res.update(batch_exists_keys_s=n * 1000 / el)
            if progress:
                progress(1.0)
    return res
