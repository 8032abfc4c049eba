"""Baseline: a plain Python TCP ping-pong over loopback, the floor for a synchronous small transfer.

The calling process connects to a child (this file run with ``--echo``) and, one at a time,
``sendall``s ``size`` bytes and waits for a 1-byte acknowledgement, which the child sends once it
has received all ``size`` bytes. The round-trip times give P50/P99. ``TCP_NODELAY`` on both ends.
A synchronous kvpool WRITE does the same work (send the bytes, wait for the target's ack), so its
latency is reported as a multiple of this one, measured in the same run.

    python benchmarks/socket_pingpong.py --size 4096 --duration 2 [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


def _echo(size: int) -> int:
    """Child: accept one connection; ack every ``size`` bytes received with one byte."""
    buf = memoryview(bytearray(size))
    with socket.socket() as ls:
        ls.bind((LOOPBACK, 0))
        ls.listen(1)
        print(ls.getsockname()[1], flush=True)
        conn, _ = ls.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            got = 0
            while got < size:
                n = conn.recv_into(buf[got:])
                if n == 0:
                    return 0
                got += n
            conn.sendall(b"k")


def run_pingpong(size: int = 4096, duration_s: float = 2.0) -> dict[str, Any]:
    """Round trips of ``size`` bytes + a 1-byte ack for ``duration_s``; P50/P99 in µs."""
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--echo", "--size", str(size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        payload = bytes(size)
        lat: list[float] = []
        with socket.create_connection((LOOPBACK, port), timeout=30) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            end = time.perf_counter() + duration_s
            while True:
                t0 = time.perf_counter()
                s.sendall(payload)
                if not s.recv(1):
                    raise RuntimeError("echo process closed the connection")
                t1 = time.perf_counter()
                lat.append(t1 - t0)
                if t1 > end and len(lat) >= 100:
                    break
        lat.sort()
        return {
            "system": "socket-pingpong",
            "size": size,
            "round_trips": len(lat),
            "p50_us": lat[len(lat) // 2] * 1e6,
            "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
        }
    finally:
        child.kill()
        child.wait()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--duration", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--echo", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.echo:
        return _echo(a.size)
    res = run_pingpong(a.size, a.duration)
    print(
        json.dumps(res)
        if a.json
        else f"ping-pong {a.size} B: P50 {res['p50_us']:.1f} µs P99 {res['p99_us']:.1f} µs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
