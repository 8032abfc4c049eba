"""The target decides on the same-host path too (issue 12, deliverable 2): real target processes,
native engines, process_vm_writev and the fence table (csrc/fence.h)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool import _native

REMOTE_BOUNDS = 1

TARGET = r"""
import json, sys, time
from kvpool import _native
e = _native.NativeEngine(host="127.0.0.1", port=0, secret="", lanes=1, slice_size=1 << 20,
                         timeout_ms=5000, connect_timeout_ms=5000, max_frame=1 << 24)
buf = bytearray(65536)
addr, n = _native.buffer_address(buf)
slot, gen, _ = e.register_memory(addr, n, True, False)
print(json.dumps(dict(pid=__import__("os").getpid(), port=e.port, inc=e.incarnation, fence_fd=e.fence_fd,
                      addr=addr, n=n, slot=slot, gen=gen)), flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "unregister":
        e.unregister_memory(addr)
        out = {}
    elif cmd[0] == "shrink":
        slot, gen, _ = e.register_memory(addr, 4096, True, False)
        out = {"slot": slot, "gen": gen}
    elif cmd[0] == "head":
        out = {"head": bytes(buf[:8]).hex(), "tail": bytes(buf[-8:]).hex()}
    elif cmd[0] == "fence_check":  # unregister, then watch the memory: nothing may land any more
        e.unregister_memory(addr)
        snap = bytes(buf)
        time.sleep(float(cmd[1]))
        out = {"changed": bytes(buf) != snap}
    elif cmd[0] == "stats":
        out = dict(e.server_stats())
    else:
        break
    print(json.dumps(out), flush=True)
"""


class _Target:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.info = json.loads(self.proc.stdout.readline())

    def ask(self, line: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def target():
    t = _Target()
    yield t
    t.close()


def _native_engine(timeout_ms: int = 5000) -> Any:
    """An initiator's native engine on loopback: one lane, no secret, ``timeout_ms`` for both
    transfers and connects."""
    return _native.NativeEngine(
        host="127.0.0.1",
        port=0,
        secret="",
        lanes=1,
        slice_size=1 << 20,
        timeout_ms=timeout_ms,
        connect_timeout_ms=timeout_ms,
        max_frame=1 << 24,
    )


def _initiator(t: _Target):
    e = _native_engine()
    src = bytearray(65536)
    local, n = _native.buffer_address(src)
    e.register_memory(local, n, False, False)
    i = t.info
    h = e.add_peer("127.0.0.1", i["port"], i["inc"], i["pid"], [(i["addr"], i["n"], 0)])
    assert e.set_peer_fence(h, i["pid"], i["fence_fd"], [(i["addr"], i["n"], i["slot"], i["gen"])])
    return e, src, local, h


def test_same_host_write_lands_through_the_fence(target: _Target) -> None:
    e, src, local, h = _initiator(target)
    try:
        src[:8] = b"SAMEHOST"
        src[-8:] = b"LASTBYTE"
        assert e.transfer_sync(_native.OP_WRITE, local, h, target.info["addr"], 65536) == 0
        assert target.ask("head") == {"head": b"SAMEHOST".hex(), "tail": b"LASTBYTE".hex()}
        assert e.peer_fence_refused(h) == 0
        assert target.ask("stats")["accepted"] == 0  # no TCP connection: it went the same-host way
    finally:
        e.shutdown()


def test_write_after_unregister_is_refused_as_over_tcp(target: _Target) -> None:
    e, src, local, h = _initiator(target)
    try:
        src[:8] = b"FIRST..."
        assert e.transfer_sync(_native.OP_WRITE, local, h, target.info["addr"], 65536) == 0
        target.ask("unregister")
        src[:8] = b"LATE!!!!"
        # The initiator's descriptor still lists the buffer: the fence sends it to TCP, where the
        # target refuses it.
        assert e.transfer_sync(_native.OP_WRITE, local, h, target.info["addr"], 65536) == REMOTE_BOUNDS
        assert e.peer_fence_refused(h) >= 1
        assert target.ask("head")["head"] == b"FIRST...".hex()
    finally:
        e.shutdown()


def test_shrunk_registration_is_never_written_past_its_end(target: _Target) -> None:
    e, src, local, h = _initiator(target)
    try:
        target.ask("unregister")
        target.ask("shrink")  # same address, 4 KiB now
        src[-8:] = b"PASTEND!"
        assert e.transfer_sync(_native.OP_WRITE, local, h, target.info["addr"], 65536) == REMOTE_BOUNDS
        assert target.ask("head")["tail"] != b"PASTEND!".hex()
        src[:8] = b"INBOUNDS"
        assert e.transfer_sync(_native.OP_WRITE, local, h, target.info["addr"], 4096) == 0  # over TCP
        assert target.ask("head")["head"] == b"INBOUNDS".hex()
    finally:
        e.shutdown()


def test_no_write_lands_after_unregister_returns_under_a_stream_of_writes(target: _Target) -> None:
    """An initiator writes as fast as it can while the target unregisters; once unregister
    returned, the memory must not change any more (the check-then-write window is closed)."""
    e, src, local, h = _initiator(target)
    stop = threading.Event()
    count = [0]

    def writer() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            src[:8] = k.to_bytes(8, "little")
            if e.transfer_sync(_native.OP_WRITE, local, h, target.info["addr"], 65536) == 0:
                count[0] += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        for _ in range(1000):
            if count[0] >= 20:
                break
            time.sleep(0.01)
        assert count[0] >= 20
        assert target.ask("fence_check 0.5") == {"changed": False}
    finally:
        stop.set()
        t.join(30)
        e.shutdown()


# ------------------------------------------------------------------ through TransferEngine

ENGINE_TARGET = r"""
import json, sys
from kvpool import TransferEngine
eng = TransferEngine(protocol="auto", timeout_s=5, secret=sys.argv[1] or None, metadata=sys.argv[2],
                     name=sys.argv[3] or None)
buf = bytearray(65536)
addr = eng.register_local_memory(buf)
print(json.dumps({"segment": eng.segment_name, "addr": addr}), flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "unregister":
        eng.unregister_local_memory(addr)
        out = {}
    elif cmd[0] == "head":
        out = {"head": bytes(buf[:8]).hex()}
    else:
        break
    print(json.dumps(out), flush=True)
eng.close()
"""


class _EngineTarget(_Target):
    def __init__(self, secret: str = "", metadata: str = "p2p", name: str = "") -> None:
        cmd = [sys.executable, "-c", ENGINE_TARGET, secret, metadata, name]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.info = json.loads(self.proc.stdout.readline())


def test_auto_write_after_unregister_is_refused_as_over_tcp() -> None:
    from kvpool import OpCode, TransferEngine
    from kvpool.errors import TransferError

    t = _EngineTarget()
    try:
        with TransferEngine(protocol="auto", timeout_s=5) as eng:
            src = bytearray(b"FIRST..." + bytes(65528))
            a = eng.register_local_memory(src)
            h = eng.open_segment(t.info["segment"])
            assert eng.uses_same_host_path(h)
            eng.transfer_sync(t.info["segment"], a, t.info["addr"], 65536, OpCode.WRITE)
            assert t.ask("head")["head"] == b"FIRST...".hex()
            t.ask("unregister")
            src[:8] = b"LATE!!!!"
            with pytest.raises(TransferError, match="remote-accessible"):
                eng.transfer_sync(t.info["segment"], a, t.info["addr"], 65536, OpCode.WRITE)
            assert t.ask("head")["head"] == b"FIRST...".hex()
    finally:
        t.close()


def test_forged_descriptor_in_an_open_store_is_refused_before_any_transfer() -> None:
    """A metadata store anyone can write (no server secret): a forged descriptor naming the
    target's pid and buffers (or a harvester's port) is refused by an engine holding the secret."""
    from kvpool import OpCode, TransferEngine
    from kvpool.errors import AuthenticationError
    from kvpool.transfer.metadata import HttpMetadata
    from kvpool.transfer.metadata_server import MetadataServer

    with MetadataServer() as ms:
        t = _EngineTarget("s3", ms.url, "victim")
        try:
            store = HttpMetadata(ms.url)
            genuine = store.get("victim")
            assert genuine is not None
            from kvpool.transfer.types import SegmentDescriptor

            desc = SegmentDescriptor.from_bytes(genuine, "s3")
            store.put("forged", desc.to_bytes())  # same pid, buffers and port, unsigned
            store.put("copied", genuine)  # the genuine signed descriptor under another name
            with TransferEngine(protocol="auto", secret="s3", metadata=ms.url, timeout_s=5) as eng:
                src = bytearray(b"EVIL" * 16384)
                a = eng.register_local_memory(src)
                with pytest.raises(AuthenticationError, match="unsigned"):
                    eng.open_segment("forged")
                with pytest.raises(AuthenticationError, match="describes segment 'victim'"):
                    eng.open_segment("copied")
                with pytest.raises(AuthenticationError):
                    eng.transfer_sync("forged", a, desc.buffers[0].addr, 4, OpCode.WRITE)
                assert t.ask("head")["head"] == bytes(8).hex()
                eng.transfer_sync("victim", a, desc.buffers[0].addr, 4, OpCode.WRITE)  # genuine: fine
                assert t.ask("head")["head"] == (b"EVIL" + bytes(4)).hex()
        finally:
            t.close()


WRITER = r"""
import sys
from kvpool import OpCode, TransferEngine
eng = TransferEngine(protocol="auto", timeout_s=30)
src = bytearray(b"W" * int(sys.argv[3]))
a = eng.register_local_memory(src)
eng.transfer_sync(sys.argv[1], a, int(sys.argv[2]), len(src), OpCode.WRITE)
print("go", flush=True)
while True:
    try:
        eng.transfer_sync(sys.argv[1], a, int(sys.argv[2]), len(src), OpCode.WRITE)
    except Exception:
        pass
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@contextlib.contextmanager
def _stopped_inside_a_copy(eng: Any, n: int) -> Iterator[tuple[bytearray, int, subprocess.Popen, Exception]]:
    """A same-host writer process (WRITER) copying into a fresh ``n``-byte buffer of ``eng``,
    stopped (SIGSTOP) inside a copy: (buffer, its address, the writer, the RegistrationError its
    unregister raised). A stop between two copies fences nothing (unregister succeeds): the case is
    set up again with a fresh buffer and writer, at most 10 times (one is nearly always enough: each
    copy of ``n`` = 64 MiB takes milliseconds). The writer is killed on the way out."""
    import os
    import signal

    from kvpool.errors import RegistrationError

    for _ in range(10):
        buf = bytearray(n)
        addr = eng.register_local_memory(buf)
        w = subprocess.Popen(
            [sys.executable, "-c", WRITER, eng.segment_name, str(addr), str(n)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert w.stdout is not None and w.stdout.readline().strip() == "go"
            assert buf[:1] == b"W"
            os.kill(w.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while not _stopped(w.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                eng.unregister_local_memory(addr)
                continue  # stopped between copies: nothing to fence, try again
            except RegistrationError as exc:
                yield buf, addr, w, exc
                return
        finally:
            w.kill()
            w.wait()
    pytest.fail("in 10 tries the writer was never stopped inside a copy")


def test_unregister_under_a_stopped_same_host_writer_raises_and_leaves_it_unpublished() -> None:
    """A same-host peer SIGSTOPped inside a copy into our buffer: the fence retire cannot be
    confirmed, so unregister raises RegistrationError, and the range is nonetheless unregistered
    and unpublished (not half-done: still in the Python registry and the descriptor)."""
    import os
    import signal

    from kvpool import TransferEngine
    from kvpool.errors import AddressNotRegistered

    n = 64 << 20
    with (
        TransferEngine(protocol="auto", timeout_s=1) as eng,
        _stopped_inside_a_copy(eng, n) as (buf, addr, w, exc),
    ):
        assert "stopped inside a copy" in str(exc)
        assert addr not in [b.addr for b in eng.local_descriptor().buffers]
        with pytest.raises(AddressNotRegistered):
            eng.unregister_local_memory(addr)  # gone everywhere, not half-registered
        os.kill(w.pid, signal.SIGCONT)
        time.sleep(0.5)  # the copy in flight finishes; every later one is refused
        buf[:] = bytes(n)
        time.sleep(0.5)
        assert buf.count(0) == n


def test_range_under_a_stopped_same_host_writer_cannot_be_registered_again() -> None:
    """Unregister raised because a same-host peer is stopped inside a copy into the buffer: the
    range cannot be registered again (even local-only) while that copy may still land in it, since
    the peer's bytes, sent for the old registration, would land in the new one; once the peer
    continues, the range registers and nothing of the old registration's writes lands any more."""
    import os
    import signal

    from kvpool import TransferEngine
    from kvpool.errors import RegistrationError

    n = 64 << 20
    with (
        TransferEngine(protocol="auto", timeout_s=1) as eng,
        _stopped_inside_a_copy(eng, n) as (buf, _, w, _exc),
    ):
        try:
            eng.register_local_memory(buf, remote_accessible=False)
        except RegistrationError as exc:
            assert "still inside a copy" in str(exc)
        else:  # registered again: no peer may write into it now
            buf[:] = bytes(n)
            os.kill(w.pid, signal.SIGCONT)
            time.sleep(0.5)
            assert buf.count(0) == n, "the stopped peer's copy landed in the new registration"
            pytest.fail("registered again under a stopped same-host writer")
        os.kill(w.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:  # its copy ends: the range is free again
            try:
                eng.register_local_memory(buf, remote_accessible=False)
                break
            except RegistrationError:
                assert time.monotonic() < deadline, "the range stayed reserved after the peer went on"
                time.sleep(0.02)
        buf[:] = bytes(n)
        time.sleep(0.5)
        assert buf.count(0) == n


SUCCESSOR = r"""
import json, os, sys
from kvpool import _native
kw = dict(host="127.0.0.1", port=0, secret="", lanes=1, slice_size=1 << 20, timeout_ms=2000,
          connect_timeout_ms=2000, max_frame=1 << 24)
a = _native.NativeEngine(**kw)
old = bytearray(65536)
addr, n = _native.buffer_address(old)
slot, gen, _ = a.register_memory(addr, n, True, False)
info = dict(pid=os.getpid(), port=a.port, inc=a.incarnation, fence_fd=a.fence_fd, addr=addr, n=n,
            slot=slot, gen=gen)
a.shutdown()  # its fence fd is closed: the next engine's table takes the number
b = _native.NativeEngine(**kw)
new = bytearray(65536)
b.register_memory(*_native.buffer_address(new), True, False)
info["new_fence_fd"] = b.fence_fd
print(json.dumps(info), flush=True)
for line in sys.stdin:
    print(json.dumps({"head": bytes(old[:8]).hex()}), flush=True)
"""


def test_stale_descriptor_never_pins_another_engines_fence_table() -> None:
    """A descriptor of an engine that shut down, its process still running another engine whose
    fence table now has the same fd number (and the same first slot and generation): the
    initiator must not take that table as the old engine's and copy into the old engine's memory,
    which no registration holds any more."""
    t = _Target.__new__(_Target)
    t.proc = subprocess.Popen(
        [sys.executable, "-c", SUCCESSOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert t.proc.stdout is not None
    t.info = json.loads(t.proc.stdout.readline())
    try:
        assert t.info["new_fence_fd"] == t.info["fence_fd"]  # the case: the number was reused
        e = _native_engine(2000)
        try:
            src = bytearray(b"STALE!!!" * 8192)
            local, n = _native.buffer_address(src)
            e.register_memory(local, n, False, False)
            i = t.info
            h = e.add_peer("127.0.0.1", i["port"], i["inc"], i["pid"], [(i["addr"], i["n"], 0)])
            mapped = e.set_peer_fence(h, i["pid"], i["fence_fd"], [(i["addr"], i["n"], i["slot"], i["gen"])])
            assert e.transfer_sync(_native.OP_WRITE, local, h, i["addr"], n) != 0
            assert t.ask("head")["head"] == bytes(8).hex(), "written into memory no engine holds"
            assert not mapped
        finally:
            e.shutdown()
    finally:
        t.close()
