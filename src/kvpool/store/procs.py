"""Child processes for tests, benchmarks and the demo: a master and storage clients, stopped by PID."""

from __future__ import annotations

import sys
from typing import Any

from kvpool.child import ChildProcess, cli_flags, free_port, stop_process
from kvpool.errors import MasterUnavailable

__all__ = ["MasterProcess", "StorageProcess", "free_port", "stop_process"]


class MasterProcess(ChildProcess):
    """``kvpool master`` in a child process on a free loopback port (stopped by SIGTERM)."""

    start_error = MasterUnavailable

    def __init__(self, port: int | None = None, **options: Any) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvpool.cli", "master", "--host", "127.0.0.1", "--port", str(self.port)]
        super().__init__(
            cmd + cli_flags(options),
            stdin=False,
            secret=options.get("secret"),
            metadata=options.get("metadata"),
        )


class StorageProcess(ChildProcess):
    """``kvpool store-server`` in a child process: contributes ``segment_size`` bytes to the pool."""

    start_error = MasterUnavailable

    def __init__(self, master: str, segment_size: int = 256 << 20, **options: Any) -> None:
        cmd = [
            sys.executable, "-m", "kvpool.cli", "store-server", "--master", master,
            "--segment-size", str(segment_size), "--stdin",
        ]  # fmt: skip
        super().__init__(
            cmd + cli_flags(options), secret=options.get("secret"), metadata=options.get("metadata")
        )
        self.segment: str = self.info["segment"]
        self.client: str = self.info["client"]
