"""The initiator against a hostile *target*: a Python server that speaks kvpool's wire protocol
(csrc/wire.h) and then trickles its replies one byte at a time, faster than any socket timeout.
Every frame has a whole-frame deadline on the client side, so the transfer (or the handshake)
fails with a typed error soon after ``timeout_s`` instead of living as long as the peer likes."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from kvpool import OpCode, TransferEngine
from kvpool.errors import KvpoolError, SegmentNotFound, TransferError
from tests.wire_target import WireTarget

CHALLENGE, HELLO_OK, RESP = 0x4E50564B, 0x4F50564B, 0x4150564B
INC = 0x1234_5678_9ABC
BASE = 0x7F00_0000_0000
DRIP_S = 0.3  # one byte per DRIP_S: each syscall sees progress long before its timeout


class TricklingTarget(WireTarget):
    """Accepts kvpool connections; ``mode``: 'hello' trickles the challenge, 'read' the READ
    payload, 'write' the WRITE reply header. Descriptor requests are answered at full speed."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        super().__init__(incarnation=INC, base=BASE)

    def _drip(self, c: socket.socket, data: bytes) -> None:
        for i in range(len(data)):
            if self.stop:
                return
            c.sendall(data[i : i + 1])
            time.sleep(DRIP_S)

    def _recv(self, c: socket.socket, n: int) -> bytes:
        b = self.recv_exact(c, n)
        if b is None:
            raise ConnectionError
        return b

    def _serve(self, c: socket.socket) -> None:
        try:
            challenge = struct.pack("<II", CHALLENGE, 0) + os.urandom(32)
            if self.mode == "hello":
                self._drip(c, challenge)
                return
            c.sendall(challenge)
            self._recv(c, 72)  # Hello
            c.sendall(struct.pack("<IiQ", HELLO_OK, 0, INC) + bytes(32))
            while True:
                magic, op, _f, _r, rid, _r2, _addr, n = struct.unpack("<IBBHIIQQ", self._recv(c, 32))
                if op == 3:  # descriptor
                    c.sendall(struct.pack("<IiIIQ", RESP, 0, rid, 0, len(self.blob)) + self.blob)
                elif op == 2:  # READ: honest header, trickled payload
                    c.sendall(struct.pack("<IiIIQ", RESP, 0, rid, 0, n))
                    self._drip(c, bytes(n))
                elif op == 1:  # WRITE: take the payload, trickle the reply
                    self._recv(c, n)
                    self._drip(c, struct.pack("<IiIIQ", RESP, 0, rid, 0, 0))
        except OSError:
            pass
        finally:
            c.close()


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    eng = TransferEngine(protocol="tcp", timeout_s=1.5, connect_timeout_s=1.5)
    yield eng
    eng.close()


@pytest.mark.parametrize("op", [OpCode.READ, OpCode.WRITE])
def test_trickled_reply_times_out(engine: TransferEngine, op: OpCode) -> None:
    target = TricklingTarget("read" if op == OpCode.READ else "write")
    try:
        buf = bytearray(4096)
        addr = engine.register_local_memory(buf)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="(?i)tim"):
            engine.transfer_sync(target.name, addr, BASE, 4096, op)
        took = time.monotonic() - t0
        # whole frame 1.5 s (+ at most one syscall timeout); trickled to the end it would take
        # 4096 x 0.3 s (READ) or 24 x 0.3 s = 7.2 s (WRITE reply)
        assert took < 6.0, took
    finally:
        target.close()


def test_trickled_handshake_times_out(engine: TransferEngine) -> None:
    target = TricklingTarget("hello")  # 40 challenge bytes x 0.3 s = 12 s
    try:
        t0 = time.monotonic()
        with pytest.raises((SegmentNotFound, KvpoolError)):
            engine.open_segment(target.name)
        assert time.monotonic() - t0 < 6.0
    finally:
        target.close()
