"""Space in the mounted segments: placement, frees, and fences on ranges a writer may still write.

A range whose writer finished (committed, or told the master its write never started) is free at
once. A range taken back from a writer that did not finish — its put timed out, failed, or its
client died — is *fenced*: it stays allocated until the writer can no longer write into it, i.e.
until both

* ``quarantine_s`` has passed (longer than any writer's transfer timeout, so bytes of a failed
  write still on their way have landed or been refused), and
* the writer's client reported, in a heartbeat, a *floor* above the allocation's generation (no
  write of that generation or older is in flight or can start there any more), and
* the segment's own storage process ran since (``drained``: its heartbeat before last came once
  ``quarantine_s`` had passed). A failed write's bytes may wait in that process's socket for as
  long as it is stopped, and land in the range whenever it runs again: a storage process stopped
  past ``quarantine_s`` (but not declared dead: ``client_ttl_s`` longer) wrote a timed-out put's
  value over the next object placed there, its header intact.

A writer that never reports again (dead, or stopped) holds its fences for ``fence_hold_s``; then
the range is reused but recorded as *suspect*: objects placed over it must carry a checksum, so
that a write landing there much later is caught by readers instead of being returned.

A committed replica dropped while readers hold leases on its object (a forced remove) is *held*:
it stays allocated until the last of those leases ends (:meth:`Space.hold`), so that no new object
is written where a reader may still be reading.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.store.allocator import RangeAllocator
from kvpool.store.objects import Segment

SAMPLE = 8  # segments looked at per placement before a full scan


def _free(s: Segment) -> int:
    return s.alloc.free_bytes


def _largest(s: Segment) -> int:
    return s.alloc.largest_free


@dataclass(slots=True)
class Fence:
    """An allocation taken back from a writer that may still write into it."""

    seg: Segment
    offset: int
    gen: int
    client: str
    since: float


class Space:
    """Segments and their allocators, with the pool's capacity and use kept up to date."""

    def __init__(self, alignment: int, quarantine_s: float, fence_hold_s: float,
                 drained: Callable[[Segment, float], bool] | None = None) -> None:  # fmt: skip
        self.alignment = alignment
        self.quarantine_s = quarantine_s
        self.fence_hold_s = fence_hold_s
        # drained(seg, t): bytes sent to the segment's storage before t have landed or never will
        self.drained = drained
        self.segments: dict[str, Segment] = {}
        self.capacity = 0
        self.used = 0
        self.fenced = 0  # allocations held by fences
        self._live: list[Segment] = []
        self._cursor = 0
        self._max_size = 0
        self._fences: dict[str, list[Fence]] = {}
        self._holds: list[tuple[float, int, Segment, int]] = []  # heap: (until, n, segment, offset)
        self._hold_ids = itertools.count()

    # ------------------------------------------------------------------ segments
    def mount(self, name: str, client: str, base: int, size: int, host_id: str) -> Segment:
        """A new mounted segment."""
        seg = Segment(name, client, base, size, host_id, RangeAllocator(size, self.alignment))
        self.segments[name] = seg
        self._live.append(seg)
        self.capacity += size
        self._max_size = max(self._max_size, size)
        return seg

    def unmount(self, seg: Segment) -> None:
        """Forget a segment's space at once (its objects are let go of by the master)."""
        if seg.dead:
            return
        seg.dead = True
        self.segments.pop(seg.name, None)
        self._live.remove(seg)
        self.capacity -= seg.size
        self.used -= seg.alloc.used_bytes
        self._max_size = max((s.size for s in self._live), default=0)
        for cid in list(self._fences):
            kept = [f for f in self._fences[cid] if f.seg is not seg]
            self.fenced -= len(self._fences[cid]) - len(kept)
            if kept:
                self._fences[cid] = kept
            else:
                del self._fences[cid]

    def fits_anywhere(self, alloc_size: int) -> bool:
        """Whether an allocation this big could fit into some mounted segment at all."""
        return alloc_size <= self._max_size

    # ------------------------------------------------------------------ placement
    def place(
        self, alloc_size: int, n: int, preferred: str | None, exclude: set[Segment], now: float,
        scan: bool = True,
    ) -> list[tuple[Segment, int]]:  # fmt: skip
        """Up to ``n`` allocations on distinct segments: ``preferred`` first, then the emptiest of
        a few sampled segments, then (only when those lack room, and ``scan``) all of them.
        Segments a reader reported unreachable are used last."""
        if n == 1 and preferred is None and not exclude:
            one = self._place_one(alloc_size, now)
            if one is not None:
                return [one]
        out: list[tuple[Segment, int]] = []
        taken = set(exclude)

        def take(s: Segment, reported_ok: bool) -> None:
            if s in taken or s.dead or (s.reported_until > now and not reported_ok):
                return
            if s.alloc.largest_free < alloc_size:
                return
            off = s.alloc.allocate(alloc_size)
            if off is not None:
                self.used += s.alloc.size_of(off)
                taken.add(s)
                out.append((s, off))

        if preferred is not None and preferred in self.segments:
            take(self.segments[preferred], False)
        live = self._live
        if len(out) < n and live:
            # A window of segments that moves on with every placement (no random draw: cheap, and
            # it spreads objects over all segments); the emptiest of the window first.
            k = len(live)
            start = self._cursor % k
            self._cursor = start + SAMPLE
            window = live[start : start + SAMPLE] + (live[: start + SAMPLE - k] if start + SAMPLE > k else [])
            if n == 1 and len(out) == 0:
                take(max(window, key=_free), False)
            if len(out) < n:
                for s in sorted(window, key=_free, reverse=True):
                    if len(out) == n:
                        break
                    take(s, False)
        if len(out) < n and scan:
            for reported_ok in (False, True):
                for s in sorted(live, key=_largest, reverse=True):
                    if len(out) == n:
                        break
                    take(s, reported_ok)
        return out

    def _place_one(self, alloc_size: int, now: float) -> tuple[Segment, int] | None:
        """The common case of :meth:`place` (one replica, no preference): the emptiest segment of
        the moving window when it is usable and has room; None sends the caller the long way."""
        live = self._live
        k = len(live)
        if not k:
            return None
        start = self._cursor % k
        self._cursor = start + SAMPLE
        window = live[start : start + SAMPLE] + (live[: start + SAMPLE - k] if start + SAMPLE > k else [])
        s = max(window, key=_free)
        alloc = s.alloc
        if s.dead or s.reported_until > now or alloc.largest_free < alloc_size:
            return None
        off = alloc.allocate(alloc_size)
        if off is None:
            return None
        self.used += alloc.size_of(off)
        return s, off

    @staticmethod
    def suspect(seg: Segment, offset: int, alloc_size: int) -> bool:
        """Whether an allocation overlaps a range a lost writer may still write into."""
        end = offset + alloc_size
        return any(a < end and offset < b for a, b in seg.suspect)

    def free(self, seg: Segment, offset: int) -> None:
        """Give an allocation back (its writer is done with it)."""
        if not seg.dead:
            self.used -= seg.alloc.free(offset)

    # ------------------------------------------------------------------ fences
    def fence(self, seg: Segment, offset: int, gen: int, client: str, now: float) -> None:
        """Keep an allocation whose writer may still write into it (see the module docstring)."""
        if seg.dead:
            return
        self._fences.setdefault(client, []).append(Fence(seg, offset, gen, client, now))
        self.fenced += 1

    def hold(self, seg: Segment, offset: int, until: float) -> None:
        """Keep an allocation readers may still read (under a lease) until ``until``."""
        if seg.dead:
            return
        heapq.heappush(self._holds, (until, next(self._hold_ids), seg, offset))
        self.fenced += 1

    def release_holds(self, now: float) -> int:
        """Free the held allocations whose leases have ended; returns how many."""
        holds, n = self._holds, 0
        while holds and holds[0][0] <= now:
            _, _, seg, offset = heapq.heappop(holds)
            self.free(seg, offset)
            self.fenced -= 1
            n += 1
        return n

    def has_fences(self, client: str) -> bool:
        """Whether a client's writes hold fences."""
        return client in self._fences

    def release(self, floor_of: Callable[[str], int | None], now: float, only: str | None = None) -> int:
        """Free the fenced allocations nobody can write into any more; returns how many.
        ``floor_of(client)`` is the client's last reported floor (None: gone without one)."""
        freed = 0
        for cid in [only] if only is not None else list(self._fences):
            fences = self._fences.get(cid)
            if not fences:
                continue
            floor = floor_of(cid)
            drained = self.drained
            kept: list[Fence] = []
            for f in fences:
                if now - f.since < self.quarantine_s:
                    kept.append(f)
                elif drained is not None and not drained(f.seg, f.since + self.quarantine_s):
                    kept.append(f)  # its storage did not run since: the write's bytes may still land
                elif floor is not None and f.gen < floor:
                    self.free(f.seg, f.offset)
                    freed += 1
                elif now - f.since >= self.fence_hold_s:
                    # The writer never confirmed: reuse the range, but only for checksummed objects.
                    _add_range(f.seg.suspect, f.offset, f.offset + f.seg.alloc.size_of(f.offset))
                    self.free(f.seg, f.offset)
                    freed += 1
                else:
                    kept.append(f)
            self.fenced -= len(fences) - len(kept)
            if kept:
                self._fences[cid] = kept
            else:
                del self._fences[cid]
        return freed


def _add_range(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    """Add ``[start, end)`` to a list of ranges, merging overlapping and touching ones."""
    ranges.append((start, end))
    ranges.sort()
    merged = [ranges[0]]
    for a, b in ranges[1:]:
        if a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    ranges[:] = merged
