"""Per-call cost of the transfer engine's Python surface against a peer process.

``transfer_sync`` (4 KiB write/read, 16 MiB read) and ``batch_transfer_sync`` (256 × 4 KiB) over TCP and
the same-host path; min and median of 9 timed repeats. The minimum is the figure that survives a
noisy machine; compare two builds by running this in both, interleaved.

    python benchmarks/engine_overhead.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from kvpool import OpCode, TransferEngine
from kvpool._smoke import pick
from kvpool.transfer.peer import PeerProcess

OP_READ = OpCode.READ


Case = tuple[str, int, Callable[[], object]]


def _cases(eng: TransferEngine, seg: str, local: int, remote: int) -> list[Case]:
    n, big = 256, 16 << 20
    locs = [local + i * 4096 for i in range(n)]
    rems = [remote + i * 4096 for i in range(n)]
    return [
        ("transfer_sync 4K write", 4096, lambda: eng.transfer_sync(seg, local, remote, 4096, OpCode.WRITE)),
        ("transfer_sync 4K read", 4096, lambda: eng.transfer_sync(seg, local, remote, 4096, OpCode.READ)),
        (
            f"batch_transfer_sync {n}x4K read",
            4096,
            lambda: eng.batch_transfer_sync(seg, locs, rems, [4096] * n, OpCode.READ),
        ),
        ("transfer_sync 16M read", 16 << 20, lambda: eng.transfer_sync(seg, local, remote, big, OP_READ)),
    ]


def main() -> None:
    with PeerProcess(64 << 20) as peer:
        for proto in ("tcp", "auto"):
            with TransferEngine(protocol=proto, timeout_s=10) as eng:
                buf = bytearray(64 << 20)
                local = eng.register_local_memory(buf)
                for name, size, fn in _cases(eng, peer.segment, local, peer.addr):
                    for _ in range(pick(20, 2)):
                        fn()
                    per_call: list[float] = []
                    calls = pick(200, 20) if size < (1 << 20) else pick(20, 2)
                    for _ in range(pick(9, 1)):
                        t = time.perf_counter()
                        for _ in range(calls):
                            fn()
                        per_call.append((time.perf_counter() - t) / calls * 1e6)
                    lo, med = min(per_call), statistics.median(per_call)
                    print(f"{proto:5} {name:34} min {lo:9.1f} us  median {med:9.1f} us", flush=True)


if __name__ == "__main__":
    main()
