"""RPC server: the :mod:`kvpool._rpc` protocol served by one thread over non-blocking sockets.

Server resources are bounded per peer and in total (:class:`RpcLimits`): message size, a deadline
for a started frame, unsent replies (a peer that does not read them is not read either, and is
closed when they do not drain), idle connections (reaped), the number of connections, and the
bytes of partial frames and unsent replies over all connections. At the fd limit the server stops
accepting for a moment and keeps serving the connections it has.
"""

from __future__ import annotations

import collections
import errno
import hmac
import os
import random
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool import errors
from kvpool._rpc import (
    _LEN,
    PRE_AUTH_MAX,
    RECV_CHUNK,
    VERSION,
    _complete,
    client_mac,
    frame,
    log,
    server_mac,
    unpack,
)


@dataclass(frozen=True)
class RpcLimits:
    """Bounds on what one peer, and all peers together, may make an :class:`RpcServer` hold.

    Attributes:
        max_message: biggest frame accepted from an authenticated peer (bytes).
        handshake_timeout_s: a new connection must authenticate within this.
        frame_timeout_s: a frame whose first bytes arrived must be complete within this.
        idle_timeout_s: a connection with no traffic for this long is closed (clients reconnect).
        out_high_water: unsent reply bytes above which a connection is not read any more.
        out_timeout_s: a connection whose unsent replies make no progress for this long is closed.
        input_budget, output_budget: bytes of partial frames / unsent replies over all connections;
            above them, connections holding the most are not read until the totals drop.
        max_connections: open connections; beyond it the oldest unauthenticated one (or the new
            one) is closed.
        frames_per_event: frames handled per connection per readiness event (fairness).
    """

    max_message: int = 16 << 20
    handshake_timeout_s: float = 5.0
    frame_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0
    out_high_water: int = 1 << 20
    out_timeout_s: float = 30.0
    input_budget: int = 32 << 20
    output_budget: int = 32 << 20
    max_connections: int = 4096
    frames_per_event: int = 64


class Connection:
    """Server-side state of one peer connection. ``state`` is free for the handler (e.g. the
    client id bound to this connection at registration)."""

    __slots__ = (
        "sock", "peer", "inbuf", "out", "authed", "nonce", "state", "last_io", "frame_since",
        "out_since", "closing", "events", "accepted",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, peer: Any, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.out = bytearray()
        self.authed = False
        self.nonce = os.urandom(32)
        self.state: dict[str, Any] = {}
        self.last_io = now
        self.frame_since = 0.0  # when the partial frame in inbuf started (0: none)
        self.out_since = 0.0  # when unsent replies last made no progress (0: none pending)
        self.closing = False
        self.events = selectors.EVENT_READ  # selector interest (0: unregistered)
        self.accepted = now


Handler = Callable[..., "dict[str, Any] | None"]


class RpcServer:
    """Single-threaded RPC endpoint: non-blocking sockets under a selector.

    ``handler(request)`` — or ``handler(request, connection)`` with ``with_connection=True`` — runs
    for every request of an authenticated connection and returns the reply map (``id`` is filled
    in; None sends nothing). ``on_tick()`` runs about every ``tick_s``. Bytes that are not frames
    or not msgpack, and frames over the limits, get an error reply and the connection is closed.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        on_tick: Callable[[], None],
        tick_s: float = 0.1,
        *,
        secret: str | None = None,
        instance: int | None = None,
        limits: RpcLimits | None = None,
        with_connection: bool = False,
        on_close: Callable[[Connection], None] | None = None,
    ) -> None:
        self.handler = handler
        self.on_tick = on_tick
        self.on_close = on_close
        self.tick_s = tick_s
        self.secret = secret or None
        self.instance = instance if instance is not None else random.getrandbits(63)
        self.limits = limits or RpcLimits()
        self._with_conn = with_connection
        self._sel = selectors.DefaultSelector()
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            ls = socket.socket(infos[0][0], socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(infos[0][4])
            ls.listen(512)
        except OSError as exc:
            raise errors.InvalidArgument(
                f"cannot listen on {host}:{port}: {exc}; pick another --port or stop what is using it"
            ) from None
        ls.setblocking(False)
        self._listen = ls
        self.port: int = ls.getsockname()[1]
        self._sel.register(ls, selectors.EVENT_READ, None)
        self._accepting = True
        self._accept_resume = 0.0
        self._conns: dict[socket.socket, Connection] = {}
        self._unauthed: collections.OrderedDict[socket.socket, None] = collections.OrderedDict()
        self._in_total = 0
        self._out_total = 0
        self._starved: set[socket.socket] = set()  # not read for now: looked at by the sweep
        self._ready: set[socket.socket] = set()  # complete frames left over by the fairness cap
        self._stop = threading.Event()
        self.stats: collections.Counter[str] = collections.Counter()
        self.max_frame_s = 0.0
        # call_soon: functions other threads hand to this loop, and the socket that wakes it
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)

    # ------------------------------------------------------------------ loop
    def serve_forever(self) -> None:
        """Serve until :meth:`stop`."""
        next_tick = time.monotonic() + self.tick_s
        next_sweep = time.monotonic() + 0.5
        while not self._stop.is_set():
            wait = 0.0 if self._ready else max(0.0, next_tick - time.monotonic())
            for key, events in self._sel.select(wait):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listen:
                    self._accept()
                    continue
                if sock is self._wake_r:
                    self._run_calls()
                    continue
                conn = self._conns.get(sock)
                if conn is None:
                    continue
                if events & selectors.EVENT_READ:
                    self._read(conn)
                if events & selectors.EVENT_WRITE and sock in self._conns:
                    self._flush(conn)
            if self._ready:
                ready, self._ready = self._ready, set()
                for sock in ready:
                    conn = self._conns.get(sock)
                    if conn is not None:
                        self._frames(conn, time.monotonic())
                        if sock in self._conns:
                            self._flush(conn)
            now = time.monotonic()
            if not self._accepting and now >= self._accept_resume:
                self._accepting = True
                self._sel.register(self._listen, selectors.EVENT_READ, None)
            if now >= next_sweep:
                next_sweep = now + 0.5
                self._sweep(now)
            if now >= next_tick:
                next_tick = now + self.tick_s
                self.on_tick()
        for sock in list(self._conns):
            self._close(self._conns[sock])
        if self._accepting:
            self._sel.unregister(self._listen)
        self._listen.close()
        self._sel.unregister(self._wake_r)
        self._wake_r.close()
        self._wake_w.close()
        self._sel.close()

    def stop(self) -> None:
        """Make :meth:`serve_forever` return (soon: the loop is woken)."""
        self._stop.set()
        self.call_soon(lambda: None)

    # ------------------------------------------------------------------ deferred replies
    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server's thread soon; any thread may call this. For replies a
        handler deferred (it returned None and kept the connection): ``fn`` sends them with
        :meth:`reply`."""
        self._calls.append(fn)
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # a wake-up is pending already (buffer full), or the server has stopped

    def reply(self, conn: Connection, rid: Any, out: dict[str, Any]) -> None:
        """Server thread only (a handler, ``on_tick`` or a :meth:`call_soon` function): send
        ``out`` as the reply to request ``rid`` of ``conn``, if it is still connected."""
        if conn.sock not in self._conns:
            return
        out["id"] = rid
        self._queue(conn, frame(out))
        self._flush(conn)

    def _run_calls(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self._calls:
            fn = self._calls.popleft()
            try:
                fn()
            except Exception:  # noqa: BLE001 - a callback bug must not take the server down
                log.exception("RPC server callback failed")

    @property
    def connections(self) -> int:
        """Open connections."""
        return len(self._conns)

    # ------------------------------------------------------------------ accept / close
    def _accept(self) -> None:
        try:
            sock, peer = self._listen.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # Out of descriptors: stop accepting for a moment (the listen socket would stay
                # readable and spin the loop), make room by dropping the oldest unauthenticated
                # peer, keep serving everyone else.
                self.stats["accept_backoff"] += 1
                if self._accepting:
                    self._sel.unregister(self._listen)
                    self._accepting = False
                self._accept_resume = time.monotonic() + 0.1
                if self._unauthed:
                    self._close(self._conns[next(iter(self._unauthed))])
            return
        now = time.monotonic()
        if len(self._conns) >= self.limits.max_connections:
            self.stats["refused_max_connections"] += 1
            if self._unauthed:
                self._close(self._conns[next(iter(self._unauthed))])
            else:
                sock.close()
                return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock, peer, now)
        self._conns[sock] = conn
        self._unauthed[sock] = None
        self._sel.register(sock, selectors.EVENT_READ, None)
        hello = {
            "kvpool": VERSION,
            "nonce": conn.nonce,
            "auth": self.secret is not None,
            "instance": self.instance,
            "idle_s": self.limits.idle_timeout_s,
            "max_message": self.limits.max_message,
        }
        self._queue(conn, frame(hello))
        self._flush(conn)

    def _close(self, conn: Connection) -> None:
        sock = conn.sock
        if self._conns.pop(sock, None) is None:
            return
        self._unauthed.pop(sock, None)
        self._starved.discard(sock)
        self._ready.discard(sock)
        self._in_total -= len(conn.inbuf)
        self._out_total -= len(conn.out)
        if conn.events:
            self._sel.unregister(sock)
        sock.close()
        if self.on_close is not None and conn.authed:
            self.on_close(conn)

    def _refuse(self, conn: Connection, code: str, msg: str) -> None:
        """Answer with an error, then hang up once it is sent (or at the next sweep)."""
        self.stats[f"refused_{code.lower()}"] += 1
        self._queue(conn, frame({"id": None, "ok": False, "err": code, "msg": msg}))
        conn.closing = True
        self._in_total -= len(conn.inbuf)
        conn.inbuf = bytearray()
        conn.frame_since = 0.0
        self._flush(conn)

    # ------------------------------------------------------------------ input
    def _read(self, conn: Connection) -> None:
        if conn.closing:
            self._close(conn)
            return
        try:
            data = conn.sock.recv(RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        now = time.monotonic()
        conn.last_io = now
        if not conn.inbuf:
            if (
                conn.authed
                and not conn.out
                and not conn.closing
                and len(data) >= 4
                and _LEN.unpack_from(data)[0] == len(data) - 4 <= self.limits.max_message
            ):
                self._single(conn, data)  # the common case: one whole request in one read
                return
            conn.frame_since = now
        conn.inbuf += data
        self._in_total += len(data)
        self._frames(conn, now)
        if conn.sock in self._conns:
            self._flush(conn)

    def _frames(self, conn: Connection, now: float) -> None:
        buf = conn.inbuf
        pos = 0
        handled = 0
        limit = self.limits.max_message if conn.authed else PRE_AUTH_MAX
        hwm = self.limits.out_high_water
        while len(buf) - pos >= 4 and handled < self.limits.frames_per_event and len(conn.out) < hwm:
            n = _LEN.unpack_from(buf, pos)[0]
            if n > limit:
                del buf[:pos]
                self._in_total -= pos
                what = "before authentication" if not conn.authed else ""
                self._refuse(conn, "INVALID", f"message of {n} bytes exceeds the limit of {limit} {what}")
                return
            end = pos + 4 + n
            if len(buf) < end:
                break
            t0 = time.perf_counter()
            try:
                req = unpack(buf[pos + 4 : end])  # a copy decodes faster than a memoryview
            except Exception as exc:  # noqa: BLE001 - not msgpack: answer and hang up
                del buf[:pos]
                self._in_total -= pos
                self._refuse(conn, "INVALID", f"malformed message: {exc}")
                return
            pos = end
            handled += 1
            if not conn.authed:
                if not self._authenticate(conn, req):
                    del buf[:pos]
                    self._in_total -= pos
                    return
                limit = self.limits.max_message
                continue
            self._dispatch(conn, req)
            dt = time.perf_counter() - t0
            if dt > self.max_frame_s:
                self.max_frame_s = dt  # decode + handle + encode of the slowest message so far
            if conn.closing or conn.sock not in self._conns:
                break
        if pos:
            del buf[:pos]
            self._in_total -= pos
        if pos or not buf:  # a frame was consumed: what is left (if anything) started in this read
            conn.frame_since = now if buf else 0.0
        elif not conn.frame_since:
            conn.frame_since = now
        # else: still the same partial frame, whose deadline runs from its first bytes
        if handled >= self.limits.frames_per_event and _complete(buf):
            self._ready.add(conn.sock)  # more complete frames wait: served in the next loop round

    def _single(self, conn: Connection, data: bytes) -> None:
        """One whole request that arrived alone on an authenticated connection with nothing
        buffered either way: what :meth:`_frames` and :meth:`_flush` would do, minus the
        buffering (the reply goes to the socket at once; what it does not take is queued)."""
        t0 = time.perf_counter()
        try:
            req = unpack(data[4:])
        except Exception as exc:  # noqa: BLE001 - not msgpack: answer and hang up
            self._refuse(conn, "INVALID", f"malformed message: {exc}")
            return
        out = self._answer(req, conn)
        dt = time.perf_counter() - t0
        if dt > self.max_frame_s:
            self.max_frame_s = dt
        if out is None or conn.sock not in self._conns:
            return
        if conn.out or conn.closing:  # the handler queued something itself: keep the order
            self._queue(conn, out)
            self._flush(conn)
            return
        try:
            n = conn.sock.send(out)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._close(conn)
            return
        if n < len(out):
            self._queue(conn, out[n:])
            self._flush(conn)  # sets the deadline for the rest and asks for EVENT_WRITE

    def _authenticate(self, conn: Connection, req: Any) -> bool:
        if not isinstance(req, dict):
            self._refuse(conn, "INVALID", "malformed handshake")
            return False
        if self.secret is not None:
            mac = req.get("mac")
            cnonce = req.get("cnonce")
            if not isinstance(mac, bytes) or not isinstance(cnonce, bytes):
                self._refuse(
                    conn, "AUTH", "this server requires a secret: configure the same secret on the client"
                )
                return False
            if not hmac.compare_digest(mac, client_mac(self.secret, conn.nonce, cnonce)):
                self._refuse(conn, "AUTH", "wrong secret: configure the same secret on both sides")
                return False
            reply = {"ok": True, "mac": server_mac(self.secret, conn.nonce, cnonce)}
        else:
            reply = {"ok": True, "mac": None}
        conn.authed = True
        self._unauthed.pop(conn.sock, None)
        self._queue(conn, frame(reply))
        return True

    def _dispatch(self, conn: Connection, req: Any) -> None:
        out = self._answer(req, conn)
        if out is not None:
            self._queue(conn, out)

    def _answer(self, req: Any, conn: Connection) -> bytes | None:
        """The reply frame to one request (None: a one-way request, or the handler answers none)."""
        rid = req.get("id") if isinstance(req, dict) else None
        try:
            if not isinstance(req, dict):
                raise errors.InvalidArgument("malformed request: not a map")
            out = self.handler(req, conn) if self._with_conn else self.handler(req)
        except Exception as exc:  # noqa: BLE001 - a handler bug must not take the server down
            log.exception("RPC handler failed")
            out = {"ok": False, "err": "ERROR", "msg": f"server error: {exc!r}"}
        if out is None or (isinstance(req, dict) and req.get("oneway")):
            return None
        out["id"] = rid
        try:
            return frame(out)
        except Exception as exc:  # noqa: BLE001 - a reply msgpack cannot encode
            return frame({"id": rid, "ok": False, "err": "ERROR", "msg": f"unencodable reply: {exc!r}"})

    # ------------------------------------------------------------------ output
    def _queue(self, conn: Connection, data: bytes) -> None:
        conn.out += data
        self._out_total += len(data)

    def _flush(self, conn: Connection) -> None:
        out = conn.out
        now = time.monotonic()
        if out:
            try:
                n = conn.sock.send(out)
                del out[:n]
                self._out_total -= n
                if n:
                    conn.last_io = now
                    conn.out_since = now if out else 0.0
                elif not conn.out_since:
                    conn.out_since = now
            except (BlockingIOError, InterruptedError):
                if not conn.out_since:
                    conn.out_since = now
            except OSError:
                self._close(conn)
                return
        if conn.closing and not out:
            self._close(conn)
            return
        if len(out) < self.limits.out_high_water and conn.authed and _complete(conn.inbuf):
            self._ready.add(conn.sock)  # requests held back while replies were above high water
        self._rearm(conn)

    def _want_read(self, conn: Connection) -> bool:
        lim = self.limits
        if conn.closing or len(conn.out) >= lim.out_high_water:
            return False  # a peer that does not read its replies is not read either
        if self._out_total > lim.output_budget and len(conn.out) > 0:
            return False
        if self._in_total > lim.input_budget and len(conn.inbuf) > RECV_CHUNK:
            return False  # partial frames hold too much memory over all peers: biggest wait
        return True

    def _rearm(self, conn: Connection) -> None:
        """Selector interest from the connection's state; one that is neither read nor written is
        unregistered and looked at again by the sweep."""
        want_read = self._want_read(conn)
        want = (selectors.EVENT_READ if want_read else 0) | (selectors.EVENT_WRITE if conn.out else 0)
        if not want_read:
            self._starved.add(conn.sock)
        if want == 0:
            if conn.events:
                self._sel.unregister(conn.sock)
                conn.events = 0
            return
        if not conn.events:
            self._sel.register(conn.sock, want, None)
        elif conn.events != want:
            self._sel.modify(conn.sock, want, None)
        conn.events = want

    # ------------------------------------------------------------------ housekeeping
    def _sweep(self, now: float) -> None:
        """Deadlines (handshake, partial frame, unsent replies, idle) and paused connections."""
        lim = self.limits
        while self._unauthed:
            sock = next(iter(self._unauthed))
            conn = self._conns[sock]
            if now - conn.accepted < lim.handshake_timeout_s:
                break
            self.stats["closed_handshake_timeout"] += 1
            self._close(conn)
        for conn in list(self._conns.values()):
            if conn.frame_since and now - conn.frame_since > lim.frame_timeout_s:
                self.stats["closed_frame_timeout"] += 1
                self._close(conn)
            elif conn.out_since and now - conn.out_since > lim.out_timeout_s:
                self.stats["closed_out_timeout"] += 1
                self._close(conn)
            elif now - conn.last_io > lim.idle_timeout_s and not conn.out:
                self.stats["closed_idle"] += 1
                self._close(conn)
            elif conn.closing and now - conn.last_io > 1.0:
                self._close(conn)
        if self._starved:
            starved, self._starved = self._starved, set()
            for sock in starved:
                conn = self._conns.get(sock)
                if conn is None:
                    continue
                if conn.inbuf and len(conn.inbuf) >= 4:
                    self._frames(conn, now)
                if sock in self._conns:
                    self._flush(conn)
