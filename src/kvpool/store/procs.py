"""Child processes for tests, benchmarks and the demo: a master and storage clients, stopped by PID."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

from kvpool.errors import MasterUnavailable


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """Stop ``proc`` by PID: SIGTERM, then SIGKILL if it is still alive after ``grace_s`` seconds.

    A no-op if it has already exited; waits for it (reaps it) either way.
    """
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class MasterProcess:
    """``kvpool master`` in a child process on a free loopback port."""

    def __init__(self, port: int | None = None, **options: Any) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvpool.cli", "master", "--host", "127.0.0.1", "--port", str(self.port)]
        for k, v in options.items():
            flag = f"--{k.replace('_', '-')}"
            if v is True:
                cmd.append(flag)
            elif v is not None and v is not False:
                cmd += [flag, str(v)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            stop_process(self.proc)
            raise MasterUnavailable(f"kvpool master did not start (exit {self.proc.poll()})")
        self.info: dict[str, Any] = json.loads(line)
        self.pid = self.proc.pid

    def kill(self) -> None:
        """SIGKILL the master."""
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Stop it (SIGTERM, then SIGKILL)."""
        stop_process(self.proc)
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> MasterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StorageProcess:
    """``kvpool store-server`` in a child process: contributes ``segment_size`` bytes to the pool."""

    def __init__(self, master: str, segment_size: int = 256 << 20, **options: Any) -> None:
        cmd = [
            sys.executable, "-m", "kvpool.cli", "store-server", "--master", master,
            "--segment-size", str(segment_size), "--stdin",
        ]  # fmt: skip
        for k, v in options.items():
            if v is not None:
                cmd += [f"--{k.replace('_', '-')}", str(v)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line or line.startswith("{"):
                break
        if not line.startswith("{"):
            stop_process(self.proc)
            raise MasterUnavailable(f"storage client did not start (exit {self.proc.poll()})")
        info = json.loads(line)
        self.segment: str = info["segment"]
        self.client: str = info["client"]
        self.pid: int = info["pid"]

    def kill(self) -> None:
        """SIGKILL it."""
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Ask it to exit (stdin closes), then terminate/kill."""
        if self.proc.poll() is None and self.proc.stdin:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_process(self.proc)
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> StorageProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
