"""Side-by-side: kvpool store vs Mooncake Store (TCP) vs redis-server driven by redis-py.

Every system runs as its own set of processes on loopback, the value stored in a segment (or
server) owned by another process than the measuring client. Runs are interleaved (kvpool,
Mooncake, redis, kvpool, ...) and each figure is the median over ``--repeats``.

    python benchmarks/compare_store.py --duration 3 --repeats 3 [--value-sizes 4096]

Needs ``pip install mooncake-transfer-engine-non-cuda redis`` and Debian's ``redis-server``,
``libibverbs1 librdmacm1 libnuma1``.
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
from kvpool.store.bench import run_store_bench  # noqa: E402
from mooncake_store import run_mooncake_store  # noqa: E402
from redis_store import run_redis  # noqa: E402

KEYS = ("put_ops_s", "get_ops_s", "put_gbps", "get_gbps", "put_p50_us", "get_p50_us")


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print markdown tables."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--value-sizes", type=int, nargs="+", default=[4096, 1 << 20])
    ap.add_argument(
        "--systems",
        nargs="+",
        default=["kvpool", "mooncake", "redis"],
        choices=["kvpool", "mooncake", "redis"],
        help="systems to run (kvpool is always run: the ratios are against it)",
    )
    ap.add_argument("--json", action="store_true")
    args = shorten(ap.parse_args(argv), duration=0.3, repeats=1)
    runners = {
        "kvpool": lambda vs: run_store_bench(vs, args.duration),
        "mooncake": lambda vs: run_mooncake_store(vs, duration_s=args.duration),
        "redis": lambda vs: run_redis(vs, duration_s=args.duration),
    }
    runners = {k: fn for k, fn in runners.items() if k == "kvpool" or k in args.systems}
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for vs in args.value_sizes:
            for name, fn in runners.items():
                res = fn(vs)
                samples.setdefault((name, vs), []).append(res)
                print(json.dumps({"system": name, **{k: res[k] for k in KEYS}}), file=sys.stderr, flush=True)
    med = {key: {k: statistics.median(r[k] for r in rs) for k in KEYS} for key, rs in samples.items()}
    batch_keys = ("batch_put_gbps", "batch_get_gbps", "batch_exists_keys_s")
    extra = {
        vs: {k: statistics.median(r[k] for r in samples[("kvpool", vs)]) for k in batch_keys}
        for vs in args.value_sizes
    }
    if args.json:
        print(json.dumps({"median": {f"{k[0]}@{k[1]}": v for k, v in med.items()}, "kvpool_batch": extra}))
        return 0
    print(f"{args.duration}s per phase, median of {args.repeats} interleaved runs, GB = 1e9 bytes\n")
    print("| value | system | put ops/s | put GB/s | put P50 µs | get ops/s | get GB/s | get P50 µs |")
    print("|---|---|---|---|---|---|---|---|")

    def label(vs: int) -> str:
        return f"{vs >> 20} MiB" if vs >= 1 << 20 else f"{vs >> 10} KiB"

    for vs in args.value_sizes:
        for name in runners:
            m = med[(name, vs)]
            size = label(vs)
            print(
                f"| {size} | {name} | {m['put_ops_s']:,.0f} | {m['put_gbps']:.2f} | {m['put_p50_us']:.0f} | "
                f"{m['get_ops_s']:,.0f} | {m['get_gbps']:.2f} | {m['get_p50_us']:.0f} |"
            )
    print("\n| value | kvpool / Mooncake put | get | kvpool / redis put | get |\n|---|---|---|---|---|")
    for vs in args.value_sizes:
        k = med[("kvpool", vs)]
        mc, rd = med.get(("mooncake", vs)), med.get(("redis", vs))

        def ratio(peer: dict[str, float] | None, key: str, k: dict[str, float] = k) -> str:
            return "-" if peer is None else f"{k[key] / peer[key]:.2f}x"

        print(
            f"| {label(vs)} | {ratio(mc, 'put_ops_s')} | {ratio(mc, 'get_ops_s')} | "
            f"{ratio(rd, 'put_ops_s')} | {ratio(rd, 'get_ops_s')} |"
        )
    print("\nkvpool batches of 32:", json.dumps(extra))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
