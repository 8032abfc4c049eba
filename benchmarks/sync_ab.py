"""4 KiB ``transfer_sync`` WRITE latency (p50, best of 3 loops) over the same-host path and TCP, to
a peer process; public API only, so the same file runs against any build (before/after A/B: run it
in each worktree alternately). Prints JSON ``{"auto": us, "tcp": us}``.

    python benchmarks/sync_ab.py
"""

from __future__ import annotations

import json
import time

from kvpool import OpCode, TransferEngine
from kvpool.transfer.peer import PeerProcess


def p50_us(eng: TransferEngine, segment: str, local: int, remote: int, n: int) -> float:
    best = float("inf")
    pc = time.perf_counter_ns
    for _ in range(3):
        ts = []
        for _ in range(n):
            t = pc()
            eng.transfer_sync(segment, local, remote, 4096, OpCode.WRITE)
            ts.append(pc() - t)
        ts.sort()
        best = min(best, ts[n // 2] / 1000)
    return best


def main() -> None:
    out = {}
    with PeerProcess(8 << 20) as peer:
        for proto, n in (("auto", 20000), ("tcp", 4000)):
            with TransferEngine(protocol=proto) as eng:
                buf = bytearray(4096)  # kept alive while registered
                a = eng.register_local_memory(buf)
                for _ in range(2000):
                    eng.transfer_sync(peer.segment, a, peer.addr, 4096, OpCode.WRITE)
                out[proto] = round(p50_us(eng, peer.segment, a, peer.addr, n), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
