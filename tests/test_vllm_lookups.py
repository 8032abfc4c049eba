"""The store connector's background lookups (kvpool.connectors.vllm.nonblocking.AsyncLookups):
the client is made before the first request needs it, and never leaked."""

from __future__ import annotations

import threading
import time

from kvpool.connectors.vllm.nonblocking import AsyncLookups


class _Client:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _wait(lk, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not lk.done:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_the_client_is_made_at_start_not_by_the_first_lookup() -> None:
    made = threading.Event()
    clients: list[_Client] = []

    def connect() -> _Client:
        clients.append(_Client())
        made.set()
        return clients[-1]

    lookups = AsyncLookups(connect, lambda c, keys: [k == "hit" for k in keys])
    try:
        assert made.wait(5), "no connection before any lookup"
        assert lookups.client is clients[0]
        lk = lookups.submit(["hit", "miss"])
        _wait(lk)
        assert lk.found == [True, False] and lk.error is None and len(clients) == 1
    finally:
        lookups.close()


def test_a_failed_start_is_retried_by_the_first_lookup() -> None:
    calls = []

    def connect() -> _Client:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionRefusedError("master not up yet")
        return _Client()

    lookups = AsyncLookups(connect, lambda c, keys: [True] * len(keys))
    try:
        lk = lookups.submit(["a"])
        _wait(lk)
        assert lk.found == [True] and len(calls) == 2
    finally:
        lookups.close()


def test_a_client_made_after_close_is_closed_not_leaked() -> None:
    release = threading.Event()
    client = _Client()

    def connect() -> _Client:
        release.wait(5)
        return client

    lookups = AsyncLookups(connect, lambda c, keys: [])
    lookups.close(timeout=0.05)  # the owner gives up waiting while the connection is being made
    assert lookups.client is None
    release.set()
    deadline = time.monotonic() + 5
    while not client.closed:
        assert time.monotonic() < deadline, "client made after close() was not closed"
        time.sleep(0.01)
    assert lookups.client is None
