"""A target process for the RDMA tests: one engine on the fake-verbs test double, one buffer.

``python -m kvpool.testing.rdma_peer --size BYTES`` (the double's registry comes from the
``KVPOOL_FAKE_VERBS_*`` environment) prints ``{"segment", "addr", "size", "pid"}`` and answers
``checksum OFF LEN``, ``fill SEED``, ``stats`` and ``exit`` on stdin, one JSON line each.
Test double only: this never touches a real RDMA device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import xxhash

from kvpool import _native
from kvpool.child import ChildProcess
from kvpool.transfer.engine import TransferEngine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--topology", default=None)
    args = ap.parse_args(argv)
    buf = bytearray(args.size)
    eng = TransferEngine(protocol="rdma", rdma_verbs="double", rdma_topology=args.topology)
    addr = eng.register_local_memory(buf)
    view = memoryview(buf)
    info = {"segment": eng.segment_name, "addr": addr, "size": args.size, "pid": os.getpid()}
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        if cmd[0] == "checksum":
            off, n = int(cmd[1]), int(cmd[2])
            print(json.dumps({"xxh3": xxhash.xxh3_64_hexdigest(view[off : off + n])}), flush=True)
        elif cmd[0] == "fill":
            _native.fill_pattern(addr, args.size, int(cmd[1]))
            print(json.dumps({"ok": True}), flush=True)
        elif cmd[0] == "stats":
            print(json.dumps({"passive_qps": len(eng.rdma._passive)}), flush=True)
        else:
            print(json.dumps({"error": f"unknown command {cmd[0]}"}), flush=True)
    eng.close()
    return 0


class RdmaPeer(ChildProcess):
    """:func:`main` in a child process (test double only)."""

    exit_line = "exit"

    def __init__(self, size: int, topology: str | None = None) -> None:
        cmd = [sys.executable, "-m", "kvpool.testing.rdma_peer", "--size", str(size)]
        if topology:
            cmd += ["--topology", topology]
        super().__init__(cmd)
        self.segment: str = self.info["segment"]
        self.addr: int = self.info["addr"]
        self.pid: int = self.info["pid"]

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())


if __name__ == "__main__":
    raise SystemExit(main())
