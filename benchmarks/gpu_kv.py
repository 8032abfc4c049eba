"""GPU KV movement between two processes on one host: kvpool's CUDA IPC path next to the CUDA IPC
limit measured in the same run (issue 10's targets).

Shapes (a Llama-8B-like FlashAttention KV cache: bf16, 8 KV heads, head 128, block 16 -> 32 KiB
per block and plane):
- ``scattered``: 4,096 blocks of 32 KiB (a 128 MiB request) at random block ids of a 1 GiB cache
  on each side, GPU -> GPU (target <= 0.15 ms from submit to completion seen by the caller), with
  the addresses as Python lists and as numpy uint64 arrays;
- ``whole``: one range of 1 MiB / 64 MiB / 512 MiB, GPU -> GPU (targets >= 100 / - / 1,000 GB/s);
- ``host``: 16 MiB and 64 MiB between our GPU and the peer's shared host memory (target >= 40 GB/s);
- ``limit``: one cuMemcpy of the contiguous 128 MiB inside the peer's mapped memory (the ceiling);
- ``vllm``: a decode's P/D load of a 4,096-token request from vLLM FlashAttention-layout caches of a
  Llama-8B-shaped model (32 layers, bf16, ``(2, blocks, 16, 8, 128)`` per layer: 16,384 ranges of
  32 KiB, 512 MiB), planned by the connector's own ``plan_columns``, bytes checked;
- ``store``: ``Store.get_into`` / ``put_from`` of 1 MiB values between a GPU buffer and a same-host
  storage process (target: get_into >= 20 GB/s);
- ``tcp``: ``protocol="tcp"`` (no CUDA IPC): 64 MiB GPU -> peer GPU and back (staged on both sides),
  GPU -> peer host 16 MiB (the issue's "before" anchor: 6.2 GB/s), and host -> peer host 64 MiB in the
  same run (target: GPU <-> GPU over TCP >= 80 % of host <-> host).

    python benchmarks/gpu_kv.py [--reps 20] [--vllm-blocks 2048] [--json out.json]

Needs a CUDA driver that sees a GPU (or ``KVPOOL_CUDA_DRIVER`` = the fake driver of
``kvpool.testing.fakecuda``, which checks that the benchmark runs; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvpool import OpCode, TransferEngine, _native
from kvpool.transfer.cuda_driver import load_driver

CACHE = 1 << 30
BLOCK = 32 << 10
NBLOCKS = 4096
HOST = 256 << 20
LAYERS = 32


def serve(vllm_blocks: int) -> None:
    """The peer: a 1 GiB GPU cache and a shared host buffer, registered, and with ``vllm_blocks``
    the prefill side's vLLM-shaped caches (:func:`_vllm_caches`, each region filled with its own
    pattern); waits for stdin EOF."""
    drv = load_driver()
    if drv is None:
        sys.exit("no CUDA driver")
    eng = TransferEngine()
    g = drv.alloc(CACHE, 0)
    eng.register_local_memory(g, CACHE, location="cuda:0")
    shm = eng.alloc_shared_buffer(HOST)
    layers = _vllm_caches(drv, eng, vllm_blocks, fill=True) if vllm_blocks else []
    info = {"name": eng.segment_name, "gpu": g, "shm": _native.buffer_address(shm)[0], "layers": layers}
    print(json.dumps(info), flush=True)
    sys.stdin.read()
    eng.close()


def _vllm_caches(drv, eng: TransferEngine, nblocks: int, fill: bool) -> list[int]:  # noqa: ANN001
    """vLLM FlashAttention-layout KV caches of a Llama-8B-shaped model: 32 layers, each one
    ``(2, nblocks, 16, 8, 128)`` bf16 tensor (K and V planes; 32 KiB per block and plane),
    registered; with ``fill`` region r (layer * 2 + plane) holds ``fill_pattern(seed=r)``."""
    size = 2 * nblocks * BLOCK
    bases = []
    for layer in range(LAYERS):
        a = drv.alloc(size, 0)
        eng.register_local_memory(a, size, location="cuda:0", remote_accessible=fill)
        if fill:
            host = bytearray(nblocks * BLOCK)
            for plane in range(2):
                _native.fill_pattern(_native.buffer_address(host)[0], len(host), layer * 2 + plane)
                drv.memcpy(a + plane * nblocks * BLOCK, _native.buffer_address(host)[0], len(host))
        bases.append(a)
    return bases


def _vllm(drv, eng: TransferEngine, info: dict, nblocks: int, reps: int) -> dict[str, float]:  # noqa: ANN001
    """A decode's P/D load of a 4,096-token request (256 blocks at random ids on both sides) from
    the peer's vLLM-shaped caches, planned by the connector's own code (``region_pairs`` +
    ``plan_columns``: every layer and plane, contiguous runs merged) and read with one
    ``batch_transfer_sync``; bytes checked on 8 of the 64 regions."""
    from kvpool.connectors.vllm.reshard import KvLayout, RegionAddr, plan_columns, region_pairs

    out = Figures()
    mine = _vllm_caches(drv, eng, nblocks, fill=False)
    lay = KvLayout("heads", 1, 0, 8, 128, "bfloat16", 16, LAYERS, 256, order="NHD")
    regions = [
        (
            RegionAddr(d + plane * nblocks * BLOCK, BLOCK, nblocks),
            RegionAddr(p + plane * nblocks * BLOCK, BLOCK, nblocks),
        )
        for d, p in zip(mine, info["layers"], strict=True)
        for plane in range(2)
    ]
    rng = np.random.default_rng(1)
    want = 4096 // 16
    lb, rb = rng.permutation(nblocks)[:want], rng.permutation(nblocks)[:want]
    rp = region_pairs(lay, lay, regions)
    t0 = time.perf_counter()
    cols = plan_columns(lay, lay, rp, lb, rb)
    plan_s = time.perf_counter() - t0
    t = _time(lambda: eng.batch_transfer_sync(info["name"], *cols, OpCode.READ), reps)
    total = want * BLOCK * 2 * LAYERS
    out["vllm_4096tok_ranges"] = float(len(cols[0]))
    out["vllm_4096tok_plan_ms"] = plan_s * 1e3
    out["vllm_4096tok_read_ms"] = t * 1e3
    out["vllm_4096tok_GBps"] = total / t / 1e9
    host = bytearray(nblocks * BLOCK)
    got = bytearray(BLOCK)
    for r in rng.permutation(2 * LAYERS)[:8].tolist():
        _native.fill_pattern(_native.buffer_address(host)[0], len(host), r)
        base = mine[r // 2] + (r % 2) * nblocks * BLOCK
        for k in rng.permutation(want)[:16].tolist():
            drv.memcpy(_native.buffer_address(got)[0], base + int(lb[k]) * BLOCK, BLOCK)
            if got != host[int(rb[k]) * BLOCK : (int(rb[k]) + 1) * BLOCK]:
                raise AssertionError(f"vLLM-shaped load: region {r} block {int(lb[k])} holds other bytes")
    out["vllm_4096tok_bytes_checked"] = 1.0
    return out


class Figures(dict):
    """The figures, each printed as it is measured (a later step that hangs or fails on a GPU
    leaves the earlier ones in the log)."""

    def __setitem__(self, key: str, value: float) -> None:
        super().__setitem__(key, value)
        print(f"{key} = {value:.4g}", flush=True)


def _store(drv, reps: int) -> dict[str, float]:  # noqa: ANN001 - the driver
    """Store put_from / get_into of 1 MiB values between a GPU buffer here and a same-host storage
    process's shared memory (target: get_into >= 20 GB/s)."""
    from kvpool import Store
    from kvpool.store.procs import MasterProcess, StorageProcess

    out = Figures()
    size, n = 1 << 20, 64
    with MasterProcess() as m, StorageProcess(m.address, 512 << 20):
        st = Store.connect(master=m.address, segment_size=0)
        try:
            g = drv.alloc(n * size, 0)
            st.register_buffer(g, n * size, location="cuda:0")
            keys = [f"v{k}" for k in range(n)]
            addrs = [g + k * size for k in range(n)]
            for k, a in zip(keys, addrs, strict=True):
                st.put_from(k, a, size)
            t = _time(lambda: [st.get_into(k, a, size) for k, a in zip(keys, addrs, strict=True)], reps)
            out["store_get_into_gpu_1MiB_GBps"] = n * size / t / 1e9
            if hasattr(st, "batch_get_into"):
                t = _time(lambda: st.batch_get_into(keys, addrs, [size] * n), reps)
                out["store_batch_get_into_gpu_64x1MiB_GBps"] = n * size / t / 1e9
            st.remove_all()
            t = _time(
                lambda: [st.put_from(k, a, size) or st.remove(k) for k, a in zip(keys, addrs, strict=True)], 3
            )
            out["store_put_from_gpu_1MiB_GBps_with_remove"] = n * size / t / 1e9
        finally:
            st.remove_all()
            st.close()
    return out


def _time(fn, reps: int) -> float:  # noqa: ANN001 - a no-argument callable
    fn()  # warm: mappings opened, kernel loaded
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _tcp(drv, info: dict, mine: int, reps: int) -> dict[str, float]:  # noqa: ANN001 - the driver
    """The TCP figures (an engine that initiates over TCP only: GPU memory staged on both sides)."""
    out: dict[str, float] = Figures()
    size = 64 << 20
    with TransferEngine(protocol="tcp") as eng:
        g = drv.alloc(size, 0)
        eng.register_local_memory(g, size, location="cuda:0", remote_accessible=False)
        name = info["name"]
        t = _time(lambda: eng.transfer_sync(name, g, info["gpu"], size), reps)
        out["tcp_gpu_to_gpu_64MiB_GBps"] = size / t / 1e9
        t = _time(lambda: eng.transfer_sync(name, g, info["gpu"], size, OpCode.READ), reps)
        out["tcp_gpu_from_gpu_64MiB_GBps"] = size / t / 1e9
        t = _time(lambda: eng.transfer_sync(name, g, info["shm"], 16 << 20), reps)
        out["tcp_gpu_to_host_16MiB_GBps"] = (16 << 20) / t / 1e9
        host = bytearray(size)
        h = eng.register_local_memory(host)
        t = _time(lambda: eng.transfer_sync(name, h, info["shm"], size), reps)
        out["tcp_host_to_host_64MiB_GBps"] = size / t / 1e9
        out["tcp_gpu_over_host_ratio"] = out["tcp_gpu_to_gpu_64MiB_GBps"] / out["tcp_host_to_host_64MiB_GBps"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument(
        "--vllm-blocks",
        type=int,
        default=2048,
        help="blocks per layer of the vLLM-shaped caches on each side (0: skip that section)",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.vllm_blocks)
        return
    drv = load_driver()
    if drv is None:
        sys.exit("kvpool: ProtocolUnavailable: no CUDA driver sees a GPU (KVPOOL_CUDA_DRIVER: the fake)")
    fake = "fakecuda" in (os.environ.get("KVPOOL_CUDA_DRIVER") or "")
    peer = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--vllm-blocks", str(a.vllm_blocks)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    info = json.loads(peer.stdout.readline())
    out: dict[str, float] = Figures()
    try:
        with TransferEngine() as eng:
            mine = drv.alloc(CACHE, 0)
            eng.register_local_memory(mine, CACHE, location="cuda:0", remote_accessible=False)
            rng = np.random.default_rng(0)
            src = (mine + rng.permutation(CACHE // BLOCK)[:NBLOCKS].astype(np.uint64) * BLOCK).tolist()
            dst = (info["gpu"] + rng.permutation(CACHE // BLOCK)[:NBLOCKS].astype(np.uint64) * BLOCK).tolist()
            name = info["name"]
            t = _time(lambda: eng.batch_transfer_sync(name, src, dst, [BLOCK] * NBLOCKS), a.reps)
            out["scattered_4096x32KiB_ms"] = t * 1e3
            out["scattered_GBps"] = NBLOCKS * BLOCK / t / 1e9
            t = _time(lambda: eng.batch_transfer_sync(name, src, dst, [BLOCK] * NBLOCKS, OpCode.READ), a.reps)
            out["scattered_read_4096x32KiB_ms"] = t * 1e3
            # the block tables as numpy uint64 arrays (how a connector holds them): no list conversion
            cols = (np.array(src, np.uint64), np.array(dst, np.uint64), np.full(NBLOCKS, BLOCK, np.uint64))
            t = _time(lambda: eng.batch_transfer_sync(name, *cols), a.reps)
            out["scattered_arrays_4096x32KiB_ms"] = t * 1e3
            for size in (1 << 20, 64 << 20, 512 << 20):
                t = _time(lambda s=size: eng.transfer_sync(name, mine, info["gpu"], s), a.reps)
                out[f"whole_{size >> 20}MiB_GBps"] = size / t / 1e9
            for size in (16 << 20, 64 << 20):
                t = _time(lambda s=size: eng.transfer_sync(name, mine, info["shm"], s), a.reps)
                out[f"gpu_to_host_{size >> 20}MiB_GBps"] = size / t / 1e9
                t = _time(lambda s=size: eng.transfer_sync(name, mine, info["shm"], s, OpCode.READ), a.reps)
                out[f"host_to_gpu_{size >> 20}MiB_GBps"] = size / t / 1e9
            # the ceiling, same run: one copy of 128 MiB into the peer's memory, mapped here
            ipc = next(t for t in eng._transports if t.name == "cuda_ipc")
            peer_state = next(iter(ipc._peers.values()))
            base = next(b.mapped for b in peer_state.bufs if b.gpu and b.mapped)

            def limit() -> None:
                drv.memcpy(base, mine, NBLOCKS * BLOCK)

            t = _time(limit, a.reps)
            out["limit_contiguous_128MiB_ms"] = t * 1e3
            if a.vllm_blocks:
                try:
                    out.update(_vllm(drv, eng, info, a.vllm_blocks, a.reps))
                except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                    print(f"vllm: FAILED {type(exc).__name__}: {exc}", flush=True)
        for step in (_tcp, _store):
            try:  # one failing section must not hide the others' figures
                out.update(step(drv, info, mine, a.reps) if step is _tcp else step(drv, a.reps))
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                print(f"{step.__name__[1:]}: FAILED {type(exc).__name__}: {exc}", flush=True)
    finally:
        peer.stdin.close()
        peer.wait(30)
    print(("FAKE DRIVER: figures are not GPU figures\n" if fake else "") + json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
