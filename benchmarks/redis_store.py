"""Baseline: Redis put/get (SET/GET) over loopback, one client, one op at a time.

Starts Debian's ``redis-server`` on a free port bound to ``127.0.0.1`` with persistence off
(``--save '' --appendonly no``) and drives it from this process with redis-py: ``set(key,
value)`` on distinct keys for ``duration_s``, then ``get(key)`` on the keys it stored -- a plain
round trip per op, no pipelining, no batching (like a store API's put/get).  A sample of the
returned values is compared with what was stored (the first 8 bytes of each value hold the key
index, so a wrong key is caught too).

Bounded live set, mirroring ``mooncake_store.py``: at most ``live_bytes`` (default 512 MiB) of
values are kept; when that window is full the oldest key is ``DEL``eted *outside the timed
region* (its time is subtracted from the put phase).  The get phase cycles over the keys still
alive, oldest first, wrapping around if it runs longer than the window.

Units: ``*_gbps`` are GB/s = 1e9 bytes/s of value payload; ``*_ops_s`` completed ops per second
of loop wall time; ``*_p50_us``/``*_p99_us`` per-call latencies in microseconds (nearest rank).
redis-py uses its pure-Python RESP parser unless ``hiredis`` is installed.

CLI::

    python benchmarks/redis_store.py --value-size 1048576 --duration 5 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from _common import (
    LOOPBACK,
    add_store_args,
    check_run_length,
    expected_value,
    format_store_result,
    free_port,
    spawn_logged,
    stamp_index,
    stop_process_group,
    store_result,
    tail_file,
)
from _common import STORE_RESULT_KEYS as RESULT_KEYS

SYSTEM = "redis"
INSTALL_HINT = "apt-get install redis-server; pip install redis"
DEFAULT_LIVE_BYTES = 512 << 20
WARMUP_OPS = 16
VERIFY_SAMPLES = 64
LOG_TAIL_LINES = 30


def find_redis_server() -> str:
    """``$REDIS_SERVER``, else ``/usr/bin/redis-server``, else ``redis-server`` on PATH.

    Raises:
        FileNotFoundError: if none exists.
    """
    for cand in (os.environ.get("REDIS_SERVER"), "/usr/bin/redis-server", shutil.which("redis-server")):
        if cand and os.path.isfile(cand):
            return cand
    raise FileNotFoundError(f"redis-server not found. {INSTALL_HINT}")


def _log_tail(log: Path) -> str:
    """The last ``LOG_TAIL_LINES`` lines of the redis-server log (``""`` if it cannot be read)."""
    return tail_file(log, LOG_TAIL_LINES)


def _measure(client: Any, value_size: int, n_ops: int | None, duration_s: float, live_bytes: int) -> dict:
    """The put then get loops against a connected redis-py client; returns the result dict."""
    window = max(1, live_bytes // value_size)
    prefix = f"rbench-{uuid.uuid4().hex[:12]}-"
    value = bytearray(os.urandom(value_size))
    base = bytes(value)

    for w in range(WARMUP_OPS):  # connection, allocator warm-up; not measured
        key = f"{prefix}warm-{w}"
        stamp_index(value, w)
        if client.set(key, value) is not True:
            raise RuntimeError(f"warm-up SET {key} failed")
        if client.get(key) != expected_value(base, w):
            raise RuntimeError(f"warm-up GET {key} returned wrong/missing bytes")
        client.delete(key)

    pc = time.perf_counter
    live: deque[int] = deque()
    put_lat: list[float] = []
    remove_s = 0.0
    t_start = pc()
    deadline = t_start + duration_s
    i = 0
    while (i < n_ops) if n_ops is not None else (pc() < deadline):
        if len(live) >= window:  # untimed: keep the live set bounded
            r0 = pc()
            client.delete(f"{prefix}{live.popleft()}")
            remove_s += pc() - r0
        key = f"{prefix}{i}"
        stamp_index(value, i)
        t0 = pc()
        ok = client.set(key, value)
        put_lat.append(pc() - t0)
        if ok is not True:
            raise RuntimeError(f"SET {key} #{i} returned {ok!r}")
        live.append(i)
        i += 1
    put_wall = pc() - t_start - remove_s
    n_put = i

    keys = list(live)
    check_every = max(1, (n_ops or len(keys)) // VERIFY_SAMPLES)
    get_lat: list[float] = []
    checked = 0
    t_start = pc()
    deadline = t_start + duration_s
    j = 0
    while (j < n_ops) if n_ops is not None else (pc() < deadline):
        idx = keys[j % len(keys)]
        key = f"{prefix}{idx}"
        t0 = pc()
        got = client.get(key)
        get_lat.append(pc() - t0)
        if got is None or len(got) != value_size:
            raise RuntimeError(f"GET {key} #{j} returned {None if got is None else len(got)} bytes")
        if j % check_every == 0:  # content check, excluded from the timing
            c0 = pc()
            if got != expected_value(base, idx):
                raise RuntimeError(f"GET {key} returned different bytes than were SET")
            checked += 1
            t_start += pc() - c0
        j += 1
    get_wall = pc() - t_start
    n_get = j
    if checked == 0:
        raise RuntimeError("no GET result was verified")
    for start in range(0, len(keys), 1000):  # cleanup, not measured
        client.delete(*(f"{prefix}{k}" for k in keys[start : start + 1000]))

    return store_result(SYSTEM, value_size, n_put, put_wall, n_get, get_wall, put_lat, get_lat)


def run_redis(
    value_size: int,
    duration_s: float = 5.0,
    *,
    n_ops: int | None = None,
    live_bytes: int = DEFAULT_LIVE_BYTES,
    startup_timeout_s: float = 20.0,
    op_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Measure single-client Redis SET/GET over loopback.

    Args:
        value_size: bytes per value (> 0).
        duration_s: length of each phase (put, then get) when ``n_ops`` is None.
        n_ops: if given, exactly this many SETs (distinct keys) and GETs instead.
        live_bytes: max bytes of benchmark values stored at once (oldest deleted, untimed).
        startup_timeout_s: max time for redis-server to answer PING.
        op_timeout_s: socket timeout of every redis-py call.

    Returns:
        ``{"system": "redis", "value_size", "put_ops_s", "get_ops_s", "put_gbps", "get_gbps",
        "put_p50_us", "put_p99_us", "get_p50_us", "get_p99_us"}`` (GB = 1e9 bytes).

    Raises:
        FileNotFoundError: redis-server or redis-py missing.
        ValueError: bad arguments.
        RuntimeError: the server failed to start or died, an op failed, or data did not verify
            (the message contains the server log tail).
    """
    if value_size <= 0 or value_size > live_bytes:
        raise ValueError("need 0 < value_size <= live_bytes")
    check_run_length(n_ops, duration_s)
    try:
        import redis
    except ImportError as e:
        raise FileNotFoundError(f"redis-py not installed. {INSTALL_HINT}") from e
    server_bin = find_redis_server()

    proc: subprocess.Popen[bytes] | None = None
    client: Any = None
    with tempfile.TemporaryDirectory(prefix="redis_bench_") as tmp:
        log = Path(tmp) / "redis.log"
        try:
            port = free_port()
            cmd = [
                server_bin,
                "--port",
                str(port),
                "--bind",
                LOOPBACK,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                tmp,
                "--daemonize",
                "no",
            ]
            proc = spawn_logged(cmd, log, tmp)
            client = redis.Redis(
                host=LOOPBACK, port=port, socket_timeout=op_timeout_s, socket_connect_timeout=2.0
            )
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {proc.returncode}:\n{_log_tail(log)}")
                try:
                    if client.ping():
                        break
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server not answering after {startup_timeout_s}s:\n{_log_tail(log)}"
                    )
                time.sleep(0.05)
            try:
                res = _measure(client, value_size, n_ops, duration_s, live_bytes)
            except (redis.RedisError, RuntimeError) as e:
                raise RuntimeError(f"Redis benchmark failed: {e}\n--- redis log ---\n{_log_tail(log)}") from e
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server died during the run ({proc.returncode}):\n{_log_tail(log)}")
            return {k: res[k] for k in RESULT_KEYS}
        finally:
            if client is not None:
                client.close()
            stop_process_group(proc)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints a one-line summary or, with ``--json``, the result dict."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_store_args(p)
    a = p.parse_args(argv)
    res = run_redis(a.value_size, a.duration, n_ops=a.n_ops)
    print(json.dumps(res) if a.json else format_store_result(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
