"""An engine port under 10,000 hostile connections (issue 12 target), three real processes.

    python benchmarks/hostile_peers.py --connections 10000 --mode idle
    python benchmarks/hostile_peers.py --connections 10000 --mode trickle

- target: one TransferEngine (tcp, with a secret) serving a 1 MiB buffer; it measures its own RSS
  and ``register_local_memory`` / ``unregister_local_memory`` times on request;
- attacker: opens ``--connections`` sockets to the target port from 127.0.x.1 source addresses
  (200 per address, under the default per-peer bound of 256) and sends nothing (``idle``) or one
  byte of a hello per connection per second (``trickle``; the handshake deadline closes them and
  the attacker reconnects);
- initiator (this process): 1 MiB WRITEs with ``transfer_sync`` from 127.0.0.1.

Prints one JSON object: idle and attacked figures (median and p90 of the 1 MiB transfer, register
and unregister times, target RSS, the server's counters) and whether each target was met:
the process survives, RSS grows < 100 MB, the 1 MiB transfer within 10 ms of its idle figure,
register_local_memory <= 10 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from kvpool._smoke import shorten

MIB = 1 << 20


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def target(secret: str) -> None:
    """The engine under attack; answers `reg`, `rss`, `stats`, `exit` on stdin."""
    from kvpool import TransferEngine

    eng = TransferEngine(protocol="tcp", secret=secret, timeout_s=30)
    buf = bytearray(MIB)
    addr = eng.register_local_memory(buf)
    info = {"segment": eng.segment_name, "addr": addr, "port": eng.port, "pid": os.getpid()}
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        if cmd[0] == "reg":
            reg, unreg = [], []
            for _ in range(int(cmd[1])):
                b = bytearray(MIB)
                t0 = time.perf_counter()
                a = eng.register_local_memory(b)
                t1 = time.perf_counter()
                eng.unregister_local_memory(a)
                t2 = time.perf_counter()
                reg.append((t1 - t0) * 1e3)
                unreg.append((t2 - t1) * 1e3)
            out: dict[str, Any] = {
                "register_ms_median": statistics.median(reg),
                "register_ms_max": max(reg),
                "unregister_ms_median": statistics.median(unreg),
                "unregister_ms_max": max(unreg),
            }
        elif cmd[0] == "rss":
            out = {"rss_mb": _rss_mb()}
        elif cmd[0] == "stats":
            out = dict(eng._native.server_stats())
        else:
            out = {"error": cmd[0]}
        print(json.dumps(out), flush=True)
    eng.close()


def attacker(port: int, n: int, mode: str) -> None:
    """Holds `n` connections open; prints {"open": k} once they are up, then runs until killed."""
    socks: list[socket.socket | None] = [None] * n

    def dial(i: int) -> socket.socket | None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((f"127.0.{2 + i // 200}.1", 0))
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
            return None

    for i in range(n):
        socks[i] = dial(i)
    time.sleep(1.0)
    print(json.dumps({"open": sum(s is not None for s in socks)}), flush=True)
    hello = b"KVPH\x02\x00\x00\x00" + b"\x00" * 64
    pos = [0] * n
    while True:  # once a second: keep all n open (reconnect what the server closed), trickle
        t0 = time.monotonic()
        for i, s in enumerate(socks):
            if s is None:
                socks[i] = dial(i)
                continue
            try:
                if s.recv(4096) == b"":
                    raise ConnectionResetError
                # (the challenge arrived; keep going)
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                socks[i], pos[i] = dial(i), 0
                continue
            if mode == "trickle" and pos[i] < len(hello):
                with contextlib.suppress(OSError):
                    s.send(hello[pos[i] : pos[i] + 1])
                    pos[i] += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))


def _measure(eng: Any, segment: str, local: int, remote: int, n: int) -> dict[str, float]:
    from kvpool import OpCode

    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.transfer_sync(segment, local, remote, MIB, OpCode.WRITE)
        lat.append((time.perf_counter() - t0) * 1e3)
    lat.sort()
    p90 = lat[int(0.9 * (len(lat) - 1))]
    return {"write_1mib_ms_median": statistics.median(lat), "write_1mib_ms_p90": p90}


def main(argv: list[str] | None = None) -> int:
    """Run target, attacker and initiator; print the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--mode", choices=["idle", "trickle"], default="idle")
    ap.add_argument("--transfers", type=int, default=200)
    ap.add_argument("--hold-s", type=float, default=6.0, help="attack time before measuring")
    ap.add_argument("--secret", default="hostile-bench")
    ap.add_argument("--role", choices=["main", "target", "attacker"], default="main", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "main":
        shorten(args, connections=200, transfers=20, hold_s=1.0)
    _raise_nofile()
    if args.role == "target":
        target(args.secret)
        return 0
    if args.role == "attacker":
        attacker(args.port, args.connections, args.mode)
        return 0

    from kvpool import TransferEngine, _native
    from kvpool.child import ChildProcess

    me = [sys.executable, os.path.abspath(__file__)]
    tgt = ChildProcess(me + ["--role", "target", "--secret", args.secret])
    att = None
    try:
        with TransferEngine(protocol="tcp", secret=args.secret, timeout_s=30) as ini:
            src = bytearray(MIB)
            local = ini.register_local_memory(src)
            _native.fill_pattern(local, MIB, 5)
            seg, remote = tgt.info["segment"], tgt.info["addr"]
            _measure(ini, seg, local, remote, 20)  # warm-up
            idle = {**_measure(ini, seg, local, remote, args.transfers), **tgt.ask("reg 50")}
            idle.update(tgt.ask("rss"))
            role = ["--role", "attacker", "--port", str(tgt.info["port"])]
            att = subprocess.Popen(
                me + role + ["--connections", str(args.connections), "--mode", args.mode],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert att.stdout is not None
            opened = json.loads(att.stdout.readline())["open"]
            time.sleep(args.hold_s)  # past the handshake deadline: reaped and re-opened connections
            attacked = {**_measure(ini, seg, local, remote, args.transfers), **tgt.ask("reg 50")}
            attacked.update(tgt.ask("rss"))
            stats = tgt.ask("stats")
            alive = tgt.proc.poll() is None
    finally:
        if att is not None:
            att.kill()
            att.wait()
        tgt.close()
    delta = attacked["write_1mib_ms_median"] - idle["write_1mib_ms_median"]
    rss_growth = attacked["rss_mb"] - idle["rss_mb"]
    result = {
        "mode": args.mode,
        "connections_opened": opened,
        "server_open_connections": stats.get("open"),
        "idle": idle,
        "attacked": attacked,
        "server": stats,
        "targets": {
            "process_survives": alive,
            "rss_growth_mb": round(rss_growth, 1),
            "rss_growth_below_100mb": rss_growth < 100,
            "write_1mib_median_delta_ms": round(delta, 3),
            "write_within_10ms_of_idle": delta <= 10,
            "register_ms_max": round(attacked["register_ms_max"], 3),
            "register_within_10ms": attacked["register_ms_max"] <= 10,
        },
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
