"""Where the small objects a client put or read live, so that it reads them without asking the
master (one engine READ, checked by header and checksum; a failed check falls back to the master)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvpool.store.layout import CHECKSUM_ALWAYS_MAX


class Loc(NamedTuple):
    """A small committed object's location."""

    epoch: int
    gen: int
    size: int
    csum: int
    replicas: tuple[tuple[str, int], ...]  # (segment, address): tuples of atoms, which the garbage
    since: float  # collector stops tracking, so 100,000s of entries do not slow its full passes


def _written(segments: Sequence[str], replicas: list[list[Any]]) -> tuple[tuple[str, int], ...]:
    """(segment, address) of the replicas written completely (their segment in ``segments``)."""
    if len(replicas) == 1:
        r = replicas[0]
        return ((r[0], r[1]),) if r[0] in segments else ()
    return tuple((r[0], r[1]) for r in replicas if r[0] in segments)


class LocationCache:
    """LRU of :class:`Loc` by key: at most ``capacity`` entries, each used for ``ttl_s``."""

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._loc: collections.OrderedDict[str, Loc] = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, key: str, epoch: int, gen: int, size: int, csum: int | None,
                 segments: Sequence[str], replicas: list[list[Any]]) -> None:  # fmt: skip
        """A committed object (only small ones with a checksum are kept), on ``segments``. Called
        after every small put: one entry without :meth:`remember_many`'s lists."""
        if self.capacity <= 0 or csum is None or size > CHECKSUM_ALWAYS_MAX:
            return
        reps = _written(segments, replicas)
        if not reps:
            return
        entry = Loc(epoch, gen, size, csum, reps, time.monotonic())
        loc = self._loc
        with self._lock:
            loc[key] = entry
            loc.move_to_end(key)
            while len(loc) > self.capacity:
                loc.popitem(last=False)

    def remember_many(self, epoch: int, items: Sequence[tuple[str, int, int, int | None, Sequence[str],
                                                             list[list[Any]]]]) -> None:  # fmt: skip
        """:meth:`remember` for many objects of one epoch: (key, gen, size, csum, segments, replicas)."""
        if self.capacity <= 0:
            return
        now = time.monotonic()
        new: list[tuple[str, Loc]] = []
        for key, gen, size, csum, segments, replicas in items:
            if csum is None or size > CHECKSUM_ALWAYS_MAX:
                continue
            reps = _written(segments, replicas)
            if reps:
                new.append((key, Loc(epoch, gen, size, csum, reps, now)))
        if not new:
            return
        loc = self._loc
        with self._lock:
            for key, entry in new:
                loc[key] = entry
                loc.move_to_end(key)
            while len(loc) > self.capacity:
                loc.popitem(last=False)

    def get(self, key: str, epoch: int | None) -> Loc | None:
        """The location of ``key`` under the master of ``epoch`` (None: unknown, stale, expired)."""
        loc = self._loc.get(key)
        if loc is None:
            return None
        if loc.epoch != epoch or time.monotonic() - loc.since > self.ttl_s:
            self.forget(key)
            return None
        return loc

    def forget(self, key: str) -> None:
        """Drop one location (it did not check out, or the key was removed)."""
        if key in self._loc:
            with self._lock:
                self._loc.pop(key, None)

    def clear(self) -> None:
        """Drop every location (the master changed)."""
        with self._lock:
            self._loc.clear()
