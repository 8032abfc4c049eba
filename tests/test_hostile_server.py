"""Hostile peers against the engine's TCP server (issue 12, deliverables 3 and 4).

Real sockets against a real server, and a real target process for the thread-exhaustion and
10,000-connection cases. No timing assertions: every wait is for an event (EOF, an answer), with
generous safety timeouts that only turn a hang into a failure.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Iterator
from hashlib import sha256
from pathlib import Path

import pytest
import xxhash

from kvpool import OpCode, TransferEngine, _native
from kvpool.errors import AuthenticationError, SegmentNotFound
from kvpool.transfer.peer import PeerProcess

HELLO_OK = struct.Struct("<IiQ")
RESP = struct.Struct("<IiIIQ")
REFUSED_STATUS = 1  # ST_REMOTE_BOUNDS


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _wait_eof(s: socket.socket, limit_s: float = 30.0) -> bool:
    """True once the server closed the connection (EOF or reset); False if it stayed open."""
    s.settimeout(limit_s)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _connect(port: int, src: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((src, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def _authed(port: int, secret: str = "") -> socket.socket:
    s = _connect(port)
    challenge = _recv_exact(s, _native.CHALLENGE_SIZE)
    s.sendall(_native.encode_hello(secret, challenge))
    _m, status, _inc = HELLO_OK.unpack(_recv_exact(s, HELLO_OK.size))
    assert status == 0
    _recv_exact(s, 32)
    return s


def _native_engine(**kw: int | str) -> _native.NativeEngine:
    opts: dict[str, int | str] = dict(
        host="127.0.0.1",
        port=0,
        secret="",
        lanes=1,
        slice_size=1 << 20,
        timeout_ms=30000,
        connect_timeout_ms=5000,
        max_frame=1 << 24,
    )
    opts.update(kw)
    return _native.NativeEngine(**opts)


# ------------------------------------------------------------------ challenge-response


@pytest.mark.parametrize("klen", [0, 5, 64, 65, 300])
def test_native_hmac_matches_python(klen: int) -> None:
    key, msg = os.urandom(klen), os.urandom(1000 + klen)
    assert _native.hmac_sha256(key, msg) == hmac.new(key, msg, sha256).digest()
    assert _native.hmac_sha256(key, b"") == hmac.new(key, b"", sha256).digest()


class _Harvester:
    """A listener a forged descriptor points at: it records what a client sends and answers with
    a challenge of its choosing and an 'ok' carrying a proof it cannot compute."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.captured = bytearray()
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                c, _ = self.sock.accept()
                with c:
                    c.settimeout(5)
                    c.sendall(struct.pack("<II", 0x4E50564B, 1) + b"\x07" * 32)
                    self.captured += _recv_exact(c, 72)
                    c.sendall(HELLO_OK.pack(0x4F50564B, 0, 1234) + b"\x00" * 32)
                    with contextlib.suppress(OSError):
                        self.captured += c.recv(4096)

    def close(self) -> None:
        self.sock.close()


def test_secret_never_travels_and_impostor_is_refused() -> None:
    secret = "correct horse battery staple"
    harvester = _Harvester()
    try:
        with TransferEngine(protocol="tcp", secret=secret, timeout_s=5, connect_timeout_s=5) as eng:
            with pytest.raises(AuthenticationError, match="did not prove the shared secret"):
                eng.open_segment(f"127.0.0.1:{harvester.port}")
    finally:
        harvester.close()
    assert len(harvester.captured) >= 72
    assert secret.encode() not in bytes(harvester.captured)
    # What it got is a proof bound to its own nonce and the client's: useless elsewhere.
    client_nonce, proof = bytes(harvester.captured[8:40]), bytes(harvester.captured[40:72])
    assert (
        proof
        == hmac.new(secret.encode(), b"kvpool-engine-client" + b"\x07" * 32 + client_nonce, sha256).digest()
    )


def test_client_with_secret_refuses_server_without_one() -> None:
    with (
        TransferEngine(protocol="tcp", timeout_s=5) as open_target,
        TransferEngine(protocol="tcp", secret="s", timeout_s=5) as eng,
    ):
        with pytest.raises(AuthenticationError):
            eng.open_segment(open_target.segment_name)


# ------------------------------------------------------------------ locks, deadlines, reaping


def test_trickling_write_holds_no_lock_and_unregister_fences_it() -> None:
    """A WRITE stalled mid-payload does not delay register/unregister; bytes after unregister
    are drained, never landed, and the WRITE is refused."""
    with TransferEngine(protocol="tcp", timeout_s=120) as tgt:
        buf = bytearray(4096)
        addr = tgt.register_local_memory(buf)
        s = _authed(tgt.port)
        s.sendall(_native.encode_request(_native.OP_WRITE, 7, addr, 4096) + b"\xab")
        # Wait until the byte landed: the server is now inside the frame.
        for _ in range(1000):
            if buf[0] == 0xAB:
                break
            time.sleep(0.01)
        assert buf[0] == 0xAB
        done = threading.Event()

        def other_work() -> None:
            extra = bytearray(1 << 20)
            tgt.register_local_memory(extra)
            tgt.unregister_local_memory(extra)
            tgt.unregister_local_memory(addr)
            done.set()

        t = threading.Thread(target=other_work, daemon=True)
        t.start()
        # With a lock held across socket I/O this would wait for the 120 s frame deadline.
        assert done.wait(60), "register/unregister blocked behind a stalled WRITE"
        s.sendall(b"\xcd" * 4095)
        _m, st, rid, _r, _ln = RESP.unpack(_recv_exact(s, RESP.size))
        assert (st, rid) == (REFUSED_STATUS, 7)
        assert bytes(buf[1:]) == bytes(4095)  # nothing landed after unregister
        assert tgt._native.server_stats()["fenced_accesses"] >= 1
        s.close()


def test_whole_frame_deadline_is_not_reset_by_trickling() -> None:
    with TransferEngine(protocol="tcp", timeout_s=1) as tgt:
        buf = bytearray(4096)
        addr = tgt.register_local_memory(buf)
        s = _authed(tgt.port)
        s.sendall(_native.encode_request(_native.OP_WRITE, 1, addr, 64))
        closed = False
        for _ in range(60):  # one byte every 0.25 s: the frame would need 16 s
            try:
                s.sendall(b"\x01")
            except OSError:
                closed = True
                break
            time.sleep(0.25)
            s.setblocking(False)
            try:
                if s.recv(64) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed = True
                break
            finally:
                s.setblocking(True)
        assert closed, "a trickling frame outlived the whole-frame deadline"
        assert tgt._native.server_stats()["frame_timeouts"] >= 1
        # The server still serves others.
        with TransferEngine(protocol="tcp") as ini:
            src = bytearray(b"x" * 4096)
            a = ini.register_local_memory(src)
            ini.transfer_sync(tgt.segment_name, a, addr, 4096, OpCode.WRITE)
        assert bytes(buf) == bytes(src)


def test_handshake_deadline_and_idle_reaping() -> None:
    eng = _native_engine(connect_timeout_ms=500, idle_timeout_ms=700)
    try:
        silent = _connect(eng.port)
        trickler = _connect(eng.port)
        trickler.sendall(b"K")  # a hello that never completes
        idle = _authed(eng.port)
        assert _wait_eof(silent)
        assert _wait_eof(trickler)
        assert _wait_eof(idle)
        stats = eng.server_stats()
        assert stats["handshake_timeouts"] >= 2
        assert stats["idle_closed"] >= 1
        assert stats["open"] == 0
    finally:
        eng.shutdown()


def test_connection_bounds_per_peer_and_total() -> None:
    eng = _native_engine(max_connections_per_peer=4, max_connections=6)
    socks: list[socket.socket] = []
    try:
        for _ in range(4):
            socks.append(_connect(eng.port, "127.0.0.2"))
            assert len(_recv_exact(socks[-1], _native.CHALLENGE_SIZE)) == _native.CHALLENGE_SIZE
        over = _connect(eng.port, "127.0.0.2")
        assert _recv_exact(over, 4) == b"KVPB"  # refused at accept: 'busy', no challenge
        assert _wait_eof(over)
        for _ in range(2):
            socks.append(_connect(eng.port, "127.0.0.3"))
            assert len(_recv_exact(socks[-1], _native.CHALLENGE_SIZE)) == _native.CHALLENGE_SIZE
        full = _connect(eng.port, "127.0.0.4")
        assert _recv_exact(full, 4) == b"KVPB"
        stats = eng.server_stats()
        assert stats["refused_peer_limit"] >= 1 and stats["refused_total_limit"] >= 1
        for s in socks:
            s.close()
        socks.clear()
        for _ in range(200):  # the slots come back once the server saw the closes
            if eng.server_stats()["open"] == 0:
                break
            time.sleep(0.05)
        ok = _authed(eng.port)
        ok.close()
        for _ in range(200):
            if eng.server_stats()["open"] == 0:
                break
            time.sleep(0.05)
        # A refused engine client is told why.
        for _ in range(4):
            socks.append(_connect(eng.port))
            assert _recv_exact(socks[-1], 4) == b"KVPN"  # admitted (a challenge)
        with pytest.raises(SegmentNotFound, match="connection bound"):
            _native.fetch_descriptor("127.0.0.1", eng.port, "", 5000)
    finally:
        for s in socks:
            s.close()
        eng.shutdown()


def test_unauthenticated_reads_and_writes_never_touch_memory() -> None:
    """Requests sent before (or instead of) a valid hello are refused with the connection."""
    with TransferEngine(protocol="tcp", secret="k", timeout_s=5) as tgt:
        buf = bytearray(4096)
        addr = tgt.register_local_memory(buf)
        s = _connect(tgt.port)
        _recv_exact(s, _native.CHALLENGE_SIZE)
        s.sendall(_native.encode_request(_native.OP_WRITE, 1, addr, 4) + b"EVIL")
        assert _wait_eof(s, 10)
        assert bytes(buf) == bytes(4096)


# ------------------------------------------------------------------ real target process


def _pids_cgroup() -> Path | None:
    root = Path("/sys/fs/cgroup/pids")
    if not root.is_dir():
        root = Path("/sys/fs/cgroup")
        if (
            not (root / "cgroup.controllers").exists()
            or "pids" not in (root / "cgroup.controllers").read_text()
        ):
            return None
    d = root / f"kvpool-test-{os.getpid()}"
    try:
        d.mkdir()
    except OSError:
        return None
    return d


@contextlib.contextmanager
def _thread_capped(pid: int) -> Iterator[None]:
    """No new thread or process for `pid` from now on (pids cgroup; RLIMIT_NPROC does not bind
    root, which CI runs as)."""
    cg = _pids_cgroup()
    if cg is None:
        pytest.skip("no writable pids cgroup here to cap the target's threads")
    try:
        (cg / "cgroup.procs").write_text(str(pid))
        (cg / "pids.max").write_text((cg / "pids.current").read_text().strip())
        yield
    finally:
        with contextlib.suppress(OSError):
            (cg / "pids.max").write_text("max")
        parent = cg.parent
        with contextlib.suppress(OSError):
            (parent / "cgroup.procs").write_text(str(pid))
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _open_many(port: int, n: int, partial_every: int = 0) -> list[socket.socket]:
    """`n` connections from many 127.x source addresses (under the per-peer bound); every
    `partial_every`-th sends a fragment of a hello and stops."""
    out = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((f"127.0.{2 + i // 200}.1", 0))
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        out.append(s)
    if partial_every:
        for i, s in enumerate(out):
            if i % partial_every == 0:
                with contextlib.suppress(OSError):
                    s.send(b"KVP")
    return out


def _check_write(peer: PeerProcess, secret: str | None = None) -> None:
    with TransferEngine(protocol="tcp", secret=secret, timeout_s=60, connect_timeout_s=30) as ini:
        src = bytearray(1 << 20)
        a = ini.register_local_memory(src)
        _native.fill_pattern(a, len(src), 99)
        ini.transfer_sync(peer.segment, a, peer.addr, len(src), OpCode.WRITE)
        assert peer.checksum(0, len(src)) == xxhash.xxh3_64_hexdigest(src)


def test_thread_exhausted_target_survives_connection_flood() -> None:
    """The target may start no thread at all; hundreds of connections (idle and partial hellos)
    neither crash it (the old server aborted on std::system_error) nor stop it serving."""
    with PeerProcess(1 << 20, protocol="tcp", secret="k", timeout_s=30) as peer:
        with _thread_capped(peer.pid):
            socks = _open_many(peer.port, 600, partial_every=2)
            try:
                _check_write(peer, "k")
                assert peer.proc.poll() is None
            finally:
                for s in socks:
                    s.close()


def test_ten_thousand_idle_connections() -> None:
    hard = _raise_nofile()
    n = 10_000 if hard >= 10_200 else hard - 200
    assert n >= 1000, f"open-file limit {hard} is too low for this test"
    with PeerProcess(1 << 20, protocol="tcp", secret="k", timeout_s=30) as peer:
        socks = _open_many(peer.port, n)
        try:
            _check_write(peer, "k")
            assert peer.proc.poll() is None
        finally:
            for s in socks:
                s.close()


def test_bounds_from_transfer_config() -> None:
    """The server bounds are TransferConfig fields; a refused engine is told why."""
    with TransferEngine(protocol="tcp", max_connections_per_peer=2, idle_timeout_s=60) as tgt:
        held = [_connect(tgt.port) for _ in range(2)]
        for s in held:
            assert _recv_exact(s, 4) == b"KVPN"
        with TransferEngine(protocol="tcp") as ini, pytest.raises(SegmentNotFound, match="connection bound"):
            ini.open_segment(tgt.segment_name)
        for s in held:
            s.close()
