"""The KV-event subscriber of the live router: one thread per vLLM instance started with
``kvpool proxy --kv-events``, feeding that instance's blocks into the router's
:class:`~kvpool.conductor.index.BlockIndex`. Started and stopped by
:class:`kvpool.conductor.live.LiveRouter` (``start``/``close``); never touches the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvpool.conductor.index import BlockIndex, Location

__all__ = ["EventSubscriber"]

_log = logging.getLogger("kvpool.conductor.live")  # the router's logger, as before the split


class EventSubscriber(threading.Thread):
    """Subscribes to one vLLM instance's KV-event publisher and feeds the index.

    Messages are ``(topic, seq, payload)``; a gap in ``seq`` is counted (``gaps``) -- the index
    may then miss blocks until they are stored again. Bounded: the socket's receive high-water
    mark caps what is queued, ``max_msg_bytes`` each message (ZMQ ``MAXMSGSIZE``); payloads are
    parsed in C++ without the GIL. The index's own cap (``BlockIndex(max_blocks=...)``) bounds what
    the events add: an ingest that takes it over evicts the oldest entries of the location holding
    the most blocks (``evicted`` counts the entries evicted after this publisher's messages).
    """

    def __init__(self, index: BlockIndex, endpoint: str, gpu: Location, cpu: Location | None,
                 topic: str = "", name: str = "", *,
                 max_msg_bytes: int = 16 * 1024 * 1024) -> None:  # fmt: skip
        super().__init__(name=f"kvpool-kv-events-{name}", daemon=True)
        self.index = index
        self.endpoint = endpoint
        self.gpu = gpu
        self.cpu = cpu
        self.topic = topic.encode()
        self.stop_event = threading.Event()
        self.last_seq = -1
        self.gaps = 0
        self.batches = 0
        self.last_event_ts = 0.0
        self.last_recv = 0.0
        self.first_block_size_error: int | None = None
        self.max_msg_bytes = int(max_msg_bytes)
        self.evicted = 0
        self.disconnects = 0

    def run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        # libzmq drops a connection that sent a message over MAXMSGSIZE and never reconnects it:
        # the monitor sees the disconnect and the subscriber connects again.
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            while not self.stop_event.is_set():
                ready = dict(poller.poll(200))
                if mon in ready:
                    self._on_disconnect(sock, mon)
                if sock not in ready:
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(frames)
        finally:
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)

    def _on_disconnect(self, sock: Any, mon: Any) -> None:
        """Reconnect after the publisher's connection dropped (an oversized message, or it went away)."""
        import zmq

        while mon.poll(0):
            mon.recv_multipart(zmq.NOBLOCK)
        self.disconnects += 1
        try:
            sock.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass
        sock.connect(self.endpoint)

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.index.counters["malformed"] = self.index.counters.get("malformed", 0) + 1
            return
        _, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big", signed=True)
        if self.last_seq >= 0 and seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq
        st = self.index.ingest(payload, self.gpu, self.cpu)
        self.batches += 1
        if st["evicted"]:
            if not self.evicted:
                _log.warning(
                    "the prefix index reached its cap of %d blocks after KV events from %s: evicting "
                    "the oldest entries of the instances holding the most",
                    self.index.max_blocks, self.endpoint,
                )  # fmt: skip
            self.evicted += int(st["evicted"])
        self.last_recv = time.time()
        if st["last_ts"]:
            self.last_event_ts = float(st["last_ts"])
        if st["skipped_block_size"] and self.first_block_size_error is None:
            self.first_block_size_error = int(st["last_bad_block_size"])
            _log.error(
                "KV events from %s have block size %d but the router uses %d: no prefix will match; "
                "restart the proxy with --block-size %d",
                self.endpoint, st["last_bad_block_size"], self.index.block_size, st["last_bad_block_size"],
            )  # fmt: skip

    def stop(self) -> None:
        self.stop_event.set()
