"""A target process for demos, benchmarks and tests: one engine, one registered buffer.

Run ``python -m kvpool.transfer.peer --size BYTES [--protocol P] [--secret S] [--metadata URL]``.
It prints one JSON line ``{"segment", "addr", "size", "pid", "port"}`` and then answers commands
on stdin, one per line, each with one JSON line on stdout:

- ``checksum OFFSET LENGTH`` → ``{"xxh3": "<hex>"}`` of that range of its buffer
- ``fill SEED`` → fills the buffer with the deterministic pattern of ``SEED``
- ``exit`` (or EOF) → closes the engine and exits
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import xxhash

from kvpool import _native
from kvpool.child import ChildProcess, cli_flags
from kvpool.transfer.engine import TransferEngine


def main(argv: list[str] | None = None) -> int:
    """Serve one buffer until stdin closes."""
    from kvpool._sizes import size_arg
    from kvpool.cli_errors import CliParser

    ap = CliParser(prog="python -m kvpool.transfer.peer", description=__doc__)
    ap.add_argument("--size", type=size_arg("--size"), required=True, help="bytes of the buffer served")
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--protocol", default="auto")
    ap.add_argument(
        "--metadata",
        default=os.environ.get("KVPOOL_METADATA", "p2p"),
        help="default: $KVPOOL_METADATA or p2p",
    )
    ap.add_argument("--name", default=None)
    ap.add_argument("--secret", default=os.environ.get("KVPOOL_SECRET"), help="default: $KVPOOL_SECRET")
    ap.add_argument("--timeout-s", type=float, default=30.0)
    ap.add_argument(
        "--no-dumpable", action="store_true", help="prctl(PR_SET_DUMPABLE, 0): refuse ptrace-like access"
    )
    ap.add_argument("--shm", action="store_true", help="serve a shared-memory (memfd) buffer")
    ap.add_argument("--location", default="cpu", help="cpu, or cuda:N to serve GPU memory (CUDA driver)")
    args = ap.parse_args(argv)
    if args.no_dumpable:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    gpu = args.location.startswith("cuda")
    buf = bytearray(0 if args.shm else args.size)
    eng = TransferEngine(
        hostname=args.hostname,
        port=args.port,
        protocol=args.protocol,
        metadata=args.metadata,
        name=args.name,
        secret=args.secret,
        timeout_s=args.timeout_s,
    )
    extra = None
    if gpu:
        from kvpool.errors import ProtocolUnavailable
        from kvpool.transfer.cuda_driver import load_driver

        drv = load_driver()
        if drv is None:
            raise ProtocolUnavailable(f"--location {args.location}: no CUDA driver with a GPU loads here")
        addr = drv.alloc(args.size, int(args.location.partition(":")[2] or 0))
        eng.register_local_memory(addr, args.size, location=args.location)
        view = memoryview(buf)  # a host mirror, refreshed from the GPU before each checksum
        host = _native.buffer_address(buf)[0]

        def checksum(a: list[str]) -> dict[str, Any]:
            off, n = int(a[0]), int(a[1])
            drv.memcpy(host + off, addr + off, n)
            return {"xxh3": xxhash.xxh3_64_hexdigest(view[off : off + n])}

        def fill(a: list[str]) -> dict[str, Any]:
            _native.fill_pattern(host, args.size, int(a[0]))
            drv.memcpy(addr, host, args.size)
            return {"ok": True}

        extra = {"checksum": checksum, "fill": fill}
    elif args.shm:
        view = eng.alloc_shared_buffer(args.size)
        addr = _native.buffer_address(view)[0]
    else:
        addr = eng.register_local_memory(buf)
        view = memoryview(buf)
    print(
        json.dumps(
            {"segment": eng.segment_name, "addr": addr, "size": args.size, "port": eng.port, "pid": _pid()}
        ),
        flush=True,
    )
    serve_commands(addr, view, args.size, extra)
    eng.close()
    return 0


def serve_commands(
    addr: int,
    view: memoryview,
    size: int,
    extra: dict[str, Callable[[list[str]], dict[str, Any]]] | None = None,
) -> None:
    """Answer stdin commands with one JSON line each until ``exit`` or EOF: ``checksum OFF LEN``
    (xxh3-64 of a range of the served buffer), ``fill SEED`` (pattern), plus ``extra`` commands."""
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        if extra and cmd[0] in extra:
            out = extra[cmd[0]](cmd[1:])
        elif cmd[0] == "checksum":
            off, n = int(cmd[1]), int(cmd[2])
            out: dict[str, Any] = {"xxh3": xxhash.xxh3_64_hexdigest(view[off : off + n])}
        elif cmd[0] == "fill":
            _native.fill_pattern(addr, size, int(cmd[1]))
            out = {"ok": True}
        else:
            out = {"error": f"unknown command {cmd[0]}"}
        print(json.dumps(out), flush=True)


def _pid() -> int:
    import os

    return os.getpid()


class PeerProcess(ChildProcess):
    """Starts :func:`main` in a child process and talks to it (used by demo, bench and tests)."""

    exit_line = "exit"

    def __init__(self, size: int, prefix: list[str] | None = None, **options: Any) -> None:
        cmd = list(prefix or []) + [sys.executable, "-m", "kvpool.transfer.peer", "--size", str(size)]
        super().__init__(
            cmd + cli_flags(options), secret=options.get("secret"), metadata=options.get("metadata")
        )
        self.segment: str = self.info["segment"]
        self.addr: int = self.info["addr"]
        self.size: int = self.info["size"]
        self.port: int = self.info["port"]

    def checksum(self, offset: int, length: int) -> str:
        """xxh3-64 hex digest of a range of the peer's buffer."""
        return self.ask(f"checksum {offset} {length}")["xxh3"]

    def fill(self, seed: int) -> None:
        """Fill the peer's buffer with the pattern of ``seed``."""
        self.ask(f"fill {seed}")


if __name__ == "__main__":
    from kvpool.cli_errors import run_main

    raise SystemExit(run_main(main))
