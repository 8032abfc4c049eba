"""A few threads that run jobs, one at a time per key (a strand), in order per key.

The RDMA progress thread hands its connect and disconnect RPCs here, keyed by peer: a peer that
accepts TCP and never answers holds one thread (and delays only its own RPCs), never the progress
thread or another peer's RPCs while a thread is free.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Hashable

log = logging.getLogger("kvpool.transfer.rdma")


class Strands:
    """Run ``fn``s submitted under a key on at most ``workers`` threads (started on demand),
    one at a time and in submission order per key; keys take turns. At most ``per_key`` jobs wait
    per key (:meth:`submit` then refuses). Jobs must not raise (an exception is logged)."""

    def __init__(self, workers: int, per_key: int, name: str = "kvpool-rdma-rpc") -> None:
        self.workers = workers
        self.per_key = per_key
        self.name = name
        self._cv = threading.Condition()
        self._queues: dict[Hashable, collections.deque[Callable[[], None]]] = {}
        self._ready: collections.deque[Hashable] = collections.deque()  # keys with jobs, not running
        self._running: set[Hashable] = set()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, key: Hashable, fn: Callable[[], None]) -> bool:
        """Queue ``fn`` under ``key``; False (not queued) when closed or ``per_key`` jobs wait."""
        with self._cv:
            if self._closed:
                return False
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = collections.deque()
            if len(q) >= self.per_key:
                return False
            q.append(fn)
            if len(q) == 1 and key not in self._running:
                self._ready.append(key)
            if self._idle == 0 and len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._threads.append(t)
                t.start()
            self._cv.notify()
        return True

    def close(self) -> None:
        """Drop the jobs not started; threads exit after the job they run (not waited for)."""
        with self._cv:
            self._closed = True
            self._queues.clear()
            self._ready.clear()
            self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._ready and not self._closed:
                    self._idle += 1
                    self._cv.wait()
                    self._idle -= 1
                if self._closed:
                    return
                key = self._ready.popleft()
                q = self._queues[key]
                fn = q.popleft()
                if not q:
                    del self._queues[key]
                self._running.add(key)
            try:
                fn()
            except Exception:  # noqa: BLE001 - a job's own failure; the strand goes on
                log.exception("rdma RPC job failed")
            with self._cv:
                self._running.discard(key)
                if key in self._queues:  # more came while it ran: its turn again, after the others
                    self._ready.append(key)
                    self._cv.notify()
