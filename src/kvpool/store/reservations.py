"""A store client's write bookkeeping: the allocations it may still write into (its *floor*) and
its reservations (allocations granted ahead of puts of one size and config)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

RESERVE_MAX = 4 << 20  # single puts up to this size use reservations (one round trip)
RESERVE_BYTES = 16 << 20  # bytes of reservations asked for at a time, per (size, config)
RESERVE_LOW = 6  # below this many left, a pool is refilled in the background
RESERVE_BATCH_MAX = 64  # batch puts of up to this many equal-sized values use reservations


def mounts_of(reply: dict[str, Any]) -> dict[str, int]:
    """The ``mounts`` of a master's reply that grants allocations (segment -> the mount id the
    grant is on, which a failed write's report names); empty from an older master (its reports
    name the segment alone) or when not a map of names to ints."""
    m = reply.get("mounts")
    if not isinstance(m, dict):
        return {}
    return {k: v for k, v in m.items() if type(k) is str and type(v) is int}


def reserve_count(size: int) -> int:
    """How many reservations to ask for with a put of ``size`` bytes (2 to 16)."""
    return max(2, min(16, RESERVE_BYTES // size)) if 0 < size <= RESERVE_MAX else 0


class WriteFloor:
    """Allocations this client may still write into; their oldest is the floor it reports to the
    master in every heartbeat (the master reuses space taken back from it only below that)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epoch = 0
        self.inflight: dict[int, int] = {}  # generation -> writes into it not yet ended
        self.max_seen = 0
        # (epoch, generations, settled) of writes whose GPU copies may run after their call raised
        self.late: list[tuple[int, list[int], Callable[[], bool]]] = []

    def begin(self, epoch: int, gens: Sequence[int]) -> None:
        """Allocations received (called before anything is written into them)."""
        with self.lock:
            if epoch != self.epoch:
                self.epoch, self.max_seen = epoch, 0
                self.inflight.clear()
            inflight = self.inflight
            for g in gens:
                inflight[g] = inflight.get(g, 0) + 1
            if gens:
                self.max_seen = max(self.max_seen, max(gens))

    def end(self, epoch: int, gens: Sequence[int]) -> None:
        """Allocations this client will not write into any more."""
        with self.lock:
            if epoch != self.epoch:
                return
            inflight = self.inflight
            for g in gens:
                n = inflight.get(g, 0) - 1
                if n > 0:
                    inflight[g] = n
                else:
                    inflight.pop(g, None)

    def end_when(self, epoch: int, gens: Sequence[int], settled: Callable[[], bool]) -> None:
        """Allocations a write may still write into after its call raised (a TransferTimeout's
        GPU copies; ``settled`` answers without blocking whether they ended): ended by
        :meth:`floor` once ``settled()`` is True, the floor staying at or below them until then."""
        with self.lock:
            self.late.append((epoch, list(gens), settled))

    def floor(self) -> int:
        """Every allocation older than this is done with. Called by the heartbeat thread (and at
        unregister); ends the late writes whose copies ended first."""
        if self.late:
            with self.lock:
                late, self.late = self.late, []
            keep = []
            for epoch, gens, settled in late:
                if settled():
                    self.end(epoch, gens)
                else:
                    keep.append((epoch, gens, settled))
            with self.lock:
                self.late = keep + self.late
        with self.lock:
            return min(self.inflight) if self.inflight else self.max_seen + 1


class Resv(NamedTuple):
    """A reservation: an allocation granted ahead of a put of this size and config."""

    deadline: float  # no write starts into it after this
    epoch: int
    gen: int
    verify: bool
    replicas: list[list[Any]]
    mounts: dict[str, int]  # segment -> the mount the grant is on (see :func:`mounts_of`)


class ReservationPool:
    """Reservations by (size, config). Puts take them; pools running low are marked for the
    heartbeat thread to refill (``wanted`` is set); every reservation held counts in the floor."""

    def __init__(self, writes: WriteFloor) -> None:
        self.writes = writes
        self.lock = threading.Lock()
        self._pools: dict[tuple[Any, ...], list[Resv]] = {}
        self._refilling: dict[tuple[Any, ...], tuple[int, Any]] = {}
        self.wanted = threading.Event()

    def add(self, key: tuple[Any, ...], epoch: int, granted: list[list[Any]], deadline: float,
            current_epoch: int | None, mounts: dict[str, int] | None = None) -> None:  # fmt: skip
        """Reservations from a reply of the master of ``epoch`` (dropped if it is not current);
        ``mounts``: the reply's (:func:`mounts_of`; None: unknown, reports name the segment)."""
        if not granted:
            return
        self.writes.begin(epoch, [g[0] for g in granted])
        m = {} if mounts is None else mounts
        entries = [Resv(deadline, epoch, gen, verify, reps, m) for gen, verify, reps in granted]
        with self.lock:
            if epoch == current_epoch:
                self._pools.setdefault(key, [])[:0] = entries
                return
        self.writes.end(epoch, [e.gen for e in entries])

    def take(self, key: tuple[Any, ...], size: int, config: Any) -> Resv | None:
        """A reservation still open for writing (the caller ends it in the floor), or None."""
        now = time.monotonic()
        expired: list[Resv] = []
        with self.lock:
            pool = self._pools.get(key)
            while pool and pool[-1].deadline < now:
                expired.append(pool.pop())  # no write starts into them any more
            entry = pool.pop() if pool else None
            if (
                entry is not None
                and pool is not None
                and len(pool) < RESERVE_LOW
                and key not in self._refilling
            ):
                self._refilling[key] = (size, config)
                self.wanted.set()
        for e in expired:
            self.writes.end(e.epoch, [e.gen])
        return entry

    def take_many(self, key: tuple[Any, ...], n: int) -> tuple[list[Resv], int] | None:
        """``n`` reservations still open for writing and how many are left after them, or None
        (nothing taken) when fewer are held. The caller ends the ones taken in the floor; a pool
        running low is not marked for refill here (a batch asks for more with its commit)."""
        now = time.monotonic()
        expired: list[Resv] = []
        with self.lock:
            pool = self._pools.get(key)
            while pool and pool[-1].deadline < now:
                expired.append(pool.pop())
            if pool is None or len(pool) < n:
                taken = None
            else:
                taken = pool[-n:]
                del pool[-n:]
                left = len(pool)
        for e in expired:
            self.writes.end(e.epoch, [e.gen])
        return None if taken is None else (taken, left)

    def drop_on(self, segments: set[str]) -> list[Resv]:
        """Take out the reservations with a replica on any of ``segments`` (writes there failed)
        and end them in the floor; the caller revokes them (nothing was written into them)."""
        out: list[Resv] = []
        with self.lock:
            for pool in self._pools.values():
                bad = [e for e in pool if any(r[0] in segments for r in e.replicas)]
                if bad:
                    out += bad
                    pool[:] = [e for e in pool if not any(r[0] in segments for r in e.replicas)]
        for e in out:
            self.writes.end(e.epoch, [e.gen])
        return out

    def expire(self) -> None:
        """Let go of reservations past their deadline."""
        now = time.monotonic()
        dropped: list[Resv] = []
        with self.lock:
            for pool in self._pools.values():
                while pool and pool[-1].deadline < now:
                    dropped.append(pool.pop())
        for e in dropped:
            self.writes.end(e.epoch, [e.gen])

    def clear(self) -> list[Resv]:
        """Take every reservation out (the master changed, or the client closes)."""
        with self.lock:
            out = [e for pool in self._pools.values() for e in pool]
            self._pools.clear()
        for e in out:
            self.writes.end(e.epoch, [e.gen])
        return out

    def to_refill(self) -> dict[tuple[Any, ...], tuple[int, Any]]:
        """The pools marked as running low (size, config), unmarked."""
        with self.lock:
            wanted, self._refilling = self._refilling, {}
            self.wanted.clear()
        return wanted

    def held(self) -> list[Resv]:
        """A copy of every reservation held (tests look at them)."""
        with self.lock:
            return [e for pool in self._pools.values() for e in pool]
