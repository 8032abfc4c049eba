"""Store master latency at scale: 1M objects, 1,000 segments, eviction running.

A real ``kvpool master`` process; 10 client connections mount 100 segments each (the master never
touches segment memory, so the segments are address ranges only) and heartbeat. A loader fills
the pool with ``--objects`` committed objects through batch ``put_start``/``put_end`` (1,024 keys
a request) to just under the eviction watermark. Then, for ``--duration`` seconds:

* this process measures single-key ``put`` (``put_start`` + ``put_end``) and ``get`` (+ lease
  release) round trips one at a time;
* a second process pings the master every millisecond (the longest ping is the longest stall a
  client saw);
* a third process drives batch load: 1,024-key ``get`` and ``put`` batches (new keys, so the pool
  passes its watermark and eviction runs in bounded steps), and, once, a 1M-key ``get`` (refused
  with BatchTooLarge) and a ``stats`` call.

Printed: p50/p99/max of put and get as this client saw them (each includes two Python RPC ends),
the longest ping, the master's own longest request (``max_request_s``), evictions, and the time
the fill took.

    python benchmarks/master_latency.py [--objects 1000000] [--segments 1000] [--duration 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from typing import Any

from kvpool._rpc import RpcClient
from kvpool._smoke import shorten
from kvpool.store.procs import MasterProcess

VALUE = 4096
ALLOC = VALUE + 64  # header; allocations are 64-byte aligned
BATCH = 1024  # the master's max_batch


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))] if xs else 0.0


def _put_batch(rpc: RpcClient, keys: list[str]) -> int:
    r = rpc.call("put_start", keys=keys, sizes=[VALUE] * len(keys), config={})
    items = [
        [k, v[0], 1, [x[0] for x in v[2]]]
        for k, (code, v) in zip(keys, r["results"], strict=True)
        if code is None
    ]
    if items:
        rpc.call("put_end", items=items, epoch=r["epoch"])
    return len(items)


def _heartbeats(clients: list[RpcClient], stop: threading.Event) -> None:
    while not stop.wait(0.5):
        for c in clients:
            try:
                c.call("heartbeat", floor=1 << 62)
            except Exception:  # noqa: BLE001 - the benchmark reports what it sees
                pass


def _pinger(addr: str, duration: float, q: Any) -> None:
    rpc = RpcClient(addr, 30)
    worst, n = 0.0, 0
    end = time.monotonic() + duration
    while time.monotonic() < end:
        t = time.perf_counter()
        rpc.call("ping")
        worst = max(worst, time.perf_counter() - t)
        n += 1
        time.sleep(0.001)
    q.put({"ping_max_ms": worst * 1e3, "pings": n})


def _loader(addr: str, duration: float, objects: int, q: Any) -> None:
    rpc = RpcClient(addr, 60)
    rpc.call("register", client="batch-load")
    end = time.monotonic() + duration
    gets = puts = 0
    i = 0
    huge_s = 0.0
    while time.monotonic() < end:
        keys = [f"o{(i * BATCH + j) % objects}" for j in range(BATCH)]
        r = rpc.call("get", keys=keys)
        rpc.send(
            "release",
            leases=[[k, v["gen"]] for k, (c, v) in zip(keys, r["results"], strict=True) if c is None],
        )
        gets += 1
        puts += _put_batch(rpc, [f"n{i}-{j}" for j in range(BATCH)])
        if i == 3:
            t = time.perf_counter()
            try:  # as many keys as fit the master's 2 MiB message limit: unpacked, then refused
                rpc.call("get", keys=[f"x{j}" for j in range(200_000)])
            except Exception:  # noqa: BLE001 - BatchTooLarge expected
                pass
            huge_s = time.perf_counter() - t
            rpc.call("stats")
        i += 1
        time.sleep(0.05)
    q.put({"batch_gets": gets, "batch_put_keys": puts, "huge_request_s": huge_s})


def _phase(addr: str, duration: float, objects: int, loaded: bool) -> dict[str, Any]:
    """Single-key put/get round trips from this process for ``duration`` seconds, with the
    pinger (and, when ``loaded``, the batch loader) running in their own processes."""
    q: Any = mp.Queue()
    procs = [mp.Process(target=_pinger, args=(addr, duration, q))]
    if loaded:
        procs.append(mp.Process(target=_loader, args=(addr, duration, objects, q)))
    for p in procs:
        p.start()
    me = RpcClient(addr, 30)
    me.call("register", client=f"measure-{loaded}")
    put_lat: list[float] = []
    get_lat: list[float] = []
    end = time.monotonic() + duration
    i = 0
    while time.monotonic() < end:
        t = time.perf_counter()
        _put_batch(me, [f"m{loaded}-{i}"])
        put_lat.append(time.perf_counter() - t)
        key = f"o{(i * 7919) % objects}"
        t = time.perf_counter()
        code, info = me.call("get", keys=[key])["results"][0]
        if code is None:
            me.send("release", leases=[[key, info["gen"]]])
        get_lat.append(time.perf_counter() - t)
        i += 1
    out: dict[str, Any] = {}
    for p in procs:
        p.join(duration + 120)
    while not q.empty():
        out.update(q.get())
    me.call("unregister")
    out.update(
        ops=len(put_lat),
        put_p50_ms=statistics.median(put_lat) * 1e3,
        put_p99_ms=_pct(put_lat, 99) * 1e3,
        put_max_ms=max(put_lat) * 1e3,
        get_p50_ms=statistics.median(get_lat) * 1e3,
        get_p99_ms=_pct(get_lat, 99) * 1e3,
        get_max_ms=max(get_lat) * 1e3,
    )
    return out


def run(objects: int, segments: int, duration: float) -> dict[str, Any]:
    """Fill, then measure; returns the figures."""
    seg_size = int(objects * ALLOC / 0.94 / segments) // 64 * 64  # filled to 94% (watermark 95%)
    res: dict[str, Any] = {"objects": objects, "segments": segments, "segment_size": seg_size}
    with MasterProcess(client_ttl_s=10.0, put_timeout_s=60.0) as m:
        owners = [RpcClient(m.address, 30) for _ in range(10)]
        for i, c in enumerate(owners):
            c.call("register", client=f"owner-{i}", host_id="bench")
            for s in range(segments // 10):
                c.call(
                    "mount",
                    segment=f"seg-{i}-{s}",
                    base=(1 << 40) + (i * 1000 + s) * (1 << 32),
                    size=seg_size,
                )
        stop = threading.Event()
        hb = threading.Thread(target=_heartbeats, args=(owners, stop), daemon=True)
        hb.start()
        loader = RpcClient(m.address, 60)
        loader.call("register", client="loader")
        t0 = time.perf_counter()
        for a in range(0, objects, BATCH):
            _put_batch(loader, [f"o{k}" for k in range(a, min(objects, a + BATCH))])
        res["fill_s"] = time.perf_counter() - t0
        s = loader.call("stats")["stats"]
        res["filled_objects"] = s["objects"]
        res["used_fraction"] = s["used"] / s["capacity"]
        owners.append(loader)  # heartbeats from now on
        s = loader.call("stats", reset_max=True)["stats"]
        res["fill_max_request_ms"] = s["max_request_s"] * 1e3
        res["fill_max_message_ms"] = s["max_message_s"] * 1e3
        for name, loaded in (("quiet", False), ("loaded", True)):
            res[name] = _phase(m.address, duration, objects, loaded=loaded)
            s = loader.call("stats", reset_max=True)["stats"]
            res[name]["master_max_request_ms"] = s["max_request_s"] * 1e3
            res[name]["master_max_request_op"] = s["max_request_op"]
            res[name]["master_max_message_ms"] = s["max_message_s"] * 1e3
        stop.set()
        res.update(
            evictions=s["counters"].get("evictions", 0),
            evict_steps=s["counters"].get("evict_steps", 0),
            clients_dead=s["counters"].get("clients_dead", 0),
            objects_end=s["objects"],
        )
    return res


def main(argv: list[str] | None = None) -> int:
    """Run and print."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--segments", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--json", action="store_true")
    a = shorten(ap.parse_args(argv), objects=5000, segments=10, duration=1.0)
    res = run(a.objects, a.segments, a.duration)
    if a.json:
        print(json.dumps(res))
        return 0
    for k, v in res.items():
        for kk, vv in v.items() if isinstance(v, dict) else [("", v)]:
            shown = f"{vv:,.3f}" if isinstance(vv, float) else f"{vv:,}" if isinstance(vv, int) else vv
            print(f"{k + ' ' + kk:32} {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
