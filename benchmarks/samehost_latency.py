"""Latency of one small ``transfer_sync`` WRITE to a same-host peer, through its mapped shared
buffer (``alloc_shared_buffer``: a plain copy) and through ``process_vm_writev`` (private
memory): the per-call cost of the same-host path's checks (fence pin, peer liveness).

    python benchmarks/samehost_latency.py --size 4096 --calls 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvpool import OpCode, TransferEngine
from kvpool._smoke import shorten
from kvpool.transfer.peer import PeerProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=20000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    a = shorten(ap.parse_args(), calls=200, rounds=2)
    with TransferEngine(protocol="auto") as eng:
        src = bytearray(os.urandom(max(a.size, 4096)))
        s = eng.register_local_memory(src)
        for shm, what in ((True, "mapped shared buffer"), (False, "process_vm_writev")):
            with PeerProcess(max(a.size, 1 << 20), shm=shm) as p:
                eng.transfer_sync(p.segment, s, p.addr, a.size, OpCode.WRITE)
                assert eng.uses_same_host_path(eng.open_segment(p.segment))
                per_call = []
                for _ in range(a.rounds):
                    t = time.perf_counter()
                    for _ in range(a.calls):
                        eng.transfer_sync(p.segment, s, p.addr, a.size, OpCode.WRITE)
                    per_call.append((time.perf_counter() - t) / a.calls * 1e6)
                print(f"{a.size} B WRITE, same host, {what}: median {statistics.median(per_call):.2f} us, "
                      f"min {min(per_call):.2f} us per call ({a.rounds} rounds of {a.calls})")  # fmt: skip


if __name__ == "__main__":
    main()
