"""The CUDA IPC run planner in C++ (csrc/ipc_plan.cpp: ``_native.ipc_classify`` and
``ipc_addresses``) against a numpy reference written from its contract, on random tables and
requests, edges included (a range ending exactly at a buffer's end, one byte past it, before the
first buffer, a READ into read-only memory, no peer buffers, a wrapping length)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool import _native
from kvpool.errors import InvalidArgument, RemoteAccessError
from kvpool.transfer.transport import READ, WRITE

U64 = np.uint64


def _table(rng: np.random.Generator, m: int, base: int) -> tuple[np.ndarray, np.ndarray]:
    sizes = rng.integers(1, 4096, m).astype(U64)
    gaps = rng.integers(0, 64, m).astype(U64)
    starts = base + np.cumsum(gaps + np.concatenate([[0], sizes[:-1]]).astype(U64)).astype(U64)
    return starts, starts + sizes


def _reference(ops, locs, rems, lens, rs, re_, ro, rg, ps, pe, pg, strict):  # noqa: ANN001, ANN202
    n = len(locs)
    code, bad = 0, -1
    local_gpu = np.zeros(n, bool)
    ridx = np.full(n, -1, np.int64)
    ipc = np.zeros(n, bool)
    staged, all_inside = False, True
    for k in range(n):
        a, ln = int(locs[k]), int(lens[k])
        i = int(np.searchsorted(rs, U64(a), side="right")) - 1
        in_reg = i >= 0 and a < int(re_[i])
        gpu = in_reg and bool(rg[i])
        fits = i >= 0 and a + ln <= int(re_[i])
        if code == 0:
            if strict and not fits:
                code = 1
            elif gpu and not fits:
                code = 3
            elif strict and bool(ro[i]) and ops is not None and ops[k] == READ:
                code = 2
            if code:
                bad = k
        r = int(np.searchsorted(ps, U64(int(rems[k])), side="right")) - 1
        inside = r >= 0 and int(rems[k]) + ln <= int(pe[r])
        local_gpu[k], ridx[k] = gpu, r
        ipc[k] = (inside and bool(pg[r])) or (gpu and inside)
        staged |= gpu and not inside
        all_inside &= inside
    return code, bad, local_gpu, ridx, ipc, staged, all_inside, int(ipc.sum())


@pytest.mark.parametrize("seed", range(40))
def test_classify_matches_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    m, p, n = int(rng.integers(0, 6)), int(rng.integers(0, 5)), int(rng.integers(1, 200))
    rs, re_ = _table(rng, m, 1 << 20)
    ps, pe = _table(rng, p, 1 << 40)
    ro, rg, pg = rng.random(m) < 0.2, rng.random(m) < 0.5, rng.random(p) < 0.5

    # requests near the tables' edges: inside, ending exactly at an end, one byte past, outside
    def near(starts: np.ndarray, ends: np.ndarray, base: int) -> tuple[int, int]:
        if not len(starts) or rng.random() < 0.1:
            return base - 1000 + int(rng.integers(0, 2000)), int(rng.integers(1, 100))
        j = int(rng.integers(0, len(starts)))
        a = int(rng.integers(int(starts[j]), int(ends[j])))
        ln = (
            int(ends[j]) - a + int(rng.choice([0, 0, 1, -1]))
            if rng.random() < 0.5
            else int(rng.integers(1, 64))
        )
        return a, max(ln, 1)

    cols = [near(rs, re_, 1 << 20) for _ in range(n)]
    rcols = [near(ps, pe, 1 << 40) for _ in range(n)]
    if seed % 2:  # runs of requests in one registration / peer buffer (the planner's search hints)
        cols.sort()
        rcols.sort()
    locs = np.array([c[0] for c in cols], U64)
    lens = np.array([c[1] for c in cols], U64)
    rems = np.array([c[0] for c in rcols], U64)
    ops = np.where(rng.random(n) < 0.5, READ, WRITE).astype(np.uint8)
    for strict in (True, False):
        o = ops if strict else np.zeros(0, np.uint8)
        got = _native.ipc_classify(o, locs, rems, lens, rs, re_, ro, rg, ps, pe, pg, strict)
        want = _reference(ops if strict else None, locs, rems, lens, rs, re_, ro, rg, ps, pe, pg, strict)
        assert got[:2] == want[:2]
        for g, w in zip(got[2:5], want[2:5], strict=True):
            assert np.array_equal(g, w)
        assert tuple(got[5:]) == want[5:]


def test_classify_refuses_a_wrapping_length_and_bad_columns() -> None:
    rs, re_ = np.array([1000], U64), np.array([2000], U64)
    flags = np.array([True])
    ps, pe = np.array([10_000], U64), np.array([20_000], U64)
    huge = np.array([(1 << 64) - 10], U64)  # 1500 + huge wraps below the registration's end
    got = _native.ipc_classify(np.array([WRITE], np.uint8), np.array([1500], U64), np.array([10_000], U64),
                               huge, rs, re_, ~flags, flags, ps, pe, flags, True)  # fmt: skip
    assert got[0] == 1 and got[1] == 0
    assert not got[6]  # the remote range wraps too: not inside
    with pytest.raises(InvalidArgument, match="bad column"):
        _native.ipc_classify(np.zeros(2, np.uint8), np.array([1500], U64), np.array([10_000], U64),
                             np.array([8], U64), rs, re_, ~flags, flags, ps, pe, flags, True)  # fmt: skip
    with pytest.raises(InvalidArgument, match="bad column"):  # int32 lengths where uint64 are expected
        one = np.array([8], np.int32)
        _native.ipc_classify(np.zeros(1, np.uint8), np.array([1500], U64), np.array([10_000], U64),
                             one, rs, re_, ~flags, flags, ps, pe, flags, True)  # fmt: skip


def test_addresses_put_the_remote_side_by_direction() -> None:
    ops = np.array([WRITE, READ, WRITE], np.uint8)
    locs = np.array([100, 200, 300], U64)
    rems = np.array([5010, 7020, 5030], U64)
    ridx = np.array([0, 1, 0], np.int64)
    bases = np.array([900_000, 800_000], U64)  # where the peer's buffers are mapped here
    starts = np.array([5000, 7000], U64)
    out = np.zeros(6, U64)
    _native.ipc_addresses(ops, locs, rems, ridx, bases, starts, out.ctypes.data)
    assert out[:3].tolist() == [100, 800_020, 300]  # sources: ours for WRITEs, the peer's for READs
    assert out[3:].tolist() == [900_010, 200, 900_030]
    with pytest.raises(RemoteAccessError, match="mapped"):
        _native.ipc_addresses(ops, locs, rems, np.array([0, -1, 0], np.int64), bases, starts, out.ctypes.data)
    with pytest.raises(RemoteAccessError, match="mapped"):  # a buffer of the run not opened (base 0)
        _native.ipc_addresses(ops, locs, rems, ridx, np.array([900_000, 0], U64), starts, out.ctypes.data)


def test_u64_column_converts_lists_of_ints_and_declines_the_rest() -> None:
    """``_native.u64_column``: a list or tuple of ints in [0, 2**63) as uint64 (equal to numpy's
    conversion); None (the caller's numpy path then names what is wrong) for a negative int, one
    past 2**63, a float, another sequence type - and the engine's column check raises
    InvalidArgument for those exactly as before."""
    from kvpool.transfer.sync import _u64_columns

    class Seven(int):  # an int subclass whose __index__ numpy (and int()) would use
        def __index__(self) -> int:
            return 7

        __int__ = __index__

    big = [0x7F00_0000_0000 + 32768 * i for i in range(4096)]
    for seq in (big, tuple(big), [0, 1, 2**63 - 1], []):
        a = _native.u64_column(seq)
        assert a is not None and a.dtype == U64
        assert a.tolist() == [int(x) for x in seq]
    odd = ([1, -1], [2**63], [2**64 + 5], [1.0], [1, "2"], range(3), np.arange(3), [True, 3], [Seven(3)])
    for bad in odd:
        assert _native.u64_column(bad) is None
    assert _u64_columns(([Seven(3)], [True], [8]))[0].tolist() == [7]  # numpy's reading, as before
    cols = _u64_columns((big, big[::-1], [4096] * len(big)))
    assert [c.tolist() for c in cols] == [big, big[::-1], [4096] * len(big)]
    for bad_cols in (([1], [-1], [8]), ([1], [2], [0]), (["x"], [2], [8]), ([2**64], [2], [8])):
        with pytest.raises(InvalidArgument):
            _u64_columns(bad_cols)
