"""Conductor balancing threshold (issue 13): local cache-aware vs the conductor fetching whenever
faster (threshold 1) vs fetching only a prefix more than X times what it would reuse without fetching,
on synthetic Mooncake-shaped traces (small and larger caches, light to heavy load, three seeds), and
on the Mooncake trace when it is there.

    python benchmarks/conductor_balancing.py [--thresholds 1 2 4] [--trace FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpool._smoke import pick
from kvpool.conductor.sim import SimConfig, load_requests, simulate, synthetic_requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--thresholds", nargs="+", type=float, default=[1.0, 2.0, 4.0])
    ap.add_argument(
        "--trace", default=None, help="also the Mooncake trace, 8 prefill + 8 decode (Fig. 5 setting)"
    )
    a = ap.parse_args()
    rows = []
    for seed in pick((1, 2, 4), (1,)):
        for cache in (300, 1000):
            for rate in pick((2.0, 3.0, 4.0, 5.0), (5.0,)):
                reqs = synthetic_requests(pick(1500, 300), rate_per_s=rate, seed=seed)
                cfg = dict(prefill=4, decode=4, cache_blocks=cache)
                local = simulate(reqs, SimConfig(policy="cache", **cfg))["ttft_s"]["mean"]
                row = {"seed": seed, "cache_blocks": cache, "rate": rate, "cache": local}
                for x in a.thresholds:
                    sim = simulate(reqs, SimConfig(policy="conductor", balancing_threshold=x, **cfg))
                    row[f"conductor@{x:g}"] = sim["ttft_s"]["mean"]
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    for x in a.thresholds:
        k = f"conductor@{x:g}"
        wins = sum(r[k] < r["cache"] for r in rows)
        worst = max(r[k] / r["cache"] for r in rows)
        print(f"threshold {x:g}: mean TTFT below local cache-aware in {wins}/{len(rows)} settings; "
              f"worst ratio to it {worst:.2f}x")  # fmt: skip
    if a.trace and Path(a.trace).exists():
        reqs = load_requests(a.trace)
        print(
            "trace cache",
            round(simulate(reqs, SimConfig(policy="cache", prefill=8, decode=8))["ttft_s"]["mean"], 3),
        )
        for x in a.thresholds:
            sim = simulate(reqs, SimConfig(policy="conductor", prefill=8, decode=8, balancing_threshold=x))
            print(
                f"trace conductor@{x:g}",
                round(sim["ttft_s"]["mean"], 3),
                "transfers",
                sim["transfers"]["count"],
            )


if __name__ == "__main__":
    main()
