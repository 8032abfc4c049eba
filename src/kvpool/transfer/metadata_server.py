"""In-memory HTTP metadata server, shipped as ``kvpool metadata-server``.

It speaks Mooncake's HTTP metadata protocol at ``/metadata``:

* ``GET /metadata?key=K`` -> 200 with the stored bytes, or 404 when ``K`` is absent;
* ``PUT /metadata?key=K`` with a body -> 200, stores the body under ``K``;
* ``DELETE /metadata?key=K`` -> 200 when ``K`` was removed, 404 when it was absent.

A missing ``key`` gets 400, another path 404, a body over the size limit 413 and a ``PUT`` without a
length (neither ``Content-Length`` nor chunked encoding) 411.  Everything lives in one dict in memory, so
a restart forgets all descriptors; run one server per cluster and point
``metadata_url="http://HOST:PORT/metadata"`` at it.

Safety (issue 12): with ``secret`` (``--secret`` / ``KVPOOL_SECRET``) a ``PUT``/``DELETE`` must carry
``X-Kvpool-Auth: ts=..,nonce=..,mac=..`` (see :func:`kvpool.transfer.metadata.auth_header`; the secret
never travels, a header is good for one write within ``AUTH_WINDOW_S``), else 401 with nothing more
said. Without a secret anyone who reaches the port can write: trusted networks only. Reads stay open
(descriptors are signed by the engines themselves). Bounded: keys (``max_keys``), stored bytes
(``max_total_bytes``) -> 507; open connections in total and per client address -> 503 and close;
each request, the wait for it included, must complete within ``idle_timeout_s`` (a reaper thread
shuts down connections past it, so trickling a byte now and then does not keep one open).
Replies go out in one write with ``TCP_NODELAY`` (a keep-alive request used to wait ~40 ms for the
client's delayed ACK between the header and body writes).
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvpool.transfer.metadata import AUTH_HEADER, write_mac

__all__ = ["DEFAULT_MAX_BODY_BYTES", "METADATA_PATH", "MetadataServer", "main"]

#: Largest request body accepted; larger ones are refused with 413.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

#: Default bounds: keys, bytes stored, open connections (total, per client address), idle seconds.
DEFAULT_MAX_KEYS = 100_000
DEFAULT_MAX_TOTAL_BYTES = 1 << 30
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
DEFAULT_IDLE_TIMEOUT_S = 30.0

#: How far a signed write's timestamp may be from the server's clock, in seconds.
AUTH_WINDOW_S = 300

#: Path the protocol is served at.
METADATA_PATH = "/metadata"

# After refusing a body: how long and how many bytes to drain before closing the connection.
_LINGER_S = 2.0
_LINGER_MAX_BYTES = 64 * 1024 * 1024

_log = logging.getLogger(__name__)


class _BodyTooLarge(Exception):
    """The request body exceeds the server's limit."""


class _BadBody(Exception):
    """The request body is malformed (bad length or chunk framing)."""


class _Handler(BaseHTTPRequestHandler):
    """Request handler; the store lives on the server object."""

    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "kvpool-metadata"
    sys_version = ""
    wbufsize = -1  # buffered: status, headers and body leave in one write (flushed per request)
    _linger = False  # set when a reply went out before the request body was read

    def setup(self) -> None:
        """Per-connection idle timeout and no Nagle delay on replies."""
        self.timeout = self.server.idle_timeout_s
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle_one_request(self) -> None:
        """One request, waiting for it included, within ``idle_timeout_s`` as a whole: a client
        trickling a byte now and then (each resetting the socket timeout) is still cut off."""
        self.server.watch(self.connection)
        try:
            super().handle_one_request()
        finally:
            self.server.unwatch(self.connection)

    # -- helpers ---------------------------------------------------------------------------------------

    def log_message(self, format: str, *args: object) -> None:
        """Send the per-request access log to ``logging`` at debug level instead of stderr."""
        _log.debug("%s - %s", self.address_string(), format % args)

    def _reply(
        self,
        status: int,
        body: bytes = b"",
        content_type: str = "text/plain; charset=utf-8",
        close: bool = False,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _key(self) -> str | None:
        """Return the ``key`` query argument, or reply with an error and return ``None``."""
        parts = urllib.parse.urlsplit(self.path)
        if parts.path != METADATA_PATH:
            self._reply(404, f"unknown path {parts.path!r}; use {METADATA_PATH}?key=...\n".encode())
            return None
        values = urllib.parse.parse_qs(parts.query, keep_blank_values=True).get("key")
        if not values or not values[0]:
            self._reply(400, b"missing ?key= query argument\n")
            return None
        return values[0]

    def _read_body(self) -> bytes:
        limit = self.server.max_body_bytes
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked(limit)
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise _BadBody("length required")
        try:
            length = int(length_text)
        except ValueError:
            raise _BadBody(f"bad Content-Length {length_text!r}") from None
        if length < 0:
            raise _BadBody(f"bad Content-Length {length_text!r}")
        if length > limit:
            raise _BodyTooLarge()
        body = self.rfile.read(length)
        if len(body) != length:
            raise _BadBody("body shorter than Content-Length")
        return body

    def _read_chunked(self, limit: int) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BadBody("bad chunk size") from None
            if size < 0:
                raise _BadBody("bad chunk size")
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # skip trailers
                return b"".join(chunks)
            total += size
            if total > limit:
                raise _BodyTooLarge()
            data = self.rfile.read(size)
            if len(data) != size:
                raise _BadBody("truncated chunk")
            chunks.append(data)
            self.rfile.readline(1024)  # CRLF after the chunk data

    def _refuse_body(self, status: int, message: str) -> None:
        """Reply ``status`` without reading the body, then close (draining what the client still sends)."""
        self._linger = True
        self._reply(status, f"{message}\n".encode(), close=True)

    def finish(self) -> None:
        """Flush the reply; after a refused body, half-close and drain briefly so the client reads it.

        Closing a socket with unread data makes the kernel send a reset, which can destroy the reply
        before the client reads it; draining for a short while avoids that for ordinary clients.
        """
        super().finish()
        if not self._linger:
            return
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_LINGER_S)
            deadline = time.monotonic() + _LINGER_S
            drained = 0
            while time.monotonic() < deadline and drained < _LINGER_MAX_BYTES:
                data = self.connection.recv(1 << 16)
                if not data:
                    break
                drained += len(data)
        except OSError:
            pass

    def handle_expect_100(self) -> bool:
        """Refuse an announced oversized body with 413 before the client sends it (curl asks first)."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = 0
        if length > self.server.max_body_bytes:
            self._refuse_body(413, f"body larger than {self.server.max_body_bytes} bytes")
            return False
        return super().handle_expect_100()

    # -- methods ---------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        key = self._key()
        if key is None:
            return
        value = self.server.store_get(key)
        if value is None:
            self._reply(404, b"metadata not found\n")
        else:
            self._reply(200, value, content_type="application/octet-stream")

    def _authorized(self, key: str, body: bytes) -> bool:
        """True when the write carries a fresh, unused proof of the secret (or there is no secret);
        otherwise replies 401 (saying only that a valid proof is needed) and returns False."""
        if self.server.check_write(self.command, key, body, self.headers.get(AUTH_HEADER, "")):
            return True
        self._reply(401, b"write refused: a valid X-Kvpool-Auth proof of the cluster secret is required\n")
        return False

    def do_PUT(self) -> None:
        key = self._key()
        if key is None:
            self._linger = True  # the body was not read
            self.close_connection = True
            return
        try:
            body = self._read_body()
        except _BodyTooLarge:
            self._refuse_body(413, f"body larger than {self.server.max_body_bytes} bytes")
            return
        except _BadBody as exc:
            self._refuse_body(411 if str(exc) == "length required" else 400, str(exc))
            return
        if not self._authorized(key, body):
            return
        refused = self.server.store_put(key, body)
        if refused:
            self._reply(507, f"{refused}\n".encode())
            return
        self._reply(200, b"metadata updated\n")

    def do_DELETE(self) -> None:
        key = self._key()
        if key is None:
            return
        if not self._authorized(key, b""):
            return
        if self.server.store_delete(key):
            self._reply(200, b"metadata deleted\n")
        else:
            self._reply(404, b"metadata not found\n")


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer holding the store and its lock."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], max_body_bytes: int, limits: dict[str, Any]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.max_body_bytes = max_body_bytes
        self.secret: str | None = limits["secret"] or None
        self.max_keys: int = limits["max_keys"]
        self.max_total_bytes: int = limits["max_total_bytes"]
        self.max_connections: int = limits["max_connections"]
        self.max_per_client: int = limits["max_connections_per_client"]
        self.idle_timeout_s: float = limits["idle_timeout_s"]
        self._store: dict[str, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._conns: dict[str, int] = {}
        self._open = 0
        self._nonces: dict[str, float] = {}  # nonce -> when it expires (replay window)
        self._deadlines: dict[socket.socket, float] = {}  # connection -> end of its current request
        self._closing = threading.Event()
        super().__init__(address, _Handler)
        self._reaper = threading.Thread(target=self._reap, name="kvpool-metadata-reaper", daemon=True)
        self._reaper.start()

    # -- whole-request deadlines -------------------------------------------------------------------------

    def watch(self, conn: socket.socket) -> None:
        with self._lock:
            self._deadlines[conn] = time.monotonic() + self.idle_timeout_s

    def unwatch(self, conn: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(conn, None)

    def _reap(self) -> None:
        """Shut down connections whose request (or the wait for it) overran its deadline."""
        while not self._closing.wait(min(0.5, self.idle_timeout_s / 4)):
            now = time.monotonic()
            with self._lock:
                late = [c for c, t in self._deadlines.items() if t <= now]
                for c in late:
                    del self._deadlines[c]
            for c in late:
                try:
                    c.shutdown(socket.SHUT_RDWR)  # the handler's blocked read returns; it closes
                except OSError:
                    pass

    # -- connection bounds ----------------------------------------------------------------------------

    def process_request(self, request: Any, client_address: Any) -> None:
        """Start a handler thread only under the connection bounds; otherwise 503 and close."""
        peer = str(client_address[0])
        with self._lock:
            ok = self._open < self.max_connections and self._conns.get(peer, 0) < self.max_per_client
            if ok:
                self._open += 1
                self._conns[peer] = self._conns.get(peer, 0) + 1
        if not ok:
            try:
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(peer)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(str(client_address[0]))

    def _release(self, peer: str) -> None:
        with self._lock:
            self._open -= 1
            n = self._conns.get(peer, 0) - 1
            if n > 0:
                self._conns[peer] = n
            else:
                self._conns.pop(peer, None)

    # -- authentication --------------------------------------------------------------------------------

    def check_write(self, method: str, key: str, body: bytes, header: str) -> bool:
        """Whether a write may proceed: no secret configured, or a fresh unused valid proof."""
        if self.secret is None:
            return True
        try:
            fields = dict(part.split("=", 1) for part in header.split(","))
            ts, nonce, mac = fields["ts"], fields["nonce"], fields["mac"]
            when = int(ts)
        except (KeyError, ValueError):
            return False
        now = time.time()
        if abs(now - when) > AUTH_WINDOW_S or not 8 <= len(nonce) <= 64:
            return False
        if not hmac.compare_digest(
            mac.encode(), write_mac(self.secret, method, key, ts, nonce, body).encode()
        ):
            return False
        with self._lock:
            if len(self._nonces) > 100_000:
                self._nonces = {n: t for n, t in self._nonces.items() if t > now}
            if nonce in self._nonces:
                return False  # replayed
            self._nonces[nonce] = now + 2 * AUTH_WINDOW_S
        return True

    # -- store -----------------------------------------------------------------------------------------

    def store_get(self, key: str) -> bytes | None:
        with self._lock:
            return self._store.get(key)

    def store_put(self, key: str, value: bytes) -> str | None:
        """Store; returns why not (a bound) or None."""
        with self._lock:
            old = self._store.get(key)
            if old is None and len(self._store) >= self.max_keys:
                return f"too many keys (limit {self.max_keys}); delete stale segments or raise --max-keys"
            grown = self._bytes - (len(old) if old is not None else 0) + len(value)
            if grown > self.max_total_bytes:
                return f"store full (limit {self.max_total_bytes} bytes); delete stale segments or raise it"
            self._store[key] = value
            self._bytes = grown
        return None

    def store_delete(self, key: str) -> bool:
        with self._lock:
            old = self._store.pop(key, None)
            if old is None:
                return False
            self._bytes -= len(old)
            return True

    def server_close(self) -> None:
        self._closing.set()
        super().server_close()

    def handle_error(self, request: object, client_address: object) -> None:
        """Log handler crashes (e.g. a client hanging up mid-request) at debug level, not on stderr."""
        _log.debug("error while serving %s", client_address, exc_info=True)


class MetadataServer:
    """Mooncake-compatible HTTP metadata server holding descriptors in memory.

    ``MetadataServer(port=0)`` binds a free port at construction; :attr:`url` gives the metadata URL to
    hand to clients.  Use :meth:`start` / :meth:`stop` to run it on a background thread (also as a
    context manager), or :meth:`serve_forever` to run it on the calling thread.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        *,
        secret: str | None = None,
        max_keys: int = DEFAULT_MAX_KEYS,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self.host = host
        if max_body_bytes < 0:
            raise ValueError(f"max_body_bytes must be >= 0, got {max_body_bytes}")
        limits = dict(
            secret=secret,
            max_keys=max_keys,
            max_total_bytes=max_total_bytes,
            max_connections=max_connections,
            max_connections_per_client=max_connections_per_client,
            idle_timeout_s=idle_timeout_s,
        )
        for k, v in limits.items():
            if k != "secret" and not v > 0:
                raise ValueError(f"{k} must be positive, got {v!r}")
        self._server = _Server((host, port), max_body_bytes, limits)
        self._thread: threading.Thread | None = None
        self._serving = threading.Event()
        self._closed = False

    @property
    def port(self) -> int:
        """The TCP port actually bound."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """Metadata URL for clients, e.g. ``http://127.0.0.1:8080/metadata``."""
        host = self.host
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}{METADATA_PATH}"

    def start(self) -> MetadataServer:
        """Serve on a daemon thread and return ``self``; starting a running or stopped server fails."""
        if self._thread is not None or self._serving.is_set() or self._closed:
            raise RuntimeError("metadata server already started or stopped; create a new one")
        self._serving.set()
        self._thread = threading.Thread(target=self._run, name="kvpool-metadata-server", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._server.serve_forever()
        finally:
            self._serving.clear()

    def serve_forever(self) -> None:
        """Serve on the calling thread until :meth:`stop` is called from another thread."""
        if self._thread is not None or self._serving.is_set() or self._closed:
            raise RuntimeError("metadata server already started or stopped; create a new one")
        self._serving.set()
        try:
            self._run()
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop serving and release the port.  Safe to call more than once, from any thread."""
        if self._serving.is_set():
            self._server.shutdown()  # returns once serve_forever has left its loop
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if not self._closed:
            self._closed = True
            self._server.server_close()

    def __enter__(self) -> MetadataServer:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvpool metadata-server``: serve until interrupted, return the exit status."""
    from kvpool.cli_errors import CliParser, port_arg

    parser = CliParser(
        prog="kvpool metadata-server",
        description="In-memory HTTP metadata server (Mooncake protocol) for kvpool segment descriptors.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; use 0.0.0.0 to serve other hosts)",
    )
    parser.add_argument(
        "--port", type=port_arg("--port"), default=8080, help="TCP port to bind (default 8080; 0 = any)"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest descriptor accepted, in bytes (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--secret",
        default=os.environ.get("KVPOOL_SECRET"),
        help="cluster secret: writes must prove it (default $KVPOOL_SECRET; none = trusted network only)",
    )
    parser.add_argument("--max-keys", type=int, default=DEFAULT_MAX_KEYS, help="most descriptors stored")
    parser.add_argument(
        "--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, help="open connections"
    )
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="close a connection idle this long",
    )
    args = parser.parse_args(argv)
    if args.max_body_bytes < 0:
        parser.error("--max-body-bytes must be >= 0")
    try:
        server = MetadataServer(
            args.host,
            args.port,
            args.max_body_bytes,
            secret=args.secret,
            max_keys=args.max_keys,
            max_connections=args.max_connections,
            idle_timeout_s=args.idle_timeout_s,
        )
    except OSError as exc:
        print(
            f"kvpool: {type(exc).__name__}: metadata-server cannot bind {args.host}:{args.port}: "
            f"{exc.strerror or exc}; "
            f"pick another --port or stop what is using it",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print(f"kvpool metadata server listening on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
