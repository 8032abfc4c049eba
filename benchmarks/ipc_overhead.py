"""Software cost of a synchronous CUDA IPC transfer: N scattered ranges of 256 B from our GPU
buffer to a peer process's GPU buffer (``batch_transfer_sync`` with numpy address arrays), best and
median of ``--reps`` calls. The ranges are tiny, so on a GPU the figure is kvpool's submit and
completion path plus the launch; on the fake driver (``--fake``: kvpool.testing.fakecuda, built
here) it also holds the fake's own per-operation thread hand-offs and copies, so compare trees on
the same machine in the same run, never with GPU figures.

    python benchmarks/ipc_overhead.py [--fake] [--ranges 1 4096] [--reps 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

CACHE = 64 << 20
BLOCK = 256


def serve() -> None:
    """The peer: a registered GPU buffer; prints its segment and address, waits for stdin EOF."""
    from kvpool import TransferEngine
    from kvpool.transfer.cuda_driver import load_driver

    drv = load_driver()
    if drv is None:
        sys.exit("no CUDA driver")
    with TransferEngine() as eng:
        g = drv.alloc(CACHE, 0)
        eng.register_local_memory(g, CACHE, location="cuda:0")
        print(json.dumps({"name": eng.segment_name, "gpu": g}), flush=True)
        sys.stdin.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fake", action="store_true", help="use the fake CUDA driver (kvpool.testing.fakecuda)")
    ap.add_argument("--ranges", type=int, nargs="+", default=[1, 4096])
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve()
        return
    if a.fake:
        from kvpool.testing.fakecuda import build

        os.environ["KVPOOL_CUDA_DRIVER"] = build()
    from kvpool import OpCode, TransferEngine
    from kvpool.transfer.cuda_driver import load_driver

    drv = load_driver()
    if drv is None:
        sys.exit("kvpool: no CUDA driver sees a GPU (--fake: the fake driver)")
    cmd = [sys.executable, __file__, "--serve"]
    peer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(peer.stdout.readline())  # type: ignore[union-attr]
        with TransferEngine() as eng:
            g = drv.alloc(CACHE, 0)
            eng.register_local_memory(g, CACHE, location="cuda:0", remote_accessible=False)
            rng = np.random.default_rng(1)
            out = {}
            for n in a.ranges:
                lb = rng.permutation(CACHE // BLOCK)[:n].astype(np.uint64)
                rb = rng.permutation(CACHE // BLOCK)[:n].astype(np.uint64)
                locs = np.uint64(g) + lb * np.uint64(BLOCK)
                rems = np.uint64(info["gpu"]) + rb * np.uint64(BLOCK)
                lens = np.full(n, BLOCK, dtype=np.uint64)
                eng.batch_transfer_sync(info["name"], locs, rems, lens, OpCode.WRITE)  # warm: mapping, kernel
                ts = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    eng.batch_transfer_sync(info["name"], locs, rems, lens, OpCode.WRITE)
                    ts.append(time.perf_counter() - t0)
                ts.sort()
                out[f"{n}_ranges_best_ms"] = ts[0] * 1e3
                out[f"{n}_ranges_median_ms"] = ts[len(ts) // 2] * 1e3
                best, median = ts[0] * 1e3, ts[len(ts) // 2] * 1e3
                print(f"{n} ranges of {BLOCK} B: best {best:.3f} ms, median {median:.3f} ms", flush=True)
        print(("FAKE DRIVER: software cost only, not GPU figures\n" if a.fake else "") + json.dumps(out))
    finally:
        peer.stdin.close()  # type: ignore[union-attr]
        peer.wait(10)


if __name__ == "__main__":
    main()
