"""Helpers shared by the baseline benchmark scripts (standard library only).

The baselines are run both as ``python benchmarks/X.py`` and imported by
``benchmarks/compare_*.py`` after ``sys.path.insert(0, benchmarks_dir)``; in both cases the
benchmarks directory is on ``sys.path``, so they import this module as ``from _common import ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
MOONCAKE_INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda; apt-get install libibverbs1 librdmacm1 libnuma1"
)
# Keys of the result dict of the single-client put/get store baselines (Mooncake Store, Redis).
STORE_RESULT_KEYS = (
    "system",
    "value_size",
    "put_ops_s",
    "get_ops_s",
    "put_gbps",
    "get_gbps",
    "put_p50_us",
    "put_p99_us",
    "get_p50_us",
    "get_p99_us",
)


# --------------------------------------------------------------------------------------------
# processes and logs
# --------------------------------------------------------------------------------------------


def spawn_logged(
    cmd: list[str], log: Path, cwd: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session (so it leads its own process group), output to ``log``.

    stdin is ``/dev/null``; stdout and stderr both go to ``log`` (truncated). ``env=None``
    inherits this process's environment.
    """
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )


def stop_process_group(proc: subprocess.Popen[bytes] | None, grace_s: float = 5.0) -> None:
    """Terminate then kill ``proc`` and the process group it leads (started with a new session).

    SIGTERM goes to the group, then after ``grace_s`` SIGKILL, waiting ``grace_s`` again; if
    the group cannot be signalled, ``proc`` itself is terminated/killed.  A no-op for ``None``
    or a process that has already exited.
    """
    if proc is None or proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        except OSError:
            (proc.terminate if sig == signal.SIGTERM else proc.kill)()
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def read_text(path: Path) -> str:
    """The text of ``path`` (undecodable bytes replaced), or ``""`` if it cannot be read."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def tail(text: str, n: int) -> str:
    """The last ``n`` lines of ``text`` (leading/trailing white space stripped first)."""
    return "\n".join(text.strip().splitlines()[-n:])


def tail_file(path: Path, n: int) -> str:
    """The last ``n`` lines of the file at ``path``, or ``""`` if it cannot be read."""
    return tail(read_text(path), n)


# --------------------------------------------------------------------------------------------
# ports and binaries
# --------------------------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    """Return ``n`` distinct currently-free TCP ports on 127.0.0.1 (racy, but good enough).

    The sockets are held open together while the ports are picked, so the ports cannot collide.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


def find_mooncake_binary(name: str, env_var: str) -> str:
    """Locate the native executable ``name`` shipped in the installed ``mooncake`` package.

    Order: ``$<env_var>``; the ELF inside the installed ``mooncake`` package, found with
    ``importlib.util.find_spec`` without importing the package (preferred: the console script on
    PATH is a Python wrapper that forks the ELF, which makes clean termination harder; the ELF
    is made executable if it is not); finally ``name`` on PATH.

    Raises:
        FileNotFoundError: if no binary can be found (message contains the install hint).
    """
    env = os.environ.get(env_var)
    if env:
        if os.path.isfile(env):
            return env
        raise FileNotFoundError(f"{env_var}={env!r} does not exist. {MOONCAKE_INSTALL_HINT}")
    try:
        spec = importlib.util.find_spec("mooncake")  # does not execute the package
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = Path(loc) / name
            if cand.is_file():
                if not os.access(cand, os.X_OK):
                    with contextlib.suppress(OSError):
                        cand.chmod(cand.stat().st_mode | 0o111)
                return str(cand)
    which = shutil.which(name)
    if which:
        return which
    raise FileNotFoundError(f"{name} not found. {MOONCAKE_INSTALL_HINT}")


def mooncake_env() -> dict[str, str]:
    """Child environment: inherited, minus stray Mooncake tuning vars, plus loopback binding."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}
    env["MC_TCP_BIND_ADDRESS"] = LOOPBACK
    return env


# --------------------------------------------------------------------------------------------
# put/get store baselines
# --------------------------------------------------------------------------------------------


def check_run_length(n_ops: int | None, duration_s: float) -> None:
    """Validate the run length of a put/get benchmark (a fixed op count, or else a duration).

    Raises:
        ValueError: ``n_ops`` is given but not positive, or it is None and ``duration_s`` is not
            positive.
    """
    if n_ops is not None and n_ops <= 0:
        raise ValueError("n_ops must be positive (or None for a timed run)")
    if n_ops is None and duration_s <= 0:
        raise ValueError("duration_s must be positive")


def stamp_index(buf: bytearray, i: int) -> None:
    """Stamp key index ``i`` into the first (up to) 8 bytes of ``buf``."""
    n = min(8, len(buf))
    buf[:n] = struct.pack("<Q", i)[:n]


def expected_value(base: bytes, i: int) -> bytes:
    """The value stored under key index ``i``: ``base`` with ``i`` stamped into its header."""
    buf = bytearray(base)
    stamp_index(buf, i)
    return bytes(buf)


def percentile(sorted_vals: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 if empty)."""
    if not sorted_vals:
        return 0.0
    k = max(0, min(len(sorted_vals) - 1, math.ceil(p / 100.0 * len(sorted_vals)) - 1))
    return sorted_vals[k]


def store_result(
    system: str,
    value_size: int,
    n_put: int,
    put_wall: float,
    n_get: int,
    get_wall: float,
    put_lat: list[float],
    get_lat: list[float],
) -> dict[str, Any]:
    """The result dict (keys ``STORE_RESULT_KEYS``) of a put/get run.

    Args:
        system: name reported as ``"system"``.
        value_size: bytes per value.
        n_put, n_get: ops completed in each phase.
        put_wall, get_wall: timed seconds of each phase.
        put_lat, get_lat: per-call latencies in seconds (sorted in place here).

    Returns:
        ops per second, GB/s (1e9 bytes/s of payload) and nearest-rank P50/P99 latencies in µs.
    """
    put_lat.sort()
    get_lat.sort()
    return {
        "system": system,
        "value_size": value_size,
        "put_ops_s": n_put / put_wall,
        "get_ops_s": n_get / get_wall,
        "put_gbps": n_put * value_size / put_wall / 1e9,
        "get_gbps": n_get * value_size / get_wall / 1e9,
        "put_p50_us": percentile(put_lat, 50) * 1e6,
        "put_p99_us": percentile(put_lat, 99) * 1e6,
        "get_p50_us": percentile(get_lat, 50) * 1e6,
        "get_p99_us": percentile(get_lat, 99) * 1e6,
    }


def add_store_args(p: argparse.ArgumentParser) -> None:
    """Add the put/get baselines' common options: ``--value-size --duration --n-ops --json``."""
    p.add_argument("--value-size", type=int, default=1 << 20, help="bytes per value")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per phase (put, then get)")
    p.add_argument("--n-ops", type=int, default=None, help="fixed op count per phase instead of --duration")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def format_store_result(res: dict[str, Any]) -> str:
    """One-line human-readable summary of a ``store_result`` dict."""
    return (
        f"{res['system']} value={res['value_size']} "
        f"put {res['put_ops_s']:.0f} ops/s {res['put_gbps']:.3f} GB/s "
        f"p50 {res['put_p50_us']:.0f} us p99 {res['put_p99_us']:.0f} us | "
        f"get {res['get_ops_s']:.0f} ops/s {res['get_gbps']:.3f} GB/s "
        f"p50 {res['get_p50_us']:.0f} us p99 {res['get_p99_us']:.0f} us"
    )
