"""Peers that restart, die or stall: typed errors within the configured timeout, never a hang."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import xxhash

from kvpool import OpCode, TransferEngine, TransferRequest, TransferState, _native
from kvpool.errors import BatchInFlight, SegmentNotFound, TransferError, TransferTimeout, late_batch
from kvpool.transfer.peer import PeerProcess
from tests.servers import free_port


def test_peer_restart_is_noticed_and_descriptor_refetched(tcp_engine: TransferEngine) -> None:
    eng = tcp_engine
    port = free_port()
    src = bytearray(1 << 20)
    saddr = eng.register_local_memory(src)
    _native.fill_pattern(saddr, len(src), 1)
    p1 = PeerProcess(2 << 20, port=port)
    name = p1.segment
    eng.transfer_sync(name, saddr, p1.addr, len(src), OpCode.WRITE)
    old = eng.get_segment_descriptor(name)
    p1.kill()
    p2 = PeerProcess(2 << 20, port=port)
    try:
        assert p2.segment == name
        # The old addresses belong to a process that is gone: refused, never written into the new one.
        with pytest.raises(TransferError, match="restarted|closed"):
            eng.transfer_sync(name, saddr, p1.addr, len(src), OpCode.WRITE)
        new = eng.get_segment_descriptor(name)
        assert new.incarnation != old.incarnation and new.pid == p2.pid
        assert new.buffers[0].addr == p2.addr
        eng.transfer_sync(name, saddr, p2.addr, len(src), OpCode.WRITE)
        assert p2.checksum(0, len(src)) == xxhash.xxh3_64_hexdigest(src)
    finally:
        p2.close()


def test_same_host_peer_restart_new_addresses_refetched(engine: TransferEngine) -> None:
    """Same-host path: after a peer restarts on the same port, a request to the NEW process's memory
    (outside the descriptor we hold) fails once, typed ("exited"), instead of being refused forever;
    then the descriptor is re-fetched and the bytes land in the new process."""
    port = free_port()
    src = bytearray(os.urandom(1 << 16))
    saddr = engine.register_local_memory(src)
    p1 = PeerProcess(2 << 20, port=port)
    try:
        engine.transfer_sync(p1.segment, saddr, p1.addr, 4096, OpCode.WRITE)
        assert engine.uses_same_host_path(engine.open_segment(p1.segment))
    finally:
        p1.kill()
    p2 = PeerProcess(2 << 20, port=port)
    try:
        assert p2.segment == p1.segment
        if p2.addr != p1.addr:  # else the new address is inside the old descriptor: the TCP test's case
            with pytest.raises(SegmentNotFound, match="exited"):
                engine.batch_transfer_sync(p2.segment, [saddr], [p2.addr], [len(src)])
        assert engine.get_segment_descriptor(p2.segment).pid == p2.pid
        engine.transfer_sync(p2.segment, saddr, p2.addr, len(src), OpCode.WRITE)
        assert p2.checksum(0, len(src)) == xxhash.xxh3_64_hexdigest(src)
    finally:
        p2.close()


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_peer_killed_mid_batch_fails_within_timeout(protocol: str) -> None:
    timeout_s = 2.0
    with TransferEngine(protocol=protocol, timeout_s=timeout_s, connect_timeout_s=1.0) as eng:
        bs, n = 4 << 20, 64
        src = bytearray(bs * 4)
        saddr = eng.register_local_memory(src)
        p = PeerProcess(bs * 4)
        h = eng.open_segment(p.segment)
        bid = eng.allocate_batch_id(n)
        reqs = [
            TransferRequest(OpCode.WRITE, saddr + (i % 4) * bs, h, p.addr + (i % 4) * bs, bs)
            for i in range(n)
        ]
        eng.submit_transfer(bid, reqs)
        p.kill()
        t0 = time.monotonic()
        st = eng.wait_batch(bid, timeout_s=timeout_s + 10)
        assert time.monotonic() - t0 < timeout_s + 5
        # Some requests may have landed before the kill; the rest must be FAILED/TIMEOUT, none PENDING.
        states = {eng.get_transfer_status(bid, i).state for i in range(n)}
        assert TransferState.PENDING not in states
        assert states - {TransferState.COMPLETED} <= {TransferState.FAILED, TransferState.TIMEOUT}
        if st.state == TransferState.COMPLETED:  # the whole batch made it before the kill
            assert states == {TransferState.COMPLETED}
        else:
            assert st.state in (TransferState.FAILED, TransferState.TIMEOUT)
        eng.free_batch_id(bid)
        p.close()


def _wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (a SIGSTOP takes effect asynchronously: a thread
    running on another core may still answer a handshake for a moment)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = {
            open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
            for t in os.listdir(f"/proc/{pid}/task")
        }
        if states <= {"T", "t"}:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def _connect_lanes(eng: TransferEngine, p: PeerProcess, saddr: int) -> None:
    """Opens every data connection (lane) of ``eng`` to ``p``: one request's slices spread over
    the lanes, so a request of several slices per lane connects them all."""
    size = min(p.size, 4 * eng.config.lanes * eng.config.slice_size)
    assert size >= 2 * eng.config.lanes * eng.config.slice_size
    eng.batch_transfer_sync(p.segment, [saddr], [p.addr], [size], OpCode.WRITE)


def test_a_peer_stalled_before_the_handshake_fails_the_transfer_at_once_not_as_a_timeout() -> None:
    """A target that accepts connections but never answers (SIGSTOP: its kernel still completes
    the TCP connect) and has no data connection from us yet: the transfer fails after
    connect_timeout_s with a plain TransferError saying the handshake did not complete, not a
    TransferTimeout — no request frame was sent, so nothing can land later, and a caller holding
    memory for a possible late WRITE (the SGLang prefill withholding an abort's ack, a store put
    revoking its allocation) need not. Until 2026-11-27 it was a TIMEOUT after connect_timeout_s."""
    ct = 1.0
    with TransferEngine(protocol="tcp", timeout_s=30.0, connect_timeout_s=ct) as eng:
        src = bytearray(1 << 20)
        saddr = eng.register_local_memory(src)
        p = PeerProcess(1 << 20)
        try:
            h = eng.open_segment(p.segment)  # its descriptor, no data connection yet
            os.kill(p.pid, signal.SIGSTOP)
            _wait_stopped(p.pid)
            t0 = time.monotonic()
            with pytest.raises(TransferError) as ei:
                eng.batch_transfer_sync(p.segment, [saddr], [p.addr], [1 << 20], OpCode.WRITE)
            assert time.monotonic() - t0 < ct * 3 + 1  # the connect timeout, not timeout_s (30 s)
            assert not isinstance(ei.value, TransferTimeout), ei.value
            assert "did not complete the handshake" in str(ei.value), ei.value
            assert late_batch(ei.value) is None
            bid = eng.allocate_batch_id(1)
            eng.submit_transfer(bid, [TransferRequest(OpCode.WRITE, saddr, h, p.addr, 4096)])
            st = eng.wait_batch(bid, timeout_s=30)
            assert st.state == TransferState.FAILED, st  # not TIMEOUT: nothing of it can land
            eng.free_batch_id(bid)
        finally:
            os.kill(p.pid, signal.SIGCONT)
            p.close()


def test_a_write_that_timed_out_on_a_stopped_peer_does_not_land_when_it_runs_again() -> None:
    """A WRITE sent to a target that is then stopped (SIGSTOP: its kernel still takes the bytes
    into the socket buffer) times out; when the target runs again its reactor must not apply the
    frames still queued: the initiator resets the connection when it gives up (SO_LINGER 0) and
    the target drops a reset connection unread. Until 2026-11-27 the target applied the old WRITE
    on resuming — over memory the store may have handed to another object meanwhile."""
    n = 64 << 10
    with TransferEngine(protocol="tcp", timeout_s=1.0, connect_timeout_s=1.0) as eng:
        src = bytearray(b"\xab" * (8 << 20))
        saddr = eng.register_local_memory(src)
        p = PeerProcess(8 << 20, protocol="tcp")
        try:
            _connect_lanes(eng, p, saddr)  # the lanes exist: a stall is not a handshake failure
            eng.transfer_sync(p.segment, saddr, p.addr, n)  # and the one this call takes (the first idle)
            p.fill(7)
            before = p.checksum(0, n)
            os.kill(p.pid, signal.SIGSTOP)
            _wait_stopped(p.pid)
            with pytest.raises(TransferTimeout):
                eng.transfer_sync(p.segment, saddr, p.addr, n)
            os.kill(p.pid, signal.SIGCONT)
            time.sleep(0.5)  # its reactor runs again (and would read the queued frames)
            assert p.checksum(0, n) == before, "the timed-out WRITE landed after the target resumed"
            eng.transfer_sync(p.segment, saddr, p.addr, n)  # a new connection works
            assert p.checksum(0, n) == xxhash.xxh3_64_hexdigest(bytes(src[:n]))
        finally:
            os.kill(p.pid, signal.SIGCONT)
            p.close()


class _Tracer:
    """Holds threads of another process at a system call's entry or exit (x86-64 ptrace: what a
    thread stalled exactly there looks like), the rest of the process running on."""

    SEIZE, INTERRUPT, SYSCALL, GETREGS, DETACH = 0x4206, 0x4207, 24, 12, 17
    EPOLL = {232, 281, 441}  # epoll_wait, epoll_pwait, epoll_pwait2

    def __init__(self) -> None:
        import ctypes

        self.ct = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self.libc.ptrace.restype = ctypes.c_long

    def _pt(self, req: int, tid: int, data: int = 0) -> None:
        if self.libc.ptrace(req, tid, None, self.ct.c_void_p(data)) == -1:
            raise OSError(self.ct.get_errno(), f"ptrace({req}, {tid})")

    def _stop(self, tid: int) -> None:
        st = self.ct.c_int()
        self.libc.waitpid(tid, self.ct.byref(st), 0x40000000)  # __WALL

    def _regs(self, tid: int) -> tuple[int, int]:
        buf = (self.ct.c_ulong * 27)()
        self._pt(self.GETREGS, tid, self.ct.addressof(buf))
        return buf[15], self.ct.c_long(buf[10]).value  # orig_rax (the call), rax (-ENOSYS at entry)

    def hold_at_epoll_entry(self, tid: int) -> None:
        self._pt(self.SEIZE, tid, 1)  # PTRACE_O_TRACESYSGOOD
        self._pt(self.INTERRUPT, tid)
        self._stop(tid)
        for _ in range(1000):
            self._pt(self.SYSCALL, tid)
            self._stop(tid)
            call, rax = self._regs(tid)
            if call in self.EPOLL and rax == -38:
                return
        raise AssertionError(f"thread {tid} never entered epoll_wait")

    def run_to_exit(self, tid: int) -> None:
        self._pt(self.SYSCALL, tid)  # the call runs (it returns at once: events are ready)
        self._stop(tid)

    def release(self, tid: int) -> None:
        self._pt(self.DETACH, tid)


def _reactor_threads(pid: int) -> list[int]:
    """Threads of ``pid`` waiting in epoll_wait (the server's reactors: its other threads block
    elsewhere)."""

    def call(t: str) -> int:
        f = open(f"/proc/{pid}/task/{t}/syscall").read().split()[0]
        return int(f) if f.lstrip("-").isdigit() else -1

    for _ in range(100):
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if call(t) in _Tracer.EPOLL]
        if len(tids) >= 2:
            return tids
        time.sleep(0.05)
    raise AssertionError("no reactor threads in epoll_wait")


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="holds threads with x86-64 ptrace registers")
def test_a_write_that_timed_out_does_not_land_when_the_reactor_stalled_after_epoll_returned() -> None:
    """The target's reactor threads stall right after epoll_wait returned the connection as
    readable (held there with ptrace; its other threads, the store's heartbeat among them, run on),
    the WRITE times out and the initiator resets the connection; when the reactor goes on, the
    flags it holds say only "readable". It must look at the socket again before reading the
    queued frames. Until 2026-11-27 it applied the timed-out WRITE."""
    n = 64 << 10
    tracer = _Tracer()
    outcomes = []
    with TransferEngine(protocol="tcp", timeout_s=1.0, connect_timeout_s=1.0) as eng:
        src = bytearray(b"\xcd" * (8 << 20))
        saddr = eng.register_local_memory(src)
        for _ in range(4):  # a try whose WRITE went out on a new connection fails its handshake
            p = PeerProcess(8 << 20, protocol="tcp")
            try:
                _connect_lanes(eng, p, saddr)
                eng.transfer_sync(p.segment, saddr, p.addr, n)  # the lane the write takes is open
                p.fill(7)
                before = p.checksum(0, n)
                tids = _reactor_threads(p.pid)
                for t in tids:
                    tracer.hold_at_epoll_entry(t)
                errors: list[BaseException] = []

                def write(p: PeerProcess = p, errors: list[BaseException] = errors) -> None:
                    try:
                        eng.transfer_sync(p.segment, saddr, p.addr, n)
                    except BaseException as exc:  # noqa: BLE001 - checked below
                        errors.append(exc)

                th = threading.Thread(target=write)
                th.start()
                time.sleep(0.3)  # the frames are in the target's socket buffer
                for t in tids:
                    tracer.run_to_exit(t)  # epoll_wait returned "readable"; held right after it
                th.join(30)
                time.sleep(0.2)  # the initiator's reset reached the target
                for t in tids:
                    tracer.release(t)
                time.sleep(0.5)
                timed_out = bool(errors) and isinstance(errors[0], TransferTimeout)
                outcomes.append(timed_out)
                if timed_out:
                    assert p.checksum(0, n) == before, "the timed-out WRITE landed after the stall"
                    break
            finally:
                p.close()
    assert any(outcomes), f"no try timed out with its frames queued ({outcomes})"


def test_stalled_peer_times_out_and_in_flight_batch_cannot_be_freed() -> None:
    timeout_s = 1.0
    with TransferEngine(protocol="tcp", timeout_s=timeout_s, connect_timeout_s=1.0) as eng:
        bs = 16 << 20
        src = bytearray(bs)
        saddr = eng.register_local_memory(src)
        p = PeerProcess(bs)
        try:
            h = eng.open_segment(p.segment)
            _connect_lanes(eng, p, saddr)  # a stall on a fresh connection is a handshake failure
            os.kill(p.pid, signal.SIGSTOP)
            bid = eng.allocate_batch_id(4)
            eng.submit_transfer(bid, [TransferRequest(OpCode.WRITE, saddr, h, p.addr, bs)] * 4)
            with pytest.raises(BatchInFlight):
                eng.free_batch_id(bid)
            t0 = time.monotonic()
            st = eng.wait_batch(bid, timeout_s=30)
            waited = time.monotonic() - t0
            assert st.state == TransferState.TIMEOUT, st
            assert waited < timeout_s * 4 + 2, waited  # one stalled send per lane, then every slice fails
            err = eng.get_transfer_status(bid, 0)
            assert err.state in (TransferState.TIMEOUT, TransferState.FAILED) and err.error
            eng.free_batch_id(bid)
        finally:
            os.kill(p.pid, signal.SIGCONT)
            p.close()


def test_sync_batch_with_any_timed_out_request_raises_transfer_timeout() -> None:
    """One synchronous batch to two peers: one killed (its requests FAILED, first in the batch),
    one stalled (SIGSTOP: its WRITEs time out). The call raises TransferTimeout naming both
    failures, not a plain TransferError: the stalled peer may still apply WRITE frames it
    received, and a caller that reads TransferError as "nothing of the call can still land"
    (the SGLang prefill then acks an abort, the decode reuses the pages) must not see one."""
    with TransferEngine(protocol="tcp", timeout_s=1.0, connect_timeout_s=1.0) as eng:
        bs = 4 << 20
        src = bytearray(bs)
        saddr = eng.register_local_memory(src)
        gone, stalled = PeerProcess(bs), PeerProcess(bs)
        try:
            eng.batch_transfer_sync(gone.segment, [saddr], [gone.addr], [4096], OpCode.WRITE)  # connected
            _connect_lanes(eng, stalled, saddr)
            gone.kill()
            os.kill(stalled.pid, signal.SIGSTOP)
            parts = [
                (gone.segment, [saddr] * 2, [gone.addr] * 2, [4096] * 2),
                (stalled.segment, [saddr] * 20, [stalled.addr] * 20, [bs] * 20),  # > INLINE_MAX: one batch
            ]
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout) as ei:
                eng.batch_transfer_sync_multi(parts, OpCode.WRITE)
            assert time.monotonic() - t0 < 30
            msg = str(ei.value)
            m = re.search(r"timed out, request (\d+):", msg)
            assert "request 0: FAILED" in msg and m and int(m.group(1)) >= 2, msg  # a stalled peer's
            assert late_batch(ei.value) is None  # nothing of it still runs here
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
            stalled.close()
            gone.close()


def test_unreachable_segment_is_segment_not_found(engine: TransferEngine) -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(SegmentNotFound):
        engine.open_segment(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 3


def test_same_host_path_falls_back_to_tcp_when_kernel_refuses(tmp_path) -> None:
    """Target not dumpable + initiator without CAP_SYS_PTRACE: process_vm_writev gets EPERM."""
    with PeerProcess(1 << 20, no_dumpable=True, shm=True) as p:
        script = textwrap.dedent(
            f"""
            import json
            from kvpool import TransferEngine, OpCode, _native
            with TransferEngine(protocol="auto", timeout_s=5) as eng:
                buf = bytearray(65536)
                a = eng.register_local_memory(buf)
                _native.fill_pattern(a, len(buf), 77)
                h = eng.open_segment({p.segment!r})
                before = eng.uses_same_host_path(h)
                assert eng.shared_buffers_mapped(h) == 0  # /proc/<pid>/fd refused too
                eng.transfer_sync({p.segment!r}, a, {p.addr}, len(buf), OpCode.WRITE)
                after = eng.uses_same_host_path(h)
                print(json.dumps({{"before": before, "after": after}}))
            """
        )
        cmd = [
            "setpriv",
            "--bounding-set=-sys_ptrace",
            "--inh-caps=-sys_ptrace",
            sys.executable,
            "-c",
            script,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
        # The target's fence table cannot be mapped either (same ptrace rule): the same-host path is
        # off from open_segment on, and the write goes over TCP.
        assert line == '{"before": false, "after": false}'
        expect = bytearray(65536)
        _native.fill_pattern(_native.buffer_address(expect)[0], len(expect), 77)
        assert p.checksum(0, 65536) == xxhash.xxh3_64_hexdigest(expect)
