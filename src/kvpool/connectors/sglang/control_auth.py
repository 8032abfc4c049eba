"""Authentication of the SGLang P/D backend's ZMQ control messages (no SGLang import).

The prefill and decode managers talk over ZMQ PUSH/PULL sockets that anyone who reaches the port
can send to: a decode's registration names the segment and memory a prefill then WRITEs into, its
metadata names destination pages, an ABORT fails a room, a status message makes a decode compute
with the KV it believes arrived. With a cluster secret (``KVPOOL_SECRET``, the transfer engine's
``secret``) every message carries one trailing frame of :data:`TRAILER_LEN` bytes::

    sender (8 random bytes, one per manager) | counter (u64 BE) | time (u64 BE, ms since epoch) | mac (32)
    mac = HMAC-SHA256(key, len(receiver) (u64 BE) | receiver | sender | counter | time
                           | for each frame: len (u64 BE) | frame)
    key = HMAC-SHA256(secret, "kvpool-sglang-pd-control-v2")

``receiver`` is the control endpoint the message is sent to, ``host:port`` (:func:`endpoint_id`:
an IP in its compressed form, IPv6 in brackets): the sender takes it from the address it sends
to (a prefill rank's ``rank_ip``/``rank_port`` from the bootstrap server, a decode's ``ip``/``port``
from its metadata or ABORT), the receiver from its own (``local_ip``, ``rank_port``), which is what
it registers and sends. It is not in the trailer: a message sealed for one manager fails the MAC
("bad MAC") at any other, so a message captured on its way to one decode rank or prefill rank
cannot be replayed to another (each receiver's replay window only knows what it accepted).

A receiver drops (counts, logs at most every 10 s, never acts on) a message whose trailer is
missing or whose MAC is wrong, whose time is more than ``window_s`` from its own clock (replays
after a receiver restart; hosts need clocks within ``window_s``), or whose counter it has already
accepted from that sender or is more than :data:`REPLAY_WINDOW` behind the highest one (replays;
a sliding window as IPsec's, so messages reordered across threads or sockets still pass). The
table of senders is bounded: a sender silent for ``2 * window_s`` is forgotten (its old messages
are stale by then) and beyond ``max_senders`` the longest silent one is. Without a secret messages
go unsigned and unchecked (logged once per process). The bootstrap server's registrations use the
same trailer with their own key (:mod:`kvpool.connectors.sglang.bootstrap_auth`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from ipaddress import ip_address
from typing import Any

log = logging.getLogger("kvpool.connectors.sglang")

PURPOSE = b"kvpool-sglang-pd-control-v2"
TRAILER_LEN = 8 + 8 + 8 + 32
REPLAY_WINDOW = 1024
_HEADER = struct.Struct(">8sQQ")
_LEN = struct.Struct(">Q")
_warned_unauthenticated: set[bytes] = set()  # purposes whose missing secret was logged
_CONTROL_WARNING = (
    "kvpool SGLang backend: the P/D control socket is unauthenticated (no KVPOOL_SECRET): "
    "anyone who reaches it can register destinations for KV writes and abort rooms"
)


def endpoint_id(host: str, port: int | str) -> bytes:
    """The receiver id a message to the control socket at ``host``:``port`` is sealed for: an IP in
    its compressed form (IPv6 in brackets), a host name in lower case."""
    host = host.strip().strip("[]")
    try:
        host = ip_address(host).compressed
    except ValueError:
        host = host.lower()
    return (f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}").encode()


def endpoint_of(endpoint: str) -> bytes:
    """:func:`endpoint_id` of a ZMQ endpoint such as ``tcp://10.0.0.1:5000`` or ``tcp://[::1]:5000``."""
    host, _, port = endpoint.split("://", 1)[-1].rpartition(":")
    return endpoint_id(host, port)


class Throttle:
    """Lets a log line through at most once per ``interval_s`` (callers count what it hides)."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._next = 0.0

    def ready(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True


class ControlAuth:
    """Signs outgoing and checks incoming control messages of one manager.

    :meth:`seal` is called by any thread that sends (under the socket's send lock, so one socket
    carries increasing counters) with the id of the receiver it sends to; :meth:`open` by the
    manager's one control thread, which accepts only what was sealed for ``receiver``, its own id.
    """

    def __init__(
        self,
        secret: str | None,
        *,
        window_s: float | None = None,
        max_senders: int = 65536,
        clock: Callable[[], float] = time.time,
        purpose: bytes = PURPOSE,
        what: str = "control message",
        warning: str = _CONTROL_WARNING,
        receiver: bytes = b"",
    ) -> None:
        """``purpose`` derives the key (one per use of the secret); ``what`` names the messages in
        logs; ``warning`` is logged once per process and purpose when there is no secret;
        ``receiver``: this manager's own :func:`endpoint_id` (b"" where there is one receiver per
        key, as the bootstrap server)."""
        self.enabled = bool(secret)
        self.receiver = receiver
        self.what = what
        key = (secret or "").encode("utf-8", "surrogatepass")
        self._key = hmac.new(key, purpose, hashlib.sha256).digest()
        if window_s is None:
            window_s = float(os.environ.get("KVPOOL_SGLANG_AUTH_WINDOW_S", "120"))
        self.window_ms = int(window_s * 1000)
        self.max_senders = max_senders
        self._clock = clock
        self._sender = os.urandom(8)
        self._counter = 0
        self._lock = threading.Lock()
        # sender -> (highest counter, bitmap of the REPLAY_WINDOW counters below it, receive time ms)
        self._seen: OrderedDict[bytes, tuple[int, int, int]] = OrderedDict()
        self.dropped: Counter[str] = Counter()
        self._throttle = Throttle()
        if not self.enabled and purpose not in _warned_unauthenticated:
            _warned_unauthenticated.add(purpose)
            log.warning(warning)

    def _mac(self, receiver: bytes, header: bytes, frames: Sequence[bytes]) -> bytes:
        h = hmac.new(self._key, _LEN.pack(len(receiver)), hashlib.sha256)
        h.update(receiver)
        h.update(header)
        for f in frames:
            h.update(_LEN.pack(len(f)))
            h.update(f)
        return h.digest()

    def seal(self, frames: Sequence[bytes], receiver: bytes = b"") -> list[bytes]:
        """``frames`` plus the trailer, sealed for ``receiver`` (the :func:`endpoint_id` of the
        control socket it is sent to; unchanged without a secret)."""
        frames = [bytes(f) for f in frames]
        if not self.enabled:
            return frames
        with self._lock:
            self._counter += 1
            counter = self._counter
        header = _HEADER.pack(self._sender, counter, int(self._clock() * 1000))
        return [*frames, header + self._mac(receiver, header, frames)]

    def open(self, frames: Sequence[bytes]) -> list[bytes] | None:
        """The message without its trailer, or None when it must be dropped (counted and logged)."""
        return self.check(frames)[0]

    def check(
        self, frames: Sequence[bytes], receivers: Sequence[bytes] | None = None
    ) -> tuple[list[bytes] | None, str | None]:
        """(the message without its trailer, None), or (None, why it was dropped: "unsigned",
        "bad MAC" (also: sealed for another receiver), "stale (clock skew or replay)" or
        "replayed"; counted and logged). ``receivers``: the ids it may be sealed for (default:
        this manager's own)."""
        frames = list(frames)
        if not self.enabled:
            return frames, None
        if len(frames) < 2 or len(frames[-1]) != TRAILER_LEN:
            return None, self._drop("unsigned")
        trailer, body = bytes(frames[-1]), [bytes(f) for f in frames[:-1]]
        header, mac = trailer[: _HEADER.size], trailer[_HEADER.size :]
        ids = (self.receiver,) if receivers is None else receivers
        if not any(hmac.compare_digest(mac, self._mac(r, header, body)) for r in ids):
            return None, self._drop("bad MAC")
        sender, counter, sent_ms = _HEADER.unpack(header)
        now_ms = int(self._clock() * 1000)
        if abs(now_ms - sent_ms) > self.window_ms:
            return None, self._drop("stale (clock skew or replay)")
        prev = self._seen.get(sender)
        if prev is None:
            top, bits = counter, 1
            self._forget(now_ms)
        else:
            top, bits, _ = prev
            if counter > top:
                shift = counter - top
                bits = ((bits << shift) | 1) & ((1 << REPLAY_WINDOW) - 1) if shift < REPLAY_WINDOW else 1
                top = counter
            elif top - counter >= REPLAY_WINDOW or (bits >> (top - counter)) & 1:
                return None, self._drop("replayed")
            else:
                bits |= 1 << (top - counter)
        self._seen[sender] = (top, bits, now_ms)
        self._seen.move_to_end(sender)
        return body, None

    def _forget(self, now_ms: int) -> None:
        """Before a new sender is added: drop senders silent for 2 windows, and the longest silent
        ones beyond ``max_senders``."""
        while self._seen:
            sender, (_, _, last_ms) = next(iter(self._seen.items()))
            if now_ms - last_ms <= 2 * self.window_ms and len(self._seen) < self.max_senders:
                break
            del self._seen[sender]

    def _drop(self, why: str) -> str:
        self.dropped[why] += 1
        if self._throttle.ready():
            log.warning(
                "kvpool SGLang backend: dropped unauthenticated %s(s) (%s); so far: %s",
                self.what,
                why,
                dict(self.dropped),
            )
        return why


class SigningSocket:
    """Wraps a cached PUSH socket of SGLang's receiver so that each message it sends is signed for
    ``receiver``, the prefill rank it is connected to (SGLang's receiver sends under the socket's
    lock, so one socket carries increasing counters)."""

    def __init__(self, sock: Any, auth: ControlAuth, receiver: bytes) -> None:
        self._sock = sock
        self._auth = auth
        self._receiver = receiver

    def send_multipart(self, frames: Sequence[bytes], *args: Any, **kwargs: Any) -> Any:
        return self._sock.send_multipart(self._auth.seal(frames, self._receiver), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
