"""Python overhead of one small ``transfer_sync``: ``engine.transfer_sync`` against the native call
alone, 4 KiB WRITE over the same-host path to a target in another process (best of 5 loops).

    python benchmarks/sync_overhead.py
"""

from __future__ import annotations

import time

from kvpool import OpCode, TransferEngine, _native
from kvpool.transfer.peer import PeerProcess

N = 30000


def main() -> None:
    with PeerProcess(8 << 20) as peer, TransferEngine(protocol="auto") as eng:
        buf = bytearray(4096)
        a = eng.register_local_memory(buf)
        hid = eng.open_segment(peer.segment).id
        nat = eng._native
        for _ in range(3000):
            eng.transfer_sync(peer.segment, a, peer.addr, 4096, OpCode.WRITE)
        full, raw = [], []
        for _round in range(5):
            t = time.perf_counter()
            for _ in range(N):
                eng.transfer_sync(peer.segment, a, peer.addr, 4096, OpCode.WRITE)
            full.append((time.perf_counter() - t) / N * 1e6)
            t = time.perf_counter()
            for _ in range(N):
                nat.transfer_sync(_native.OP_WRITE, a, hid, peer.addr, 4096)
            raw.append((time.perf_counter() - t) / N * 1e6)
        f, r = min(full), min(raw)
        print(f"engine.transfer_sync {f:.2f} us   native call alone {r:.2f} us   python {f - r:.2f} us")


if __name__ == "__main__":
    main()
