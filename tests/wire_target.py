"""A fake kvpool TCP target for tests of the initiator against hostile peers: it listens on
loopback, publishes a descriptor (one 1 MiB buffer at ``base``, another host), and serves every
connection in a thread with the subclass's :meth:`_serve` (which speaks csrc/wire.h itself)."""

from __future__ import annotations

import socket
import threading

from kvpool.transfer.types import BufferDescriptor, SegmentDescriptor


class WireTarget:
    def __init__(self, incarnation: int, base: int = 0x7F00_0000_0000) -> None:
        self.incarnation = incarnation
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.name = f"127.0.0.1:{self.port}"
        desc = SegmentDescriptor(
            name=self.name, hostname="127.0.0.1", port=self.port, host_id="another-host", pid=1,
            incarnation=incarnation, buffers=[BufferDescriptor(base, 1 << 20)], protocols=["tcp"],
        )  # fmt: skip
        self.blob = desc.to_bytes()
        self.stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        raise NotImplementedError

    @staticmethod
    def recv_exact(c: socket.socket, n: int) -> bytes | None:
        """``n`` bytes, or None when the peer closed or the socket timed out first."""
        b = b""
        while len(b) < n:
            try:
                k = c.recv(n - len(b))
            except OSError:
                return None
            if not k:
                return None
            b += k
        return b

    def close(self) -> None:
        self.stop = True
        self.sock.close()
