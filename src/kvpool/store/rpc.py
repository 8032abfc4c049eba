"""Master RPC: msgpack maps over zmq (ROUTER on the master, DEALER per client), with timeouts.

Request: ``{"op": str, "id": int, "auth": str | None, ...args}``.
Reply: ``{"id": int, "ok": True, ...}`` or ``{"id": int, "ok": False, "err": CODE, "msg": str}``.
Per-key results of batch calls are ``[CODE | None, value]`` pairs so one bad key never fails the batch.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import msgpack
import zmq

from kvpool import errors


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
    "UNAVAILABLE": errors.MasterUnavailable,
    "UNKNOWN_CLIENT": UnknownClient,
    "ERROR": errors.StoreError,
}


def raise_for(code: str, msg: str) -> None:
    """Raise the typed error for a wire error code."""
    raise ERRORS.get(code, errors.StoreError)(msg)


def pack(obj: Any) -> bytes:
    """msgpack encode."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """msgpack decode (strings as str, binaries as bytes)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class RpcClient:
    """A DEALER socket to the master; thread-safe (one call in flight), re-made after a timeout."""

    def __init__(self, address: str, timeout_s: float, secret: str | None = None) -> None:
        self.address = address
        self.timeout_ms = int(timeout_s * 1000)
        self.secret = secret
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            s.connect(f"tcp://{self.address}")
            self._sock = s
        return self._sock

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; typed error on failure or timeout."""
        args["op"] = op
        args["auth"] = self.secret
        with self._lock:
            rid = next(self._ids)
            args["id"] = rid
            sock = self._socket()
            sock.send(pack(args))  # queued until connected; the poll below bounds the wait
            while True:
                try:
                    reply = unpack(sock.recv())  # RCVTIMEO bounds the wait
                except zmq.Again:
                    self._reset()
                    raise errors.MasterUnavailable(
                        f"store master at {self.address} did not answer {op!r} within "
                        f"{self.timeout_ms / 1000:.1f}s (is `kvpool master` running?)"
                    ) from None
                if reply.get("id") == rid:
                    break  # stale replies of timed-out calls are dropped
        if not reply.get("ok"):
            raise_for(reply.get("err", "ERROR"), reply.get("msg", "store error"))
        return reply

    def send(self, op: str, **args: Any) -> None:
        """Fire-and-forget request: its reply is dropped by the next :meth:`call`."""
        args["op"] = op
        args["auth"] = self.secret
        with self._lock:
            args["id"] = next(self._ids)
            self._socket().send(pack(args))

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def close(self) -> None:
        """Close the socket."""
        with self._lock:
            self._reset()
