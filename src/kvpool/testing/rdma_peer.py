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

from kvpool.child import ChildProcess
from kvpool.testing import fake_verbs
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.peer import serve_commands


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--topology", default=None)
    args = ap.parse_args(argv)
    buf = bytearray(args.size)
    eng = TransferEngine(protocol="rdma", verbs=fake_verbs, rdma_topology=args.topology)
    addr = eng.register_local_memory(buf)
    view = memoryview(buf)
    info = {"segment": eng.segment_name, "addr": addr, "size": args.size, "pid": os.getpid()}
    print(json.dumps(info), flush=True)
    serve_commands(addr, view, args.size, {"stats": lambda _: {"passive_qps": len(eng.rdma._passive)}})
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


if __name__ == "__main__":
    raise SystemExit(main())
