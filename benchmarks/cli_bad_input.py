"""Wall time of every case of the CLI bad-input matrix (tests/test_cli_errors.py) against the
1 s target, next to the same run's bare interpreter start (``python -c pass``, the floor of any
command-line tool written in Python).

Run: ``python benchmarks/cli_bad_input.py [--repeat 3]`` from the repository root. Prints one line
per case (best of ``--repeat``) and a summary; exit status 1 if any case has a traceback or the
wrong exit status.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_cli_errors import CASES, bad_input_places, fill, run_kvpool  # noqa: E402

from kvpool._smoke import pick, shorten  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the best is kept (default 3)")
    args = shorten(ap.parse_args(), repeat=1)
    base = []
    for _ in range(max(3, args.repeat)):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        base.append(time.monotonic() - t0)
    start = min(base)
    bad, times = 0, []
    with tempfile.TemporaryDirectory() as tmp, bad_input_places(Path(tmp)) as places:
        for case in pick(CASES, CASES[::4]):  # smoke: every 4th case (tests/test_cli_errors.py runs all)
            best, line, ok = 1e9, "", True
            for _ in range(args.repeat):
                out, dt = run_kvpool([fill(a, places) for a in case.args], case.env, case.memlock, timeout=60)
                best = min(best, dt)
                line = out.stderr.strip()
                ok = ok and out.returncode == case.rc and "Traceback" not in out.stderr
            bad += not ok
            times.append((best, case.id))
            print(f"{best:6.3f} s  {'ok ' if ok else 'BAD'} {case.id:22} {line[:100]}", flush=True)
    times.sort()
    slow = [(t, i) for t, i in times if t >= 1.0]
    print(
        f"\n{len(times)} cases: median {times[len(times) // 2][0]:.3f} s, max {times[-1][0]:.3f} s "
        f"({times[-1][1]}), {len(slow)} at or over 1 s {[i for _, i in slow]}; "
        f"bare `python -c pass` {start:.3f} s (median/bare = {times[len(times) // 2][0] / start:.1f}x, "
        f"max/bare = {times[-1][0] / start:.1f}x); "
        f"{bad} wrong"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
