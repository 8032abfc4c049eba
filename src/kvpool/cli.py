"""``kvpool`` command line: demo, bench, master, store-server, metadata-server, proxy, topology."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from kvpool.errors import KvpoolError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1024
    return f"{n} B"


def _with_progress(label: str, quiet: bool, run: Callable[[Any], Any]) -> Any:
    """Call ``run(progress)`` under a transient progress bar on a terminal (stderr), plainly
    otherwise; ``progress`` takes the fraction done (0..1) or is None."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        return run(None)
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task(label, total=1.0)
        return run(lambda f: prog.update(task, completed=f))


def cmd_demo(args: argparse.Namespace) -> int:
    """Two engines in separate processes move ≥1 GiB each way per path and verify checksums."""
    from rich.console import Console
    from rich.table import Table

    from kvpool.transfer.bench import parse_size, run_demo

    console = Console(width=max(100, Console().width))
    total = parse_size(args.bytes)
    protocols = tuple(args.protocols.split(","))
    console.print(
        f"[bold]kvpool demo[/]: two processes on loopback, {_human(total)} each way per path, "
        f"block sizes 64 KiB / 512 KiB / 4 MiB, batches of 32, xxh3 checksums"
    )
    table = Table(title="kvpool transfer engine")
    for col in ("path", "block", "direction", "bytes", "GB/s", "batch P50 µs", "batch P99 µs", "checksum"):
        table.add_column(col, justify="right" if col not in ("path", "direction") else "left")

    def on_row(r: object) -> None:
        console.print(
            f"  {r.path:9} {_human(r.block_size):>8} {r.direction:5} {r.gbps:6.2f} GB/s", highlight=False
        )

    rows = run_demo(total_bytes=total, protocols=protocols, on_row=on_row)
    for r in rows:
        table.add_row(
            r.path,
            _human(r.block_size),
            r.direction,
            _human(r.bytes),
            f"{r.gbps:.2f}",
            f"{r.p50_us:.0f}",
            f"{r.p99_us:.0f}",
            "ok" if r.verified else "MISMATCH",
        )
    console.print(table)
    ok = all(r.verified for r in rows)
    console.print("[green]all checksums match[/]" if ok else "[red]checksum mismatch[/]")
    if not ok or args.no_store:
        return 0 if ok else 1

    from kvpool.store.bench import run_store_demo

    console.print(
        "\n[bold]kvpool store[/]: embedded master; this process and a second one contribute "
        "256 MiB each; 192 objects of 1 MiB with 2 replicas"
    )
    srows = run_store_demo()
    st = Table(title="kvpool store")
    for col in ("op", "objects", "bytes", "GB/s", "P50 µs", "P99 µs"):
        st.add_column(col, justify="left" if col == "op" else "right")
    for r in srows[:-1]:
        cells = [
            str(r["objects"]),
            _human(r["bytes"]),
            f"{r['gbps']:.2f}",
            f"{r['p50_us']:.0f}",
            f"{r['p99_us']:.0f}",
        ]
        st.add_row(r["op"], *cells)
    console.print(st)
    v = srows[-1]
    console.print(
        f"[green]all {v['objects']} objects verified[/]; replicas on {v['replica_segments_of_demo_0']} "
        f"distinct segments; pool {_human(v['pool_used'])} used of {_human(v['pool_capacity'])} "
        f"in {v['segments']} segments"
    )
    return 0


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    """Benchmark the transfer engine between two processes."""

    from kvpool.transfer.bench import parse_size, run_transfer_bench

    opts = {}
    if args.secret:
        opts["secret"] = args.secret
    results = []
    for bs in args.block_size:
        for op in args.op:
            kw = dict(
                block_size=parse_size(bs),
                batch_size=args.batch_size,
                operation=op,
                duration_s=args.duration,
                protocol=args.protocol,
                threads=args.threads,
                sync=args.sync,
                **opts,
            )
            res = _with_progress(
                f"{op} {bs}", args.json, lambda p, kw=kw: run_transfer_bench(**kw, progress=p)
            )
            results.append(res.as_dict())
            if not args.json:
                print(
                    f"{res.protocol:5} path={res.path:9} {op:5} block={_human(res.block_size):>8} "
                    f"batch={res.batch_size:<4} threads={res.threads} {res.gbps:7.3f} GB/s "
                    f"{res.ops_per_s:10.0f} ops/s  P50 {res.p50_us:9.1f} µs  P99 {res.p99_us:9.1f} µs",
                    flush=True,
                )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def cmd_metadata_server(args: argparse.Namespace) -> int:
    """Serve segment descriptors over HTTP."""
    from kvpool.transfer import metadata_server

    return metadata_server.main(["--host", args.host, "--port", str(args.port)])


def cmd_master(args: argparse.Namespace) -> int:
    """Run the store master until SIGTERM/SIGINT."""
    import signal
    import threading

    from kvpool.config import MasterConfig
    from kvpool.store.master import Master

    fields = {k: v for k, v in vars(args).items() if k in MasterConfig.model_fields and v is not None}
    master = Master(MasterConfig(**fields))
    master.manage_gc()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    master.start()
    print(json.dumps({"address": master.address, "metrics_port": master.metrics_port}), flush=True)
    done.wait()
    master.stop()
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    """Run the prefill/decode disaggregation proxy until SIGTERM/SIGINT."""
    from kvpool.connectors import proxy

    return proxy.main(args)


def cmd_bench_store(args: argparse.Namespace) -> int:
    """Benchmark the store across three processes."""

    from kvpool.store.bench import run_store_bench
    from kvpool.transfer.bench import parse_size

    results = []
    for vs in args.value_size:
        res = _with_progress(
            f"store {vs}",
            args.json,
            lambda p, vs=vs: run_store_bench(
                parse_size(vs), args.duration, args.protocol, progress=p, checksum=args.checksum
            ),
        )
        results.append(res)
        if not args.json:
            r = res
            print(
                f"value={_human(r['value_size']):>8}  "
                f"put {r['put_gbps']:6.3f} GB/s {r['put_ops_s']:8.0f} ops/s "
                f"P50 {r['put_p50_us']:7.1f} P99 {r['put_p99_us']:7.1f} µs | get {r['get_gbps']:6.3f} GB/s "
                f"{r['get_ops_s']:8.0f} ops/s P50 {r['get_p50_us']:7.1f} P99 {r['get_p99_us']:7.1f} µs | "
                f"batch put {r['batch_put_gbps']:.3f} get {r['batch_get_gbps']:.3f} GB/s | "
                f"exists {r['batch_exists_keys_s']:.0f} keys/s",
                flush=True,
            )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def cmd_bench_trace(args: argparse.Namespace) -> int:
    """Replay a conversation trace through the store at several pool sizes; print hit rates."""
    from kvpool.store.trace import find_shared_trace, load_trace, run_hit_rate_study, synthetic_trace

    path = args.trace or find_shared_trace()
    trace = load_trace(path) if path else synthetic_trace()
    if args.max_requests:
        trace = trace[: args.max_requests]
    print(f"trace: {path or 'synthetic'} ({len(trace)} requests)", file=sys.stderr, flush=True)
    rows = run_hit_rate_study(trace, tuple(args.pool_blocks), block_bytes=args.block_bytes)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| pool blocks | pool bytes | hit rate | ideal (infinite pool) | evictions | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['pool_blocks']} | {_human(r['pool_bytes'])} | {r['hit_rate']:.4f} "
            f"| {r['ideal_hit_rate']:.4f} | {r['evictions']} | {r['seconds']:.1f} |"
        )
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    """Print the RDMA NIC topology matrix (Mooncake JSON) discovered from sysfs or read from a file."""
    from kvpool.transfer.rdma import topology as tp

    devices = [d for d in (args.devices or "").split(",") if d] or None
    matrix = tp.load_matrix(args.file, sysfs=args.sysfs, allowed=devices)
    if args.json:
        print(json.dumps(matrix))
        return 0
    print(json.dumps(matrix, indent=2))
    if args.file is None:
        nics = tp.discover_nics(args.sysfs)
        gpus = tp.discover_gpus(args.sysfs)
        print(f"# {len(nics)} RDMA NIC(s), {len(gpus)} NVIDIA GPU(s) under {args.sysfs}", file=sys.stderr)
        for d in nics + gpus:
            print(f"#   {d.name:10} numa {d.numa:>2}  {d.pci_path}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpool`` argument parser."""
    ap = argparse.ArgumentParser(
        prog="kvpool", description="KV cache pooling: transfer engine, store, connectors"
    )
    sub = ap.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="move >=1 GiB between two processes, verify, print a table")
    demo.add_argument("--bytes", default="1G", help="bytes per direction per path (default 1G)")
    demo.add_argument("--protocols", default="tcp,auto", help="comma-separated protocols (default tcp,auto)")
    demo.add_argument("--no-store", action="store_true", help="skip the store part")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bt = bsub.add_parser("transfer", help="two-process transfer engine benchmark")
    bt.add_argument("--block-size", nargs="+", default=["1M"], help="one or more sizes, e.g. 64K 1M 4M")
    bt.add_argument("--batch-size", type=int, default=32)
    bt.add_argument("--op", nargs="+", choices=["write", "read"], default=["write"])
    bt.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    bt.add_argument("--protocol", choices=["tcp", "auto", "rdma"], default="tcp")
    bt.add_argument("--threads", type=int, default=2, help="initiator threads")
    bt.add_argument("--sync", action="store_true", help="one transfer_sync call per request (latency)")
    bt.add_argument("--secret", default=None)
    bt.add_argument("--json", action="store_true", help="machine-readable output")
    bt.set_defaults(func=cmd_bench_transfer)

    bs = bsub.add_parser("store", help="store benchmark: master, storage client and this process")
    bs.add_argument("--value-size", nargs="+", default=["4K", "1M"])
    bs.add_argument("--duration", type=float, default=5.0, help="seconds per phase")
    bs.add_argument("--protocol", choices=["tcp", "auto"], default="auto")
    bs.add_argument("--json", action="store_true")
    bs.add_argument("--checksum", action="store_true", help="xxh3 for every object (StoreConfig.checksum)")
    bs.set_defaults(func=cmd_bench_store)

    bt2 = bsub.add_parser(
        "trace", help="replay a conversation trace through the store; hit rate per pool size"
    )
    bt2.add_argument("--trace", default=None, help="JSONL trace (default: ../shared/traces/... or synthetic)")
    bt2.add_argument("--pool-blocks", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    bt2.add_argument("--block-bytes", type=int, default=4096)
    bt2.add_argument("--max-requests", type=int, default=None)
    bt2.add_argument("--json", action="store_true")
    bt2.set_defaults(func=cmd_bench_trace)

    ma = sub.add_parser("master", help="run the store master")
    ma.add_argument("--host", default="127.0.0.1")
    ma.add_argument("--port", type=int, default=50051)
    ma.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0 = any)")
    ma.add_argument("--eviction-high-watermark", type=float, default=None)
    ma.add_argument("--eviction-ratio", type=float, default=None)
    ma.add_argument("--lease-ttl-ms", type=int, default=None)
    ma.add_argument("--client-ttl-s", type=float, default=None)
    ma.add_argument("--put-timeout-s", type=float, default=None)
    ma.add_argument("--secret", default=None)
    ma.add_argument("--hot-key-replication", action="store_true", default=None)
    ma.add_argument("--hot-interval-s", type=float, default=None)
    ma.add_argument("--hot-window-s", type=float, default=None)
    ma.add_argument("--hot-max-replicas", type=int, default=None)
    for flag, typ in (("--quarantine-s", float), ("--fence-hold-s", float), ("--max-batch", int),
                      ("--evict-batch", int), ("--max-message", int), ("--idle-timeout-s", float),
                      ("--max-connections", int)):  # fmt: skip
        ma.add_argument(flag, type=typ, default=None, help="see MasterConfig")
    ma.set_defaults(func=cmd_master)

    # Parsed by kvpool.store.server itself (see main()); listed here for --help.
    sub.add_parser("store-server", help="contribute memory (and SSD) to the pool (see store-server --help)")

    ms = sub.add_parser("metadata-server", help="HTTP metadata server for segment descriptors")
    ms.add_argument("--host", default="127.0.0.1")
    ms.add_argument("--port", type=int, default=8080)
    ms.set_defaults(func=cmd_metadata_server)

    px = sub.add_parser("proxy", help="OpenAI-compatible prefill/decode disaggregation proxy for vLLM")
    px.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill vLLM base URLs")
    px.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode vLLM base URLs")
    px.add_argument("--host", default="127.0.0.1")
    px.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 = any)")
    px.add_argument("--timeout-s", type=float, default=300.0, help="longest wait for a backend to send")
    px.add_argument("--health-interval-s", type=float, default=5.0, help="backend health polls (0 = off)")
    px.add_argument("--connect-timeout-s", type=float, default=10.0)
    px.add_argument("--max-connections", type=int, default=1024, help="connections to backends, total")
    px.add_argument("--log-level", default="INFO")
    px.set_defaults(func=cmd_proxy)

    tp = sub.add_parser("topology", help="print the RDMA NIC topology matrix (Mooncake JSON format)")
    tp.add_argument("--sysfs", default="/sys", help="sysfs root to discover from (default /sys)")
    tp.add_argument("--file", default=None, help="read (and validate) this topology JSON instead")
    tp.add_argument("--devices", default=None, help="comma-separated NIC allow-list")
    tp.add_argument("--json", action="store_true", help="compact JSON only")
    tp.set_defaults(func=cmd_topology)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpool`` command."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["store-server"]:
        from kvpool.store import server

        return server.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KvpoolError as exc:
        print(f"kvpool: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
