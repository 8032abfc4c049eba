"""Per-slice Python cost of the RDMA transport's data path, measured through the fake-verbs TEST
DOUBLE (``python -m kvpool.testing.rdma_overhead``).

Three costs per slice, in microseconds: ``submit`` (validation, slicing, NIC assignment; caller's
thread), ``post`` (building the linked ``SendWR``/``SGE`` list and ``post_send``; progress thread)
and ``complete`` (polling, per-slice status aggregation). With the double, ``SendWR``/``SGE`` are
plain Python objects; the real pyverbs ones (Cython) are measured separately when pyverbs imports.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import timeit
from typing import Any


def _timed(obj: Any, name: str, acc: list[float]) -> None:
    fn = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def pyverbs_wr_cost() -> float | None:
    """µs to build one real pyverbs SGE + SendWR + set_wr_rdma (None without pyverbs)."""
    from kvpool.errors import ProtocolUnavailable
    from kvpool.transfer.rdma.verbs import load_verbs

    try:
        V = load_verbs()
    except ProtocolUnavailable:
        return None
    E, SendWR, SGE = V.enums, V.wr.SendWR, V.wr.SGE
    nxt = SendWR(wr_id=0, opcode=E.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(4096, 64, 1)], send_flags=0)

    def one() -> None:
        wr = SendWR(
            wr_id=1,
            opcode=E.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[SGE(4096, 65536, 7)],
            send_flags=0,
            next_wr=nxt,
        )
        wr.set_wr_rdma(9, 8192)

    n = 100_000
    return timeit.timeit(one, number=n) / n * 1e6


def measure(slice_kib: int = 4, total_mib: int = 64, nics: int = 4, chain: int = 32) -> dict[str, Any]:
    from kvpool import OpCode, TransferEngine, TransferRequest
    from kvpool.testing import fake_verbs as fv

    fv.configure(tempfile.mkdtemp(prefix="kvpool-verbs-"), [f"mlx5_{k}" for k in range(nics)])
    opts = dict(protocol="rdma", verbs=fv, rdma_slice_size=slice_kib << 10, rdma_chain=chain)
    with TransferEngine(**opts) as t, TransferEngine(**opts) as i:
        size = total_mib << 20
        base = t.register_local_memory(bytearray(size))
        la = i.register_local_memory(bytearray(size))
        seg = i.open_segment(t.segment_name)
        # warm up: endpoints connected
        i.batch_transfer_sync(t.segment_name, [la], [base], [size])
        post, comp = [0.0], [0.0]
        _timed(i.rdma, "_post", post)
        _timed(i.rdma, "_on_completions", comp)
        reqs = [
            TransferRequest(OpCode.WRITE, la + k * (1 << 20), seg, base + k * (1 << 20), 1 << 20)
            for k in range(total_mib)
        ]
        s0 = i.rdma.stats["slices"]
        t0 = time.perf_counter()
        bid = i.allocate_batch_id(len(reqs))
        i.submit_transfer(bid, reqs)
        t_submit = time.perf_counter() - t0
        i.wait_batch(bid)
        wall = time.perf_counter() - t0
        i.free_batch_id(bid)
        n = i.rdma.stats["slices"] - s0
    return {
        "slices": n,
        "slice_bytes": slice_kib << 10,
        "chain": chain,
        "submit_us_per_slice": t_submit / n * 1e6,
        "post_us_per_slice": post[0] / n * 1e6,
        "complete_us_per_slice": comp[0] / n * 1e6,
        "wall_us_per_slice_double": wall / n * 1e6,
        "pyverbs_sendwr_sge_us": pyverbs_wr_cost(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slice-kib", type=int, default=4)
    ap.add_argument("--total-mib", type=int, default=64)
    ap.add_argument("--chain", type=int, default=32)
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.slice_kib, args.total_mib, chain=args.chain), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
