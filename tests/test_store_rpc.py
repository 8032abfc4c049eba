"""kvpool._rpc over real loopback sockets: handshake, limits and deadlines against hostile peers."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool import Store
from kvpool._rpc import RpcClient, frame, unpack
from kvpool._rpc_server import RpcLimits, RpcServer
from kvpool.errors import AuthenticationError, InvalidArgument, MasterUnavailable
from kvpool.store.procs import MasterProcess, StorageProcess


def _echo(req: dict[str, Any]) -> dict[str, Any]:
    if req.get("op") == "big":
        return {"ok": True, "blob": b"x" * int(req["n"])}
    return {"ok": True, "echo": req.get("v")}


class _Server:
    def __init__(self, secret: str | None = None, **limits: Any) -> None:
        self.srv = RpcServer("127.0.0.1", 0, _echo, lambda: None, secret=secret, limits=RpcLimits(**limits))
        self.address = f"127.0.0.1:{self.srv.port}"
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.srv.stop()
        self.thread.join(5)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[_Server]:
    s = _Server(**getattr(request, "param", {}))
    yield s
    s.close()


def _raw(address: str) -> tuple[socket.socket, dict[str, Any]]:
    """A raw connection and the server's hello."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    return s, _read_frame(s)


def _read_frame(s: socket.socket) -> Any:
    hdr = _recv_exact(s, 4)
    return unpack(_recv_exact(s, struct.unpack("<I", hdr)[0]))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("closed")
        buf += chunk
    return buf


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        while True:
            if s.recv(65536) == b"":
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.mark.parametrize("secret", ["pw", "pässwörd 🔑 with spaces"])
def test_challenge_response_any_utf8_secret_never_in_clear(secret: str) -> None:
    srv = _Server(secret=secret)
    try:
        assert RpcClient(srv.address, 5, secret).call("echo", v=1)["echo"] == 1
        # Watch what a client sends: the secret never appears, in any encoding.
        s, hello = _raw(srv.address)
        assert hello["auth"] is True and len(hello["nonce"]) == 32
        seen = bytearray()
        lst = socket.create_server(("127.0.0.1", 0))
        port = lst.getsockname()[1]

        def fake_server() -> None:
            c, _ = lst.accept()
            c.sendall(frame({**hello, "nonce": os.urandom(32)}))
            c.settimeout(2)
            try:
                while chunk := c.recv(4096):
                    seen.extend(chunk)
            except OSError:
                pass
            c.close()

        t = threading.Thread(target=fake_server, daemon=True)
        t.start()
        with pytest.raises(MasterUnavailable):
            RpcClient(f"127.0.0.1:{port}", 1, secret).call("echo")
        t.join(5)
        s.close()
        lst.close()
        assert seen, "the client sent nothing"
        for enc in ("utf-8", "utf-16-le", "utf-32-le"):
            assert secret.encode(enc) not in seen
    finally:
        srv.close()


def test_wrong_or_missing_secret_says_so() -> None:
    srv = _Server(secret="right")
    try:
        with pytest.raises(AuthenticationError, match="wrong secret"):
            RpcClient(srv.address, 5, "wrong").call("echo")
        with pytest.raises(AuthenticationError, match="requires a secret"):
            RpcClient(srv.address, 5, None).call("echo")
    finally:
        srv.close()
    open_srv = _Server(secret=None)
    try:
        with pytest.raises(AuthenticationError, match="without a secret"):
            RpcClient(open_srv.address, 5, "mine").call("echo")
    finally:
        open_srv.close()


def test_store_wrong_secret_is_not_master_unavailable() -> None:
    with MasterProcess(secret="ünïcode-sëcret") as m:
        with pytest.raises(AuthenticationError, match="wrong secret"):
            Store.connect(master=m.address, segment_size=0, secret="other")
        with Store.connect(master=m.address, segment_size=1 << 20, secret="ünïcode-sëcret") as st:
            st.put("k", b"v")
            assert st.get("k") == b"v"


def test_child_processes_get_the_secret_outside_their_command_line() -> None:
    """Every local user can read /proc/PID/cmdline: the master, storage servers and transfer peers
    kvpool starts get the secret in their environment, and still enforce it."""
    from kvpool.transfer.peer import PeerProcess

    secret = "argv-secret-7f3a"
    with MasterProcess(secret=secret) as m, StorageProcess(m.address, 1 << 20, secret=secret) as sp:
        with PeerProcess(1 << 20, secret=secret) as peer:
            for pid in (m.proc.pid, sp.proc.pid, peer.proc.pid):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    assert secret.encode() not in f.read()
        with pytest.raises(AuthenticationError, match="wrong secret"):
            Store.connect(master=m.address, segment_size=0, secret="other")
        with Store.connect(master=m.address, segment_size=0, secret=secret) as st:
            st.put("k", b"v")  # lands in the storage server's segment: it registered with the secret
            assert st.get("k") == b"v" and st.info("k")["replicas"][0][0] == sp.segment


@pytest.mark.parametrize("server", [{"secret": "s"}], indirect=True)
def test_big_message_before_auth_is_refused(server: _Server) -> None:
    s, _ = _raw(server.address)
    s.sendall(struct.pack("<I", 60 << 20) + b"\0" * 1024)  # announces 60 MiB, before the handshake
    reply = _read_frame(s)
    assert reply["ok"] is False and "before authentication" in reply["msg"]
    assert _closed_within(s, 3)
    assert server.srv._in_total < 1 << 20


@pytest.mark.parametrize("server", [{"frame_timeout_s": 0.5, "handshake_timeout_s": 0.5}], indirect=True)
def test_partial_frames_and_silent_handshakes_time_out(server: _Server) -> None:
    silent, _ = _raw(server.address)  # never authenticates
    partial = RpcClient(server.address, 5)
    partial.call("echo")
    sock = partial._sock
    assert sock is not None
    sock.sendall(struct.pack("<I", 1000) + b"\x81")  # 1 of 1000 bytes, then nothing
    t0 = time.monotonic()
    assert _closed_within(silent, 5) and _closed_within(sock, 5)
    assert time.monotonic() - t0 < 4
    assert server.srv.stats["closed_handshake_timeout"] >= 1 and server.srv.stats["closed_frame_timeout"] >= 1


@pytest.mark.parametrize("server", [{"frame_timeout_s": 0.5}], indirect=True)
def test_a_frame_trickled_a_byte_at_a_time_still_times_out(server: _Server) -> None:
    """The frame deadline runs from the frame's first bytes: more bytes do not extend it."""
    peer = RpcClient(server.address, 5)
    peer.call("echo")  # authenticated
    sock = peer._sock
    assert sock is not None
    sock.sendall(struct.pack("<I", 1000) + b"\x81")
    t0 = time.monotonic()
    closed_after = None
    while time.monotonic() - t0 < 4:
        time.sleep(0.1)
        try:
            sock.sendall(b"\x00")  # 1 byte every 0.1 s: the frame is never complete
        except OSError:
            closed_after = time.monotonic() - t0
            break
    assert closed_after is not None and closed_after < 2.5, closed_after
    assert server.srv.stats["closed_frame_timeout"] == 1


@pytest.mark.parametrize("server", [{"out_high_water": 256 << 10, "out_timeout_s": 1.0}], indirect=True)
def test_a_peer_that_does_not_read_replies_is_not_read_and_is_dropped(server: _Server) -> None:
    c = RpcClient(server.address, 5)
    c.call("echo")
    sock = c._sock
    assert sock is not None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    req = frame({"op": "big", "id": 7, "n": 64 << 10, "pad": b"p" * 4096})
    sock.settimeout(0.2)
    sent = 0
    try:
        for _ in range(20000):  # 80 MiB of requests for 1.2 GiB of replies, read none
            sock.sendall(req)
            sent += 1
    except (TimeoutError, OSError):
        pass
    time.sleep(0.3)
    # The server stopped reading this peer near its high-water mark instead of buffering replies.
    assert server.srv._out_total <= (256 << 10) + (128 << 10), server.srv._out_total
    assert sent < 20000
    assert _closed_within(sock, 5)  # replies made no progress for out_timeout_s
    assert server.srv.stats["closed_out_timeout"] == 1
    assert RpcClient(server.address, 5).call("echo", v=2)["echo"] == 2


@pytest.mark.parametrize("server", [{"idle_timeout_s": 0.6}], indirect=True)
def test_idle_connections_are_reaped_and_clients_reconnect(server: _Server) -> None:
    c = RpcClient(server.address, 5)
    assert c.call("echo", v=1)["echo"] == 1
    old = c._sock
    time.sleep(1.6)
    assert server.srv.connections == 0
    assert c.call("echo", v=2)["echo"] == 2  # a fresh connection, no error
    assert c._sock is not old


def test_malformed_frames_get_typed_error_and_hang_up(server: _Server) -> None:
    c = RpcClient(server.address, 5)
    c.call("echo")
    sock = c._sock
    assert sock is not None
    sock.sendall(struct.pack("<I", 3) + b"\xc1\xc1\xc1")
    reply = _read_frame(sock)
    assert reply["ok"] is False and reply["err"] == "INVALID"
    assert _closed_within(sock, 3)
    with pytest.raises(InvalidArgument):
        RpcClient(server.address, 5).call("echo", v=b"x" * (20 << 20))  # over max_message
    assert RpcClient(server.address, 5).call("echo", v=3)["echo"] == 3


_FD_SERVER = textwrap.dedent(
    """
    import resource, sys, threading
    from kvpool._rpc_server import RpcServer
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    srv = RpcServer("127.0.0.1", 0, lambda r: {"ok": True}, lambda: None)
    print(srv.port, flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), srv.stop()), daemon=True).start()
    srv.serve_forever()
    """
)


def test_fd_limit_backs_off_accept_and_keeps_serving() -> None:
    p = subprocess.Popen([sys.executable, "-c", _FD_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        port = int(p.stdout.readline())
        addr = f"127.0.0.1:{port}"
        good = RpcClient(addr, 5)
        good.call("ping")
        floods = []
        for _ in range(120):  # far beyond the server's 64 descriptors
            try:
                floods.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                break
        time.sleep(0.5)
        cpu0 = _cpu_s(p.pid)
        time.sleep(1.0)
        assert _cpu_s(p.pid) - cpu0 < 0.5, "the server spins at the fd limit"
        for _ in range(5):
            assert good.call("ping")["ok"]  # existing clients are still served
        for s in floods:
            s.close()
        time.sleep(0.5)
        assert RpcClient(addr, 5).call("ping")["ok"]  # and new ones once descriptors free up
    finally:
        p.stdin.close()  # type: ignore[union-attr]
        p.wait(10)


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_deferred_reply_is_sent_from_another_thread_and_stop_wakes_the_loop() -> None:
    parked: list[tuple[Any, Any]] = []

    def handler(req: dict[str, Any], conn: Any) -> dict[str, Any] | None:
        if req.get("op") == "later":
            parked.append((conn, req["id"]))
            return None  # answered later, through call_soon + reply
        return {"ok": True, "v": req.get("v")}

    srv = RpcServer("127.0.0.1", 0, handler, lambda: None, tick_s=30.0, with_connection=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    waiter = RpcClient(f"127.0.0.1:{srv.port}", 5.0)
    other = RpcClient(f"127.0.0.1:{srv.port}", 5.0)
    try:
        got: list[Any] = []
        th = threading.Thread(target=lambda: got.append(waiter.call("later")))
        th.start()
        deadline = time.monotonic() + 5
        while not parked and time.monotonic() < deadline:
            time.sleep(0.005)
        assert other.call("now", v=3)["v"] == 3  # a parked question holds up no one else
        assert th.is_alive() and not got
        conn, rid = parked[0]
        srv.call_soon(lambda: srv.reply(conn, rid, {"ok": True, "v": "late"}))
        th.join(5)
        assert got and got[0]["v"] == "late"  # woken at once (the tick is 30 s)
    finally:
        waiter.close()
        other.close()
        t0 = time.monotonic()
        srv.stop()
        t.join(5)
        assert not t.is_alive() and time.monotonic() - t0 < 2
