"""Space allocator the store master uses to place objects inside a client's mounted segment.

The master never touches the segment's bytes: it only hands out ``[offset, offset + size)`` ranges
and takes them back. :class:`RangeAllocator` does best-fit placement with immediate coalescing of
freed ranges, in ``O(log n)`` search plus amortized ``O(1)`` dict updates per call.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from kvpool.errors import InvalidArgument

__all__ = ["RangeAllocator"]


def _check_int(name: str, value: object) -> int:
    """Return ``value`` if it is a plain ``int`` (not ``bool``), else raise :class:`InvalidArgument`."""
    if type(value) is int:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}: {value!r}")


class RangeAllocator:
    """Hands out aligned ``[offset, offset+size)`` ranges of a segment of ``capacity`` bytes.

    Best-fit over free blocks grouped into size bins: a sorted list of the distinct free-block
    sizes (bisect) and, per size, an insertion-ordered dict of the offsets of the blocks of that
    size; plus dicts ``start->size`` and ``end->start`` so a free coalesces with both neighbours in
    ``O(log n)``. (A single sorted list of ``(size, offset)`` would memmove the whole list on every
    call once there are many equal-size holes, which dominate when objects have similar sizes.)

    Every offset handed out is a multiple of ``alignment`` and every size is rounded up to a
    multiple of it. Free blocks therefore always start on an aligned offset; only the block that
    ends at ``capacity`` can have an unaligned end when ``capacity`` is not a multiple of
    ``alignment`` (its unaligned tail counts as free bytes but can never be handed out alone).
    Among free blocks of the best-fitting size, the most recently freed (or split off) one is used.

    Not thread safe: the caller (the store master) serializes calls.
    """

    __slots__ = (
        "capacity",
        "alignment",
        "_mask",
        "_sizes",
        "_bins",
        "_free_start",
        "_free_end",
        "_alloc",
        "_used",
    )

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        """Create an allocator over ``capacity`` bytes (``> 0``) with a power-of-two ``alignment``.

        Raises :class:`InvalidArgument` if ``capacity <= 0`` or ``alignment`` is not a power of two.
        """
        capacity = _check_int("capacity", capacity)
        alignment = _check_int("alignment", alignment)
        if capacity <= 0:
            raise InvalidArgument(f"capacity must be > 0 bytes, got {capacity}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgument(f"alignment must be a power of two (1, 2, 4, ...), got {alignment}")
        self.capacity: int = capacity
        self.alignment: int = alignment
        self._mask: int = alignment - 1
        # Distinct sizes of free blocks, ascending: best fit is the first size >= the request.
        self._sizes: list[int] = [capacity]
        # size -> {offset: None} of the free blocks of that size (insertion ordered, never empty).
        self._bins: dict[int, dict[int, None]] = {capacity: {0: None}}
        self._free_start: dict[int, int] = {0: capacity}  # free block start -> size
        self._free_end: dict[int, int] = {capacity: 0}  # free block end -> start
        self._alloc: dict[int, int] = {}  # allocated offset -> rounded size
        self._used: int = 0

    # ------------------------------------------------------------------ free-block bookkeeping

    def _add_free(self, start: int, size: int) -> None:
        """Record ``[start, start+size)`` as a free block (caller guarantees it is coalesced)."""
        self._free_start[start] = size
        self._free_end[start + size] = start
        bin_ = self._bins.get(size)
        if bin_ is None:
            self._bins[size] = {start: None}
            insort(self._sizes, size)
        else:
            bin_[start] = None

    def _unbin(self, start: int, size: int) -> None:
        """Remove the free block at ``start`` of ``size`` from its size bin."""
        bin_ = self._bins[size]
        del bin_[start]
        if not bin_:
            del self._bins[size]
            sizes = self._sizes
            del sizes[bisect_left(sizes, size)]

    # ------------------------------------------------------------------ allocation

    def allocate(self, size: int) -> int | None:
        """Reserve ``size`` bytes (rounded up to ``alignment``) and return their offset.

        Picks a free block of the smallest size that fits and carves the range from its start.
        Returns ``None`` when no free block is large enough. Raises :class:`InvalidArgument` if
        ``size`` is not a positive int.
        """
        if type(size) is not int:
            size = _check_int("size", size)
        if size <= 0:
            raise InvalidArgument(f"size must be > 0 bytes, got {size}")
        mask = self._mask
        size = (size + mask) & ~mask
        sizes = self._sizes
        i = bisect_left(sizes, size)
        if i == len(sizes):
            return None
        bsize = sizes[i]
        bin_ = self._bins[bsize]
        offset = bin_.popitem()[0]
        if not bin_:
            del self._bins[bsize]
            del sizes[i]
        del self._free_start[offset]
        del self._free_end[offset + bsize]
        if bsize != size:
            self._add_free(offset + size, bsize - size)
        self._alloc[offset] = size
        self._used += size
        return offset

    def free(self, offset: int) -> int:
        """Release the allocation starting at ``offset`` and return its (rounded) size.

        The range is merged with free neighbours on both sides. Raises :class:`InvalidArgument`
        if ``offset`` is not the start of a live allocation (unknown offset or double free).
        """
        if type(offset) is not int:
            offset = _check_int("offset", offset)
        try:
            size = self._alloc.pop(offset)
        except KeyError:
            raise InvalidArgument(
                f"offset {offset!r} is not the start of a live allocation (unknown offset or double free)"
            ) from None
        self._used -= size
        free_start = self._free_start
        free_end = self._free_end
        start = offset
        end = offset + size
        # Merge with the free block right after us.
        rsize = free_start.pop(end, None)
        if rsize is not None:
            self._unbin(end, rsize)
            end += rsize
            del free_end[end]
        # Merge with the free block right before us.
        lstart = free_end.pop(start, None)
        if lstart is not None:
            self._unbin(lstart, start - lstart)
            del free_start[lstart]
            start = lstart
        self._add_free(start, end - start)
        return size

    def size_of(self, offset: int) -> int:
        """Return the (rounded) size allocated at ``offset``.

        Raises :class:`InvalidArgument` if ``offset`` is not the start of a live allocation.
        """
        if type(offset) is not int:
            offset = _check_int("offset", offset)
        try:
            return self._alloc[offset]
        except KeyError:
            raise InvalidArgument(f"offset {offset!r} is not the start of a live allocation") from None

    def __contains__(self, offset: object) -> bool:
        """Whether ``offset`` is the start of a live allocation."""
        return isinstance(offset, int) and not isinstance(offset, bool) and offset in self._alloc

    # ------------------------------------------------------------------ accounting

    @property
    def used_bytes(self) -> int:
        """Bytes held by live allocations (rounded sizes)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Bytes not held by any allocation (``capacity - used_bytes``)."""
        return self.capacity - self._used

    @property
    def largest_free(self) -> int:
        """Size of the largest free block (0 when the segment is full)."""
        sizes = self._sizes
        return sizes[-1] if sizes else 0

    @property
    def num_allocations(self) -> int:
        """Number of live allocations."""
        return len(self._alloc)

    @property
    def num_free_blocks(self) -> int:
        """Number of (maximally coalesced) free blocks."""
        return len(self._free_start)

    def fragmentation(self) -> float:
        """``1 - largest_free / free_bytes``; ``0.0`` when nothing is free.

        0 means all free space is one contiguous block; values near 1 mean it is scattered.
        """
        free_bytes = self.capacity - self._used
        if free_bytes == 0:
            return 0.0
        return 1.0 - self.largest_free / free_bytes

    def stats(self) -> dict[str, float | int]:
        """A snapshot: capacity, used, free, largest_free, allocations, free_blocks, fragmentation."""
        return {
            "capacity": self.capacity,
            "used": self._used,
            "free": self.capacity - self._used,
            "largest_free": self.largest_free,
            "allocations": len(self._alloc),
            "free_blocks": len(self._free_start),
            "fragmentation": self.fragmentation(),
        }

    def __repr__(self) -> str:
        return (
            f"RangeAllocator(capacity={self.capacity}, alignment={self.alignment}, used={self._used}, "
            f"allocations={len(self._alloc)}, free_blocks={len(self._free_start)})"
        )
