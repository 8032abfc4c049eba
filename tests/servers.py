"""Start real metadata servers (etcd, redis, kvpool's HTTP server) as subprocesses for tests.

Each context manager starts its server on a free loopback port, waits until it answers, yields its
metadata URL and, in ``finally``, terminates the process by PID (then kills it if it lingers).  The
pytest fixtures at the bottom wrap them at session scope; a conftest picks them up with::

    from tests.servers import etcd_url, http_metadata_url, redis_url  # noqa: F401
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

import pytest

from kvpool.store.procs import free_port, stop_process  # free_port is re-exported (see __all__)

__all__ = [
    "etcd_server",
    "etcd_url",
    "free_port",
    "http_metadata_server",
    "http_metadata_url",
    "redis_server",
    "redis_url",
]

START_TIMEOUT_S = 20.0

_no_proxy_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _free_ports(n: int) -> list[int]:
    """Return ``n`` distinct free ports (held open together so they cannot collide)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _tail(log: IO[bytes], limit: int = 2000) -> str:
    """Last ``limit`` bytes of the server log (pread: the child shares the file offset)."""
    size = os.fstat(log.fileno()).st_size
    start = max(0, size - limit)
    return os.pread(log.fileno(), size - start, start).decode("utf-8", "replace")


def _wait_ready(proc: subprocess.Popen[bytes], log: IO[bytes], what: str, ready: Callable[[], bool]) -> None:
    """Poll ``ready()`` until it returns True; fail with the server log if it exits or times out."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} at startup:\n{_tail(log)}")
        try:
            if ready():
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready within {START_TIMEOUT_S:g} s:\n{_tail(log)}")
        time.sleep(0.1)


@contextlib.contextmanager
def _running(
    cmd: list[str],
    what: str,
    ready: Callable[[], bool],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env
        )
        try:
            _wait_ready(proc, log, what, ready)
            yield proc
        finally:
            stop_process(proc)


def _http_ok(url: str, expect: int = 200) -> bool:
    try:
        with _no_proxy_opener.open(url, timeout=1.0) as resp:
            return resp.status == expect
    except urllib.error.HTTPError as err:
        return err.code == expect


@contextlib.contextmanager
def etcd_server(tmp_path: Path, extra: Sequence[str] = ()) -> Iterator[str]:
    """Run etcd (with ``extra`` flags) with its data under ``tmp_path``; yield ``"etcd://127.0.0.1:PORT"``."""
    client_port, peer_port = _free_ports(2)
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    data_dir = Path(tmp_path) / f"etcd-{client_port}"
    cmd = [
        shutil.which("etcd") or "etcd",
        "--name",
        "kvpool-test",
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"kvpool-test={peer}",
        "--initial-cluster-state",
        "new",
        "--logger",
        "zap",
        "--log-level",
        "error",
        *extra,
    ]
    with _running(cmd, "etcd", lambda: _http_ok(f"{client}/health"), cwd=Path(tmp_path)):
        yield f"etcd://127.0.0.1:{client_port}"


def _redis_ping(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64).startswith(b"+PONG")


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Run redis-server without persistence; yield ``"redis://127.0.0.1:PORT"``."""
    port = free_port()
    cmd = [
        shutil.which("redis-server") or "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--loglevel",
        "warning",
    ]
    with tempfile.TemporaryDirectory(prefix="kvpool-redis-") as work_dir:
        with _running(cmd, "redis-server", lambda: _redis_ping(port), cwd=Path(work_dir)):
            yield f"redis://127.0.0.1:{port}"


@contextlib.contextmanager
def http_metadata_server() -> Iterator[str]:
    """Run ``python -m kvpool.transfer.metadata_server``; yield ``"http://127.0.0.1:PORT/metadata"``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metadata"
    env = dict(os.environ)
    cmd = [  # the installed package's `kvpool metadata-server`
        sys.executable,
        "-m",
        "kvpool.cli",
        "metadata-server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with _running(cmd, "kvpool metadata-server", lambda: _http_ok(f"{url}?key=__ready__", 404), env=env):
        yield url


def _require(binary: str, debian_package: str) -> None:
    if shutil.which(binary) is None:
        # A core test never skips silently: fail with the install hint (.ci/run installs both).
        pytest.fail(f"{binary} is not installed (apt-get install {debian_package})")


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL ``etcd://127.0.0.1:PORT`` of an etcd started for the test session."""
    _require("etcd", "etcd-server")
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL ``redis://127.0.0.1:PORT`` of a redis-server started for the test session."""
    _require("redis-server", "redis-server")
    with redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def http_metadata_url() -> Iterator[str]:
    """URL ``http://127.0.0.1:PORT/metadata`` of a ``kvpool metadata-server`` subprocess."""
    with http_metadata_server() as url:
        yield url
