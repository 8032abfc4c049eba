"""SGLang P/D per-request KV transfer: kvpool vs Mooncake's TCP transfer engine, same calls.

Reproduces what SGLang's ``mooncake_tcp`` backend does for one request (one chunk): one
``batch_transfer_sync_write`` with an entry per (buffer, run of pages contiguous on both sides),
buffers in SGLang's MHA order (K of every layer, then V), each page one ``item_len`` of
``page_size * kv_heads * head_dim * 2`` bytes (bf16). Default: 64 pages x 32 layers, page 16,
head 128, 8 KV heads -> 32 KiB items, 128 MiB per request. Two processes on loopback: the
measuring process (prefill) writes into a target process (decode). ``--pages-layout scattered``
uses random, distinct page ids on both sides (one entry per page and buffer: 4096 entries);
``contiguous`` one run per buffer (64 entries).

    python benchmarks/sglang_transfer.py --systems kvpool mooncake --requests 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvpool._smoke import shorten

LAYERS, PAGE, HEADS, HEAD_DIM = 32, 16, 8, 128
ITEM = PAGE * HEADS * HEAD_DIM * 2
POOL_PAGES = 160  # pages per buffer in each process (the request uses 64 of them)


def _engine(system: str, protocol: str) -> Any:
    if system == "kvpool":
        from kvpool import TransferEngine

        return TransferEngine(hostname="127.0.0.1", protocol=protocol)
    from mooncake.engine import TransferEngine as MC

    e = MC()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake initialize returned {rc}")
    return e


def _register(system: str, eng: Any, buf: np.ndarray) -> None:
    if system == "kvpool":
        eng.register_local_memory(buf)
    elif eng.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")


def _segment(system: str, eng: Any) -> str:
    return eng.segment_name if system == "kvpool" else f"127.0.0.1:{eng.get_rpc_port()}"


def target(system: str, protocol: str) -> None:
    """Decode side: register 2*LAYERS buffers (one allocation), print where, wait for stdin EOF."""
    import xxhash

    buf = np.zeros(2 * LAYERS * POOL_PAGES * ITEM, np.uint8)
    eng = _engine(system, protocol)
    _register(system, eng, buf)
    print(json.dumps({"segment": _segment(system, eng), "addr": int(buf.ctypes.data)}), flush=True)
    for line in sys.stdin:
        pages = json.loads(line)
        views = buf.reshape(2 * LAYERS, POOL_PAGES, ITEM)
        digest = xxhash.xxh3_64_hexdigest(np.ascontiguousarray(views[:, pages, :]).tobytes())
        print(json.dumps({"digest": digest}), flush=True)


def run(system: str, protocol: str, layout: str, requests: int, pages: int, mc_max: int) -> dict[str, Any]:
    import xxhash

    proc = subprocess.Popen(
        [sys.executable, __file__, "--target", system, "--protocol", protocol],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        info = json.loads(proc.stdout.readline())
        src = np.random.default_rng(1).integers(0, 255, 2 * LAYERS * POOL_PAGES * ITEM, dtype=np.uint8)
        eng = _engine(system, protocol)
        _register(system, eng, src)
        rng = np.random.default_rng(2)
        if layout == "contiguous":
            sp, dp = np.arange(10, 10 + pages), np.arange(40, 40 + pages)
        else:
            sp, dp = rng.permutation(POOL_PAGES)[:pages], rng.permutation(POOL_PAGES)[:pages]
        # runs contiguous on both sides (SGLang's group_concurrent_contiguous)
        breaks = np.where((np.diff(sp) != 1) | (np.diff(dp) != 1))[0] + 1
        runs = [
            (int(s[0]), int(d[0]), len(s))
            for s, d in zip(np.split(sp, breaks), np.split(dp, breaks), strict=True)
        ]
        buf_bytes = POOL_PAGES * ITEM
        srcs, dsts, lens = [], [], []
        for b in range(2 * LAYERS):  # K0..K31, V0..V31
            for s0, d0, n in runs:
                srcs.append(int(src.ctypes.data) + b * buf_bytes + s0 * ITEM)
                dsts.append(info["addr"] + b * buf_bytes + d0 * ITEM)
                lens.append(n * ITEM)
        seg = info["segment"]
        times = []
        for _ in range(requests + 2):
            t0 = time.perf_counter()
            if system == "kvpool":
                eng.batch_transfer_sync(seg, srcs, dsts, lens)
            else:
                # Mooncake's TCP transport rejects big batches ("TCP lane queue-full rejection"):
                # split like SGLang's SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES does.
                m = mc_max
                for i in range(0, len(srcs), m):
                    if (
                        eng.batch_transfer_sync_write(seg, srcs[i : i + m], dsts[i : i + m], lens[i : i + m])
                        != 0
                    ):
                        raise RuntimeError(
                            f"mooncake batch_transfer_sync_write of {min(m, len(srcs) - i)} failed"
                        )
            times.append(time.perf_counter() - t0)
        times = times[2:]  # warm-up (connections, first touch)
        proc.stdin.write(json.dumps(dp.tolist()) + "\n")
        proc.stdin.flush()
        got = json.loads(proc.stdout.readline())["digest"]
        want = xxhash.xxh3_64_hexdigest(
            np.ascontiguousarray(src.reshape(2 * LAYERS, POOL_PAGES, ITEM)[:, sp, :]).tobytes()
        )
        total = sum(lens)
        med = statistics.median(times)
        return {
            "system": system,
            "protocol": protocol if system == "kvpool" else "tcp",
            "layout": layout,
            "entries": len(lens),
            "bytes": total,
            "median_ms": med * 1e3,
            "gbps": total / med / 1e9,
            "verified": got == want,
            "calls": 1 if system == "kvpool" else -(-len(lens) // mc_max),
        }
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", default=["kvpool", "mooncake"], choices=["kvpool", "mooncake"])
    ap.add_argument("--protocols", nargs="+", default=["tcp", "auto"], help="kvpool protocols to run")
    ap.add_argument("--layouts", nargs="+", default=["contiguous", "scattered"])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument(
        "--mooncake-max-entries",
        type=int,
        default=2048,
        help="split Mooncake's batch into calls of at most this many entries (4096 fail)",
    )
    ap.add_argument("--target", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--measure", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--protocol", default="tcp", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = shorten(ap.parse_args(argv), requests=2, pages=8)
    if args.target:
        target(args.target, args.protocol)
        return 0
    if args.measure:
        system, proto, layout = args.measure
        print(
            json.dumps(run(system, proto, layout, args.requests, args.pages, args.mooncake_max_entries)),
            flush=True,
        )
        return 0
    results = []
    for layout in args.layouts:
        for system in args.systems:
            for proto in args.protocols if system == "kvpool" else ["tcp"]:
                # A fresh process per measurement (Mooncake's engine is one per process).
                cmd = [
                    sys.executable,
                    __file__,
                    "--measure",
                    system,
                    proto,
                    layout,
                    "--requests",
                    str(args.requests),
                    "--pages",
                    str(args.pages),
                ]
                res = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if res.returncode != 0:
                    raise SystemExit(f"{system}/{proto}/{layout} failed:\n{res.stderr[-3000:]}")
                r = json.loads(res.stdout.strip().splitlines()[-1])
                results.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results))
        return 0
    print("| layout | system | protocol | entries (calls) | MiB | ms per request | GB/s | bytes verified |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        mib = r["bytes"] / 2**20
        print(
            f"| {r['layout']} | {r['system']} | {r['protocol']} | {r['entries']} ({r['calls']}) | {mib:.0f} "
            f"| {r['median_ms']:.2f} | {r['gbps']:.2f} | {r['verified']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
