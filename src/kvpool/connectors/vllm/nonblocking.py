"""What keeps the connectors' scheduler hooks from ever waiting on the network.

vLLM calls the scheduler hooks on its engine-core loop, once per waiting request per step; a hook
that waits on a master RPC stalls every request of the instance. So:

* :class:`Breaker` -- a circuit breaker around a remote service. Closed: use it. After a failure
  or a timeout it opens for ``retry_s`` (one warning, not one per request); then a single probe
  decides whether it closes again (one info line) or stays open.
* :class:`AsyncLookups` -- store lookups (``batch_exists``) run on one background thread; the hook
  starts a lookup and answers "ask again" (``None``) until the result is there, or gives up
  after ``timeout_s`` and opens the breaker. Lookups that queue up while one runs go to the
  master together (one round trip for all of them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvpool.connectors.vllm")


class Breaker:
    """Circuit breaker: ``closed()`` says whether to use the service now.

    Thread-safe. ``fail`` opens it (logs once per outage), ``ok`` closes it (logs the recovery),
    ``want_probe`` is true once per ``retry_s`` while open: the caller then sends one probe and
    reports its outcome with ``ok`` or ``fail``.
    """

    def __init__(self, what: str, retry_s: float) -> None:
        self.what = what
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._open = False
        self._until = 0.0
        self._probing = False
        self.outages = 0

    def closed(self) -> bool:
        return not self._open

    def fail(self, why: object) -> None:
        with self._lock:
            self._probing = False
            self._until = time.monotonic() + self.retry_s
            if self._open:
                return
            self._open = True
            self.outages += 1
        log.warning("kvpool: %s unreachable (%s); serving without it, next try in %.0f s",
                    self.what, why, self.retry_s)  # fmt: skip

    def ok(self) -> None:
        with self._lock:
            self._probing = False
            if not self._open:
                return
            self._open = False
        log.info("kvpool: %s reachable again; using it", self.what)

    def want_probe(self) -> bool:
        with self._lock:
            if not self._open or self._probing or time.monotonic() < self._until:
                return False
            self._probing = True
            return True


class Lookup:
    """One pending ``batch_exists``: ``found`` (or ``error``) is set when ``done``."""

    __slots__ = ("keys", "started", "done", "found", "error")

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.started = time.monotonic()
        self.done = False
        self.found: list[bool] | None = None
        self.error: BaseException | None = None


class AsyncLookups:
    """A background thread that answers :class:`Lookup` s with ``exists(keys) -> list[bool]``.

    ``connect`` (called on that thread) makes the client as soon as the thread starts, so that the
    first request's lookup does not pay for it (under load a connection took over a second: the
    lookup timed out, the breaker opened and the request's blocks were not saved); when that fails
    (a master down at start-up does not stop the engine either), each lookup tries again. At most
    ``max_keys`` keys go to the master per round trip.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        exists: Callable[[Any, list[str]], list[bool]],
        name: str = "kvpool-store-lookup",
        max_keys: int = 1 << 14,
    ) -> None:
        self._connect = connect
        self._exists = exists
        self.client: Any = None
        self._max_keys = max_keys
        self._cv = threading.Condition()
        self._queue: list[Lookup] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, keys: list[str]) -> Lookup:
        lk = Lookup(keys)
        with self._cv:
            self._queue.append(lk)
            self._cv.notify()
        return lk

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    def _take(self) -> list[Lookup] | None:
        with self._cv:
            while not self._queue and not self._stop:
                self._cv.wait()
            if self._stop:
                return None
            batch, n = [], 0
            while self._queue and (not batch or n + len(self._queue[0].keys) <= self._max_keys):
                lk = self._queue.pop(0)
                batch.append(lk)
                n += len(lk.keys)
            return batch

    def _connect_early(self) -> None:
        try:
            client = self._connect()
        except Exception as exc:  # noqa: BLE001 - the first lookup tries again
            log.info("kvpool: store not reachable at start-up (%s); trying again at the first lookup", exc)
            return
        with self._cv:
            if not self._stop:
                self.client = client
                return
        client.close()  # closed meanwhile: the owner did not see this client

    def _loop(self) -> None:
        self._connect_early()
        while (batch := self._take()) is not None:
            try:
                if self.client is None:
                    self.client = self._connect()
                keys = [k for lk in batch for k in lk.keys]
                found = self._exists(self.client, keys) if keys else []
                i = 0
                for lk in batch:
                    lk.found = list(found[i : i + len(lk.keys)])
                    i += len(lk.keys)
            except Exception as exc:  # noqa: BLE001 - every failure is the lookups' answer
                for lk in batch:
                    lk.error = exc
            for lk in batch:
                lk.done = True
