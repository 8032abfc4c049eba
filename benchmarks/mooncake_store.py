"""Baseline: Mooncake Store (TCP transport) put/get over loopback.

Uses the PyPI wheel ``mooncake-transfer-engine-non-cuda`` (``mooncake_master`` binary plus the
``mooncake.store.MooncakeDistributedStore`` Python binding) with three processes on this host:

* ``mooncake_master`` with its embedded HTTP metadata server
  (``--enable_http_metadata_server=true``); its RPC, HTTP metadata and metrics ports are free
  ports and are all given ``127.0.0.1`` as their address (see "Loopback" below);
* a *segment holder* (Python subprocess) that calls ``setup(...)`` with a 1 GiB
  ``global_segment_size``, i.e. contributes 1 GiB of DRAM to the pool, and then waits;
* a *client* (Python subprocess) with ``global_segment_size=0`` that runs the measured loop: one
  ``put(key, value)`` per op on distinct keys for ``duration_s`` (or ``n_ops``), then one
  ``get(key)`` per op on the keys it stored, verifying a sample of the returned bytes.

Since the client contributes no memory, every object lives in the holder's segment, so every
put/get moves the value across processes through Mooncake's TCP transport (127.0.0.1 only).

The setup call that works with 0.3.13.post1 (pybind overload 1; ``0`` means success)::

    store.setup(local_hostname="127.0.0.1",
                metadata_server="http://127.0.0.1:<http_port>/metadata",
                global_segment_size=1 << 30,          # 0 for the measuring client
                local_buffer_size=<bytes>,
                protocol="tcp", rdma_devices="",
                master_server_addr="127.0.0.1:<rpc_port>")

Bounded live set: Mooncake refuses to overwrite an existing key and a 1 GiB segment fills up in
about a second at 1 MiB values, so the client keeps at most ``live_bytes`` (default 512 MiB,
half the segment, below the master's 90 % eviction watermark) of its own objects alive.  When
that window is full it ``remove()``s its oldest key *outside the timed region* (the removal
time is subtracted from the put phase wall-clock).  The get phase then cycles over the keys
still alive, oldest first, wrapping around if it runs longer than the window.  Keys are unique
per run; each value is a fixed random buffer whose first 8 bytes hold the key index, so a
sample check also catches a get returning another key's value.

Units: ``put_gbps``/``get_gbps`` are GB/s = 1e9 bytes/s of value payload; ``*_ops_s`` are
completed ops per second of loop wall time (a single client, one op at a time, no batching);
``*_p50_us``/``*_p99_us`` are per-call latencies in microseconds (nearest-rank percentiles).

Loopback: every address we pass is 127.0.0.1 and ``MC_TCP_BIND_ADDRESS=127.0.0.1`` is set
(other ``MC_*`` variables are removed from the children's environment).  Checked with ``ss``:
the master's RPC and metrics ports do bind 127.0.0.1, but its HTTP metadata server still listens
on ``0.0.0.0`` despite ``--http_metadata_server_host=127.0.0.1``, and each store client's
transfer-engine handshake port (``0.0.0.0``) and TCP data port (``*``) bind the wildcard address;
no flag or variable changes that in this version.  All traffic goes 127.0.0.1 -> 127.0.0.1 (the
client logs loopback bytes per payload byte for each phase, ~1.0, as a check that values cross
TCP rather than a same-host memcpy shortcut).

CLI::

    python benchmarks/mooncake_store.py --value-size 1048576 --duration 5 [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from _common import (
    LOOPBACK,
    add_store_args,
    check_run_length,
    expected_value,
    find_mooncake_binary,
    format_store_result,
    free_ports,
    mooncake_env,
    read_text,
    spawn_logged,
    stamp_index,
    stop_process_group,
    store_result,
    tail,
    tail_file,
)
from _common import MOONCAKE_INSTALL_HINT as INSTALL_HINT
from _common import STORE_RESULT_KEYS as RESULT_KEYS

SYSTEM = "mooncake-store-tcp"
MASTER_BINARY = "mooncake_master"
SEGMENT_SIZE = 1 << 30  # what the segment holder contributes
DEFAULT_LIVE_BYTES = 512 << 20  # max bytes of the client's objects alive at once
WARMUP_OPS = 16
VERIFY_SAMPLES = 64
LOG_TAIL_LINES = 40


# --------------------------------------------------------------------------------------------
# helpers shared by the parent and the worker processes
# --------------------------------------------------------------------------------------------


def find_master_binary() -> str:
    """Locate the native ``mooncake_master`` executable.

    Order: ``$MOONCAKE_MASTER``; the ELF inside the installed ``mooncake`` package (the console
    script on PATH is a Python wrapper that forks it, which makes clean termination harder);
    finally ``mooncake_master`` on PATH.

    Raises:
        FileNotFoundError: if no binary can be found (message contains the install hint).
    """
    return find_mooncake_binary(MASTER_BINARY, "MOONCAKE_MASTER")


def _env() -> dict[str, str]:
    """Child environment: ``mooncake_env()`` (loopback binding, no stray ``MC_*``), unbuffered."""
    env = mooncake_env()
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((LOOPBACK, port)) == 0


def _http_up(url: str) -> bool:
    """True once anything answers HTTP at ``url`` (a 404 for an unknown key counts)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0):  # noqa: S310 - loopback URL we built
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


# --------------------------------------------------------------------------------------------
# worker processes (run as ``python mooncake_store.py --worker {segment,client} ...``)
# --------------------------------------------------------------------------------------------


def _setup_store(cfg: dict[str, Any], global_segment_size: int, local_buffer_size: int) -> Any:
    """Create a ``MooncakeDistributedStore`` and ``setup()`` it on loopback; exit 3 on failure."""
    from mooncake.store import MooncakeDistributedStore  # imported only in the workers

    store = MooncakeDistributedStore()
    rc = store.setup(
        local_hostname=LOOPBACK,
        metadata_server=f"http://{LOOPBACK}:{cfg['http_port']}/metadata",
        global_segment_size=global_segment_size,
        local_buffer_size=local_buffer_size,
        protocol="tcp",
        rdma_devices="",
        master_server_addr=f"{LOOPBACK}:{cfg['rpc_port']}",
    )
    if rc != 0:
        print(f"MOONCAKE_BENCH setup() failed with return code {rc}", flush=True)
        sys.exit(3)
    return store


def _worker_segment(cfg: dict[str, Any]) -> int:
    """Contribute a ``segment_size`` segment, signal readiness, wait for SIGTERM/parent exit."""
    stop = False

    def _on_term(_sig: int, _frm: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    parent = os.getppid()
    store = _setup_store(cfg, cfg["segment_size"], 16 << 20)
    Path(cfg["ready_file"]).write_text("ready")
    print("MOONCAKE_BENCH segment holder ready", flush=True)
    while not stop and os.getppid() == parent:
        time.sleep(0.2)
    store.close()
    return 0


def _lo_bytes() -> int | None:
    """Bytes received so far on the loopback interface (``/proc/net/dev``), None if unknown."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _worker_client(cfg: dict[str, Any]) -> int:
    """Run the measured put then get loops and write the result dict to ``cfg['out_file']``."""
    value_size: int = cfg["value_size"]
    n_ops: int | None = cfg["n_ops"]
    duration_s: float = cfg["duration_s"]
    window = max(1, cfg["live_bytes"] // value_size)
    store = _setup_store(cfg, 0, cfg["local_buffer_size"])
    prefix = f"mcbench-{uuid.uuid4().hex[:12]}-"
    value = bytearray(os.urandom(value_size))
    base = bytes(value)

    try:
        # Warm-up (connections, allocator, page faults), not measured.
        for w in range(WARMUP_OPS):
            key = f"{prefix}warm-{w}"
            stamp_index(value, w)
            rc = store.put(key, value)
            if rc != 0:
                raise RuntimeError(f"warm-up put({key!r}) returned {rc}")
            got = store.get(key)
            if got != expected_value(base, w):
                raise RuntimeError(f"warm-up get({key!r}) returned {len(got)} wrong/missing bytes")
            rc = store.remove(key, force=True)  # force: the get() above took a lease
            if rc != 0:
                raise RuntimeError(f"warm-up remove({key!r}) returned {rc}")

        # ---- put phase -----------------------------------------------------------------------
        live: deque[int] = deque()
        put_lat: list[float] = []
        removes = 0
        remove_s = 0.0
        pc = time.perf_counter
        lo_put0 = _lo_bytes()
        t_start = pc()
        deadline = t_start + duration_s
        i = 0
        while (i < n_ops) if n_ops is not None else (pc() < deadline):
            if len(live) >= window:  # untimed: keep the live set bounded
                r0 = pc()
                old = live.popleft()
                rc = store.remove(f"{prefix}{old}")
                remove_s += pc() - r0
                removes += 1
                if rc != 0:
                    raise RuntimeError(f"remove({prefix}{old}) returned {rc}")
            key = f"{prefix}{i}"
            stamp_index(value, i)
            t0 = pc()
            rc = store.put(key, value)
            put_lat.append(pc() - t0)
            if rc != 0:
                raise RuntimeError(f"put({key!r}) #{i} returned {rc} (live objects: {len(live)})")
            live.append(i)
            i += 1
        put_wall = pc() - t_start - remove_s
        n_put = i
        lo_put1 = _lo_bytes()

        # ---- get phase -----------------------------------------------------------------------
        keys = list(live)
        n_get_target = n_ops
        check_every = max(1, (n_get_target or len(keys)) // VERIFY_SAMPLES)
        get_lat: list[float] = []
        checked = 0
        lo_get0 = _lo_bytes()
        t_start = pc()
        deadline = t_start + duration_s
        j = 0
        while (j < n_get_target) if n_get_target is not None else (pc() < deadline):
            idx = keys[j % len(keys)]
            key = f"{prefix}{idx}"
            t0 = pc()
            got = store.get(key)
            dt = pc() - t0
            get_lat.append(dt)
            if len(got) != value_size:
                raise RuntimeError(f"get({key!r}) #{j} returned {len(got)} bytes, expected {value_size}")
            if j % check_every == 0:  # content check, excluded from the timing below
                c0 = pc()
                if got != expected_value(base, idx):
                    raise RuntimeError(f"get({key!r}) returned different bytes than were put")
                checked += 1
                t_start += pc() - c0
            j += 1
        get_wall = pc() - t_start
        n_get = j
        lo_get1 = _lo_bytes()
        if checked == 0:
            raise RuntimeError("no get result was verified")

        result = store_result(SYSTEM, value_size, n_put, put_wall, n_get, get_wall, put_lat, get_lat)
        print(
            f"MOONCAKE_BENCH n_put={n_put} put_wall_s={put_wall:.3f} removes={removes} "
            f"remove_s={remove_s:.3f} n_get={n_get} get_wall_s={get_wall:.3f} distinct_get_keys="
            f"{len(keys)} verified={checked}",
            flush=True,
        )
        # Sanity check that values really crossed TCP (not a same-host memcpy shortcut): bytes
        # received on ``lo`` per byte of payload, ~1.0 or a bit more when they did (any other
        # loopback traffic on the host during the phase adds to it; /proc/self/io does not
        # count socket send/recv, so we cannot attribute bytes per process cheaply).
        if lo_put0 is not None and lo_put1 is not None and lo_get0 is not None and lo_get1 is not None:
            print(
                f"MOONCAKE_BENCH loopback bytes per payload byte: put "
                f"{(lo_put1 - lo_put0) / (n_put * value_size):.3f}, get "
                f"{(lo_get1 - lo_get0) / (n_get * value_size):.3f}",
                flush=True,
            )
        Path(cfg["out_file"]).write_text(json.dumps(result))
        # Best-effort cleanup of what is still stored (not measured).
        for idx in keys:
            store.remove(f"{prefix}{idx}", force=True)
    finally:
        store.close()
    return 0


# --------------------------------------------------------------------------------------------
# parent: orchestration
# --------------------------------------------------------------------------------------------


def _logs(logs: dict[str, Path]) -> str:
    return "".join(
        f"\n--- {name} log ---\n{tail_file(path, LOG_TAIL_LINES)}"
        for name, path in logs.items()
        if path.exists()
    )


def _check_loader_error(logs: dict[str, Path]) -> None:
    for name, path in logs.items():
        text = read_text(path)
        if "error while loading shared libraries" in text or "No module named 'mooncake" in text:
            raise FileNotFoundError(
                f"Mooncake {name} cannot start. {INSTALL_HINT}\n{tail(text, LOG_TAIL_LINES)}"
            )


def run_mooncake_store(
    value_size: int,
    n_ops: int | None = None,
    duration_s: float = 5.0,
    *,
    live_bytes: int = DEFAULT_LIVE_BYTES,
    segment_size: int = SEGMENT_SIZE,
    startup_timeout_s: float = 60.0,
    log_dir: str | None = None,
) -> dict[str, Any]:
    """Measure Mooncake Store single-client put/get over TCP on loopback.

    Args:
        value_size: bytes per value (> 0).
        n_ops: if given, exactly this many puts (distinct keys) then this many gets; otherwise
            each phase runs for ``duration_s`` seconds.
        duration_s: length of each phase when ``n_ops`` is None.
        live_bytes: max bytes of benchmark objects alive at once (oldest removed, untimed);
            must stay well under ``segment_size``.
        segment_size: bytes the segment-holder process contributes (default 1 GiB).
        startup_timeout_s: max time for the master to listen and for each ``setup()``.
        log_dir: if given, the master/segment/client logs are copied there at the end.

    Returns:
        ``{"system": "mooncake-store-tcp", "value_size", "put_ops_s", "get_ops_s", "put_gbps",
        "get_gbps", "put_p50_us", "put_p99_us", "get_p50_us", "get_p99_us"}`` (GB = 1e9 bytes).

    Raises:
        FileNotFoundError: the wheel, the master binary or a shared library is missing.
        ValueError: bad arguments.
        RuntimeError: a process failed or timed out, an op failed, or data did not verify; the
            message contains the tails of all logs.
    """
    if value_size <= 0:
        raise ValueError("value_size must be positive")
    check_run_length(n_ops, duration_s)
    if value_size > live_bytes or live_bytes > segment_size * 0.8:
        raise ValueError("need value_size <= live_bytes <= 0.8 * segment_size")
    if importlib.util.find_spec("mooncake") is None:
        raise FileNotFoundError(f"Python package 'mooncake' not installed. {INSTALL_HINT}")
    master_bin = find_master_binary()

    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="mooncake_store_") as tmp:
        tdir = Path(tmp)
        logs = {"master": tdir / "master.log", "segment": tdir / "segment.log", "client": tdir / "client.log"}
        env = _env()
        try:
            rpc_port, http_port, metrics_port = free_ports(3)
            master = spawn_logged(
                [
                    master_bin,
                    f"--rpc_address={LOOPBACK}",
                    f"--rpc_port={rpc_port}",
                    "--enable_http_metadata_server=true",
                    f"--http_metadata_server_host={LOOPBACK}",
                    f"--http_metadata_server_port={http_port}",
                    f"--metrics_host={LOOPBACK}",
                    f"--metrics_port={metrics_port}",
                    "--logtostderr",
                    f"--log_dir={tmp}",
                ],
                logs["master"],
                tmp,
                env,
            )
            procs.append(master)
            meta_url = f"http://{LOOPBACK}:{http_port}/metadata?key=kvpool_bench_probe"
            deadline = time.monotonic() + startup_timeout_s
            while not (_port_open(rpc_port) and _http_up(meta_url)):
                if master.poll() is not None:
                    _check_loader_error(logs)
                    raise RuntimeError(f"mooncake_master exited with {master.returncode}{_logs(logs)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"mooncake_master not listening after {startup_timeout_s}s{_logs(logs)}"
                    )
                time.sleep(0.1)

            cfg: dict[str, Any] = {
                "rpc_port": rpc_port,
                "http_port": http_port,
                "segment_size": segment_size,
                "ready_file": str(tdir / "segment.ready"),
                "out_file": str(tdir / "result.json"),
                "value_size": value_size,
                "n_ops": n_ops,
                "duration_s": duration_s,
                "live_bytes": live_bytes,
                "local_buffer_size": max(64 << 20, 4 * value_size),
            }
            cfg_file = tdir / "cfg.json"
            cfg_file.write_text(json.dumps(cfg))
            me = str(Path(__file__).resolve())

            segment = spawn_logged(
                [sys.executable, me, "--worker", "segment", "--cfg", str(cfg_file)], logs["segment"], tmp, env
            )
            procs.append(segment)
            deadline = time.monotonic() + startup_timeout_s
            while not Path(cfg["ready_file"]).exists():
                for name, p in (("segment holder", segment), ("mooncake_master", master)):
                    if p.poll() is not None:
                        _check_loader_error(logs)
                        raise RuntimeError(f"{name} exited with {p.returncode}{_logs(logs)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"segment holder setup() not done after {startup_timeout_s}s{_logs(logs)}"
                    )
                time.sleep(0.05)

            client = spawn_logged(
                [sys.executable, me, "--worker", "client", "--cfg", str(cfg_file)], logs["client"], tmp, env
            )
            procs.append(client)
            # setup + warm-up + two phases + cleanup; n_ops runs get a generous fixed budget.
            budget = startup_timeout_s + (2 * duration_s if n_ops is None else 600.0) + 120.0
            try:
                rc = client.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"Mooncake client timed out after {budget:.0f}s{_logs(logs)}") from None
            out = Path(cfg["out_file"])
            if not out.exists():
                _check_loader_error(logs)
                raise RuntimeError(f"Mooncake client failed (rc={rc}), no result{_logs(logs)}")
            res = json.loads(out.read_text())
            if rc != 0:  # result was written, so only close()/cleanup failed: keep, but say so
                print(f"warning: Mooncake client exited with {rc} after the measurement", file=sys.stderr)
            for p in (segment, master):
                if p.poll() is not None:
                    raise RuntimeError(
                        f"a Mooncake process died during the run (rc={p.returncode}){_logs(logs)}"
                    )
            return {k: res[k] for k in RESULT_KEYS}
        finally:
            for p in reversed(procs):
                stop_process_group(p)
            if log_dir:
                os.makedirs(log_dir, exist_ok=True)
                for path in logs.values():
                    if path.exists():
                        shutil.copy(path, Path(log_dir) / path.name)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints a one-line summary or, with ``--json``, the result dict."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_store_args(p)
    p.add_argument("--log-dir", help="copy the master/segment/client logs into this directory")
    p.add_argument("--worker", choices=("segment", "client"), help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        cfg = json.loads(Path(a.cfg).read_text())
        return _worker_segment(cfg) if a.worker == "segment" else _worker_client(cfg)
    res = run_mooncake_store(a.value_size, a.n_ops, a.duration, log_dir=a.log_dir)
    print(json.dumps(res) if a.json else format_store_result(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
