"""kvpool's gather kernel alone (kernels/gather.ptx, as the CUDA IPC transport launches it) next to
the ceiling in the same run: 4,096 scattered KV blocks of 32 KiB (and 4 KiB, 256 B) at random
block ids of a 1 GiB buffer, GPU time by CUDA events, the bytes checked; one contiguous copy of
the same 128 MiB is the limit. Same process: an IPC mapping adds nothing once opened. Separates
the GPU's share of ``benchmarks/gpu_kv.py``'s scattered figure from kvpool's host-side software.

    python benchmarks/gpu_gather_kernel.py [--reps 50] [--json out.json]   # needs: GPU, cupy
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

import numpy as np

BLOCK_THREADS = 256  # as kvpool.transfer.cuda_ipc launches it (_BLOCK)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    import cupy as cp  # the GPU machine has it; kvpool itself does not need it

    total, nb = 1 << 30, 4096
    src = cp.arange(total // 4, dtype=cp.int32).view(cp.uint8)
    dst = cp.zeros(total, dtype=cp.uint8)
    with resources.as_file(resources.files("kvpool.transfer").joinpath("kernels/gather.ptx")) as ptx:
        fn = cp.RawModule(path=str(ptx)).get_function("kvpool_gather")
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()

    def gpu_ms(f) -> float:  # noqa: ANN001 - a no-argument callable
        f()
        cp.cuda.Device().synchronize()
        ev0.record()
        for _ in range(a.reps):
            f()
        ev1.record()
        ev1.synchronize()
        return cp.cuda.get_elapsed_time(ev0, ev1) / a.reps

    out: dict[str, float] = {}
    out["limit_contiguous_128MiB_ms"] = gpu_ms(lambda: dst.__setitem__(slice(0, nb << 15), src[: nb << 15]))
    rng = np.random.default_rng(0)
    for size in (32 << 10, 4 << 10, 256):
        so = rng.permutation(total // size)[:nb].astype(np.uint64) * np.uint64(size)
        do = rng.permutation(total // size)[:nb].astype(np.uint64) * np.uint64(size)
        table = cp.asarray(np.concatenate([so + np.uint64(src.data.ptr), do + np.uint64(dst.data.ptr),
                                           np.full(nb, size, np.uint64)]))  # fmt: skip
        args = (table.data.ptr, table.data.ptr + 8 * nb, table.data.ptr + 16 * nb, np.uint32(nb))
        dst.fill(0)
        ms = gpu_ms(lambda args=args: fn((nb,), (BLOCK_THREADS,), args))
        got = dst.reshape(-1, size)[cp.asarray(do // np.uint64(size))]
        want = src.reshape(-1, size)[cp.asarray(so // np.uint64(size))]
        if not bool((got == want).all()):
            raise SystemExit(f"kvpool_gather moved wrong bytes for {size} B blocks")
        tag = f"{size >> 10}KiB" if size >= 1024 else f"{size}B"
        out[f"kernel_4096x{tag}_ms"] = ms
        out[f"kernel_4096x{tag}_GBps"] = nb * size / ms / 1e6
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
