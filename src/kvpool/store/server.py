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


def main(argv: list[str] | None = None) -> int:
    """Mount a segment and keep it served."""
    ap = argparse.ArgumentParser(prog="kvpool store-server", description=__doc__)
    ap.add_argument("--master", required=True, help="host:port of the master")
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--segment-size", type=int, default=1 << 30)
    ap.add_argument("--buffer-size", type=int, default=64 << 20)
    ap.add_argument("--protocol", default="auto")
    ap.add_argument("--metadata", default="p2p")
    ap.add_argument("--secret", default=None)
    ap.add_argument("--ssd-dir", default=None)
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--transfer-timeout-s", type=float, default=None)
    ap.add_argument("--rpc-timeout-s", type=float, default=None)
    ap.add_argument("--stdin", action="store_true", help="exit when stdin closes")
    args = ap.parse_args(argv)
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
        **{k: v for k in ("transfer_timeout_s", "rpc_timeout_s") if (v := getattr(args, k)) is not None},
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
    raise SystemExit(main())
