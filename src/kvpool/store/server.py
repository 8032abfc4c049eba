"""``kvpool store-server``: a storage client process that contributes memory (and SSD) to the pool.

Prints one JSON line ``{"segment", "client", "pid"}`` once mounted, then serves until SIGTERM/SIGINT
or until stdin closes (when ``--stdin`` is given, as tests and benchmarks do).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from kvpool.store.client import Store

EXAMPLES = """examples:
  kvpool master --port 50051 &
  kvpool store-server --master 127.0.0.1:50051 --segment-size 4G
  kvpool store-server --master 10.0.0.1:50051 --hostname 10.0.0.2 --segment-size 64G \\
      --protocol rdma --ssd-dir /mnt/nvme/kvpool   # secret: $KVPOOL_SECRET
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpool store-server`` argument parser."""
    from kvpool._sizes import EXAMPLES as SIZES
    from kvpool._sizes import size_arg
    from kvpool.cli_errors import CliParser, host_port_arg

    ap = CliParser(prog="kvpool store-server", description=__doc__, epilog=EXAMPLES)
    ap.add_argument(
        "--master", required=True, type=host_port_arg("--master"), metavar="HOST:PORT",
        help="address of `kvpool master` (required)",
    )  # fmt: skip
    ap.add_argument(
        "--hostname", default="127.0.0.1", help="address serving this process's memory (default 127.0.0.1)"
    )
    ap.add_argument(
        "--segment-size", type=size_arg("--segment-size", allow_zero=True), default=1 << 30, metavar="SIZE",
        help=f"bytes of DRAM contributed to the pool ({SIZES}; 0 = none; default 1G)",
    )  # fmt: skip
    ap.add_argument(
        "--buffer-size", type=size_arg("--buffer-size"), default=64 << 20, metavar="SIZE",
        help="registered staging buffer for this client's own puts/gets (default 64M)",
    )  # fmt: skip
    ap.add_argument(
        "--protocol", choices=["auto", "tcp", "rdma"], default="auto",
        help="transport: auto = same-host path for local peers, else TCP (default auto)",
    )  # fmt: skip
    ap.add_argument(
        "--metadata",
        default=os.environ.get("KVPOOL_METADATA", "p2p"),
        help="metadata: p2p, http://, etcd:// or redis:// URL (default: $KVPOOL_METADATA, which keeps a "
        "password in it out of the process list, or p2p)",
    )
    ap.add_argument(
        "--secret",
        default=os.environ.get("KVPOOL_SECRET"),
        help="shared secret of the master and engines (default: $KVPOOL_SECRET, which keeps it out of "
        "the process list; none when unset)",
    )
    ap.add_argument("--ssd-dir", default=None, help="directory contributed as the SSD tier (default: none)")
    ap.add_argument(
        "--ssd-sweep-s", type=float, default=None, metavar="SECONDS",
        help="how often the SSD directory's files no copy has are removed (default: StoreConfig's, "
        "600; 0: never)",
    )  # fmt: skip
    ap.add_argument(
        "--heartbeat-s", type=float, default=1.0, metavar="SECONDS", help="heartbeat period (default 1)"
    )
    ap.add_argument(
        "--transfer-timeout-s", type=float, default=None, metavar="SECONDS",
        help="transfer timeout in seconds (default: StoreConfig's, 10)",
    )  # fmt: skip
    ap.add_argument(
        "--rpc-timeout-s", type=float, default=None, metavar="SECONDS",
        help="master RPC timeout in seconds (default: StoreConfig's, 5)",
    )  # fmt: skip
    ap.add_argument("--stdin", action="store_true", help="exit when stdin closes (for tests and scripts)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Mount a segment and keep it served."""
    from kvpool._sizes import check_memory
    from kvpool.cli_errors import UsageError

    args = build_parser().parse_args(argv)
    for name in ("heartbeat_s", "transfer_timeout_s", "rpc_timeout_s"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be more than 0 seconds, got {v}")
    check_memory(args.segment_size + args.buffer_size, "--segment-size plus --buffer-size",
                 locked=args.protocol == "rdma")  # fmt: skip
    # Is it a kvpool master (and do the secrets match)? Asked before the segment is allocated.
    from kvpool._rpc import RpcClient

    probe = RpcClient(args.master, args.rpc_timeout_s or 5.0, args.secret, what="store master")
    try:
        probe.check()
    finally:
        probe.close()
    store = Store.connect(
        master=args.master,
        hostname=args.hostname,
        segment_size=args.segment_size,
        buffer_size=args.buffer_size,
        protocol=args.protocol,
        metadata=args.metadata,
        secret=args.secret,
        ssd_dir=args.ssd_dir,
        heartbeat_s=args.heartbeat_s,
        **{
            k: v
            for k in ("transfer_timeout_s", "rpc_timeout_s", "ssd_sweep_s")
            if (v := getattr(args, k)) is not None
        },
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(
        json.dumps({"segment": store.segment_name, "client": store.client_id, "pid": os.getpid()}), flush=True
    )
    if args.stdin:
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait()
    store.close()
    return 0


if __name__ == "__main__":
    from kvpool.cli_errors import run_main

    raise SystemExit(run_main(main))
