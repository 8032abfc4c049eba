"""Baseline: plain two-process TCP socket stream over loopback.

The calling process is the *sender*; it spawns a *receiver* (this same file run with
``--receiver`` as a child process) listening on a free ``127.0.0.1`` port.  The sender
``sendall``s one preallocated ``block_size``-byte buffer in a loop for ``duration_s`` seconds,
then half-closes.  The receiver ``recv_into``s a preallocated ``bytearray`` (through a
``memoryview``), counts bytes until EOF and reports ``bytes / elapsed`` where elapsed runs from
``accept()`` to EOF.  Throughput is decimal GB/s (1e9 bytes/s) measured at the receiver.

Kernel default socket buffer sizes are kept; ``TCP_NODELAY`` is set on both ends.

CLI::

    python benchmarks/socket_stream.py --block-size 1048576 --duration 5 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import subprocess
import sys
import time
from typing import Any

from _common import LOOPBACK


def _receiver(block_size: int, accept_timeout_s: float, io_timeout_s: float) -> int:
    """Child side: listen, print the port, receive until EOF, print a JSON result line."""
    buf = bytearray(block_size)
    view = memoryview(buf)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lsock:
        lsock.bind((LOOPBACK, 0))
        lsock.listen(1)
        lsock.settimeout(accept_timeout_s)
        print(f"PORT {lsock.getsockname()[1]}", flush=True)
        conn, _ = lsock.accept()
    with conn:
        t0 = time.perf_counter()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(io_timeout_s)
        total = 0
        recv_into = conn.recv_into
        while True:
            n = recv_into(view)
            if n == 0:
                break
            total += n
        elapsed = time.perf_counter() - t0
    print("RESULT " + json.dumps({"bytes": total, "elapsed_s": elapsed}), flush=True)
    return 0


def _readline(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """Read one line from ``proc.stdout`` within ``timeout_s`` (raises RuntimeError otherwise)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    data = b""
    try:
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise RuntimeError(f"receiver produced no line within {timeout_s}s (got {data!r})")
            chunk = os.read(proc.stdout.fileno(), 1)  # byte-wise: never read past the newline
            if not chunk:
                raise RuntimeError(f"receiver closed stdout early (rc={proc.poll()}, got {data!r})")
            data += chunk
    finally:
        sel.close()
    return data.decode().strip()


def _stop(proc: subprocess.Popen[bytes] | None, grace_s: float = 5.0) -> None:
    """Terminate then kill ``proc`` by PID.

    Not ``_common.stop_process_group``: the receiver is not started in a new session, so it does
    not lead a process group of its own.
    """
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


def run_socket_stream(block_size: int, duration_s: float = 5) -> dict[str, Any]:
    """Stream ``block_size``-byte sends over loopback TCP for ``duration_s`` seconds.

    Args:
        block_size: size of the preallocated buffer passed to each ``sendall`` (and of the
            receiver's ``recv_into`` buffer).
        duration_s: how long the sender keeps sending.

    Returns:
        ``{"system": "socket-stream", "block_size", "gbps", "bytes", "elapsed_s"}`` with
        ``gbps`` = received bytes / receiver elapsed seconds / 1e9 (decimal GB/s).

    Raises:
        ValueError: bad arguments.
        RuntimeError: the receiver failed or timed out (its stderr is included).
    """
    if block_size <= 0 or duration_s <= 0:
        raise ValueError("block_size and duration_s must be positive")
    io_timeout = float(duration_s) + 30.0
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--receiver",
                "--block-size",
                str(block_size),
                "--io-timeout",
                str(io_timeout),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        line = _readline(proc, 30.0)
        if not line.startswith("PORT "):
            raise RuntimeError(f"unexpected receiver output: {line!r}")
        port = int(line.split()[1])

        payload = memoryview(bytearray(block_size))
        with socket.create_connection((LOOPBACK, port), timeout=30.0) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(io_timeout)
            sendall = sock.sendall
            deadline = time.perf_counter() + duration_s
            while time.perf_counter() < deadline:
                sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            line = _readline(proc, io_timeout)
        if not line.startswith("RESULT "):
            raise RuntimeError(f"unexpected receiver output: {line!r}")
        res = json.loads(line[len("RESULT ") :])
        proc.wait(timeout=10)
        return {
            "system": "socket-stream",
            "block_size": block_size,
            "gbps": res["bytes"] / res["elapsed_s"] / 1e9,
            "bytes": res["bytes"],
            "elapsed_s": res["elapsed_s"],
        }
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        err = b""
        if proc is not None:
            _stop(proc)
            if proc.stderr is not None:
                err = proc.stderr.read() or b""
        raise RuntimeError(
            f"socket stream benchmark failed: {exc}\n--- receiver stderr ---\n{err.decode(errors='replace')}"
        ) from exc
    finally:
        _stop(proc)
        if proc is not None:
            for f in (proc.stdout, proc.stderr):
                if f is not None:
                    f.close()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints a one-line summary or, with ``--json``, the result dict."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--io-timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.receiver:
        return _receiver(a.block_size, accept_timeout_s=30.0, io_timeout_s=a.io_timeout)
    res = run_socket_stream(a.block_size, a.duration)
    print(json.dumps(res) if a.json else f"{res['system']} block={res['block_size']} {res['gbps']:.3f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
