"""Where the objects a client put or read live, so that it reads them without asking the master
(one engine READ, checked by header and checksum; a failed check falls back to the master).

Objects with a committed checksum (every object up to 64 KiB; all with ``checksum=True``) are
kept after every put and read. A bigger object without one is kept after its *second* read
through the master: that read (leased, header-checked, so the bytes are the object's) gives this
client a checksum of its own (``kind`` :data:`LOCAL`; xxh3 at ~65 GB/s, 16 us per MiB); the
first read only notes the object (:data:`SEEN`, not usable for a read), so keys read once cost
nothing extra.

Each entry is kept as one packed ``bytes`` record, not as tuples: a ``bytes`` object is not
tracked by Python's garbage collector, so a cache that grows by one entry per put does not make
the collector run (tuples would: every put left ~3 new tracked objects behind, a batch put of 32
objects ~100, and the collector then ran every few batches — about 55 us per 32-object batch put,
full passes over the whole heap included). :meth:`LocationCache.get` unpacks one on demand."""

from __future__ import annotations

import collections
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

COMMITTED = 0  # the checksum is the one committed with the object (its header carries it)
LOCAL = 1  # the checksum was computed by this client from a leased, header-checked read
SEEN = 2  # read once through the master, no checksum: not usable for a read without the master

_HEAD = struct.Struct("<QQQQdB")  # epoch, gen, size, checksum, since, kind
_REP = struct.Struct("<IQ")  # segment number (see LocationCache._seg_ids), address
_ONE = struct.Struct(_HEAD.format + _REP.format[1:])  # an entry of one replica, packed at once


class Loc(NamedTuple):
    """A committed object's location."""

    epoch: int
    gen: int
    size: int
    csum: int
    replicas: tuple[tuple[str, int], ...]  # (segment, address)
    since: float
    kind: int = COMMITTED  # COMMITTED, LOCAL or SEEN


class LocationCache:
    """LRU of :class:`Loc` by key: at most ``capacity`` entries, each used for ``ttl_s``."""

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._loc: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._seg_ids: dict[str, int] = {}  # segment name -> number in the records (only grows:
        self._seg_names: list[str] = []  # one entry per segment this client ever wrote to or read)

    def _seg_id(self, seg: str) -> int:
        """The number of segment ``seg`` in the records (given on first use, never reused)."""
        sid = self._seg_ids.get(seg)
        if sid is None:
            with self._lock:
                sid = self._seg_ids.setdefault(seg, len(self._seg_names))
                if sid == len(self._seg_names):
                    self._seg_names.append(seg)
        return sid

    def _record(self, epoch: int, gen: int, size: int, csum: int, since: float, segments: Sequence[str],
                replicas: list[list[Any]], kind: int = COMMITTED) -> bytes | None:  # fmt: skip
        """The packed entry of the replicas written completely (segment in ``segments``)."""
        if len(replicas) == 1:  # the usual case: one replica, packed at once
            seg = replicas[0][0]
            if seg not in segments:
                return None
            return _ONE.pack(epoch, gen, size, csum, since, kind, self._seg_id(seg), replicas[0][1])
        reps = b""
        for r in replicas:
            seg = r[0]
            if seg not in segments:
                continue
            reps += _REP.pack(self._seg_id(seg), r[1])
        if not reps:
            return None
        return _HEAD.pack(epoch, gen, size, csum, since, kind) + reps

    def remember(self, key: str, epoch: int, gen: int, size: int, csum: int | None,
                 segments: Sequence[str], replicas: list[list[Any]]) -> None:  # fmt: skip
        """A committed object with a committed checksum, on ``segments``. Called
        after every small put and every read the master answered; any other entry of ``key`` is
        dropped (a big object put again after a remove elsewhere must not be read at its old place)."""
        if self.capacity <= 0:
            return
        if csum is None:
            self.forget(key)
            return
        rec = self._record(epoch, gen, size, csum, time.monotonic(), segments, replicas)
        if rec is not None:
            self._insert(((key, rec),))

    def remember_read(self, key: str, epoch: int, gen: int, size: int, csum: int | None,
                      segments: Sequence[str], replicas: list[list[Any]]) -> None:  # fmt: skip
        """A big object read through the master, without a committed checksum: ``csum`` is this
        client's own (kept as :data:`LOCAL`), or None to note the first read (:data:`SEEN`)."""
        if self.capacity <= 0:
            return
        kind, value = (SEEN, 0) if csum is None else (LOCAL, csum)
        rec = self._record(epoch, gen, size, value, time.monotonic(), segments, replicas, kind)
        if rec is not None:
            self._insert(((key, rec),))

    def remember_many(self, epoch: int, items: Sequence[tuple[str, int, int, int | None, Sequence[str],
                                                             list[list[Any]]]]) -> None:  # fmt: skip
        """:meth:`remember` for many objects of one epoch: (key, gen, size, csum, segments, replicas)."""
        if self.capacity <= 0:
            return
        now = time.monotonic()
        new: list[tuple[str, bytes]] = []
        for key, gen, size, csum, segments, replicas in items:
            if csum is None:
                self.forget(key)
                continue
            rec = self._record(epoch, gen, size, csum, now, segments, replicas)
            if rec is not None:
                new.append((key, rec))
        if new:
            self._insert(new)

    def _insert(self, entries: Sequence[tuple[str, bytes]]) -> None:
        """Add (key, record) entries as the most recent; the oldest go beyond ``capacity``."""
        loc = self._loc
        with self._lock:
            for key, rec in entries:
                if key in loc:
                    loc.move_to_end(key)  # a new key goes to the end by itself
                loc[key] = rec
            while len(loc) > self.capacity:
                loc.popitem(last=False)

    def get(self, key: str, epoch: int | None) -> Loc | None:
        """The location of ``key`` under the master of ``epoch`` (None: unknown, stale, expired)."""
        rec = self._loc.get(key)
        if rec is None:
            return None
        e, gen, size, csum, since, kind = _HEAD.unpack_from(rec)
        if e != epoch or time.monotonic() - since > self.ttl_s:
            self.forget(key)
            return None
        names = self._seg_names
        reps = tuple((names[sid], addr) for sid, addr in _REP.iter_unpack(rec[_HEAD.size :]))
        return Loc(e, gen, size, csum, reps, since, kind)

    def forget(self, key: str) -> None:
        """Drop one location (it did not check out, or the key was removed)."""
        if key in self._loc:
            with self._lock:
                self._loc.pop(key, None)

    def clear(self) -> None:
        """Drop every location (the master changed)."""
        with self._lock:
            self._loc.clear()
