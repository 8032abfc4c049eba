"""Same-host READ of one batch of equal ranges from another process's private memory, by range
size: the per-range cost of the same-host path (``process_vm_readv``, many slices per call).

    python benchmarks/samehost_ranges.py
"""

from __future__ import annotations

import statistics
import time

from kvpool import OpCode, TransferEngine
from kvpool.transfer.peer import PeerProcess

SHAPES = ((4, 4 << 20), (512, 16 << 10), (2048, 4 << 10), (8192, 1 << 10))


def main() -> None:
    with PeerProcess(64 << 20) as peer, TransferEngine(protocol="auto") as eng:
        buf = bytearray(32 << 20)
        a = eng.register_local_memory(buf)
        for n, size in SHAPES:
            locs = [a + i * size for i in range(n)]
            rems = [peer.addr + (i * size * 2) % (32 << 20) for i in range(n)]  # scattered on the peer
            lens = [size] * n
            ts = []
            for _ in range(15):
                t = time.perf_counter()
                eng.batch_transfer_sync(peer.segment, locs, rems, lens, OpCode.READ)
                ts.append(time.perf_counter() - t)
            m = statistics.median(ts)
            print(f"{n:5d} x {size:8d} B: {m * 1e3:7.2f} ms median of 15, {m / n * 1e6:6.2f} us per range")


if __name__ == "__main__":
    main()
