"""Side-by-side: kvpool transfer engine vs Mooncake Transfer Engine (TCP) vs a plain socket stream.

Runs everything in one invocation on this host, two processes per measurement, loopback only,
and prints a markdown table (plus ``--json``). Each figure is the median of ``--repeats`` runs.

    python benchmarks/compare_transfer.py --duration 5 --repeats 3

Needs ``pip install mooncake-transfer-engine-non-cuda`` and Debian's
``libibverbs1 librdmacm1 libnuma1`` for the Mooncake column (``--no-mooncake`` skips it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvpool._smoke import shorten  # noqa: E402
from kvpool.transfer.bench import run_transfer_bench  # noqa: E402
from mooncake_te import run_mooncake_te  # noqa: E402
from socket_pingpong import run_pingpong  # noqa: E402
from socket_stream import run_socket_stream  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = shorten(ap.parse_args(argv), duration=0.2, repeats=1)
    d, r = args.duration, args.repeats
    rows: list[dict[str, Any]] = []

    # Runs are interleaved (socket, kvpool, Mooncake, socket, ...) so that slow phases of a shared
    # machine hit every system alike; each figure is the median over the repeats.
    for bs in (64 * KIB, 1 * MIB, 4 * MIB):
        samples: dict[str, list[float]] = {}
        for _ in range(r):
            samples.setdefault("socket", []).append(run_socket_stream(bs, d)["gbps"])
            for op in ("write", "read"):
                kv = run_transfer_bench(bs, 32, op, d, protocol="tcp", threads=2).gbps
                samples.setdefault(f"kv-{op}", []).append(kv)
                if not args.no_mooncake:
                    samples.setdefault(f"mc-{op}", []).append(
                        run_mooncake_te(bs, op, int(max(1, d)), 2, 32)["gbps"]
                    )
        sock = statistics.median(samples["socket"])
        for op in ("write", "read"):
            kv = statistics.median(samples[f"kv-{op}"])
            mc = None if args.no_mooncake else statistics.median(samples[f"mc-{op}"])
            row = {
                "path": "tcp",
                "block": bs,
                "op": op,
                "kvpool_gbps": kv,
                "mooncake_gbps": mc,
                "socket_gbps": sock,
                "x_mooncake": kv / mc if mc else None,
                "pct_socket": 100 * kv / sock,
                "samples": {
                    k: [round(v, 3) for v in vs] for k, vs in samples.items() if op in k or k == "socket"
                },
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

    for op in ("write", "read"):
        sh = statistics.median(
            run_transfer_bench(4 * MIB, 32, op, d, protocol="auto", threads=2).gbps for _ in range(r)
        )
        rows.append({"path": "same_host", "block": 4 * MIB, "op": op, "kvpool_gbps": sh})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    # Synchronous 4 KiB WRITE against a plain Python ping-pong (4 KiB out, 1-byte ack back), the
    # same work over the same loopback, interleaved: the ratio is the figure that carries over.
    lat_runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(r):
        pp = run_pingpong(4 * KIB, d)
        lat_runs.setdefault("python ping-pong", []).append((pp["p50_us"], pp["p99_us"]))
        for proto in ("tcp", "auto"):
            x = run_transfer_bench(4 * KIB, 1, "write", d, protocol=proto, threads=1, sync=True)
            lat_runs.setdefault(proto, []).append((x.p50_us, x.p99_us))
    lat = {
        k: (statistics.median(v[0] for v in vs), statistics.median(v[1] for v in vs))
        for k, vs in lat_runs.items()
    }

    if args.json:
        print(json.dumps({"transfers": rows, "sync_4k_write_latency_us": lat}, indent=2))
        return 0
    print(f"duration {d}s per run, median of {r} runs, 2 initiator threads x batch 32, GB = 1e9 bytes\n")
    print(
        "| path | block | op | kvpool GB/s | Mooncake TE GB/s | socket stream GB/s | x Mooncake | % socket |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for x in rows:
        blk = f"{x['block'] // MIB} MiB" if x["block"] >= MIB else f"{x['block'] // KIB} KiB"

        def f(v: float | None, fmt: str = "{:.2f}") -> str:
            return "-" if v is None else fmt.format(v)

        print(
            f"| {x['path']} | {blk} | {x['op']} | {f(x['kvpool_gbps'])} | {f(x.get('mooncake_gbps'))} | "
            f"{f(x.get('socket_gbps'))} | {f(x.get('x_mooncake'), '{:.1f}x')} | "
            f"{f(x.get('pct_socket'), '{:.0f}%')} |"
        )
    print("\n| 4 KiB transfer_sync WRITE | P50 µs | P99 µs | P50 / ping-pong P50 |\n|---|---|---|---|")
    base = lat["python ping-pong"][0]
    for proto, (p50, p99) in lat.items():
        print(f"| {proto} | {p50:.1f} | {p99:.1f} | {p50 / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
