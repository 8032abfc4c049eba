"""``kvpool proxy``: run a :class:`kvpool.connectors.proxy.PDProxy` in the foreground until SIGTERM or
SIGINT (:func:`run_proxy`; :func:`main` for the command line)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from kvpool.connectors.proxy import PDProxy

__all__ = ["main", "run_proxy"]


async def _serve(proxy: PDProxy, host: str, port: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / not supported
            pass
    try:
        bound = await proxy.start(host, port)
    except OSError as exc:
        print(
            f"kvpool: {type(exc).__name__}: proxy cannot bind {host}:{port}: {exc.strerror or exc}; "
            "pick another --port or stop what is using it",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print(
        json.dumps(
            {
                "ready": True,
                "host": host,
                "port": bound,
                "prefill": [b.url for b in proxy.prefill.backends] if not proxy.aggregated else [],
                "decode": [b.url for b in proxy.decode.backends] if not proxy.aggregated else [],
                "backends": [b.url for b in proxy.prefill.backends] if proxy.aggregated else [],
                "policy": proxy.router.policy.name if proxy.router is not None else "round-robin",
            }
        ),
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await proxy.close()
    return 0


def run_proxy(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    timeout_s: float = 300.0,
    health_interval_s: float = 5.0,
    connect_timeout_s: float = 10.0,
    max_connections: int = 1024,
    router: Any = None,
    stream_kv: bool = False,
) -> int:
    """Run a :class:`PDProxy` until SIGTERM/SIGINT; return the exit status (1 when it cannot bind).

    Prints one JSON line ``{"ready": true, "host": ..., "port": N, ...}`` once it is listening.
    """
    proxy = PDProxy(
        prefill_urls,
        decode_urls,
        timeout_s=timeout_s,
        connect_timeout_s=connect_timeout_s,
        health_interval_s=health_interval_s,
        max_connections=max_connections,
        router=router,
        stream_kv=stream_kv,
    )
    return asyncio.run(_serve(proxy, host, port))


def main(args: argparse.Namespace) -> int:
    """Run ``kvpool proxy`` with the namespace parsed by ``kvpool.cli`` (prefill, decode or backends,
    host, port, timeouts, max_connections, log_level, and the router flags of
    :func:`kvpool.conductor.cli.add_proxy_options`)."""
    from kvpool.conductor.cli import router_config

    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    backends = getattr(args, "backends", None)
    if backends and (args.prefill or args.decode):
        print("kvpool: UsageError: proxy: give --backends (aggregated) or --prefill and --decode, not both",
              file=sys.stderr)  # fmt: skip
        return 2
    if not backends and not (args.prefill and args.decode):
        print("kvpool: UsageError: proxy: give --prefill URL... and --decode URL..., or --backends URL...",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        router = router_config(args, n_instances=len(backends or args.prefill or []))
        return run_proxy(
            backends or args.prefill,
            [] if backends else args.decode,
            host=args.host,
            port=args.port,
            timeout_s=args.timeout_s,
            health_interval_s=args.health_interval_s,
            connect_timeout_s=args.connect_timeout_s,
            max_connections=args.max_connections,
            router=router,
            stream_kv=bool(getattr(args, "stream_kv", False)),
        )
    except ValueError as exc:
        print(f"kvpool: InvalidArgument: proxy: {exc}", file=sys.stderr)
        return 2
