"""Sweep of the simulator's rejection modes (Mooncake Table 4: baseline > early > prediction-based).

For each cluster shape, replay speed and SLO pair, replays the trace under the conductor policy
with ``--reject-mode`` baseline, early and predict, and prints one JSON line with the rejections
by reason and the goodput of each, plus whether the paper's ordering holds.

    python benchmarks/conductor_table4_sweep.py [--trace FILE]   # 144 settings x 3 modes, ~10 min
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from kvpool.conductor.sim import SimConfig, load_requests, simulate, synthetic_requests

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "conversation_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE), help="Mooncake-format trace (default: ../shared/traces)")
    ap.add_argument("--prefill", type=int, nargs="+", default=[4, 6, 8])
    ap.add_argument("--decode", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--speedup", type=float, nargs="+", default=[2, 3, 4, 6])
    ap.add_argument("--ttft-slo", type=float, nargs="+", default=[10.0, 30.0])
    ap.add_argument("--tbt-slo", type=float, nargs="+", default=[0.04, 0.05])
    args = ap.parse_args()
    trace = load_requests(args.trace) if Path(args.trace).exists() else synthetic_requests(3000, rate_per_s=8)
    ordered = differ = 0
    for p, d, sp, ttft, tbt in itertools.product(args.prefill, args.decode, args.speedup, args.ttft_slo,
                                                 args.tbt_slo):  # fmt: skip
        row: dict[str, object] = {"prefill": p, "decode": d, "speedup": sp, "ttft_slo": ttft, "tbt_slo": tbt}
        totals = []
        for mode in ("baseline", "early", "predict"):
            cfg = SimConfig(policy="conductor", prefill=p, decode=d, speedup=sp, ttft_slo_s=ttft,
                            tbt_slo_s=tbt, reject_mode=mode)  # fmt: skip
            r = simulate(trace, cfg)
            row[mode] = {"rejected": r["rejected"], "goodput_rps": round(r["goodput_rps"], 3)}
            totals.append(r["rejected"]["total"])
        row["paper_order"] = totals[0] > totals[1] > totals[2]
        ordered += row["paper_order"]
        differ += len(set(totals)) > 1
        print(json.dumps(row), flush=True)
    src = args.trace if Path(args.trace).exists() else "synthetic (trace not found)"
    print(json.dumps({"trace": src, "modes_differ": differ, "paper_order": ordered}))


if __name__ == "__main__":
    main()
