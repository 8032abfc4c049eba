"""benchmarks/store_ab.py: the before/after A/B of ``kvpool bench store`` quoted in docs/benchmarks.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from store_ab import table  # noqa: E402


def test_table_pairs_runs_in_order_and_takes_the_median_ratio() -> None:
    def rows(put: float, get: float) -> list[dict[str, float]]:
        return [{"value_size": 4096, "put_ops_s": put, "get_ops_s": get}]

    runs = [("base", rows(100, 10)), ("new", rows(90, 30)), ("base", rows(200, 10)),
            ("new", rows(220, 10)), ("base", rows(100, 20)), ("new", rows(100, 10))]  # fmt: skip
    got = {r["figure"]: r for r in table(runs)}
    assert set(got) == {"put_ops_s", "get_ops_s"}
    assert got["put_ops_s"]["ratio"] == 1.0  # pairs 0.9, 1.1, 1.0 (not 100/100 of the medians)
    assert got["put_ops_s"]["base"] == 100 and got["put_ops_s"]["new"] == 100
    assert got["get_ops_s"]["ratio"] == 1.0 and got["get_ops_s"]["pairs"] == 3  # 3.0, 1.0, 0.5


def test_one_pair_of_this_checkout_against_itself() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/store_ab.py", ".", ".", "--pairs", "1", "--value-size", "4K",
         "--duration", "0.3", "--python", sys.executable],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("| 4096 |")]
    assert {ln.split("|")[2].strip() for ln in lines} >= {"put_ops_s", "get_ops_s", "batch_exists_keys_s"}
    assert all(float(ln.split("|")[5]) > 0 for ln in lines)
