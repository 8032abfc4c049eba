"""``kvpool`` command line: demo, bench, master, store-server, metadata-server, proxy, topology."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from kvpool._sizes import EXAMPLES as SIZES
from kvpool._sizes import check_memory, size_arg
from kvpool._sizes import human as _human
from kvpool.cli_errors import CliParser, UsageError, host_port_arg, number_arg, port_arg, run_main


def _with_progress(label: str, quiet: bool, run: Callable[[Any], Any]) -> Any:
    """Call ``run(progress)`` with ``progress(fraction)`` shown on stderr: a bar on a terminal, a
    line per quarter otherwise, nothing when ``quiet``."""
    from kvpool._progress import Reporter

    with Reporter(quiet) as rep:
        return run(rep.task(label))


def _check_rdma(protocols: tuple[str, ...] | list[str]) -> None:
    """Fail at once (ProtocolUnavailable) when RDMA is asked for and pyverbs cannot be loaded."""
    if "rdma" in protocols:
        from kvpool.transfer.rdma.verbs import load_verbs

        load_verbs()


def cmd_demo(args: argparse.Namespace) -> int:
    """Two engines in separate processes move ≥1 GiB each way per path and verify checksums."""
    from rich.console import Console
    from rich.table import Table

    from kvpool.transfer.bench import demo_bytes, run_demo

    console = Console(width=max(100, Console().width))
    total = args.bytes
    protocols = args.protocols
    _check_rdma(protocols)
    console.print(
        f"[bold]kvpool demo[/]: two processes on loopback, {_human(demo_bytes(total))} each way per path, "
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
    srows = _with_progress("store demo: master, second process, put/get/verify", args.quiet,
                           lambda p: (p(0.0), run_store_demo())[1])  # fmt: skip
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


def location_arg(flag: str) -> Any:
    """argparse type for a memory location (cpu, cpu:N, cuda, cuda:N)."""

    def parse(text: str) -> str:
        from kvpool.errors import InvalidArgument
        from kvpool.transfer.device import parse_location

        try:
            parse_location(text)
        except InvalidArgument as exc:
            raise argparse.ArgumentTypeError(f"{flag}: {exc}") from None
        return text

    return parse


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    """Benchmark the transfer engine between two processes."""

    from kvpool._smoke import shorten
    from kvpool.transfer.bench import run_transfer_bench

    shorten(args, duration=min(args.duration, 0.2))
    _check_rdma([args.protocol])
    for bs in args.block_size:
        check_memory(2 * bs * args.batch_size * args.threads, "--block-size x --batch-size x --threads (x2: "
                     "this process and the target)", locked=args.protocol == "rdma")  # fmt: skip
    opts = {}
    if args.secret:
        opts["secret"] = args.secret
    results = []
    for bs in args.block_size:
        for op in args.op:
            kw = dict(
                block_size=bs,
                batch_size=args.batch_size,
                operation=op,
                duration_s=args.duration,
                protocol=args.protocol,
                threads=args.threads,
                sync=args.sync,
                location=args.location,
                remote_location=args.remote_location,
                **opts,
            )
            res = _with_progress(
                f"{op} {_human(bs)}",
                args.json or args.quiet,
                lambda p, kw=kw: run_transfer_bench(**kw, progress=p),
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
    from kvpool.connectors import proxy_cli

    return proxy_cli.main(args)


def cmd_bench_store(args: argparse.Namespace) -> int:
    """Benchmark the store across three processes."""

    from kvpool._smoke import shorten
    from kvpool.store.bench import run_store_bench

    shorten(args, duration=min(args.duration, 0.3))
    results = []
    for vs in args.value_size:
        res = _with_progress(
            f"store {_human(vs)}",
            args.json or args.quiet,
            lambda p, vs=vs: run_store_bench(
                vs, args.duration, args.protocol, progress=p, checksum=args.checksum
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
    from kvpool._progress import Reporter

    with Reporter(args.quiet) as rep:
        name = path or "synthetic (no --trace given and no shared trace found)"
        rep.note(f"trace: {name} ({len(trace)} requests)")
        tasks: dict[int, Callable[[float], None]] = {}

        def progress(n: int, f: float) -> None:
            if n not in tasks:
                tasks[n] = rep.task(f"pool of {n} blocks")
            tasks[n](f)

        rows = run_hit_rate_study(
            trace, tuple(args.pool_blocks), block_bytes=args.block_bytes, progress=progress
        )
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


MASTER_HELP: dict[str, str] = {
    "host": "address to bind the RPC port on",
    "port": "RPC port (0 = any free port)",
    "metrics_port": "Prometheus /metrics HTTP port (0 = any free port; default: off)",
    "eviction_high_watermark": "fraction of pool capacity above which eviction starts",
    "eviction_ratio": "fraction of pool capacity each eviction round frees",
    "lease_ttl_ms": "milliseconds a read lease protects an object from being freed",
    "client_ttl_s": "seconds of silence after which a client is dead and its segments unmounted",
    "put_timeout_s": "seconds after which an uncommitted put is revoked",
    "quarantine_s": "seconds space taken back from an unfinished writer stays unused",
    "fence_hold_s": "seconds after which space of a writer that never confirmed is reused",
    "task_timeout_s": "seconds after which a task handed to a storage client counts as failed",
    "max_batch": "most keys one request may carry",
    "evict_batch": "most objects one eviction step looks at",
    "secret": "shared secret every RPC must carry (default: $KVPOOL_SECRET, which keeps it out of the "
    "process list; none when unset)",
    "hot_key_replication": "raise the replica count of the hottest keys automatically",
    "hot_window_s": "seconds of access counts the hot-key policy looks at",
    "hot_interval_s": "seconds between runs of the hot-key policy",
    "hot_max_replicas": "replicas given to hot keys",
    "alignment": "allocation alignment inside segments, in bytes",
    "max_message": "biggest RPC message accepted from an authenticated client, in bytes",
    "idle_timeout_s": "seconds an idle RPC connection stays open",
    "max_connections": "open RPC connections kept",
}

MASTER_EXAMPLES = """examples:
  kvpool master                                   # 127.0.0.1:50051, prints {"address": ...}
  KVPOOL_SECRET=... kvpool master --host 0.0.0.0 --port 50051 --metrics-port 9100
  kvpool master --hot-key-replication --hot-max-replicas 4
"""

PROXY_EXAMPLES = """examples:
  kvpool proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
  kvpool proxy --prefill http://p1:8100 http://p2:8100 --decode http://d1:8200 --timeout-s 600
then: curl http://127.0.0.1:8000/v1/completions -d '{"model": ..., "prompt": "hi"}'
"""


def _protocols(text: str) -> tuple[str, ...]:
    out = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in out if p not in ("tcp", "auto", "rdma")]
    if bad or not out:
        raise UsageError(f"--protocols: unknown protocol {bad[0] if bad else text!r}; use tcp, auto or rdma")
    return out


def _existing_file(option: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        from pathlib import Path

        if not Path(text).is_file():
            raise UsageError(f"{option}: no such file {text!r}; check the path")
        return text

    parse.__name__ = "file"
    return parse


def _add_master_options(ma: argparse.ArgumentParser) -> None:
    from kvpool.config import MasterConfig

    for name, field in MasterConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = field.default
        text = MASTER_HELP.get(name, "see MasterConfig")
        if field.annotation is bool:
            ma.add_argument(flag, action="store_true", default=None, help=text)
            continue
        shown = "off" if default is None else _human(default) if name in ("max_message",) else default
        help_text = text if "default" in text else f"{text} (default {shown})"
        kw: dict[str, Any] = {"default": None, "help": help_text}
        if name in ("max_message", "alignment"):
            kw.update(type=size_arg(flag), metavar="SIZE")
        elif name in ("host", "secret"):
            kw["metavar"] = name.upper()
            if name == "secret":  # the variable keeps it out of the process list
                kw["default"] = os.environ.get("KVPOOL_SECRET")
        elif name.endswith("port"):
            kw.update(type=port_arg(flag), metavar="PORT")
        elif isinstance(default, float) or name.endswith("_s") or "ratio" in name or "watermark" in name:
            unit = "SECONDS" if name.endswith("_s") else "X"
            kw.update(type=number_arg(flag, float, minimum=0), metavar=unit)
        else:
            kw.update(type=number_arg(flag, int, minimum=0), metavar="N")
        ma.add_argument(flag, **kw)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check this host for what kvpool can use; exit 1 when a check fails."""
    from kvpool import doctor

    return doctor.main(args)


DOCTOR_EXAMPLES = """examples:
  kvpool doctor
  kvpool doctor --master 10.0.0.1:50051 --etcd etcd://10.0.0.1:2379 --json
"""


# Commands that do not need the master's options (config models) or the conductor's commands and
# proxy options to parse their own arguments: their bad input is refused before those modules load.
LIGHT_COMMANDS = frozenset({"demo", "bench", "master", "doctor", "topology"})


def build_parser(master_options: bool = True, conductor: bool = True) -> argparse.ArgumentParser:
    """The ``kvpool`` argument parser. ``master_options=False`` leaves out ``master``'s options and
    ``conductor=False`` lists ``simulate`` and ``proxy`` without the conductor's options (both need
    heavier modules); :func:`_main` builds the full parser for every command not in LIGHT_COMMANDS."""
    ap = CliParser(
        prog="kvpool",
        description="KV cache pooling: transfer engine, store, connectors.\n"
        f"Sizes take units everywhere ({SIZES}). Errors print one line and exit 2 (usage) or 1.",
        epilog="add --debug (or set KVPOOL_DEBUG=1) to any command to see tracebacks",
    )
    ap.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="move >=1 GiB between two processes, verify, print a table")
    demo.add_argument(
        "--bytes", type=size_arg("--bytes"), default=1 << 30, metavar="SIZE",
        help="least bytes moved each way per protocol, in whole 256 MiB regions per block size "
        "(default 1G, which moves 1.5G)",
    )  # fmt: skip
    demo.add_argument(
        "--protocols", type=_protocols, default=("tcp", "auto"), metavar="LIST",
        help="comma-separated: tcp, auto (same-host path), rdma (default tcp,auto)",
    )  # fmt: skip
    demo.add_argument("--no-store", action="store_true", help="skip the store part")
    demo.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks: transfer, store, trace")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    bt = bsub.add_parser("transfer", help="two-process transfer engine benchmark")
    bt.add_argument(
        "--block-size", nargs="+", type=size_arg("--block-size"), default=[1 << 20], metavar="SIZE",
        help="one or more request sizes, e.g. 64K 1M 4M (default 1M)",
    )  # fmt: skip
    bt.add_argument("--batch-size", type=number_arg("--batch-size"), default=32, metavar="N",
                    help="requests per batch (default 32)")  # fmt: skip
    bt.add_argument("--op", nargs="+", choices=["write", "read"], default=["write"],
                    help="operations to measure, one after the other (default write)")  # fmt: skip
    bt.add_argument("--duration", type=number_arg("--duration", float), default=5.0, metavar="SECONDS",
                    help="seconds per measurement (default 5)")  # fmt: skip
    bt.add_argument("--protocol", choices=["tcp", "auto", "rdma"], default="tcp",
                    help="tcp, auto (same-host path) or rdma (default tcp)")  # fmt: skip
    bt.add_argument("--threads", type=number_arg("--threads"), default=2, metavar="N",
                    help="initiator threads (default 2)")  # fmt: skip
    bt.add_argument(
        "--sync", action="store_true",
        help="each request is its own transfer_sync call; P50/P99 still cover a whole batch",
    )  # fmt: skip
    bt.add_argument("--location", default="cpu", type=location_arg("--location"),
                    help="memory of this process's blocks: cpu or cuda:N (GPU; default cpu)")  # fmt: skip
    bt.add_argument("--remote-location", default="cpu", type=location_arg("--remote-location"),
                    help="memory of the target's buffer: cpu or cuda:N (default cpu)")  # fmt: skip
    bt.add_argument(
        "--secret", default=os.environ.get("KVPOOL_SECRET"),
        help="shared secret of both engines (default: $KVPOOL_SECRET; none when unset)",
    )  # fmt: skip
    bt.add_argument("--json", action="store_true", help="machine-readable output (no progress)")
    bt.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    bt.set_defaults(func=cmd_bench_transfer)

    bs = bsub.add_parser("store", help="store benchmark: master, storage client and this process")
    bs.add_argument("--value-size", nargs="+", type=size_arg("--value-size"), default=[4 << 10, 1 << 20],
                    metavar="SIZE", help="one or more object sizes (default 4K 1M)")  # fmt: skip
    bs.add_argument("--duration", type=number_arg("--duration", float), default=5.0, metavar="SECONDS",
                    help="seconds per phase (default 5)")  # fmt: skip
    bs.add_argument("--protocol", choices=["tcp", "auto"], default="auto",
                    help="tcp or auto (same-host path; default auto)")  # fmt: skip
    bs.add_argument("--json", action="store_true", help="machine-readable output (no progress)")
    bs.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    bs.add_argument("--checksum", action="store_true", help="xxh3 for every object (StoreConfig.checksum)")
    bs.set_defaults(func=cmd_bench_store)

    bt2 = bsub.add_parser(
        "trace", help="replay a conversation trace through the store; hit rate per pool size"
    )
    bt2.add_argument(
        "--trace", type=_existing_file("--trace"), default=None, metavar="FILE",
        help="JSONL trace; default: shared/traces/conversation_trace.jsonl found from the current "
        "directory up, else a synthetic trace (the first line printed says which)",
    )  # fmt: skip
    bt2.add_argument("--pool-blocks", type=number_arg("--pool-blocks"), nargs="+", metavar="N",
                     default=[1024, 4096, 16384, 65536],
                     help="pool sizes in blocks (default 1024 4096 16384 65536)")  # fmt: skip
    bt2.add_argument("--block-bytes", type=size_arg("--block-bytes"), default=4096, metavar="SIZE",
                     help="bytes per KV block (default 4K)")  # fmt: skip
    bt2.add_argument("--max-requests", type=number_arg("--max-requests"), default=None, metavar="N",
                     help="replay only the first N requests (default: all)")  # fmt: skip
    bt2.add_argument("--json", action="store_true", help="machine-readable output")
    bt2.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    bt2.set_defaults(func=cmd_bench_trace)

    ma = sub.add_parser("master", help="run the store master", description="Run the store master "
                        "until SIGTERM/SIGINT; prints one JSON line with its address when ready.",
                        epilog=MASTER_EXAMPLES)  # fmt: skip
    if master_options:
        _add_master_options(ma)
    ma.set_defaults(func=cmd_master)

    # Parsed by kvpool.store.server itself (see _main()); listed here for --help.
    sub.add_parser("store-server", help="contribute memory (and SSD) to the pool (see store-server --help)")

    # Parsed by kvpool.transfer.metadata_server itself (see _main()); listed here for --help.
    sub.add_parser("metadata-server", help="HTTP metadata server for segment descriptors (see its --help)")

    px = sub.add_parser("proxy", help="OpenAI-compatible prefill/decode disaggregation proxy for vLLM",
                        epilog=PROXY_EXAMPLES)  # fmt: skip
    px.add_argument("--prefill", nargs="+", default=None, metavar="URL", help="prefill vLLM base URLs")
    px.add_argument("--decode", nargs="+", default=None, metavar="URL", help="decode vLLM base URLs")
    px.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    px.add_argument("--port", type=port_arg("--port"), default=8000, metavar="PORT",
                    help="port to bind (default 8000; 0 = any)")  # fmt: skip
    px.add_argument("--timeout-s", type=number_arg("--timeout-s", float), default=300.0, metavar="SECONDS",
                    help="longest wait for a backend to send, in seconds (default 300)")  # fmt: skip
    px.add_argument("--health-interval-s", type=number_arg("--health-interval-s", float, minimum=0),
                    default=5.0, metavar="SECONDS",
                    help="seconds between backend health polls (0 = off; default 5)")  # fmt: skip
    px.add_argument("--connect-timeout-s", type=number_arg("--connect-timeout-s", float), default=10.0,
                    metavar="SECONDS", help="seconds to connect to a backend (default 10)")  # fmt: skip
    px.add_argument("--max-connections", type=number_arg("--max-connections"), default=1024, metavar="N",
                    help="connections to backends, total (default 1024)")  # fmt: skip
    px.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    type=str.upper, help="log level (default INFO)")  # fmt: skip
    px.add_argument("--stream-kv", action="store_true",
                    help="send prefill and decode at once: the decode reads each layer's KV while the "
                         "prefill computes the next (KvpoolConnector streaming P/D)")  # fmt: skip
    if conductor:  # (left out only when another command is being parsed)
        from kvpool.conductor.cli import add_proxy_options

        add_proxy_options(px)  # --backends, --policy, --kv-events, SLOs ...
    px.set_defaults(func=cmd_proxy)

    dr = sub.add_parser("doctor", help="check this host (memlock, RDMA, CUDA, GPUDirect, engines, servers)",
                        description="Check this host for what kvpool can use and say what to fix; "
                        "exit status 1 when a check fails.", epilog=DOCTOR_EXAMPLES)  # fmt: skip
    dr.add_argument("--master", type=host_port_arg("--master"), default=None, metavar="HOST:PORT",
                    help="also check that this store master answers (default: not checked)")  # fmt: skip
    dr.add_argument("--etcd", default=None, metavar="URL", help="also check etcd (etcd://host:2379)")
    dr.add_argument("--redis", default=None, metavar="URL", help="also check redis (redis://host:6379)")
    dr.add_argument("--metadata", default=None, metavar="URL",
                    help="also check an HTTP metadata server (http://host:8080/metadata)")  # fmt: skip
    dr.add_argument("--secret", default=None, help="the master's secret (default: $KVPOOL_SECRET)")
    dr.add_argument("--timeout-s", type=number_arg("--timeout-s", float), default=3.0, metavar="SECONDS",
                    help="per server check (default 3)")  # fmt: skip
    dr.add_argument("--json", action="store_true", help="JSON list of {name, status, detail, fix}")
    dr.add_argument("--sysfs", default="/sys", help="sysfs root (default /sys)")
    dr.add_argument("--procfs", default="/proc", help="procfs root (default /proc)")
    dr.set_defaults(func=cmd_doctor)

    if conductor:
        from kvpool.conductor.cli import add_commands as _add_conductor_commands

        _add_conductor_commands(sub)  # simulate
    else:
        sub.add_parser("simulate", help="replay a trace through a simulated P/D cluster per policy")

    tp = sub.add_parser("topology", help="print the RDMA NIC topology matrix (Mooncake JSON format)")
    tp.add_argument("--sysfs", default="/sys", help="sysfs root to discover from (default /sys)")
    tp.add_argument("--file", default=None, help="read (and validate) this topology JSON instead")
    tp.add_argument("--devices", default=None, help="comma-separated NIC allow-list (default: all)")
    tp.add_argument("--json", action="store_true", help="compact JSON only")
    tp.set_defaults(func=cmd_topology)
    return ap


def _main(argv: list[str]) -> int:
    if argv[:1] == ["store-server"]:
        from kvpool.store import server

        return server.main(argv[1:])
    if argv[:1] == ["metadata-server"]:
        from kvpool.transfer import metadata_server

        return metadata_server.main(argv[1:])
    cmd = argv[0] if argv else ""
    light = cmd in LIGHT_COMMANDS
    args = build_parser(master_options=cmd == "master" or not light, conductor=not light).parse_args(argv)
    return int(args.func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpool`` command: errors become one line ``kvpool: Type: message`` and
    exit status 2 (usage) or 1 (runtime); ``--debug`` or ``KVPOOL_DEBUG=1`` shows tracebacks."""
    return run_main(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
