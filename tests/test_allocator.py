"""RangeAllocator: placement, alignment, coalescing, best fit and invariants under random use."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.errors import InvalidArgument
from kvpool.store.allocator import RangeAllocator


def check_invariants(a: RangeAllocator, live: dict[int, int]) -> None:
    """Assert the allocator's accounting matches ``live`` (offset -> rounded size) and is consistent."""
    spans = sorted(live.items())
    for off, size in spans:
        assert off % a.alignment == 0
        assert size % a.alignment == 0
        assert 0 <= off and off + size <= a.capacity
        assert a.size_of(off) == size
    for (o1, s1), (o2, _) in zip(spans, spans[1:], strict=False):
        assert o1 + s1 <= o2, f"allocations overlap: [{o1}, {o1 + s1}) and [{o2}, ...)"
    assert a.used_bytes + a.free_bytes == a.capacity
    assert a.used_bytes == sum(live.values())
    assert a.num_allocations == len(live)
    assert 0 <= a.largest_free <= a.free_bytes
    assert 0.0 <= a.fragmentation() <= 1.0
    # Free blocks are exactly the gaps between allocations (so they are fully coalesced).
    gaps = []
    cursor = 0
    for off, size in spans:
        if off > cursor:
            gaps.append(off - cursor)
        cursor = off + size
    if cursor < a.capacity:
        gaps.append(a.capacity - cursor)
    assert a.num_free_blocks == len(gaps)
    assert a.largest_free == max(gaps, default=0)
    # White box: the free-block indexes agree with each other and with the gaps.
    assert sorted(a._free_start.values()) == sorted(gaps)
    assert {s + o: o for o, s in a._free_start.items()} == a._free_end
    assert a._sizes == sorted(set(gaps))
    assert {(o, s) for s, bin_ in a._bins.items() for o in bin_} == set(a._free_start.items())


# ---------------------------------------------------------------------- basics


def test_fresh_allocator() -> None:
    a = RangeAllocator(1 << 20)
    assert a.capacity == 1 << 20 and a.alignment == 64
    assert a.used_bytes == 0 and a.free_bytes == 1 << 20
    assert a.largest_free == 1 << 20
    assert a.num_allocations == 0 and a.num_free_blocks == 1
    assert a.fragmentation() == 0.0
    assert a.stats() == {
        "capacity": 1 << 20,
        "used": 0,
        "free": 1 << 20,
        "largest_free": 1 << 20,
        "allocations": 0,
        "free_blocks": 1,
        "fragmentation": 0.0,
    }


def test_allocate_free_reuse() -> None:
    a = RangeAllocator(4096, alignment=64)
    x = a.allocate(100)
    y = a.allocate(64)
    assert x == 0 and y == 128
    assert a.size_of(x) == 128 and a.size_of(y) == 64
    assert x in a and 64 not in a
    assert a.used_bytes == 192 and a.num_allocations == 2
    assert a.free(x) == 128
    assert x not in a
    # The hole at 0 is reused by an allocation that fits in it.
    assert a.allocate(128) == 0
    assert a.free(0) == 128
    assert a.free(y) == 64
    assert a.used_bytes == 0 and a.num_free_blocks == 1 and a.largest_free == 4096


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_every_offset_aligned_and_sizes_rounded(alignment: int) -> None:
    a = RangeAllocator(200 * 4 * alignment + 1000, alignment=alignment)
    rng = random.Random(alignment)
    live: dict[int, int] = {}
    for i in range(200):
        req = rng.randint(1, 3 * alignment + 17)
        off = a.allocate(req)
        assert off is not None
        assert off % alignment == 0
        rounded = -(-req // alignment) * alignment
        assert a.size_of(off) == rounded
        live[off] = rounded
        if i % 3 == 2:  # free one at random so later offsets come from reused holes too
            victim = rng.choice(sorted(live))
            assert a.free(victim) == live.pop(victim)
    check_invariants(a, live)


def test_rounding_exact_multiple_not_bumped() -> None:
    a = RangeAllocator(1024, alignment=64)
    off = a.allocate(64)
    assert a.size_of(off) == 64
    off2 = a.allocate(65)
    assert a.size_of(off2) == 128


def test_none_when_full() -> None:
    a = RangeAllocator(1024, alignment=64)
    offs = [a.allocate(64) for _ in range(16)]
    assert offs == [i * 64 for i in range(16)]
    assert a.allocate(1) is None
    assert a.free_bytes == 0 and a.largest_free == 0 and a.num_free_blocks == 0
    assert a.fragmentation() == 0.0
    a.free(offs[5])
    assert a.allocate(65) is None  # 128 bytes needed, only a 64-byte hole
    assert a.allocate(64) == offs[5]


def test_none_when_fragmented() -> None:
    a = RangeAllocator(1024, alignment=64)
    offs = [a.allocate(64) for _ in range(16)]
    for off in offs[::2]:
        a.free(off)
    assert a.free_bytes == 512 and a.largest_free == 64
    assert a.fragmentation() == pytest.approx(1 - 64 / 512)
    assert a.allocate(128) is None


def test_unaligned_capacity_tail_is_free_but_unusable() -> None:
    a = RangeAllocator(100, alignment=64)
    assert a.allocate(64) == 0
    assert a.free_bytes == 36 and a.largest_free == 36
    assert a.allocate(1) is None  # rounds to 64 > 36
    a.free(0)
    assert a.largest_free == 100 and a.num_free_blocks == 1


def test_oversized_request() -> None:
    a = RangeAllocator(4096)
    assert a.allocate(4097) is None
    assert a.allocate(4096) == 0


@pytest.mark.parametrize(
    ("capacity", "alignment"),
    [(0, 64), (-1, 64), (1024, 0), (1024, -64), (1024, 3), (1024, 48), (1.5, 64), ("1024", 64), (1024, 64.0)],
)
def test_bad_constructor_arguments(capacity: object, alignment: object) -> None:
    with pytest.raises(InvalidArgument):
        RangeAllocator(capacity, alignment)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -1, -64, 1.0, "64", None, True])
def test_bad_allocate_size(size: object) -> None:
    a = RangeAllocator(4096)
    with pytest.raises(InvalidArgument):
        a.allocate(size)  # type: ignore[arg-type]
    assert a.used_bytes == 0 and a.num_free_blocks == 1


def test_double_free_and_unknown_offset() -> None:
    a = RangeAllocator(4096)
    off = a.allocate(100)
    assert off is not None
    a.free(off)
    with pytest.raises(InvalidArgument):
        a.free(off)
    with pytest.raises(InvalidArgument):
        a.free(12345)
    off2 = a.allocate(256)
    with pytest.raises(InvalidArgument):
        a.free(off2 + 64)  # inside an allocation, not its start
    with pytest.raises(InvalidArgument):
        a.free(float(off2))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        a.size_of(off2 + 64)
    with pytest.raises(InvalidArgument):
        a.size_of("0")  # type: ignore[arg-type]
    # Failed frees left the state untouched.
    assert a.size_of(off2) == 256 and a.used_bytes == 256
    check_invariants(a, {off2: 256})


# ---------------------------------------------------------------------- coalescing


@pytest.mark.parametrize("seed", range(5))
def test_free_all_in_random_order_coalesces(seed: int) -> None:
    rng = random.Random(seed)
    cap = 1 << 20
    a = RangeAllocator(cap, alignment=64)
    offs = []
    while (off := a.allocate(rng.randint(1, 4000))) is not None:
        offs.append(off)
    assert a.largest_free < 4000 + 64
    rng.shuffle(offs)
    live = {o: a.size_of(o) for o in offs}
    for i, off in enumerate(offs):
        live.pop(off)
        a.free(off)
        if i % 37 == 0:
            check_invariants(a, live)
    assert a.num_allocations == 0
    assert a.num_free_blocks == 1
    assert a.largest_free == cap and a.free_bytes == cap and a.used_bytes == 0
    assert a.fragmentation() == 0.0
    assert a.allocate(cap) == 0


def test_coalesce_left_right_and_both() -> None:
    a = RangeAllocator(64 * 5, alignment=64)
    o = [a.allocate(64) for _ in range(5)]
    assert a.num_free_blocks == 0
    a.free(o[1])
    a.free(o[3])
    assert a.num_free_blocks == 2
    a.free(o[2])  # merges with both neighbours
    assert a.num_free_blocks == 1 and a.largest_free == 192
    a.free(o[0])  # merges with right neighbour
    assert a.num_free_blocks == 1 and a.largest_free == 256
    a.free(o[4])  # merges with left neighbour
    assert a.num_free_blocks == 1 and a.largest_free == 320


# ---------------------------------------------------------------------- best fit


def test_best_fit_takes_smallest_hole_that_fits() -> None:
    k = 1024
    a = RangeAllocator(64 * k, alignment=64)
    # Layout: [big hole 4k][sep][small hole 1k][sep][medium hole 2k][sep][rest free ...]
    big = a.allocate(4 * k)
    sep1 = a.allocate(64)
    small = a.allocate(1 * k)
    sep2 = a.allocate(64)
    medium = a.allocate(2 * k)
    sep3 = a.allocate(64)
    assert None not in (big, sep1, small, sep2, medium, sep3)
    a.free(big)
    a.free(small)
    a.free(medium)
    assert a.num_free_blocks == 4  # 3 holes + the tail

    # Fits only the tail-free / big / medium / small: smallest that fits wins each time.
    assert a.allocate(1 * k) == small
    a.free(small)
    assert a.allocate(512) == small  # smaller than every hole -> the smallest (1k)
    a.free(small)
    assert a.allocate(1 * k + 1) == medium  # too big for 1k -> the 2k hole
    a.free(medium)
    assert a.allocate(2 * k) == medium
    a.free(medium)
    assert a.allocate(3 * k) == big  # too big for 2k -> the 4k hole, not the huge tail
    a.free(big)
    assert a.allocate(5 * k) == sep3 + 64  # too big for every hole -> the tail


def test_best_fit_ties_go_to_most_recently_freed() -> None:
    a = RangeAllocator(64 * 8, alignment=64)
    o = [a.allocate(64) for _ in range(8)]
    for i in (5, 1, 3):
        a.free(o[i])
    assert a.allocate(64) == o[3]
    assert a.allocate(64) == o[1]
    assert a.allocate(64) == o[5]
    assert a.allocate(64) is None


# ---------------------------------------------------------------------- stateful property test


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences; invariants are checked after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = RangeAllocator(64 * 64 + 40, alignment=64)
        self.live: dict[int, int] = {}

    @rule(size=st.integers(min_value=1, max_value=64 * 12))
    def allocate(self, size: int) -> None:
        before = self.alloc.largest_free
        off = self.alloc.allocate(size)
        rounded = -(-size // 64) * 64
        if off is None:
            assert rounded > before
            return
        assert off not in self.live
        self.live[off] = rounded

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        assert self.alloc.free(off) == self.live.pop(off)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        self.alloc.free(off)
        self.live.pop(off)
        with pytest.raises(InvalidArgument):
            self.alloc.free(off)

    @invariant()
    def consistent(self) -> None:
        check_invariants(self.alloc, self.live)
        if not self.live:
            assert self.alloc.num_free_blocks == 1
            assert self.alloc.largest_free == self.alloc.capacity


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
