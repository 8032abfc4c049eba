"""Store master memory and service under 1,000 hostile connections.

A real ``kvpool master`` (with a secret) holds ``--objects`` objects on 100 segments and serves a
well-behaved client doing single-key put/get round trips. Its RSS after that steady phase is the
baseline. Then ``--hostile`` connections are opened and held for ``--hold`` seconds while the
well-behaved client goes on; a quarter each:

* unauthenticated, announcing a 60 MiB message and sending 4 KiB of it;
* authenticated, starting a message just under the master's limit, sending 64 KiB, stalling;
* authenticated, sending ``get`` requests of 1,024 keys back to back and never reading a reply;
* authenticated and idle.

Printed: steady RSS, the highest RSS while the hostile connections were open and its ratio to
the steady one, the well-behaved client's p50/p99/max round trip before and during, and how the
master closed connections (handshake/frame/reply deadlines).

    python benchmarks/master_hostile.py [--hostile 1000] [--objects 100000] [--hold 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import threading
import time
from typing import Any

from kvpool._rpc import RpcClient, frame
from kvpool._smoke import shorten
from kvpool.store.procs import MasterProcess

SECRET = "hostile-bench"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


def _fill(addr: str, objects: int) -> None:
    owner = RpcClient(addr, 30, SECRET)
    owner.call("register", client="owner")
    for s in range(100):
        owner.call("mount", segment=f"seg-{s}", base=(1 << 40) + s * (1 << 32), size=(objects * 4160) // 80)
    loader = RpcClient(addr, 60, SECRET)
    loader.call("register", client="loader")
    for a in range(0, objects, 1024):
        keys = [f"o{k}" for k in range(a, min(objects, a + 1024))]
        r = loader.call("put_start", keys=keys, sizes=[4096] * len(keys), config={})
        items = [
            [k, v[0], 1, [x[0] for x in v[2]]]
            for k, (c, v) in zip(keys, r["results"], strict=True)
            if c is None
        ]
        loader.call("put_end", items=items, epoch=r["epoch"])
    threading.Thread(target=_beat, args=([owner, loader],), daemon=True).start()


def _beat(clients: list[RpcClient]) -> None:
    while True:
        time.sleep(0.5)
        for c in clients:
            try:
                c.call("heartbeat", floor=1 << 62)
            except Exception:  # noqa: BLE001 - reported by the well-behaved client's figures
                pass


def _client_load(addr: str, objects: int, seconds: float) -> list[float]:
    c = RpcClient(addr, 30, SECRET)
    lat: list[float] = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        t = time.perf_counter()
        key = f"o{(i * 7919) % objects}"
        code, info = c.call("get", keys=[key])["results"][0]
        if code is None:
            c.send("release", leases=[[key, info["gen"]]])
        lat.append(time.perf_counter() - t)
        i += 1
        time.sleep(0.002)
    c.close()
    return lat


def _hostile(addr: str, n: int) -> list[socket.socket]:
    host, port = addr.rsplit(":", 1)
    socks: list[socket.socket] = []
    big_get = frame({"op": "get", "id": 1, "keys": [f"o{k}" for k in range(1024)]})
    for i in range(n):
        kind = i % 4
        if kind == 0:
            s = socket.create_connection((host, int(port)))
            s.sendall(struct.pack("<I", 60 << 20) + b"\0" * 4096)
        else:
            c = RpcClient(addr, 30, SECRET)
            c.call("ping")
            assert c._sock is not None
            s = c._sock
            c._sock = None  # keep the socket; the client object lets go of it
            if kind == 1:
                s.sendall(struct.pack("<I", (2 << 20) - 1024) + b"\x81" + b"\0" * (64 << 10))
            elif kind == 2:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.setblocking(False)
                try:
                    for _ in range(64):
                        s.send(big_get)
                except BlockingIOError:
                    pass
        socks.append(s)
    return socks


def run(hostile: int, objects: int, hold: float) -> dict[str, Any]:
    """Steady phase, then the hostile phase; returns the figures."""
    res: dict[str, Any] = {"hostile": hostile, "objects": objects}
    with MasterProcess(secret=SECRET) as m:
        _fill(m.address, objects)
        before = _client_load(m.address, objects, 5.0)
        res["steady_rss_mib"] = _rss(m.pid) / 2**20
        peak = [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                peak[0] = max(peak[0], _rss(m.pid))

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        t0 = time.monotonic()
        socks = _hostile(m.address, hostile)
        res["open_s"] = time.monotonic() - t0
        during = _client_load(m.address, objects, hold)
        stop.set()
        t.join()
        s = RpcClient(m.address, 30, SECRET).call("stats")["stats"]
        for sk in socks:
            sk.close()
        res["peak_rss_mib"] = peak[0] / 2**20
        res["rss_ratio"] = peak[0] / (res["steady_rss_mib"] * 2**20)
        for name, lat in (("before", before), ("during", during)):
            res[f"{name}_p50_ms"] = statistics.median(lat) * 1e3
            res[f"{name}_p99_ms"] = sorted(lat)[int(len(lat) * 0.99)] * 1e3
            res[f"{name}_max_ms"] = max(lat) * 1e3
        res["connections_at_end"] = s["connections"]
        res["closed"] = s["rpc_server"]
    return res


def main(argv: list[str] | None = None) -> int:
    """Run and print."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hostile", type=int, default=1000)
    ap.add_argument("--objects", type=int, default=100_000)
    ap.add_argument("--hold", type=float, default=15.0)
    ap.add_argument("--json", action="store_true")
    a = shorten(ap.parse_args(argv), hostile=40, objects=2000, hold=1.0)
    res = run(a.hostile, a.objects, a.hold)
    if a.json:
        print(json.dumps(res))
        return 0
    for k, v in res.items():
        print(f"{k:22} {v:,.2f}" if isinstance(v, float) else f"{k:22} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
