"""Before/after A/B of ``kvpool bench store`` between two checkouts of kvpool, run alternately
(base, new, base, new, ...) so that the machine's drift hits both alike; prints each figure's
medians and the median of the paired new/base ratios (the number to quote: one pair's ratio is
as noisy as the machine, the median of 5 much less so).

Each checkout runs with its own interpreter: ``DIR/.venv/bin/python`` when it exists (build the
old one into its own virtualenv first: ``git worktree add ../base 3534ff2 && cd ../base &&
python -m venv .venv && .venv/bin/pip install -e .``), else ``--python``.

    python benchmarks/store_ab.py BASE_DIR NEW_DIR [--pairs 5] [--value-size 4K 1M] [--duration 2]
        [--jsonl FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

FIGURES = ("put_ops_s", "put_p50_us", "get_ops_s", "get_p50_us", "batch_put_gbps", "batch_get_gbps",
           "batch_exists_keys_s")  # fmt: skip


def run_once(checkout: Path, python: str, sizes: list[str], duration: float) -> list[dict[str, Any]]:
    """One ``kvpool bench store --json`` in ``checkout`` with its interpreter; its rows."""
    venv = checkout / ".venv" / "bin" / "python"
    exe = str(venv) if venv.exists() else python
    cmd = [exe, "-m", "kvpool.cli", "bench", "store", "--value-size", *sizes, "--duration", str(duration)]
    cmd.append("--json")
    out = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("[") :])


def table(runs: list[tuple[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Per (value size, figure): base and new medians and the median of paired new/base ratios.
    ``runs`` alternate ("base", rows), ("new", rows), ...; the i-th base pairs with the i-th new."""
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for side, rows in runs:
        for row in rows:
            by.setdefault((side, row["value_size"]), []).append(row)
    out = []
    for size in sorted({s for _, s in by}):
        base, new = by.get(("base", size), []), by.get(("new", size), [])
        for fig in FIGURES:
            b = [r[fig] for r in base if fig in r]
            n = [r[fig] for r in new if fig in r]
            pairs = [y / x for x, y in zip(b, n, strict=False) if x]
            if not pairs:
                continue
            out.append({"value_size": size, "figure": fig, "base": statistics.median(b),
                        "new": statistics.median(n), "ratio": statistics.median(pairs),
                        "pairs": len(pairs)})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the pairs and print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--value-size", nargs="+", default=["4K", "1M"])
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--python", default=sys.executable, help="interpreter of a checkout without .venv")
    ap.add_argument("--jsonl", type=Path, help="also append every run's rows here")
    args = ap.parse_args(argv)
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    for i in range(args.pairs):
        for side in ("base", "new"):
            rows = run_once(getattr(args, side).resolve(), args.python, args.value_size, args.duration)
            runs.append((side, rows))
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps({"side": side, "pair": i, "rows": rows}) + "\n")
            print(f"pair {i + 1}/{args.pairs} {side} done", file=sys.stderr)
    print("| value | figure | base median | new median | new / base (median of paired ratios) |")
    print("|---|---|---|---|---|")
    for r in table(runs):
        print(f"| {r['value_size']} | {r['figure']} | {r['base']:.4g} | {r['new']:.4g} | {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
