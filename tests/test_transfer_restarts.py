"""Peers that die, restart or stall while an initiator holds their segment open: no byte reaches a
process it was not submitted for, no copy "succeeds" into a dead process, a segment restarted at
another address is reached again, and close() does not wait for a stopped peer's I/O timeout.

Real processes (``PeerProcess``), real sockets, real SIGKILL/SIGSTOP; the first test uses a
scripted server speaking the wire protocol so that it controls when incarnation A dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import threading
import time

import pytest
import xxhash

from kvpool import OpCode, TransferEngine, TransferRequest, _native
from kvpool.errors import KvpoolError, RemoteAccessError, TransferError
from kvpool.transfer.metadata_server import MetadataServer
from kvpool.transfer.peer import PeerProcess
from tests.servers import free_port

_REQ = struct.Struct("<IBBHIIQQ")  # wire.h ReqHdr
_RESP = struct.Struct("<iiIIQ")  # RespHdr
_RESP_MAGIC = 0x4150564B
_S_COMPLETED = 2


def _recvn(c: socket.socket, n: int) -> bytes:
    b = b""
    while len(b) < n:
        x = c.recv(n - len(b))
        if not x:
            raise EOFError
        b += x
    return b


class _TwoIncarnations:
    """A listener that handshakes as incarnation A (then never answers a request) until told
    to be B, which answers every request and counts the WRITE payloads it got by first byte."""

    A, B = 0xAAAA, 0xBBBB

    def __init__(self) -> None:
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(16)
        self.port = self.ls.getsockname()[1]
        self.inc = self.A
        self.a_conns: list[socket.socket] = []
        self.b_payloads: dict[bytes, int] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            c.sendall(struct.pack("<II", 0x4E50564B, 0) + b"\0" * 32)  # challenge (no secret)
            _recvn(c, 72)
            inc = self.inc
            c.sendall(struct.pack("<IiQ", 0x4F50564B, 0, inc) + b"\0" * 32)
            if inc == self.A:
                self.a_conns.append(c)
            else:
                threading.Thread(target=self._serve_b, args=(c,), daemon=True).start()

    def _serve_b(self, c: socket.socket) -> None:
        try:
            while True:
                _, op, _, _, rid, _, _, n = _REQ.unpack(_recvn(c, _REQ.size))
                if op == _native.OP_WRITE:
                    first = _recvn(c, n)[:1]
                    self.b_payloads[first] = self.b_payloads.get(first, 0) + 1
                c.sendall(_RESP.pack(_RESP_MAGIC, 0, rid, 0, 0))
        except (EOFError, OSError):
            pass

    def restart_as_b(self) -> None:
        self.inc = self.B
        for c in self.a_conns:
            c.shutdown(socket.SHUT_RDWR)
            c.close()

    def close(self) -> None:
        self.ls.close()


def test_writes_queued_for_a_dead_incarnation_never_reach_its_successor() -> None:
    """Writes for incarnation A wait in a full queue while the peer restarts as B and writes for B
    are queued behind them: none of A's bytes may land at B (a group once mixed both and sent
    them all over B's connection, reporting A's slots COMPLETED)."""
    srv = _TwoIncarnations()
    eng = _native.NativeEngine("127.0.0.1", 0, "", 1, 4096, 20000, 2000, 1 << 28)
    bufs = {k: ctypes.create_string_buffer(k * 4096, 4096) for k in (b"A", b"B")}
    for b in bufs.values():
        eng.register_memory(ctypes.addressof(b), 4096, False)
    base, size = 1 << 32, 1 << 34
    peer = eng.add_peer("127.0.0.1", srv.port, srv.A, 0, [(base, size, 0)])
    nx, ny = 40000, 20000  # more than the peer's queue holds: the submit of X blocks
    bx, by = eng.alloc_batch(nx), eng.alloc_batch(ny)

    def submit(batch: int, n: int, key: bytes, off: int) -> None:
        loc = ctypes.addressof(bufs[key])
        eng.submit(batch, [_native.OP_WRITE] * n, [loc] * n, [peer] * n,
                   [base + off + i * 4096 for i in range(n)], [4096] * n)  # fmt: skip

    try:
        tx = threading.Thread(target=submit, args=(bx, nx, b"A", 0))
        tx.start()
        deadline = time.monotonic() + 10
        while not srv.a_conns and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert tx.is_alive(), "X's submit should be blocked on the full queue"
        eng.update_peer(peer, srv.B, 0, [(base, size, 0)])  # the initiator learnt of the restart
        ty = threading.Thread(target=submit, args=(by, ny, b"B", 1 << 33))
        ty.start()
        time.sleep(0.3)
        srv.restart_as_b()
        tx.join(60)
        ty.join(60)
        eng.wait(bx, 30000)
        eng.wait(by, 30000)
        assert srv.b_payloads.get(b"A", 0) == 0, srv.b_payloads
        assert sum(eng.status(bx, i)[0] == _S_COMPLETED for i in range(nx)) == 0
        assert sum(eng.status(by, i)[0] == _S_COMPLETED for i in range(ny)) == ny
        assert srv.b_payloads.get(b"B", 0) == ny
    finally:
        eng.shutdown()
        srv.close()


def test_same_host_copies_to_a_killed_peer_fail() -> None:
    """A peer whose shared buffer is mapped here is SIGKILLed: WRITE and READ fail with a typed
    error (copies into the mapping of a dead process used to report success)."""
    eng = TransferEngine(protocol="auto", timeout_s=2, connect_timeout_s=1)
    src = bytearray(os.urandom(65536))
    saddr = eng.register_local_memory(src)
    dst = bytearray(65536)
    daddr = eng.register_local_memory(dst)
    p = PeerProcess(1 << 20, shm=True)
    try:
        eng.transfer_sync(p.segment, saddr, p.addr, 65536, OpCode.WRITE)
        h = eng.open_segment(p.segment)
        assert eng.uses_same_host_path(h) and eng.shared_buffers_mapped(h) == 1
        p.kill()
        time.sleep(0.2)
        for _ in range(2):
            with pytest.raises(KvpoolError):
                eng.transfer_sync(p.segment, saddr, p.addr, 65536, OpCode.WRITE)
            with pytest.raises(KvpoolError):
                eng.transfer_sync(p.segment, daddr, p.addr, 65536, OpCode.READ)
    finally:
        p.close()
        eng.close()


def test_same_host_write_after_a_restart_on_the_same_port_never_reports_success_unlanded() -> None:
    """The peer is killed and a new one listens on its port: a WRITE to the old address either
    fails with a typed error or lands in the new peer -- never "succeeds" into the dead one."""
    eng = TransferEngine(protocol="auto", timeout_s=2, connect_timeout_s=1)
    src = bytearray(os.urandom(65536))
    saddr = eng.register_local_memory(src)
    port = free_port()
    p = PeerProcess(1 << 20, shm=True, port=port)
    p2 = None
    try:
        eng.transfer_sync(p.segment, saddr, p.addr, 65536, OpCode.WRITE)
        old = p.addr
        p.kill()
        time.sleep(0.3)
        p2 = PeerProcess(1 << 20, shm=True, port=port)
        try:
            eng.transfer_sync(p.segment, saddr, old, 65536, OpCode.WRITE)
        except KvpoolError:
            pass
        else:
            assert p2.addr <= old and old + 65536 <= p2.addr + (1 << 20)
            off = old - p2.addr
            assert p2.checksum(off, 65536) == xxhash.xxh3_64_hexdigest(bytes(src))
    finally:
        if p2 is not None:
            p2.close()
        p.close()
        eng.close()


def test_a_segment_restarted_on_another_port_is_reached_again() -> None:
    """A segment named in a metadata store restarts on a new port: after at most one failed
    transfer the initiator reaches it there (its lanes kept dialling the old port)."""
    with MetadataServer(port=0).start() as ms:
        ini = TransferEngine(protocol="tcp", metadata=ms.url, name="ini", timeout_s=2, connect_timeout_s=1)
        t1 = t2 = None
        try:
            src = bytearray(b"A" * 4096)
            saddr = ini.register_local_memory(src)
            t1 = TransferEngine(protocol="tcp", metadata=ms.url, name="tgt")
            b1 = bytearray(4096)
            a1 = t1.register_local_memory(b1)
            ini.transfer_sync("tgt", saddr, a1, 4096, OpCode.WRITE)
            assert bytes(b1[:4]) == b"AAAA"
            t1.close()
            t2 = TransferEngine(protocol="tcp", metadata=ms.url, name="tgt")
            b2 = bytearray(4096)
            a2 = t2.register_local_memory(b2)
            assert t2.port != t1.port
            landed = False
            for _ in range(3):
                try:
                    ini.transfer_sync("tgt", saddr, a2, 4096, OpCode.WRITE)
                    landed = True
                    break
                except KvpoolError:
                    continue
            assert landed and bytes(b2) == bytes(src)
        finally:
            for e in (t2, ini):
                if e is not None:
                    e.close()


def test_close_does_not_wait_for_a_stopped_peers_timeout() -> None:
    """The peer is SIGSTOPped with WRITEs in flight: close() shuts the busy connections down
    instead of waiting out the 8 s I/O timeout (it took ~7.7 s)."""
    eng = TransferEngine(protocol="tcp", timeout_s=8, connect_timeout_s=1)
    bs = 8 << 20
    src = bytearray(bs * 4)
    saddr = eng.register_local_memory(src)
    p = PeerProcess(bs * 4)
    try:
        h = eng.open_segment(p.segment)
        eng.transfer_sync(p.segment, saddr, p.addr, 4096, OpCode.WRITE)  # lanes connected
        os.kill(p.pid, signal.SIGSTOP)
        bid = eng.allocate_batch_id(4)
        reqs = [TransferRequest(OpCode.WRITE, saddr + i * bs, h, p.addr + i * bs, bs) for i in range(4)]
        eng.submit_transfer(bid, reqs)
        time.sleep(0.5)
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 < 4.0
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.close()
        eng.close()


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_memory_registered_after_the_open_is_reached_and_unknown_ranges_still_refused(protocol: str) -> None:
    """The target registers a second buffer after the initiator opened its segment: a WRITE
    into it lands (the initiator asks the owner's descriptor again instead of refusing from its
    cached one); a range the owner never registered is still refused, inline and batched."""
    ini = TransferEngine(protocol=protocol, timeout_s=2, connect_timeout_s=1)
    tgt = TransferEngine(protocol=protocol)
    try:
        src = bytearray(os.urandom(8192))
        saddr = ini.register_local_memory(src)
        b1 = bytearray(4096)
        a1 = tgt.register_local_memory(b1)
        ini.transfer_sync(tgt.segment_name, saddr, a1, 4096, OpCode.WRITE)
        b2 = bytearray(8192)
        a2 = tgt.register_local_memory(b2)
        ini.transfer_sync(tgt.segment_name, saddr, a2, 4096, OpCode.WRITE)  # inline path
        assert bytes(b2[:4096]) == bytes(src[:4096])
        n = 32  # more than INLINE_MAX: one batch
        locs = [saddr + i * 256 for i in range(n)]
        rems = [a2 + i * 256 for i in range(n)]
        ini.batch_transfer_sync(tgt.segment_name, locs, rems, [256] * n, OpCode.WRITE)
        assert bytes(b2) == bytes(src)
        with pytest.raises(RemoteAccessError):
            ini.transfer_sync(tgt.segment_name, saddr, a2 + 8192 + (1 << 30), 4096, OpCode.WRITE)
        with pytest.raises(RemoteAccessError):
            ini.batch_transfer_sync(tgt.segment_name, locs, [a2 + (1 << 30) + r for r in range(n)],
                                    [256] * n, OpCode.WRITE)  # fmt: skip
    finally:
        ini.close()
        tgt.close()


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_a_range_registered_again_refuses_requests_made_for_the_old_registration(protocol: str) -> None:
    """The target unregisters a buffer and registers the same range again (another owner of that
    memory now): a peer still holding the old descriptor is refused (nothing lands: TCP's server
    compares the registration id the request names, the same-host path its fence generation),
    as an RDMA peer is with the old rkey; after re-opening, the new registration is reached."""
    ini = TransferEngine(protocol=protocol, timeout_s=2, connect_timeout_s=1)
    tgt = TransferEngine(protocol=protocol)
    try:
        src = bytearray(b"N" * 4096)
        saddr = ini.register_local_memory(src)
        other = bytearray(b"M" * 4096)
        oaddr = ini.register_local_memory(other)
        buf = bytearray(4096)
        addr = tgt.register_local_memory(buf)
        h = ini.open_segment(tgt.segment_name)
        old_id = ini.get_segment_descriptor(tgt.segment_name).buffers[0].reg_id
        assert old_id != 0

        def register_again() -> None:
            tgt.unregister_local_memory(addr)
            assert tgt.register_local_memory(buf) == addr

        register_again()  # a batched WRITE (a worker thread) for the old registration
        bid = ini.allocate_batch_id(1)
        ini.submit_transfer(bid, [TransferRequest(OpCode.WRITE, saddr, h, addr, 4096)])
        assert ini.wait_batch(bid, 5).state.name == "FAILED"
        assert "registered it again" in (ini.get_transfer_status(bid, 0).error or "")
        ini.free_batch_id(bid)
        assert bytes(buf) == bytes(4096)
        # The refusal made the engine read the owner's descriptor again: the next request
        # names the new registration and lands.
        ini.transfer_sync(tgt.segment_name, saddr, addr, 4096, OpCode.WRITE)
        assert bytes(buf) == bytes(src)
        assert ini.get_segment_descriptor(tgt.segment_name).buffers[0].reg_id != old_id

        register_again()  # an inline WRITE (the caller's thread)
        with pytest.raises(TransferError, match="registered it again"):
            ini.transfer_sync(tgt.segment_name, oaddr, addr, 4096, OpCode.WRITE)
        assert bytes(buf) == bytes(src)

        ini.transfer_sync(tgt.segment_name, saddr, addr, 64, OpCode.WRITE)  # re-read after the refusal
        dst = bytearray(4096)
        daddr = ini.register_local_memory(dst)
        register_again()  # a READ for the old registration
        with pytest.raises(TransferError, match="registered it again"):
            ini.batch_transfer_sync(tgt.segment_name, [daddr + 64 * k for k in range(20)],
                                    [addr + 64 * k for k in range(20)], [64] * 20, OpCode.READ)  # fmt: skip
        assert bytes(dst) == bytes(4096)
    finally:
        ini.close()
        tgt.close()


def test_a_stopped_peers_descriptor_is_fetched_once_per_window_not_once_per_call() -> None:
    """The peer is SIGSTOPped (its port accepts, nobody answers) and a transfer found it stale:
    open_segment then fetches its descriptor once, each fetch costing a connect timeout; the
    calls after it within the window raise the same typed error at once (each paid a connect
    timeout), and threads calling together share one fetch. After SIGCONT the segment is not
    served from the stale descriptor, and is reached again once the window passed."""
    ct = 1.0
    eng = TransferEngine(protocol="tcp", timeout_s=1, connect_timeout_s=ct)
    fetches: list[str] = []
    real_fetch = eng._fetch

    def counted(name: str):  # the real fetch, counted
        fetches.append(name)
        return real_fetch(name)

    eng._fetch = counted  # type: ignore[method-assign]
    src = bytearray(os.urandom(4096))
    saddr = eng.register_local_memory(src)
    p = PeerProcess(1 << 20)
    stopped = False
    try:
        eng.transfer_sync(p.segment, saddr, p.addr, 4096, OpCode.WRITE)
        os.kill(p.pid, signal.SIGSTOP)
        stopped = True
        time.sleep(0.2)  # stopped for sure
        with pytest.raises(KvpoolError):
            eng.transfer_sync(p.segment, saddr, p.addr, 4096, OpCode.WRITE)  # times out: stale
        fetches.clear()
        t0 = time.monotonic()
        kinds = set()
        for _ in range(6):
            with pytest.raises(KvpoolError) as ei:
                eng.open_segment(p.segment)
            kinds.add(type(ei.value))
        with pytest.raises(KvpoolError) as ei:
            eng.transfer_sync(p.segment, saddr, p.addr, 4096, OpCode.WRITE)
        elapsed = time.monotonic() - t0
        assert 0.8 * ct <= elapsed < 2.5 * ct, elapsed  # one connect timeout, not seven
        assert len(fetches) == 1, fetches
        assert len(kinds) == 1 and type(ei.value) in kinds

        time.sleep(1.1 * ct)  # the window (min(1 s, connect_timeout_s)) passed
        fetches.clear()
        got: list[BaseException | None] = []

        def call() -> None:
            try:
                eng.open_segment(p.segment)
                got.append(None)
            except KvpoolError as e:
                got.append(e)

        threads = [threading.Thread(target=call) for _ in range(6)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.monotonic() - t0 < 2.5 * ct
        assert len(fetches) == 1, fetches  # one thread fetched; the others had its error
        assert len(got) == 6 and all(e is not None and type(e) in kinds for e in got)

        os.kill(p.pid, signal.SIGCONT)
        stopped = False
        t0 = time.monotonic()
        with pytest.raises(KvpoolError):  # within the (doubled) window: no stale descriptor served
            eng.open_segment(p.segment)
        assert time.monotonic() - t0 < 0.2
        deadline = time.monotonic() + 4 * ct + 2
        while True:
            try:
                eng.open_segment(p.segment)
                break
            except KvpoolError:
                assert time.monotonic() < deadline, "the resumed peer was never reached again"
                time.sleep(0.05)
        eng.transfer_sync(p.segment, saddr, p.addr, 4096, OpCode.WRITE)
        assert p.checksum(0, 4096) == xxhash.xxh3_64_hexdigest(bytes(src))
    finally:
        if stopped:
            os.kill(p.pid, signal.SIGCONT)
        p.close()
        eng.close()


def test_a_fetch_ended_by_another_threads_interrupt_is_not_shared_with_its_waiters() -> None:
    """The thread fetching a descriptor is interrupted (KeyboardInterrupt, or a non-kvpool error
    from a bug) while another thread waits for its result: the waiter fetches itself and gets
    the segment (it raised a copy of the interrupt, in a thread nobody interrupted)."""
    from kvpool.transfer.segments import RefetchGate

    gate = RefetchGate(1.0)
    entered, release, waiting = threading.Event(), threading.Event(), threading.Event()

    class Watched(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waiting.set()
            return super().wait(timeout)

    def interrupted():
        gate._state["s"].flight.done = Watched()  # type: ignore[union-attr]  # to see the waiter wait
        entered.set()
        release.wait(5)
        raise KeyboardInterrupt

    handle = object()
    got: list[object] = []

    def lead() -> None:
        try:
            gate.run("s", interrupted)
        except KeyboardInterrupt:
            got.append("interrupted")

    def follow() -> None:
        try:
            got.append(gate.run("s", lambda: handle))  # type: ignore[arg-type, return-value]
        except BaseException as e:  # noqa: BLE001 - what the waiter raised is the point
            got.append(e)

    a = threading.Thread(target=lead)
    a.start()
    assert entered.wait(5)
    b = threading.Thread(target=follow)
    b.start()
    assert waiting.wait(5)
    release.set()
    a.join(5)
    b.join(5)
    assert len(got) == 2 and "interrupted" in got and any(x is handle for x in got), got


def test_the_refetch_gate_remembers_at_most_max_names_even_all_inside_their_window() -> None:
    """Three times MAX_NAMES segment names whose fetch fails, all inside their window (a flood of
    names from a hostile peer or metadata store): the gate remembers at most MAX_NAMES of them
    (it kept every one: only names whose window ended were dropped), the latest failures among
    them (a call for one raises at once, fetching nothing), and never forgets a fetch in flight
    (a caller of that name waits for its result instead of fetching again)."""
    from kvpool.errors import SegmentNotFound
    from kvpool.transfer.segments import RefetchGate

    gate = RefetchGate(1.0)
    gate.base_s = gate.cap_s = 600.0  # every window outlasts the test
    entered, release, fetches = threading.Event(), threading.Event(), []
    handle = object()

    def slow():
        entered.set()
        release.wait(10)
        return handle

    def fail():
        fetches.append(1)
        raise SegmentNotFound("no such peer")

    got: list[object] = []
    leader = threading.Thread(target=lambda: got.append(gate.run("in-flight", slow)))  # type: ignore[arg-type]
    leader.start()
    assert entered.wait(5)
    n = 3 * RefetchGate.MAX_NAMES
    for k in range(n):
        with pytest.raises(SegmentNotFound):
            gate.run(f"peer-{k}:1", fail)  # type: ignore[arg-type]
    assert len(fetches) == n
    assert len(gate._state) <= RefetchGate.MAX_NAMES, len(gate._state)
    with pytest.raises(SegmentNotFound, match="not asked for again"):
        gate.run(f"peer-{n - 1}:1", fail)  # type: ignore[arg-type]  # the latest failure: remembered
    assert len(fetches) == n
    waiting = threading.Event()

    class Watched(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waiting.set()
            return super().wait(timeout)

    gate._state["in-flight"].flight.done = Watched()  # type: ignore[union-attr]  # still remembered
    follower = threading.Thread(target=lambda: got.append(gate.run("in-flight", fail)))  # type: ignore[arg-type]
    follower.start()
    assert waiting.wait(5)
    release.set()
    leader.join(5)
    follower.join(5)
    assert got == [handle, handle] and len(fetches) == n  # the follower took the leader's result


def test_a_range_registered_while_another_thread_fetches_the_descriptor_is_reached() -> None:
    """A thread is fetching the target's descriptor (read before the target registered a second
    buffer) when a WRITE into that buffer is refused by the cached one: the writer does not take
    that fetch's descriptor, which lacks the buffer too; it fetches again and the WRITE lands (it
    raised RemoteAccessError for memory the owner had registered)."""
    ini = TransferEngine(protocol="tcp", timeout_s=2, connect_timeout_s=1)
    tgt = TransferEngine(protocol="tcp")
    try:
        src = bytearray(os.urandom(4096))
        saddr = ini.register_local_memory(src)
        a1 = tgt.register_local_memory(bytearray(4096))
        ini.transfer_sync(tgt.segment_name, saddr, a1, 4096, OpCode.WRITE)
        name = tgt.segment_name
        real_fetch = ini._fetch
        entered, release, waiting = threading.Event(), threading.Event(), threading.Event()

        class Watched(threading.Event):
            def wait(self, timeout: float | None = None) -> bool:
                waiting.set()
                return super().wait(timeout)

        def slow_fetch(n: str):  # the first fetch reads the descriptor now, returns it later
            ini._fetch = real_fetch  # type: ignore[method-assign]
            desc = real_fetch(n)
            ini._refetch._state[n].flight.done = Watched()  # type: ignore[union-attr]
            entered.set()
            release.wait(5)
            return desc

        ini._fetch = slow_fetch  # type: ignore[method-assign]
        other = threading.Thread(target=ini._open, args=(name,))
        other.start()
        assert entered.wait(5)
        b2 = bytearray(4096)
        a2 = tgt.register_local_memory(b2)
        got: list[BaseException | None] = []

        def write() -> None:
            try:
                ini.transfer_sync(name, saddr, a2, 4096, OpCode.WRITE)
                got.append(None)
            except KvpoolError as e:
                got.append(e)

        writer = threading.Thread(target=write)
        writer.start()
        assert waiting.wait(5)  # the writer waits for the other thread's fetch
        release.set()
        other.join(5)
        writer.join(10)
        assert got == [None], got
        assert bytes(b2) == bytes(src)
    finally:
        ini.close()
        tgt.close()
