"""Baseline: Mooncake Transfer Engine (TCP transport) over loopback.

Drives Mooncake's own ``transfer_engine_bench`` binary (shipped in the PyPI wheel
``mooncake-transfer-engine-non-cuda``) as two processes on this host:

* a *target* that registers a DRAM buffer and serves it, and
* an *initiator* that reads from / writes to that buffer in batches for a fixed time.

Everything is kept on loopback: ``--metadata_server=P2PHANDSHAKE`` (no etcd; the compiled-in
default is ``192.168.3.77:2379``), ``--local_server_name=127.0.0.1`` (default ``vm``),
``--segment_id=127.0.0.1:<port>`` (default ``192.168.3.76``), ``--auto_discovery=false`` and
``MC_TCP_BIND_ADDRESS=127.0.0.1``.  Note that Mooncake still *listens* on the wildcard
address (``0.0.0.0`` for the handshake RPC port, ``*`` for the TCP data port); there is no flag
to change that, but all traffic of the benchmark goes 127.0.0.1 -> 127.0.0.1.

Port discovery: with P2PHANDSHAKE the target picks a random RPC/handshake port and logs
``Transfer Engine RPC using P2P handshake, listening on 127.0.0.1:<port>`` (glog INFO, which we
route to stderr with ``--logtostderr``).  That ``<port>`` is what the initiator needs in
``--segment_id``.

Units: Mooncake prints ``Test completed: duration D, batch count N, throughput X GB/s`` where
``GB`` (its default ``--report_unit``) is decimal, 1e9 bytes/s -- checked against
``N * batch_size * block_size / D``.  We pass ``--report_unit=GB`` explicitly, but the parser
also understands the other units (GiB, Gb, MB, MiB, Mb, KB, KiB, Kb) and converts to 1e9 bytes/s.
We request ``--report_precision=4`` because the duration in that line is only printed with two
decimals, so recomputing from the batch count would be off by up to ~0.25 % on short runs.
The returned ``gbps`` is GB/s = 1e9 bytes per second, *not* gigabits.

CLI::

    python benchmarks/mooncake_te.py --block-size 1048576 --operation write --duration 5 [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    LOOPBACK,
    find_mooncake_binary,
    mooncake_env,
    read_text,
    spawn_logged,
    stop_process_group,
    tail,
)
from _common import MOONCAKE_INSTALL_HINT as INSTALL_HINT

BINARY_NAME = "transfer_engine_bench"
DEFAULT_BUFFER_SIZE = 1 << 30  # 1 GiB per process (Mooncake's default, made explicit)

_PORT_RE = re.compile(r"listening on [^\s:]+:(\d+)")
_READY_RE = re.compile(r"(DRAM|VRAM) is used")
_RESULT_RE = re.compile(
    r"Test completed: duration ([\d.]+), batch count (\d+), throughput ([\d.]+) ([KMG]i?[Bb])/s"
)
# Bytes per second represented by one unit, as Mooncake defines them.
_UNIT_BYTES: dict[str, float] = {
    "GB": 1e9,
    "GiB": float(1 << 30),
    "Gb": 1e9 / 8,
    "MB": 1e6,
    "MiB": float(1 << 20),
    "Mb": 1e6 / 8,
    "KB": 1e3,
    "KiB": float(1 << 10),
    "Kb": 1e3 / 8,
}


def find_binary() -> str:
    """Locate the native ``transfer_engine_bench`` executable.

    Order: ``$MOONCAKE_TE_BENCH``; the ELF inside the installed ``mooncake`` package (preferred:
    the console script on PATH is a Python wrapper that forks the ELF, which makes clean
    termination harder); finally ``transfer_engine_bench`` on PATH.

    Raises:
        FileNotFoundError: if no binary can be found (message contains the install hint).
    """
    return find_mooncake_binary(BINARY_NAME, "MOONCAKE_TE_BENCH")


def _common_flags(log_dir: str, buffer_size: int) -> list[str]:
    return [
        "--protocol=tcp",
        "--metadata_server=P2PHANDSHAKE",
        f"--local_server_name={LOOPBACK}",
        "--auto_discovery=false",
        f"--buffer_size={buffer_size}",
        "--logtostderr",
        f"--log_dir={log_dir}",
    ]


def _check_loader_error(log: str) -> None:
    if "error while loading shared libraries" in log:
        raise FileNotFoundError(f"{BINARY_NAME} cannot load its shared libraries. {INSTALL_HINT}\n{log}")


def run_mooncake_te(
    block_size: int,
    operation: str = "write",
    duration_s: int = 5,
    threads: int = 2,
    batch_size: int = 32,
    *,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    startup_timeout_s: float = 30.0,
    settle_s: float = 1.0,
) -> dict[str, Any]:
    """Run Mooncake's ``transfer_engine_bench`` (TCP, loopback) and return its throughput.

    Args:
        block_size: bytes per transfer request (``--block_size``).
        operation: ``"write"`` (initiator -> target) or ``"read"`` (target -> initiator).
        duration_s: test length in whole seconds (``--duration``; Mooncake takes an int).
        threads: initiator submission threads (``--threads``).
        batch_size: requests per batch (``--batch_size``).
        buffer_size: DRAM buffer registered by each process (default 1 GiB); must hold
            ``threads * batch_size * block_size`` bytes.
        startup_timeout_s: max time to wait for the target to log its port.
        settle_s: pause after the target is ready (it registers its buffer after logging).

    Returns:
        ``{"system": "mooncake-te-tcp", "block_size", "operation", "gbps", "threads",
        "batch_size", "duration_s", "batches", "gbps_from_batches", "raw"}`` where ``gbps`` is
        Mooncake's printed throughput converted to decimal GB/s (1e9 bytes/s),
        ``gbps_from_batches`` the cross-check ``batches * batch_size * block_size / duration / 1e9``
        (duration only has 2 decimals) and ``raw`` the last lines of the initiator's output.

    Raises:
        FileNotFoundError: binary or its shared libraries missing.
        ValueError: bad arguments.
        RuntimeError: a process failed, timed out, or no throughput line was found (with logs).
    """
    if operation not in ("read", "write"):
        raise ValueError(f"operation must be 'read' or 'write', not {operation!r}")
    if block_size <= 0 or threads <= 0 or batch_size <= 0 or int(duration_s) <= 0:
        raise ValueError("block_size, threads, batch_size and duration_s must be positive")
    duration_s = int(duration_s)
    if threads * batch_size * block_size > buffer_size:
        raise ValueError(
            f"threads*batch_size*block_size = {threads * batch_size * block_size} exceeds "
            f"buffer_size = {buffer_size}"
        )
    binary = find_binary()

    target: subprocess.Popen[bytes] | None = None
    initiator: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="mooncake_te_") as tmp:
        tdir = Path(tmp)
        t_log, i_log = tdir / "target.log", tdir / "initiator.log"
        common = _common_flags(tmp, buffer_size)
        env = mooncake_env()
        try:
            target = spawn_logged([binary, "--mode=target", *common], t_log, tmp, env)
            port: int | None = None
            deadline = time.monotonic() + startup_timeout_s
            while time.monotonic() < deadline:
                log = read_text(t_log)
                if port is None and (m := _PORT_RE.search(log)):
                    port = int(m.group(1))
                if port is not None and _READY_RE.search(log):
                    break
                if target.poll() is not None:
                    _check_loader_error(log)
                    raise RuntimeError(f"Mooncake target exited with {target.returncode}:\n{log}")
                time.sleep(0.05)
            else:
                raise RuntimeError(
                    f"Mooncake target not ready after {startup_timeout_s}s (port={port}):\n{read_text(t_log)}"
                )
            time.sleep(settle_s)
            if target.poll() is not None:
                raise RuntimeError(f"Mooncake target exited with {target.returncode}:\n{read_text(t_log)}")

            cmd = [
                binary,
                "--mode=initiator",
                *common,
                f"--segment_id={LOOPBACK}:{port}",
                f"--block_size={block_size}",
                f"--threads={threads}",
                f"--batch_size={batch_size}",
                f"--operation={operation}",
                f"--duration={duration_s}",
                "--report_unit=GB",
                "--report_precision=4",
            ]
            initiator = spawn_logged(cmd, i_log, tmp, env)
            try:
                rc = initiator.wait(timeout=duration_s + 60)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"Mooncake initiator timed out.\n--- initiator ---\n{read_text(i_log)}"
                    f"\n--- target ---\n{read_text(t_log)}"
                ) from None
            ilog = read_text(i_log)
            _check_loader_error(ilog)
            m = _RESULT_RE.search(ilog)
            if rc != 0 or m is None:
                raise RuntimeError(
                    f"Mooncake initiator failed (rc={rc}, result line {'found' if m else 'missing'})."
                    f"\n--- initiator ---\n{ilog}\n--- target ---\n{read_text(t_log)}"
                )
            dur, batches = float(m.group(1)), int(m.group(2))
            gbps = float(m.group(3)) * _UNIT_BYTES[m.group(4)] / 1e9
            from_batches = batches * batch_size * block_size / dur / 1e9 if dur > 0 else gbps
            return {
                "system": "mooncake-te-tcp",
                "block_size": block_size,
                "operation": operation,
                "gbps": gbps,
                "threads": threads,
                "batch_size": batch_size,
                "duration_s": dur,
                "batches": batches,
                "gbps_from_batches": from_batches,
                "raw": tail(ilog, 12),
            }
        finally:
            stop_process_group(initiator)
            stop_process_group(target)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints a one-line summary or, with ``--json``, the result dict."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--operation", choices=("write", "read"), default="write")
    p.add_argument("--duration", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args(argv)
    res = run_mooncake_te(a.block_size, a.operation, a.duration, a.threads, a.batch_size)
    summary = f"{res['system']} {res['operation']} block={res['block_size']} {res['gbps']:.3f} GB/s"
    print(json.dumps(res) if a.json else summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
