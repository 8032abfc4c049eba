"""Prometheus text-format metrics of the store master, served over HTTP (``/metrics``)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from kvpool.store.master import Master


class MasterCollector:
    """Reads a consistent snapshot of the master on every scrape."""

    def __init__(self, master: Master) -> None:
        self.master = master

    def collect(self) -> Any:
        """Yield metric families."""
        s = self.master.snapshot()
        c = s["counters"]
        yield GaugeMetricFamily("kvpool_objects", "Committed objects", value=s["objects"])
        yield GaugeMetricFamily("kvpool_pending_puts", "Uncommitted puts", value=s["pending"])
        yield GaugeMetricFamily("kvpool_object_bytes", "Bytes held by object replicas", value=s["bytes"])
        yield GaugeMetricFamily("kvpool_capacity_bytes", "Bytes of all mounted segments", value=s["capacity"])
        yield GaugeMetricFamily("kvpool_used_bytes", "Allocated bytes in all segments", value=s["used"])
        yield GaugeMetricFamily("kvpool_clients", "Live clients", value=s["clients"])
        yield GaugeMetricFamily(
            "kvpool_fenced_allocations", "Allocations held until their writer can no longer write",
            value=s["fenced"],
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kvpool_max_request_seconds", "Longest request the master handled", value=s["max_request_s"]
        )
        for name, help_text in (
            ("hits", "Gets that found the object"),
            ("misses", "Gets that did not"),
            ("evictions", "Objects evicted from memory"),
            ("puts", "Committed puts"),
            ("spills", "Objects spilled to the SSD tier"),
            ("hot_replications", "Replicas added by the hot-key policy"),
            ("objects_lost", "Objects lost with their last replica"),
            ("clients_dead", "Clients declared dead (missed heartbeats)"),
            ("segments_reported", "Segments a reader reported unreachable"),
            ("replicas_corrupt", "Replicas dropped because their bytes failed the checksum"),
            ("master_stalls", "Times the master itself did not run for over a second"),
        ):
            yield CounterMetricFamily(f"kvpool_{name}", help_text, value=c.get(name, 0))
        yield CounterMetricFamily(
            "kvpool_puts_revoked", "Puts revoked after put_timeout_s", value=c.get("put_revoked_timeout", 0)
        )
        used = GaugeMetricFamily(
            "kvpool_segment_used_bytes", "Allocated bytes per segment", labels=["segment"]
        )
        size = GaugeMetricFamily("kvpool_segment_size_bytes", "Size per segment", labels=["segment"])
        frag = GaugeMetricFamily(
            "kvpool_segment_fragmentation", "1 - largest free / free", labels=["segment"]
        )
        for name, seg in s["segments"].items():
            used.add_metric([name], seg["used"])
            size.add_metric([name], seg["size"])
            frag.add_metric([name], seg["fragmentation"])
        yield used
        yield size
        yield frag
        calls = CounterMetricFamily("kvpool_rpc_calls", "RPCs handled", labels=["op"])
        secs = CounterMetricFamily("kvpool_rpc_seconds", "Time spent handling RPCs", labels=["op"])
        for op, (n, t) in s["rpc"].items():
            calls.add_metric([op], n)
            secs.add_metric([op], t)
        yield calls
        yield secs


def start_metrics_server(master: Master, host: str, port: int) -> tuple[ThreadingHTTPServer, int]:
    """Serve ``/metrics`` for ``master`` on ``host:port`` (0 = free port); returns (server, port)."""
    registry = CollectorRegistry()
    registry.register(MasterCollector(master))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvpool-metrics", daemon=True).start()
    return server, server.server_address[1]
