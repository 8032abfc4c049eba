"""What the metadata backends share: an HTTP/1.1 client with an overall deadline
(:class:`HttpClient`, used by :class:`~kvpool.transfer.metadata.HttpMetadata` and
:class:`~kvpool.transfer.metadata_etcd.EtcdMetadata`), the argument checks of every backend
(:func:`check_name`, :func:`check_value`) and the few words an error message gives a network
failure (:func:`failure_reason`).
"""

from __future__ import annotations

import base64
import http.client
import socket
import threading
import time
import urllib.error
import urllib.parse

from kvpool._urls import redact_url
from kvpool.errors import InvalidArgument

__all__ = ["MAX_VALUE_BYTES", "HttpClient", "Response", "check_name", "check_value", "failure_reason"]

#: Largest descriptor a backend will read back; anything bigger is treated as a bad answer.
MAX_VALUE_BYTES = 64 * 1024 * 1024

_READ_CHUNK = 256 * 1024


def check_name(name: object) -> str:
    """Return ``name`` if it is a usable segment name, else raise :class:`InvalidArgument`."""
    if not isinstance(name, str):
        raise InvalidArgument(f"segment name must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidArgument("segment name must not be empty")
    return name


def check_value(value: object) -> bytes:
    """Return ``value`` as :class:`bytes`, raising :class:`InvalidArgument` for non-bytes-like values."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgument(f"descriptor value must be bytes, got {type(value).__name__}")


def failure_reason(exc: BaseException) -> str:
    """Describe a network exception in a few words, unwrapping :class:`urllib.error.URLError`."""
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        inner = exc.reason
        if isinstance(inner, BaseException):
            return failure_reason(inner)
        return str(inner)
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Response:
    """Status and body of an HTTP exchange, whatever the status code."""

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body


class HttpClient:
    """A small HTTP/1.1 client with an overall deadline, no environment proxies and bounded reads.

    The whole exchange -- connect, request, status line, headers and body -- ends about
    ``timeout_s`` after it started, however the server trickles its answer: each blocking socket
    operation is limited by the time left, and a watchdog shuts the socket down at the deadline
    (a per-recv timeout alone restarts with every byte of a header). Metadata servers live on the
    cluster network: an ``http_proxy`` meant for the internet would only get in the way, so
    environment proxies are deliberately not used.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def request(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        """Perform one request, whatever its status; raise ``OSError``/``HTTPException`` on trouble
        (``TimeoutError`` past the deadline).

        ``timeout_s`` overrides the client's budget for this call (callers sharing one budget over
        several attempts pass what is left of it).
        """
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {redact_url(url)}")
        all_headers = {"Content-Type": "application/octet-stream"} if body is not None else {}
        if parts.username is not None:  # http://user:password@host/...
            cred = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            all_headers["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        all_headers.update(headers or {})
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname, parts.port, timeout=budget)
        watchdog = threading.Timer(budget, _shut_down, (conn,))
        watchdog.daemon = True
        watchdog.start()
        try:
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request(method, path, body=body, headers=all_headers)
            resp = conn.getresponse()
            return Response(int(resp.status), self._read_body(resp, deadline))
        except (OSError, http.client.HTTPException):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no whole answer within {budget:g} s") from None
            raise
        finally:
            watchdog.cancel()
            conn.close()

    def _read_body(self, resp: http.client.HTTPResponse, deadline: float) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("timed out while reading the answer")
            _set_read_timeout(resp, remaining)
            chunk = resp.read1(_READ_CHUNK)  # at most one recv, so the deadline is checked often
            if not chunk:
                if time.monotonic() >= deadline:  # the watchdog ended it: not the whole answer
                    raise TimeoutError("timed out while reading the answer")
                if resp.length:  # fewer bytes than Content-Length said
                    raise http.client.IncompleteRead(b"".join(chunks), resp.length)
                return b"".join(chunks)
            total += len(chunk)
            if total > MAX_VALUE_BYTES:
                raise http.client.HTTPException(f"answer larger than {MAX_VALUE_BYTES} bytes")
            chunks.append(chunk)


def _shut_down(conn: http.client.HTTPConnection) -> None:
    """The deadline watchdog of :class:`HttpClient`: whatever the exchange waits for ends now."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _set_read_timeout(resp: http.client.HTTPResponse, remaining: float) -> None:
    """Shrink the socket timeout under ``resp`` to ``remaining`` seconds when it can be reached."""
    sock = getattr(getattr(resp.fp, "raw", None), "_sock", None)
    if isinstance(sock, socket.socket):
        try:
            sock.settimeout(max(remaining, 0.001))
        except OSError:
            pass
