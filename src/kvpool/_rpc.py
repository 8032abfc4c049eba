"""RPC: length-prefixed msgpack frames over TCP, authenticated, with bounded buffers and deadlines.

Shared by the store master, the connectors' side channels and RDMA handshakes. Plain sockets
rather than zmq: a zmq round trip crosses two I/O threads per side (27 µs measured here) where a
socket round trip costs 12 µs, and a put takes a round trip.

Wire: every message is a frame ``u32 little-endian length | msgpack body``.

Connection setup (challenge–response; the secret never travels)::

    server -> {"kvpool": 1, "nonce": 32 bytes, "auth": bool, "instance": int, "idle_s": float,
               "max_message": int}
    client -> {"cnonce": 32 bytes, "mac": HMAC-SHA256(secret, "kvpool-rpc-client" | nonce | cnonce) | None}
    server -> {"ok": True, "mac": HMAC-SHA256(secret, "kvpool-rpc-server" | cnonce | nonce) | None}
              or {"ok": False, "err": "AUTH", "msg": "wrong secret ..."} and the connection closes

The secret is any string (UTF-8 encoded for the MAC). Both sides prove they know it; a client
with a secret refuses a server without one and the other way round. Until the handshake is done a
connection may send at most ``PRE_AUTH_MAX`` bytes and must finish within ``handshake_timeout_s``.

Requests ``{"op": str, "id": int, ...}``; replies ``{"id": int, "ok": True, ...}`` or
``{"id": int, "ok": False, "err": CODE, "msg": str}``. A request with ``"oneway": True`` gets no
reply. Per-key results of batch calls are ``[CODE | None, value]`` pairs.

This module: the wire format, the handshake's MACs and :class:`RpcClient`. The server side
(:class:`~kvpool._rpc_server.RpcServer`, its bounds :class:`~kvpool._rpc_server.RpcLimits`) is in
:mod:`kvpool._rpc_server`.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

from kvpool import errors

log = logging.getLogger("kvpool.rpc")

VERSION = 1
PRE_AUTH_MAX = 4096  # bytes a connection may send before it has authenticated
RECV_CHUNK = 64 << 10  # small: recv(n) allocates n bytes up front
_LEN = struct.Struct("<I")
_TIMEVAL = struct.Struct("@ll")


class UnknownClient(errors.MasterUnavailable):
    """The master does not know this client (it restarted, or declared us dead): register again."""


# Error codes carried on the wire -> typed errors.
ERRORS: dict[str, type[errors.KvpoolError]] = {
    "NOT_FOUND": errors.ObjectNotFound,
    "EXISTS": errors.ObjectExists,
    "BUSY": errors.ObjectBusy,
    "FULL": errors.StoreFull,
    "AUTH": errors.AuthenticationError,
    "INVALID": errors.InvalidArgument,
    "TOO_LARGE": errors.BatchTooLarge,
    "STALE": errors.Fenced,
    "UNAVAILABLE": errors.MasterUnavailable,
    "UNKNOWN_CLIENT": UnknownClient,
    "ERROR": errors.StoreError,
}


def raise_for(code: str, msg: str) -> None:
    """Raise the typed error for a wire error code."""
    raise ERRORS.get(code, errors.StoreError)(msg)


_packers = threading.local()  # one msgpack.Packer per thread: packb makes (and frees) one per call


def pack(obj: Any) -> bytes:
    """msgpack encode."""
    try:
        packer = _packers.p
    except AttributeError:
        packer = _packers.p = msgpack.Packer(use_bin_type=True)
    try:
        return packer.pack(obj)
    except BaseException:
        packer.reset()  # a failed pack may leave a partial body behind (autoreset only on success)
        raise


def unpack(data: bytes | bytearray | memoryview) -> Any:
    """msgpack decode (strings as str, binaries as bytes)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def frame(obj: Any) -> bytes:
    """One wire frame: length prefix + msgpack body."""
    body = pack(obj)
    return _LEN.pack(len(body)) + body


def _key(secret: str) -> bytes:
    return secret.encode("utf-8", "surrogatepass")


def client_mac(secret: str, nonce: bytes, cnonce: bytes) -> bytes:
    """The client's proof of the secret for this connection's nonces."""
    return hmac.new(_key(secret), b"kvpool-rpc-client" + nonce + cnonce, hashlib.sha256).digest()


def server_mac(secret: str, nonce: bytes, cnonce: bytes) -> bytes:
    """The server's proof of the secret (the client checks it: mutual authentication)."""
    return hmac.new(_key(secret), b"kvpool-rpc-server" + cnonce + nonce, hashlib.sha256).digest()


def _complete(buf: bytearray) -> bool:
    """Whether ``buf`` starts with a whole frame."""
    return len(buf) >= 4 and len(buf) >= 4 + _LEN.unpack_from(buf)[0]


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise errors.InvalidArgument(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _looks_like_hello(data: bytes) -> bool:
    """Whether ``data`` can be the start of a kvpool hello: a length prefix within the pre-auth
    limit followed by a msgpack map."""
    if len(data) < 5:
        return True  # too little to tell
    n = _LEN.unpack_from(data)[0]
    return 0 < n <= PRE_AUTH_MAX and (0x80 <= data[4] <= 0x8F or data[4] in (0xDE, 0xDF))


def _probe_http(target: tuple[str, int], timeout_s: float) -> bytes | None:
    """What ``target`` sends back on a new connection that sends an HTTP request: its first bytes,
    b"" when it closes the connection without a word, None when it says nothing within
    ``timeout_s``. A kvpool RPC server sends its binary hello first (and then drops this one)."""
    try:
        with socket.create_connection(target, timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return s.recv(64)
    except TimeoutError:
        return None
    except ConnectionError:
        return b""
    except OSError:
        return None


class RpcClient:
    """One TCP connection to an RPC server; thread-safe (one call in flight), re-made after errors.

    ``on_connect(hello)`` (optional) runs after every successful handshake with the server's hello
    (its ``instance`` tells a restarted server from the old one); it may raise to refuse it.
    ``bind()`` (optional) returns the arguments of an ``attach`` request sent on every new
    connection before any call (None: nothing to attach), e.g. a session this connection joins.
    ``what`` names the server in error messages. ``reconnect``: a call whose reused connection
    turns out dead (closed or reset by the server before its reply: the server restarted on that
    address) is sent once more on a new connection, within the same deadline; only for requests
    whose repetition is harmless (read-only, or fenced by the server's instance), never after a
    timeout.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float,
        secret: str | None = None,
        *,
        on_connect: Callable[[dict[str, Any]], None] | None = None,
        bind: Callable[[], dict[str, Any] | None] | None = None,
        what: str = "RPC server",
        reconnect: bool = False,
    ) -> None:
        self.address = address
        self.reconnect = reconnect
        self._target = _split(address)
        self.timeout_s = timeout_s
        self.secret = secret
        self.what = what
        self.on_connect = on_connect
        self.bind = bind
        self._bound: dict[str, Any] | None = None  # what this connection is attached to
        self.hello: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._rbuf = bytearray()
        self._last_io = 0.0
        self._tmo = 0.0  # the socket's timeout as last set (see _deadline)
        self._kernel = False  # whether the kernel keeps it (after the handshake) or Python does

    # ------------------------------------------------------------------ connection
    def _unavailable(self, detail: str) -> errors.KvpoolError:
        return errors.MasterUnavailable(f"{self.what} at {self.address} {detail}")

    def _socket(self, deadline: float) -> socket.socket:
        sock = self._sock
        if sock is not None and self.bind is not None and self.bind() != self._bound:
            self._reset()  # the session changed (e.g. registered again): attach a new connection
            sock = None
        if sock is not None:
            idle = time.monotonic() - self._last_io
            if idle > self.hello.get("idle_s", 600.0) / 2 or (idle > 1.0 and self._peer_closed(sock)):
                self._reset()  # the server reaps idle connections: do not send into a closed one
                sock = None
        if sock is None:
            sock = self._connect(deadline)
        return sock

    @staticmethod
    def _peer_closed(sock: socket.socket) -> bool:
        """Whether the server hung up on this (idle) connection: readable with nothing to read."""
        try:
            if not select.select([sock], [], [], 0)[0]:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _connect(self, deadline: float) -> socket.socket:
        try:
            tmo = max(0.001, deadline - time.monotonic())
            s = socket.create_connection(self._target, timeout=tmo)
            self._tmo = tmo
        except OSError as exc:
            raise self._unavailable(f"is not reachable ({exc}); is it running?") from None
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = s
        self._rbuf = bytearray()
        try:
            hello = self._recv_hello(deadline)
            if not isinstance(hello, dict) or hello.get("kvpool") != VERSION:
                raise errors.ProtocolError(f"{self.address} is not a kvpool RPC server (version 1)")
            nonce = bytes(hello.get("nonce") or b"")
            cnonce = os.urandom(32)
            if hello.get("auth") and not self.secret:
                raise errors.AuthenticationError(
                    f"{self.what} at {self.address} requires a secret: configure the same secret here"
                )
            if not hello.get("auth") and self.secret:
                raise errors.AuthenticationError(
                    f"{self.what} at {self.address} runs without a secret but this side has one: "
                    "configure the same secret on both sides"
                )
            mac = client_mac(self.secret, nonce, cnonce) if self.secret else None
            self._sendall(frame({"cnonce": cnonce, "mac": mac}))
            reply = self._recv(deadline, PRE_AUTH_MAX)
            if not isinstance(reply, dict) or not reply.get("ok"):
                msg = reply.get("msg", "refused") if isinstance(reply, dict) else "refused"
                raise errors.AuthenticationError(f"{self.what} at {self.address}: {msg}")
            if self.secret and not hmac.compare_digest(
                bytes(reply.get("mac") or b""), server_mac(self.secret, nonce, cnonce)
            ):
                raise errors.AuthenticationError(
                    f"{self.what} at {self.address} could not prove it knows the secret: wrong secret "
                    "on the server side, or not the server you meant"
                )
            self.hello = hello
            if self.on_connect is not None:
                self.on_connect(hello)
            attach = self.bind() if self.bind is not None else None
            self._bound = attach
            if attach is not None:
                self._sendall(frame({**attach, "op": "attach", "id": 0}))
                reply = self._recv(deadline, 1 << 20)
                if not isinstance(reply, dict) or not reply.get("ok"):
                    r = reply if isinstance(reply, dict) else {}
                    raise_for(r.get("err", "ERROR"), r.get("msg", "attach refused"))
            self._kernel_timeouts(s, deadline)
        except errors.KvpoolError:
            self._reset()
            raise
        except (OSError, ValueError) as exc:
            self._reset()
            if isinstance(exc, TimeoutError):
                what = f"did not answer the handshake within {self.timeout_s:g}s (the RPC timeout)"
            elif isinstance(exc, ConnectionError):
                what = f"closed the connection during the handshake ({exc}): is it a kvpool master?"
            else:
                raise errors.ProtocolError(
                    f"{self.what} at {self.address} answered with something that is not kvpool RPC "
                    f"({exc}): not a kvpool master (a transfer engine or another service?); check the "
                    "address (the master's RPC port, default 50051)"
                ) from None
            raise self._unavailable(f"{what}; check the address and that it is running") from None
        return s

    def _recv_hello(self, deadline: float) -> Any:
        """The server's hello. A server that says nothing for a moment is probed on a second
        connection: an HTTP server (etcd, a metadata server, vLLM...) is refused at once rather
        than after the whole timeout."""
        quick = min(deadline, time.monotonic() + 0.3)
        try:
            return self._recv(quick, PRE_AUTH_MAX)
        except TimeoutError:
            if quick >= deadline:
                raise
        answer = _probe_http(self._target, min(1.0, max(0.001, deadline - time.monotonic())))
        if answer == b"":
            raise errors.ProtocolError(
                f"{self.what} at {self.address} sends no kvpool hello and closes connections: it is "
                "not a kvpool master (a transfer engine or another service?) or one at its "
                "connection limit; check the address (the master's RPC port, default 50051)"
            )
        if answer is not None and answer.startswith(b"HTTP/"):
            first = answer.split(b"\r\n", 1)[0].decode("latin-1")
            raise errors.ProtocolError(
                f"{self.what} at {self.address} is an HTTP server ({first!r}), not a kvpool master: "
                "check the address (the master's RPC port, default 50051)"
            )
        if answer and not _looks_like_hello(answer):
            raise errors.ProtocolError(
                f"{self.what} at {self.address} answered {answer[:24]!r}: not a kvpool master; check "
                "the address (the master's RPC port, default 50051)"
            )
        return self._recv(deadline, PRE_AUTH_MAX)

    def _kernel_timeouts(self, sock: socket.socket, deadline: float) -> None:
        """After the handshake: a blocking socket whose timeouts the kernel keeps (SO_RCVTIMEO,
        SO_SNDTIMEO), so that a call is one send and one receive system call, without the poll
        that Python's own socket timeout adds before each (see _deadline)."""
        sock.settimeout(None)
        self._kernel = True
        self._tmo = 0.0
        self._deadline(sock, deadline)

    def _deadline(self, sock: socket.socket, deadline: float) -> None:
        """Make the socket's timeout end at ``deadline`` or up to a tenth of the time left before
        it (never after it), without a system call per request: the timeout is set again only
        when it falls outside that band (a timeout that fires early is retried by _recv)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        if not 0.9 * left <= self._tmo <= left:
            if self._kernel:
                sec = int(left)
                tv = _TIMEVAL.pack(sec, max(1, int((left - sec) * 1e6)))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            else:
                sock.settimeout(left)
            self._tmo = left

    def _sendall(self, data: bytes, deadline: float | None = None) -> None:
        assert self._sock is not None
        if deadline is not None:
            self._deadline(self._sock, deadline)
        try:
            self._sock.sendall(data)
        except BlockingIOError:
            raise TimeoutError("send timed out") from None  # SO_SNDTIMEO (see _kernel_timeouts)
        self._last_io = time.monotonic()

    def _recv(self, deadline: float, limit: int) -> Any:
        """Read one frame (at most ``limit`` bytes of body) before ``deadline``."""
        sock = self._sock
        assert sock is not None
        buf = self._rbuf
        need = 4
        while True:
            if len(buf) >= 4:
                n = _LEN.unpack_from(buf)[0]
                if n > limit:
                    raise ValueError(f"reply of {n} bytes exceeds the limit of {limit}")
                need = 4 + n
                if len(buf) >= need:
                    body = buf[4:need]
                    del buf[:need]
                    self._last_io = time.monotonic()
                    return unpack(body)
            self._deadline(sock, deadline)
            try:
                data = sock.recv(max(RECV_CHUNK, need - len(buf)))
            except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO fired
                if time.monotonic() < deadline:
                    self._tmo = 0.0  # fired early (inside the band): wait for the rest
                    continue
                raise TimeoutError("receive timed out") from None
            if not data:
                raise ConnectionResetError("connection closed by the server")
            buf += data

    # ------------------------------------------------------------------ calls
    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; typed error on failure or timeout."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            rid = next(self._ids)
            args["op"] = op
            args["id"] = rid
            old = self._sock
            sock = self._socket(deadline)
            retry = self.reconnect and sock is old  # a dead reused connection is made again once
            while True:
                data = self._frame(args)
                try:
                    self._sendall(data, deadline)
                    reply = self._reply(sock, rid, deadline)
                    break
                except (OSError, ValueError) as exc:
                    self._reset()
                    if retry and isinstance(exc, ConnectionError):
                        retry = False
                        log.debug("%s at %s closed a reused connection (%s): connecting again",
                                  self.what, self.address, exc)  # fmt: skip
                        sock = self._connect(deadline)
                        continue
                    what = (
                        f"did not answer {op!r} within {self.timeout_s:g}s (the RPC timeout)"
                        if isinstance(exc, TimeoutError)
                        else f"failed {op!r} ({exc})"
                    )
                    raise self._unavailable(f"{what}; is it running?") from None
        if not reply.get("ok"):
            raise_for(reply.get("err", "ERROR"), reply.get("msg", "error"))
        return reply

    @staticmethod
    def _answers(reply: Any, rid: int) -> bool:
        """Whether ``reply`` ends the call ``rid``: its reply, or the server refusing the stream
        (e.g. a message over its limit). Replies to other ids (an abandoned call) are skipped."""
        if not isinstance(reply, dict):
            return False
        got = reply.get("id")
        return got == rid or (got is None and not reply.get("ok", True))

    def _reply(self, sock: socket.socket, rid: int, deadline: float) -> dict[str, Any]:
        """The reply to call ``rid``. The common case, nothing buffered and the whole reply in
        one receive, is one recv and one decode; anything else goes through :meth:`_recv`."""
        if not self._rbuf:
            try:
                data: bytes | None = sock.recv(RECV_CHUNK)  # the timeout _sendall set holds
            except (TimeoutError, BlockingIOError):
                data = None  # fired early, inside the band: the loop below waits for the rest
            if data is not None:
                if not data:
                    raise ConnectionResetError("connection closed by the server")
                if len(data) >= 4 and _LEN.unpack_from(data)[0] == len(data) - 4:
                    self._last_io = time.monotonic()
                    reply = unpack(data[4:])
                    if self._answers(reply, rid):
                        return reply
                else:
                    self._rbuf += data
        while True:
            reply = self._recv(deadline, 1 << 31)
            if self._answers(reply, rid):
                return reply

    def send(self, op: str, **args: Any) -> None:
        """One-way request (the server sends no reply)."""
        with self._lock:
            self._send_locked(op, args)

    def try_send(self, op: str, **args: Any) -> bool:
        """:meth:`send` if no other thread is using this connection now; False (nothing sent)
        otherwise. For background threads that must not wait behind a caller's request."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._send_locked(op, args)
        finally:
            self._lock.release()
        return True

    def _send_locked(self, op: str, args: dict[str, Any]) -> None:
        deadline = time.monotonic() + self.timeout_s
        args["op"] = op
        args["id"] = next(self._ids)
        args["oneway"] = True
        self._socket(deadline)
        data = self._frame(args)
        try:
            self._sendall(data, deadline)
        except OSError as exc:
            self._reset()
            raise self._unavailable(f": send failed ({exc})") from None

    def check(self) -> dict[str, Any]:
        """Connect and authenticate now (typed error if that fails); return the server's hello.
        Lets a command refuse a wrong address before it allocates anything."""
        with self._lock:
            self._socket(time.monotonic() + self.timeout_s)
            return dict(self.hello)

    def mark_bound(self, attach: dict[str, Any] | None) -> None:
        """The current connection is now bound to ``attach`` (a session it created itself)."""
        self._bound = attach

    def _frame(self, args: dict[str, Any]) -> bytes:
        data = frame(args)
        limit = self.hello.get("max_message", 1 << 31)
        if len(data) - 4 > limit:
            raise errors.InvalidArgument(
                f"{args['op']!r} request of {len(data) - 4} bytes exceeds the limit of {limit} bytes of "
                f"the {self.what} at {self.address}: split it"
            )
        return data

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._rbuf = bytearray()
        self._kernel = False
        self._tmo = 0.0

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._reset()

    def try_close(self) -> bool:
        """:meth:`close` unless another thread is in a call on this connection now (False:
        nothing done; that caller closes it). For shutdown paths that must not wait a timeout."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._reset()
        finally:
            self._lock.release()
        return True
