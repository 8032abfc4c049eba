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
    checksum: bool = False,
) -> dict[str, Any]:
    """put/get/batch/exists figures with the value stored in a segment owned by another process
    (``checksum``: every object gets an xxh3, checked on every read)."""
    res: dict[str, Any] = {"value_size": value_size, "protocol": protocol, "checksum": checksum}
    n_max = max(1, int(segment_size * 0.8) // value_size)
    with MasterProcess() as m, StorageProcess(m.address, segment_size, protocol=protocol):
        opts: dict[str, Any] = {"protocol": protocol, "buffer_size": 64 << 20, "checksum": checksum}
        with Store.connect(master=m.address, segment_size=0, **opts) as st:
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


def run_store_demo(n_objects: int = 192, value_size: int = 1 << 20) -> list[dict[str, Any]]:
    """The store part of ``kvpool demo``: an embedded master, this process and one more storage
    process each contribute 256 MiB; objects are put with 2 replicas (one per process), read
    back and verified, one replica set is changed, and the pool statistics are returned."""
    import xxhash

    from kvpool import _native
    from kvpool.store.client import ReplicateConfig

    rows: list[dict[str, Any]] = []
    with Store.connect(segment_size=256 << 20) as st, StorageProcess(st.master_address, 256 << 20):
        values = []
        for i in range(n_objects):
            buf = bytearray(value_size)
            _native.fill_pattern(_native.buffer_address(buf)[0], value_size, i)
            values.append(bytes(buf))
        cfg = ReplicateConfig(replicas=2)
        for name, fn in (
            ("put (2 replicas)", lambda i: st.put(f"demo-{i}", values[i], cfg)),
            ("get", lambda i: st.get(f"demo-{i}")),
        ):
            n, el, lat = _loop(fn, n_objects, 60.0)
            rows.append(
                {
                    "op": name,
                    "objects": n,
                    "bytes": n * value_size,
                    "gbps": n * value_size / el / 1e9,
                    "p50_us": percentile(lat, 50) * 1e6,
                    "p99_us": percentile(lat, 99) * 1e6,
                }
            )
        bad = [i for i in range(n_objects) if xxhash.xxh3_64(st.get(f"demo-{i}")).intdigest()
               != xxhash.xxh3_64(values[i]).intdigest()]  # fmt: skip
        if bad:
            raise RuntimeError(f"{len(bad)} objects read back wrong")
        segs = {r[0] for r in st.info("demo-0")["replicas"]}
        stats = st.stats()
        rows.append(
            {
                "op": "verify",
                "objects": n_objects,
                "bytes": n_objects * value_size,
                "segments": len(stats["segments"]),
                "replica_segments_of_demo_0": len(segs),
                "pool_used": stats["used"],
                "pool_capacity": stats["capacity"],
            }
        )
    return rows
