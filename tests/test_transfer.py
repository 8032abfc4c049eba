"""Transfer engine against real target processes over loopback: integrity, batches, concurrency."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import numpy as np
import pytest
import xxhash

from kvpool import OpCode, TransferEngine, TransferRequest, TransferState, _native
from kvpool.errors import (
    AddressNotRegistered,
    InvalidArgument,
    KvpoolError,
    RegistrationError,
    RemoteAccessError,
    TransferError,
)
from kvpool.transfer.peer import PeerProcess

SIZES = [1, 7, 4096, 65537, 1 << 20, (4 << 20) + 3, 64 << 20]


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"{n}B")
def test_write_then_read_integrity(peer: PeerProcess, protocol: str, size: int) -> None:
    with TransferEngine(protocol=protocol, timeout_s=5.0) as eng:
        src = bytearray(size)
        back = bytearray(size)
        saddr = eng.register_local_memory(src)
        baddr = eng.register_local_memory(back)
        _native.fill_pattern(saddr, size, size + len(protocol))
        h = eng.open_segment(peer.segment)
        assert eng.uses_same_host_path(h) == (protocol == "auto")
        offset = 3 if size < (64 << 20) else 0  # unaligned remote address where it fits
        assert eng.transfer_sync(peer.segment, saddr, peer.addr + offset, size, OpCode.WRITE) == size
        assert peer.checksum(offset, size) == xxhash.xxh3_64_hexdigest(src)
        assert eng.transfer_sync(peer.segment, baddr, peer.addr + offset, size, OpCode.READ) == size
        assert back == src


def test_batch_api_statuses(peer: PeerProcess, tcp_engine: TransferEngine) -> None:
    eng = tcp_engine
    n, bs = 16, 64 << 10
    src = bytearray(n * bs)
    saddr = eng.register_local_memory(src)
    _native.fill_pattern(saddr, len(src), 42)
    h = eng.open_segment(peer.segment)
    bid = eng.allocate_batch_id(n + 4)
    assert eng.get_transfer_status(bid, n).state == TransferState.WAITING
    eng.submit_transfer(
        bid, [TransferRequest(OpCode.WRITE, saddr + i * bs, h, peer.addr + i * bs, bs) for i in range(n)]
    )
    st = eng.wait_batch(bid, timeout_s=10)
    assert st.state == TransferState.COMPLETED and st.transferred_bytes == n * bs
    assert eng.batch_settled(bid)  # nothing of it copies any more
    for bad in ("1", 1.0, None):  # a TransferTimeout's batch_id is an int: anything else is refused
        with pytest.raises(InvalidArgument, match="batch_id"):
            eng.batch_settled(bad)  # type: ignore[arg-type]
    for i in range(n):
        s = eng.get_transfer_status(bid, i)
        assert s.state == TransferState.COMPLETED and s.transferred_bytes == bs and s.error is None
    # Slots beyond the submitted ones stay WAITING; submitting past capacity is refused.
    assert eng.get_transfer_status(bid, n).state == TransferState.WAITING
    with pytest.raises(Exception, match="batch is full"):
        eng.submit_transfer(bid, [TransferRequest(OpCode.WRITE, saddr, h, peer.addr, 1)] * 5)
    eng.free_batch_id(bid)
    assert peer.checksum(0, n * bs) == xxhash.xxh3_64_hexdigest(src)


def test_camelcase_aliases(peer: PeerProcess) -> None:
    with TransferEngine(protocol="tcp") as eng:
        buf = bytearray(b"x" * 4096)
        addr = eng.registerLocalMemory(buf)
        h = eng.openSegment(peer.segment)
        bid = eng.allocateBatchID(1)
        eng.submitTransfer(bid, [TransferRequest(OpCode.WRITE, addr, h, peer.addr, 4096)])
        assert eng.wait_batch(bid).state == TransferState.COMPLETED
        assert eng.getTransferStatus(bid, 0).state == TransferState.COMPLETED
        eng.freeBatchID(bid)
        eng.unregisterLocalMemory(addr)
        assert peer.checksum(0, 4096) == xxhash.xxh3_64_hexdigest(b"x" * 4096)


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_concurrent_batches_from_threads(peer: PeerProcess, protocol: str) -> None:
    threads, rounds, n, bs = 6, 20, 8, 32 << 10
    with TransferEngine(protocol=protocol, timeout_s=10) as eng:
        h = eng.open_segment(peer.segment)
        bufs = [bytearray(n * bs) for _ in range(threads)]
        backs = [bytearray(n * bs) for _ in range(threads)]
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                la = eng.register_local_memory(bufs[t])
                lb = eng.register_local_memory(backs[t])
                region = peer.addr + t * n * bs
                for r in range(rounds):
                    _native.fill_pattern(la, n * bs, t * 1000 + r)
                    for op, local in ((OpCode.WRITE, la), (OpCode.READ, lb)):
                        bid = eng.allocate_batch_id(n)
                        eng.submit_transfer(
                            bid,
                            [TransferRequest(op, local + i * bs, h, region + i * bs, bs) for i in range(n)],
                        )
                        assert eng.wait_batch(bid, timeout_s=20).state == TransferState.COMPLETED
                        eng.free_batch_id(bid)
                    assert backs[t] == bufs[t], f"thread {t} round {r} read back other bytes"
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join(60)
        assert not errors, errors[0]


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_twenty_thousand_scattered_requests_in_one_batch(peer: PeerProcess, protocol: str) -> None:
    n, bs = 20_000, 512
    rng = random.Random(5)
    slots = rng.sample(range((64 << 20) // bs), n)  # scattered remote blocks
    with TransferEngine(protocol=protocol, timeout_s=10) as eng:
        src = bytearray(n * bs)
        back = bytearray(n * bs)
        saddr = eng.register_local_memory(src)
        baddr = eng.register_local_memory(back)
        _native.fill_pattern(saddr, len(src), 99)
        h = eng.open_segment(peer.segment)
        for op, local in ((OpCode.WRITE, saddr), (OpCode.READ, baddr)):
            bid = eng.allocate_batch_id(n)
            eng.submit_transfer(
                bid,
                [TransferRequest(op, local + i * bs, h, peer.addr + s * bs, bs) for i, s in enumerate(slots)],
            )
            st = eng.wait_batch(bid, timeout_s=60)
            assert st.state == TransferState.COMPLETED, st
            assert st.transferred_bytes == n * bs
            eng.free_batch_id(bid)
        assert back == src


def test_batch_transfer_sync_and_async_wait(peer: PeerProcess, tcp_engine: TransferEngine) -> None:
    eng = tcp_engine
    bs, n = 8192, 10
    src = bytearray(n * bs)
    saddr = eng.register_local_memory(src)
    _native.fill_pattern(saddr, len(src), 3)
    total = eng.batch_transfer_sync(
        peer.segment, [saddr + i * bs for i in range(n)], [peer.addr + i * bs for i in range(n)], [bs] * n
    )
    assert total == n * bs
    assert peer.checksum(0, n * bs) == xxhash.xxh3_64_hexdigest(src)

    async def go() -> TransferState:
        h = eng.open_segment(peer.segment)
        bid = eng.allocate_batch_id(1)
        eng.submit_transfer(bid, [TransferRequest(OpCode.READ, saddr, h, peer.addr, bs)])
        st = await eng.wait_batch_async(bid, timeout_s=10)
        eng.free_batch_id(bid)
        return st.state

    assert asyncio.run(go()) == TransferState.COMPLETED


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_scattered_ranges_from_several_peers_at_once(protocol: str) -> None:
    """``batch_transfer_sync_multi``: thousands of small scattered ranges (a resharded KV load's
    head slices) from two peers in one wait land byte-exact (same host: many slices per
    process_vm_readv); a bad range in one part fails the whole call after the rest finished."""
    with PeerProcess(8 << 20) as p1, PeerProcess(8 << 20) as p2, TransferEngine(protocol=protocol) as eng:
        dst, ref = bytearray(24 << 20), bytearray(8 << 20)
        d, rf = eng.register_local_memory(dst), _native.buffer_address(ref)[0]
        sizes = [1024, 4096, 8192, 100, 16384]
        parts, checks = [], []
        off = 0
        for k, peer in enumerate((p1, p2)):
            peer.fill(k + 5)
            _native.fill_pattern(rf, len(ref), k + 5)  # the same pattern here, to compare with
            pattern = bytes(ref)
            locs, rems, lens = [], [], []
            for i in range(1500):
                n = sizes[i % len(sizes)]
                r = (i * 4099 + k * 7) % ((8 << 20) - n)
                locs.append(d + off)
                rems.append(peer.addr + r)
                lens.append(n)
                checks.append((off, pattern[r : r + n]))
                off += n + 64  # gaps: no two ranges merge
            parts.append((peer.segment, locs, rems, lens))
        total = sum(sum(p[3]) for p in parts)
        assert eng.batch_transfer_sync_multi(parts, OpCode.READ) == total
        bad_ranges = [i for i, (o, want) in enumerate(checks) if bytes(dst[o : o + len(want)]) != want]
        assert not bad_ranges, f"{len(bad_ranges)} ranges wrong, first {bad_ranges[:5]}"
        bad = (p2.segment, [d], [p2.addr + (9 << 20)], [64])  # outside p2's buffer
        with pytest.raises(RemoteAccessError):
            eng.batch_transfer_sync_multi([parts[0], bad], OpCode.READ)


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
@pytest.mark.parametrize("columns", ["lists", "numpy"])
def test_a_few_ranges_from_several_peers_move_in_one_native_call(
    protocol: str, columns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``batch_transfer_sync_multi`` with a few ranges per peer (a short resharded KV load) runs
    in the calling thread as one native call, no batch: READs and WRITEs land byte-exact on both
    peers; a bad range in the second part is a typed error; a peer killed since is a typed error,
    and the next call opens the segments again."""
    with PeerProcess(1 << 20) as p1, PeerProcess(1 << 20) as p2, TransferEngine(protocol=protocol) as eng:
        dst = bytearray(1 << 20)
        d = eng.register_local_memory(dst)
        p1.fill(11)
        p2.fill(12)
        ref = {}
        for peer, seed in ((p1, 11), (p2, 12)):
            buf = bytearray(1 << 20)
            _native.fill_pattern(_native.buffer_address(buf)[0], len(buf), seed)
            ref[peer.segment] = bytes(buf)

        def part(peer: PeerProcess, base: int) -> tuple[str, Any, Any, Any]:
            locs = [d + base + i * 8192 for i in range(16)]  # every other 4 KiB: 16 scattered ranges
            rems = [peer.addr + 65536 + i * 4096 for i in range(16)]  # one contiguous run
            lens = [4096] * 16
            cols = (
                (locs, rems, lens)
                if columns == "lists"
                else tuple(np.array(c, np.uint64) for c in (locs, rems, lens))
            )
            return (peer.segment, *cols)

        parts = [part(p1, 0), part(p2, 4096)]
        for seg, *_ in parts:
            eng.open_segment(seg)
        real_alloc = eng.allocate_batch_id
        monkeypatch.setattr(eng, "allocate_batch_id", lambda n: pytest.fail("a batch was used"))
        assert eng.batch_transfer_sync_multi(parts, OpCode.READ) == 2 * 16 * 4096
        for i in range(16):
            assert (
                dst[i * 8192 : i * 8192 + 4096] == ref[p1.segment][65536 + i * 4096 : 65536 + (i + 1) * 4096]
            )
            assert (
                dst[i * 8192 + 4096 : (i + 1) * 8192]
                == ref[p2.segment][65536 + i * 4096 : 65536 + (i + 1) * 4096]
            )
        # WRITE back to other places of both peers, then read it again
        back = [
            (seg, [d + 0], [addr + 4096], [8192])
            for seg, addr in ((p1.segment, p1.addr), (p2.segment, p2.addr))
        ]
        assert eng.batch_transfer_sync_multi(back, OpCode.WRITE) == 2 * 8192
        assert (
            p1.checksum(4096, 8192) == p2.checksum(4096, 8192) == xxhash.xxh3_64_hexdigest(bytes(dst[:8192]))
        )
        bad = (p2.segment, [d], [p2.addr + (2 << 20)], [64])  # outside p2's buffer
        with pytest.raises(RemoteAccessError):
            eng.batch_transfer_sync_multi([parts[0], bad], OpCode.READ)
        monkeypatch.setattr(eng, "allocate_batch_id", real_alloc)
        p2.proc.kill()
        p2.proc.wait()
        with pytest.raises(KvpoolError):
            eng.batch_transfer_sync_multi(parts, OpCode.READ)


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
@pytest.mark.parametrize("columns", ["lists", "numpy"])
def test_gather_and_scatter_between_one_run_and_strided_blocks(protocol: str, columns: str) -> None:
    """Many ranges contiguous on one side and strided on the other (a resharded load's head
    slices: one prefill run into every other half-block here; the same host shares one iovec
    per side's run) land byte-exact both ways, as lists or numpy columns; bad columns are a
    typed error before anything moves."""
    n, size = 700, 12 << 10
    with PeerProcess(32 << 20) as peer, TransferEngine(protocol=protocol) as eng:
        peer.fill(3)
        ref = bytearray(32 << 20)
        _native.fill_pattern(_native.buffer_address(ref)[0], len(ref), 3)
        dst = bytearray(2 * n * size)
        d = eng.register_local_memory(dst)
        locs = [d + 2 * i * size + size for i in range(n)]  # the second half of every block
        rems = [peer.addr + 4096 + i * size for i in range(n)]  # one run on the peer
        lens = [size] * n
        cols = (locs, rems, lens)
        if columns == "numpy":
            cols = tuple(np.array(c, np.uint64) for c in cols)
        assert eng.batch_transfer_sync(peer.segment, *cols, OpCode.READ) == n * size
        for i in range(n):
            assert dst[2 * i * size : 2 * i * size + size] == bytes(size), f"block {i}: first half touched"
            got = dst[2 * i * size + size : 2 * (i + 1) * size]
            assert got == ref[4096 + i * size : 4096 + (i + 1) * size], f"block {i}: wrong bytes"
        # and back: the strided halves written as one run elsewhere on the peer
        back = [peer.addr + (16 << 20) + i * size for i in range(n)]
        rcols = (locs, back, lens) if columns == "lists" else (cols[0], np.array(back, np.uint64), cols[2])
        assert eng.batch_transfer_sync(peer.segment, *rcols, OpCode.WRITE) == n * size
        want = xxhash.xxh3_64_hexdigest(bytes(ref[4096 : 4096 + n * size]))
        assert peer.checksum(16 << 20, n * size) == want
        for bad in (
            (np.array(locs, np.float64), rems, lens),  # not integers
            (locs, rems, [size] * (n - 1) + [0]),  # an empty range
            (locs, [-1] + rems[1:], lens),  # a negative address
        ):
            with pytest.raises(InvalidArgument):
                eng.batch_transfer_sync(peer.segment, *bad, OpCode.READ)
        with pytest.raises(RemoteAccessError):  # the last range past the peer's buffer
            past = rems[:-1] + [peer.addr + (32 << 20) - 100]
            eng.batch_transfer_sync(peer.segment, locs, past, lens, OpCode.READ)


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_a_few_ranges_in_the_calling_thread_land_in_order(peer: PeerProcess, protocol: str) -> None:
    """A short batch_transfer_sync (a store value and its header) is done in the calling thread
    as one exchange: the ranges land in the order given, reads come back whole, and from many
    threads at once (lanes busy: the rest is queued) every caller gets its own bytes."""
    with TransferEngine(protocol=protocol, timeout_s=5.0) as eng:
        mib = 1 << 20
        src, back, hdr = bytearray(mib), bytearray(mib), bytearray(64)
        s, b, h = (eng.register_local_memory(x) for x in (src, back, hdr))
        _native.fill_pattern(s, mib, 11)
        base = peer.addr + (8 << 20)
        # the value, then a 64-byte "header" over its first bytes: the second range wins
        assert eng.batch_transfer_sync(peer.segment, [s, s + 4096], [base, base], [mib, 64]) == mib + 64
        want = bytes(src[4096 : 4096 + 64]) + bytes(src[64:])
        assert peer.checksum(8 << 20, mib) == xxhash.xxh3_64_hexdigest(want)
        got = eng.batch_transfer_sync(peer.segment, [b, h], [base + 64, base], [mib - 64, 64], OpCode.READ)
        assert got == mib and bytes(back[: mib - 64]) == want[64:] and bytes(hdr) == want[:64]
        with pytest.raises(RemoteAccessError):  # one range outside the peer's buffer: nothing moves
            eng.batch_transfer_sync(peer.segment, [s, s], [base, peer.addr + (72 << 20)], [64, 64])

        errors: list[BaseException] = []

        def worker(k: int) -> None:
            try:
                mine, out = bytearray(65536 + 64), bytearray(65536 + 64)
                a, o = eng.register_local_memory(mine), eng.register_local_memory(out)
                r = peer.addr + (16 << 20) + k * (1 << 20)
                for i in range(40):
                    _native.fill_pattern(a, len(mine), k * 1000 + i)
                    eng.batch_transfer_sync(peer.segment, [a + 64, a], [r + 64, r], [65536, 64])
                    eng.batch_transfer_sync(peer.segment, [o + 64, o], [r + 64, r], [65536, 64], OpCode.READ)
                    assert out == mine
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
@pytest.mark.parametrize("path", ["in_thread", "batch"])
def test_scratch_memory_is_registered_for_one_call_only(peer: PeerProcess, protocol: str, path: str) -> None:
    """``batch_transfer_sync(..., scratch=)`` (the store's big put and get: a value being put, a
    fresh result) registers unregistered host memory for that call alone, inside the native call
    on the in-thread path and through register_host_scratch on the batch path (segment not open
    yet, numpy columns): the bytes move; before and after, the range is not registered (a plain
    call fails, a normal registration of it succeeds); a read-only scratch never receives a READ;
    one that overlaps a registration raises RegistrationError and nothing moves."""
    mib = 1 << 20
    with TransferEngine(protocol=protocol, timeout_s=5.0) as eng:
        hdr = bytearray(64)
        h = eng.register_local_memory(hdr)
        hdr[:] = bytes(range(64))
        base, off = peer.addr + (8 << 20), 8 << 20
        value = bytes(range(256)) * 4096
        v = _native.buffer_address(value, True)[0]
        if path == "in_thread":
            eng.open_segment(peer.segment)  # cached: the ranges go in this thread

        def cols(*c: list[int]) -> list[Any]:
            return [np.array(x, dtype=np.uint64) for x in c] if path == "batch" else list(c)

        with pytest.raises(AddressNotRegistered):  # not registered: a plain call is refused
            eng.batch_transfer_sync(peer.segment, *cols([v, h], [base + 64, base], [mib, 64]))
        n = eng.batch_transfer_sync(
            peer.segment, *cols([v, h], [base + 64, base], [mib, 64]), OpCode.WRITE, (v, mib, True)
        )
        assert n == mib + 64
        assert peer.checksum(off, 64 + mib) == xxhash.xxh3_64_hexdigest(bytes(range(64)) + value)
        out, o = _native.new_bytes(mib)
        hdr[:] = bytes(64)
        n = eng.batch_transfer_sync(
            peer.segment, *cols([o, h], [base + 64, base], [mib, 64]), OpCode.READ, (o, mib, False)
        )
        assert n == mib + 64 and out == value and bytes(hdr) == bytes(range(64))
        zeros = bytes(mib)
        z = _native.buffer_address(zeros, True)[0]
        with pytest.raises(AddressNotRegistered, match="read-only"):  # never written
            eng.batch_transfer_sync(peer.segment, *cols([z], [base], [mib]), OpCode.READ, (z, mib, True))
        assert zeros == bytes(mib)
        for bad in ((v, 0, True), ("x", mib, True), (v, mib), (v, mib, "yes"), None.__class__):
            with pytest.raises(InvalidArgument):  # a malformed scratch: typed, before anything moves
                eng.batch_transfer_sync(peer.segment, *cols([v], [base], [mib]), OpCode.WRITE, bad)
        with pytest.raises(RegistrationError):  # overlaps the header's registration: nothing moves
            eng.batch_transfer_sync(peer.segment, *cols([h], [base], [64]), OpCode.READ, (h, 64, False))
        assert peer.checksum(off, 64) == xxhash.xxh3_64_hexdigest(bytes(range(64)))
        for addr in (v, o, z):  # none of them is left registered, natively or in the engine's table
            with pytest.raises(AddressNotRegistered):
                eng.batch_transfer_sync(peer.segment, [addr], [base], [64], OpCode.WRITE)
            eng.register_local_memory(addr, mib)
            eng.unregister_local_memory(addr)


def test_requests_to_several_segments_in_one_batch(tcp_engine: TransferEngine) -> None:
    eng = tcp_engine
    with PeerProcess(1 << 20) as p1, PeerProcess(1 << 20) as p2:
        src = bytearray(8192)
        saddr = eng.register_local_memory(src)
        _native.fill_pattern(saddr, 8192, 11)
        h1, h2 = eng.open_segment(p1.segment), eng.open_segment(p2.segment)
        bid = eng.allocate_batch_id(2)
        eng.submit_transfer(
            bid,
            [
                TransferRequest(OpCode.WRITE, saddr, h1, p1.addr, 4096),
                TransferRequest(OpCode.WRITE, saddr + 4096, h2, p2.addr + 100, 4096),
            ],
        )
        assert eng.wait_batch(bid, 10).state == TransferState.COMPLETED
        eng.free_batch_id(bid)
        assert p1.checksum(0, 4096) == xxhash.xxh3_64_hexdigest(src[:4096])
        assert p2.checksum(100, 4096) == xxhash.xxh3_64_hexdigest(src[4096:])


def test_numpy_buffer_registration(peer: PeerProcess, tcp_engine: TransferEngine) -> None:
    np = pytest.importorskip("numpy")
    arr = np.arange(1024, dtype=np.uint32)
    addr = tcp_engine.register_local_memory(arr)
    assert addr == arr.ctypes.data
    tcp_engine.transfer_sync(peer.segment, addr, peer.addr, arr.nbytes, OpCode.WRITE)
    assert peer.checksum(0, arr.nbytes) == xxhash.xxh3_64_hexdigest(arr.tobytes())


def test_self_transfer_between_own_buffers() -> None:
    with TransferEngine(protocol="tcp") as eng:
        a, b = bytearray(b"hello kvpool" * 100), bytearray(1200)
        la = eng.register_local_memory(a)
        lb = eng.register_local_memory(b)
        eng.transfer_sync(eng.segment_name, la, lb, 1200, OpCode.WRITE)
        assert a == b


def test_failed_transfer_raises_typed_error(tcp_engine: TransferEngine) -> None:
    p = PeerProcess(1 << 20)
    buf = bytearray(4096)
    addr = tcp_engine.register_local_memory(buf)
    tcp_engine.open_segment(p.segment)
    p.kill()
    with pytest.raises(TransferError):
        tcp_engine.transfer_sync(p.segment, addr, p.addr, 4096, OpCode.WRITE)
    p.close()


@pytest.mark.parametrize("size", [1, 4097, (256 << 10) + 3, (3 << 20) + 5], ids=lambda n: f"{n}B")
def test_shared_memory_segment_is_mapped_and_copied_into(size: int) -> None:
    """Same host + memfd buffer: the initiator maps it and copies directly (non-temporal when big)."""
    with PeerProcess(8 << 20, shm=True) as p:
        with TransferEngine(protocol="auto") as eng, TransferEngine(protocol="tcp") as tcp:
            src = bytearray(size + 1)
            back = bytearray(size + 1)
            sa = eng.register_local_memory(src)
            ba = eng.register_local_memory(back)
            _native.fill_pattern(sa, len(src), size)
            h = eng.open_segment(p.segment)
            assert eng.shared_buffers_mapped(h) == 1
            assert tcp.shared_buffers_mapped(tcp.open_segment(p.segment)) == 0  # tcp never maps
            off = 13  # unaligned on both sides
            eng.transfer_sync(p.segment, sa + 1, p.addr + off, size, OpCode.WRITE)
            assert p.checksum(off, size) == xxhash.xxh3_64_hexdigest(src[1 : size + 1])
            eng.transfer_sync(p.segment, ba + 1, p.addr + off, size, OpCode.READ)
            assert back[1 : size + 1] == src[1 : size + 1]
            # Out-of-bounds ranges are refused before any copy, mapping or not.
            with pytest.raises(Exception, match="outside"):
                eng.transfer_sync(p.segment, sa, p.addr + (8 << 20) - 1, 2, OpCode.WRITE)


def _mapped_kib(size: int) -> list[int]:
    """Rss (KiB) of every shared-memory (memfd) mapping of ``size`` bytes in this process."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: "start-end perms ..."
                cur = line
            elif head[0] == "Size:" and int(head[1]) * 1024 != size:
                cur = None
            elif head[0] == "Rss:" and cur is not None and "memfd:" in cur:
                out.append(int(head[1]))
    return out


def test_a_big_shared_memory_segment_is_populated_in_the_background() -> None:
    """A same-host segment over 64 MiB is mapped without waiting for its page tables (a 1 GiB
    one took ~100 ms on the first transfer): a background thread fills them in while transfers
    into it already land right, and in the end every page is mapped."""
    size = 192 << 20
    with PeerProcess(size, shm=True) as p, TransferEngine(protocol="auto") as eng:
        src = bytearray(1 << 20)
        sa = eng.register_local_memory(src)
        _native.fill_pattern(sa, len(src), 7)
        h = eng.open_segment(p.segment)
        assert eng.shared_buffers_mapped(h) == 1
        for off in (size - len(src), 0, size // 2 + 4096 * 3 + 5):  # ahead of the population too
            eng.transfer_sync(p.segment, sa, p.addr + off, len(src), OpCode.WRITE)
            assert p.checksum(off, len(src)) == xxhash.xxh3_64_hexdigest(src)
        deadline = time.monotonic() + 30
        while (rss := _mapped_kib(size)) != [size >> 10] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rss == [size >> 10], rss  # every page of the mapping present


def test_a_dead_peers_shared_memory_is_unmapped() -> None:
    """A mapping of a same-host peer's memfd keeps that memory allocated after the peer died: it
    is let go of when another segment is opened (a restarted peer under a new name) or when
    ``release_exited_peers`` is called (a store client's heartbeat); a live peer's stays."""
    size = 48 << 20
    with TransferEngine(protocol="auto") as eng:
        src = bytearray(4096)
        sa = eng.register_local_memory(src)
        a, b, c = PeerProcess(size, shm=True), PeerProcess(size, shm=True), PeerProcess(size, shm=True)
        try:
            handles = {}
            for p in (a, b):
                eng.transfer_sync(p.segment, sa, p.addr, 4096, OpCode.WRITE)
                handles[p] = eng.open_segment(p.segment)
                assert eng.shared_buffers_mapped(handles[p]) == 1
            assert len(_mapped_kib(size)) == 2
            a.proc.kill()
            a.proc.wait()
            eng.transfer_sync(c.segment, sa, c.addr, 4096, OpCode.WRITE)  # opening c lets a go
            assert eng.shared_buffers_mapped(handles[a]) == 0
            assert eng.shared_buffers_mapped(handles[b]) == 1
            assert len(_mapped_kib(size)) == 2  # b's and c's
            b.proc.kill()
            b.proc.wait()
            assert eng.release_exited_peers() == 1
            assert eng.shared_buffers_mapped(handles[b]) == 0 and len(_mapped_kib(size)) == 1
            assert eng.release_exited_peers() == 0
            eng.transfer_sync(c.segment, sa, c.addr + 4096, 4096, OpCode.WRITE)  # c is untouched
            assert c.checksum(4096, 4096) == xxhash.xxh3_64_hexdigest(src)
            with pytest.raises(KvpoolError):
                eng.transfer_sync(b.segment, sa, b.addr, 4096, OpCode.WRITE)  # gone: a typed error
        finally:
            for p in (a, b, c):
                p.close()


class _CountingNative:
    """Forwards to the real native engine, recording every ``update_peer`` call."""

    def __init__(self, native: Any) -> None:
        self._n = native
        self.updates: list[tuple[int, int, int]] = []

    def update_peer(self, hid: int, inc: int, pid: int, regions: Any) -> None:
        self.updates.append((hid, inc, pid))
        self._n.update_peer(hid, inc, pid, regions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._n, name)


def test_a_segment_refresh_updates_the_native_peer_once_and_keeps_its_pidfd() -> None:
    """A refresh made the native peer's pid 0, then the real pid (its pidfd closed and reopened,
    same-host copies sent over TCP in between) and reopened the transport's own pidfd: now one
    update_peer with the peer's pid, and the pidfd kept; a SIGKILLed peer is still released."""
    with TransferEngine(protocol="auto") as eng:
        src = bytearray(b"R" * 4096)
        sa = eng.register_local_memory(src)
        p = PeerProcess(1 << 20)
        try:
            h = eng.open_segment(p.segment)
            route = eng._routes[h.id]
            assert route.name == "same_host"
            counting = _CountingNative(eng._native)
            eng._native = route.native = counting
            pidfd = route._pids[h.id][0]
            for _ in range(3):
                eng._open(p.segment)  # what open_segment does when the descriptor is stale
            assert counting.updates == [(h.id, eng._segments[p.segment][1].incarnation, p.proc.pid)] * 3
            assert route._pids[h.id][0] == pidfd
            assert eng.uses_same_host_path(h)
            eng.transfer_sync(p.segment, sa, p.addr, 4096, OpCode.WRITE)
            assert p.checksum(0, 4096) == xxhash.xxh3_64_hexdigest(src)
            p.proc.kill()
            p.proc.wait()
            assert eng.release_exited_peers() == 1
            assert eng.release_exited_peers() == 0
        finally:
            p.close()


def test_write_inline_writes_through_a_cached_segment_and_leaves_the_rest_to_transfer_sync() -> None:
    """``write_inline`` (the store's small-put write): lands through an opened segment; False, with
    nothing moved, for a segment not opened yet or arguments it does not take (``transfer_sync``
    then opens the segment or names the mistake with a typed error); a range outside the peer's
    memory raises what ``transfer_sync`` raises."""
    with PeerProcess(1 << 20, shm=True) as p, TransferEngine(protocol="auto") as eng:
        src = bytearray(4096)
        sa = eng.register_local_memory(src)
        _native.fill_pattern(sa, len(src), 3)
        assert eng.write_inline(p.segment, sa, p.addr, 4096) is False  # not opened yet
        eng.open_segment(p.segment)
        for bad in ((-1, p.addr, 16), (sa, p.addr, 0), (float(sa), p.addr, 16), (sa, p.addr, True)):
            assert eng.write_inline(p.segment, *bad) is False  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            eng.transfer_sync(p.segment, -1, p.addr, 16, OpCode.WRITE)
        assert eng.write_inline(p.segment, sa, p.addr + 5, 4096) is True
        assert p.checksum(5, 4096) == xxhash.xxh3_64_hexdigest(src)
        with pytest.raises(KvpoolError):
            eng.write_inline(p.segment, sa, p.addr + (1 << 20) - 8, 16)


def test_a_closed_engine_holds_no_descriptors() -> None:
    """close() gives back every descriptor the engine opened (server event loops, eventfds, the
    fence memfd, sockets), even while the Python object lives on."""
    import os

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    TransferEngine().close()  # first-use imports and caches
    before = fds()
    kept = []
    for _ in range(10):
        eng = TransferEngine(protocol="auto")
        eng.register_local_memory(bytearray(4096))
        eng.close()
        kept.append(eng)
    assert fds() - before <= 2, os.listdir("/proc/self/fd")
