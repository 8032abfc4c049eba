"""Two-process transfer benchmark (``kvpool bench transfer``) and the ``kvpool demo`` job."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from kvpool import _native
from kvpool.errors import InvalidArgument
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.peer import PeerProcess
from kvpool.transfer.types import OpCode, TransferRequest, TransferState


@dataclass
class BenchResult:
    """Figures of one benchmark run (GB = 1e9 bytes)."""

    protocol: str
    path: str
    operation: str
    block_size: int
    batch_size: int
    threads: int
    duration_s: float
    bytes: int
    gbps: float
    ops_per_s: float
    p50_us: float
    p99_us: float

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON output."""
        return asdict(self)


def percentile(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (0 for an empty list)."""
    if not sorted_vals:
        return 0.0
    k = min(len(sorted_vals) - 1, max(0, int(round(q / 100.0 * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[k]


def parse_size(text: str | int) -> int:
    """Parse ``4096``, ``64K``, ``1M``, ``4MiB``, ``1G`` into bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    if mult != 1:
        s = s[:-1]
    try:
        value = int(float(s) * mult)
    except ValueError:
        raise InvalidArgument(f"cannot parse size {text!r} (use e.g. 4096, 64K, 1M)") from None
    if value <= 0:
        raise InvalidArgument(f"size must be positive: {text!r}")
    return value


def run_transfer_bench(
    block_size: int = 1 << 20,
    batch_size: int = 32,
    operation: str = "write",
    duration_s: float = 5.0,
    protocol: str = "tcp",
    threads: int = 2,
    sync: bool = False,
    progress: Any = None,
    location: str = "cpu",
    remote_location: str = "cpu",
    **engine_options: Any,
) -> BenchResult:
    """Drive a target in another process for ``duration_s`` and measure throughput and latency.

    Each initiator thread owns ``batch_size`` blocks of local memory and a matching region of the
    target's buffer; it repeatedly submits one batch and waits for it. Latency is per batch (per
    request with ``batch_size=1``); with ``sync=True`` every request is a ``transfer_sync`` call.
    ``progress`` is called with the elapsed fraction (0..1) now and then. ``location`` /
    ``remote_location`` ``cuda:N`` put our blocks / the target's buffer in GPU memory (the CUDA
    driver must load: same host goes through CUDA IPC, TCP through the servers' staging).
    """
    if operation not in ("write", "read"):
        raise InvalidArgument("operation must be 'write' or 'read'")
    op = OpCode.WRITE if operation == "write" else OpCode.READ
    region = block_size * batch_size
    size = region * threads
    peer_opts = dict(engine_options, location=remote_location) if remote_location != "cpu" else engine_options
    with (
        PeerProcess(size, protocol=protocol, **peer_opts) as peer,
        TransferEngine(protocol=protocol, **engine_options) as eng,
    ):
        local = bytearray(size)
        if location.startswith("cuda"):
            laddr = _gpu_buffer(eng, location, local)
        else:
            laddr = eng.register_local_memory(local)
            _native.fill_pattern(laddr, size, 1)
        handle = eng.open_segment(peer.segment)
        path = "same_host" if eng.uses_same_host_path(handle) else "tcp"
        if "cuda" in (location + remote_location) and eng._route(handle.id).name == "cuda_ipc":
            path = "cuda_ipc"
        lat: list[list[float]] = [[] for _ in range(threads)]
        moved = [0] * threads
        stop_at = time.perf_counter() + duration_s
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                base_l, base_r = laddr + t * region, peer.addr + t * region
                reqs = [
                    TransferRequest(op, base_l + i * block_size, handle, base_r + i * block_size, block_size)
                    for i in range(batch_size)
                ]
                while time.perf_counter() < stop_at:
                    t0 = time.perf_counter()
                    if sync:
                        for r in reqs:
                            eng.transfer_sync(peer.segment, r.source, r.target_offset, r.length, op)
                    else:
                        bid = eng.allocate_batch_id(batch_size)
                        eng.submit_transfer(bid, reqs)
                        st = eng.wait_batch(bid)
                        eng.free_batch_id(bid)
                        if st.state != TransferState.COMPLETED:
                            raise RuntimeError(f"batch ended {st.state.name}")
                    lat[t].append(time.perf_counter() - t0)
                    moved[t] += region
            except BaseException as exc:  # noqa: BLE001 - reported by the caller
                errors.append(exc)

        pool = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
        t_start = time.perf_counter()
        for th in pool:
            th.start()
        while any(th.is_alive() for th in pool):
            if progress is not None:
                progress(min(1.0, (time.perf_counter() - t_start) / duration_s))
            pool[0].join(0.1)
        for th in pool:
            th.join()
        elapsed = time.perf_counter() - t_start
        if errors:
            raise errors[0]
        all_lat = sorted(x for per in lat for x in per)
        total = sum(moved)
        return BenchResult(
            protocol=protocol,
            path=path,
            operation=operation,
            block_size=block_size,
            batch_size=batch_size,
            threads=threads,
            duration_s=round(elapsed, 3),
            bytes=total,
            gbps=total / elapsed / 1e9,
            ops_per_s=total / block_size / elapsed,
            p50_us=percentile(all_lat, 50) * 1e6,
            p99_us=percentile(all_lat, 99) * 1e6,
        )


def _gpu_buffer(eng: TransferEngine, location: str, pattern: bytearray) -> int:
    """GPU memory of ``len(pattern)`` bytes on ``location``, filled with a pattern and registered."""
    from kvpool.errors import ProtocolUnavailable
    from kvpool.transfer.cuda_driver import load_driver

    drv = load_driver(eng.config.cuda_driver)
    if drv is None:
        raise ProtocolUnavailable(f"--location {location}: no CUDA driver with a GPU loads here")
    n = len(pattern)
    addr = drv.alloc(n, int(location.partition(":")[2] or 0))
    _native.fill_pattern(_native.buffer_address(pattern)[0], n, 1)
    drv.memcpy(addr, _native.buffer_address(pattern)[0], n)
    eng.register_local_memory(addr, n, location=location, remote_accessible=False)
    return addr


@dataclass
class DemoRow:
    """One line of the demo table."""

    path: str
    block_size: int
    direction: str
    bytes: int
    gbps: float
    p50_us: float
    p99_us: float
    verified: bool


def demo_bytes(total_bytes: int, region: int = 256 << 20, n_block_sizes: int = 3) -> int:
    """Bytes :func:`run_demo` moves each way per path for ``total_bytes``: whole ``region``s per
    block size, at least ``total_bytes`` in all (1 GiB asked -> 3 x 512 MiB = 1.5 GiB)."""
    per_size = max(region, total_bytes // n_block_sizes)
    return n_block_sizes * -(-per_size // region) * region


def run_demo(
    total_bytes: int = 1 << 30,
    region: int = 256 << 20,
    block_sizes: tuple[int, ...] = (64 << 10, 512 << 10, 4 << 20),
    protocols: tuple[str, ...] = ("tcp", "auto"),
    batch_size: int = 32,
    on_row: Any = None,
) -> list[DemoRow]:
    """Move ``total_bytes`` each way per path between two processes and verify checksums.

    For every protocol and block size, the local region is written block by block into a target
    process, its checksum is compared with the target's own, then read back into a second local
    buffer and compared again. Raises ``RuntimeError`` on any mismatch.
    """
    rows: list[DemoRow] = []
    for protocol in protocols:
        with PeerProcess(region, protocol=protocol) as peer, TransferEngine(protocol=protocol) as eng:
            src = bytearray(region)
            back = bytearray(region)
            saddr = eng.register_local_memory(src)
            baddr = eng.register_local_memory(back)
            handle = eng.open_segment(peer.segment)
            path = "same_host" if eng.uses_same_host_path(handle) else "tcp"
            per_size = max(region, total_bytes // len(block_sizes))
            for bs in block_sizes:
                nblocks = region // bs
                for direction, op in (("write", OpCode.WRITE), ("read", OpCode.READ)):
                    moved, lat, seed = 0, [], 0
                    while moved < per_size:
                        seed += 1
                        if op == OpCode.WRITE:
                            _native.fill_pattern(saddr, region, seed * 1000 + bs)
                        local = saddr if op == OpCode.WRITE else baddr
                        for first in range(0, nblocks, batch_size):
                            n = min(batch_size, nblocks - first)
                            reqs = [
                                TransferRequest(
                                    op, local + (first + i) * bs, handle, peer.addr + (first + i) * bs, bs
                                )
                                for i in range(n)
                            ]
                            b0 = time.perf_counter()
                            bid = eng.allocate_batch_id(n)
                            eng.submit_transfer(bid, reqs)
                            st = eng.wait_batch(bid)
                            eng.free_batch_id(bid)
                            lat.append(time.perf_counter() - b0)
                            if st.state != TransferState.COMPLETED:
                                raise RuntimeError(f"{direction} batch ended {st.state.name}")
                        moved += region
                    elapsed = sum(lat)  # transfer time only (pattern fills excluded)
                    want = xxhash.xxh3_64_hexdigest(src)
                    got = peer.checksum(0, region) if op == OpCode.WRITE else xxhash.xxh3_64_hexdigest(back)
                    lat.sort()
                    row = DemoRow(
                        path,
                        bs,
                        direction,
                        moved,
                        moved / elapsed / 1e9,
                        percentile(lat, 50) * 1e6,
                        percentile(lat, 99) * 1e6,
                        want == got,
                    )
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
                    if not row.verified:
                        raise RuntimeError(
                            f"checksum mismatch after {direction} of {bs}-byte blocks over {path}"
                        )
    return rows
