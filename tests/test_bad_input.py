"""Bad input gets a typed error and the target's memory stays untouched."""

from __future__ import annotations

import socket
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import OpCode, TransferEngine, TransferRequest, TransferState, _native
from kvpool.errors import (
    AddressNotRegistered,
    AuthenticationError,
    InvalidArgument,
    KvpoolError,
    ProtocolError,
    ProtocolUnavailable,
    RegistrationError,
    RemoteAccessError,
    SegmentNotFound,
)
from kvpool.transfer.peer import PeerProcess
from tests.conftest import view_at

HELLO_OK = struct.Struct("<IiQ")
RESP = struct.Struct("<IiIIQ")


@pytest.fixture
def target() -> TransferEngine:
    """An in-process target whose memory the test can inspect directly."""
    eng = TransferEngine(protocol="tcp", timeout_s=3.0, connect_timeout_s=1.0)
    yield eng
    eng.close()


def _registered(eng: TransferEngine, size: int, remote: bool = True, seed: int = 5) -> tuple[bytearray, int]:
    buf = bytearray(size)
    addr = eng.register_local_memory(buf, remote_accessible=remote)
    _native.fill_pattern(addr, size, seed)
    return buf, addr


def test_unregistered_local_address(peer: PeerProcess, tcp_engine: TransferEngine) -> None:
    before = peer.checksum(0, 4096)
    stray = bytearray(4096)  # never registered
    addr = _native.buffer_address(stray)[0]
    h = tcp_engine.open_segment(peer.segment)
    bid = tcp_engine.allocate_batch_id(1)
    with pytest.raises(AddressNotRegistered):
        tcp_engine.submit_transfer(bid, [TransferRequest(OpCode.WRITE, addr, h, peer.addr, 4096)])
    with pytest.raises(AddressNotRegistered):
        tcp_engine.transfer_sync(peer.segment, addr, peer.addr, 4096, OpCode.WRITE)
    # A range that starts inside a registration but runs past its end is refused too.
    _, reg = _registered(tcp_engine, 4096)
    with pytest.raises(AddressNotRegistered):
        tcp_engine.transfer_sync(peer.segment, reg + 1, peer.addr, 4096, OpCode.WRITE)
    tcp_engine.free_batch_id(bid)
    assert peer.checksum(0, 4096) == before


def test_remote_range_outside_registered_buffers(peer: PeerProcess, tcp_engine: TransferEngine) -> None:
    _, addr = _registered(tcp_engine, 8192)
    before = peer.checksum(peer.size - 4096, 4096)
    for remote in (peer.addr + peer.size - 4095, peer.addr - 4096, 0x1000, peer.addr + peer.size):
        with pytest.raises(RemoteAccessError):
            tcp_engine.transfer_sync(peer.segment, addr, remote, 4096, OpCode.WRITE)
    h = tcp_engine.open_segment(peer.segment)
    bid = tcp_engine.allocate_batch_id(2)
    # All-or-nothing: the good first request is not sent when the second is bad.
    with pytest.raises(RemoteAccessError):
        tcp_engine.submit_transfer(
            bid,
            [
                TransferRequest(OpCode.WRITE, addr, h, peer.addr + peer.size - 4096, 4096),
                TransferRequest(OpCode.WRITE, addr, h, peer.addr + peer.size - 10, 4096),
            ],
        )
    assert tcp_engine.get_batch_status(bid).state == TransferState.WAITING
    tcp_engine.free_batch_id(bid)
    assert peer.checksum(peer.size - 4096, 4096) == before


@pytest.mark.parametrize("length", [0, -1, -4096])
def test_zero_or_negative_length(peer: PeerProcess, tcp_engine: TransferEngine, length: int) -> None:
    _, addr = _registered(tcp_engine, 4096)
    h = tcp_engine.open_segment(peer.segment)
    with pytest.raises(InvalidArgument):
        tcp_engine.transfer_sync(peer.segment, addr, peer.addr, length, OpCode.WRITE)
    bid = tcp_engine.allocate_batch_id(1)
    with pytest.raises(InvalidArgument):
        tcp_engine.submit_transfer(bid, [TransferRequest(OpCode.WRITE, addr, h, peer.addr, length)])
    tcp_engine.free_batch_id(bid)


def test_other_bad_arguments(tcp_engine: TransferEngine) -> None:
    with pytest.raises(InvalidArgument):
        tcp_engine.allocate_batch_id(0)
    with pytest.raises(InvalidArgument):
        tcp_engine.free_batch_id(123456)
    with pytest.raises(InvalidArgument):
        tcp_engine.get_transfer_status(123456, 0)
    bid = tcp_engine.allocate_batch_id(1)
    with pytest.raises(InvalidArgument):
        tcp_engine.get_transfer_status(bid, 5)
    with pytest.raises(InvalidArgument):
        tcp_engine.submit_transfer(bid, [TransferRequest(7, 1, 1, 1, 1)])  # type: ignore[arg-type]
    tcp_engine.free_batch_id(bid)
    with pytest.raises(InvalidArgument):
        tcp_engine.register_local_memory(b"read-only bytes")
    with pytest.raises(InvalidArgument):
        tcp_engine.register_local_memory(12345)  # raw address without a length
    with pytest.raises(InvalidArgument):
        tcp_engine.register_local_memory(bytearray(16), location="tpu:0")
    with pytest.raises(ProtocolUnavailable):
        tcp_engine.register_local_memory(bytearray(16), location="cuda:0")
    with pytest.raises(AddressNotRegistered):
        tcp_engine.unregister_local_memory(0xDEAD000)
    with pytest.raises(InvalidArgument):
        tcp_engine.open_segment("no-port-here")
    with pytest.raises(ProtocolUnavailable):
        TransferEngine(protocol="rdma")
    # Every typed error shares one base class.
    assert issubclass(RemoteAccessError, KvpoolError) and issubclass(ProtocolError, KvpoolError)


def test_overlapping_registration_refused(tcp_engine: TransferEngine) -> None:
    buf = bytearray(8192)
    addr = tcp_engine.register_local_memory(buf)
    with pytest.raises(RegistrationError):
        tcp_engine.register_local_memory(addr + 4096, 8192)
    with pytest.raises(RegistrationError):
        tcp_engine.register_local_memory(addr - 100, 200)
    tcp_engine.unregister_local_memory(addr)
    assert tcp_engine.register_local_memory(addr + 4096, 4096) == addr + 4096


def test_unknown_and_closed_segment_handles(peer: PeerProcess, tcp_engine: TransferEngine) -> None:
    _, addr = _registered(tcp_engine, 4096)
    h = tcp_engine.open_segment(peer.segment)
    tcp_engine.close_segment(h)
    bid = tcp_engine.allocate_batch_id(1)
    with pytest.raises(SegmentNotFound):
        tcp_engine.submit_transfer(bid, [TransferRequest(OpCode.WRITE, addr, h, peer.addr, 4096)])
    with pytest.raises(SegmentNotFound):
        tcp_engine.close_segment(h)
    tcp_engine.free_batch_id(bid)


def test_non_remote_accessible_memory_is_refused(target: TransferEngine, tcp_engine: TransferEngine) -> None:
    private, paddr = _registered(target, 4096, remote=False, seed=1)
    snapshot = bytes(private)
    _, laddr = _registered(tcp_engine, 4096, seed=2)
    with pytest.raises(RemoteAccessError):  # not in the descriptor's remote-accessible list
        tcp_engine.transfer_sync(target.segment_name, laddr, paddr, 4096, OpCode.WRITE)
    assert bytes(private) == snapshot


def _raw_connect(eng: TransferEngine, secret: str = "") -> socket.socket:
    """A raw connection that answered the server's challenge (HELLO_OK follows, then its proof)."""
    s = socket.create_connection(("127.0.0.1", eng.port), timeout=3)
    challenge = _recv_exact(s, _native.CHALLENGE_SIZE)
    s.sendall(_native.encode_hello(secret, challenge))
    return s


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def test_server_bounds_checks_raw_frames(target: TransferEngine) -> None:
    """A client that skips its own checks still cannot touch unregistered or private memory."""
    pub, paddr = _registered(target, 4096, seed=1)
    priv, qaddr = _registered(target, 4096, remote=False, seed=2)
    snap_pub, snap_priv = bytes(pub), bytes(priv)
    s = _raw_connect(target)
    magic, status, _inc = HELLO_OK.unpack(_recv_exact(s, HELLO_OK.size))
    assert status == 0
    _recv_exact(s, 32)  # the server's proof
    cases = [
        (paddr + 4000, 200),  # runs past the end
        (qaddr, 100),  # registered but not remote-accessible
        (paddr - 64, 64),  # just before
        (0x10, 16),  # nowhere
    ]
    for i, (addr, n) in enumerate(cases):
        s.sendall(_native.encode_request(_native.OP_WRITE, i, addr, n) + b"\xee" * n)
        _m, st, rid, _r, ln = RESP.unpack(_recv_exact(s, RESP.size))
        assert (st, rid, ln) == (1, i, 0), (addr, n)
        s.sendall(_native.encode_request(_native.OP_READ, 100 + i, addr, n))
        _m, st, rid, _r, ln = RESP.unpack(_recv_exact(s, RESP.size))
        assert (st, rid, ln) == (1, 100 + i, 0)
    # The connection is still in sync: a valid write lands.
    s.sendall(_native.encode_request(_native.OP_WRITE, 9, paddr, 4) + b"OKAY")
    _m, st, rid, _r, _ln = RESP.unpack(_recv_exact(s, RESP.size))
    assert (st, rid) == (0, 9)
    s.close()
    assert bytes(pub) == b"OKAY" + snap_pub[4:]
    assert bytes(priv) == snap_priv


def test_wrong_secret_refused_before_memory_is_touched() -> None:
    with TransferEngine(protocol="tcp", secret="s3cret", timeout_s=2) as tgt:
        buf, addr = _registered(tgt, 4096, seed=3)
        snap = bytes(buf)
        s = _raw_connect(tgt, "wrong")
        _m, status, inc = HELLO_OK.unpack(_recv_exact(s, HELLO_OK.size))
        assert (status, inc) == (3, 0)  # a refused hello reveals nothing, not even the incarnation
        assert _recv_exact(s, 32) == bytes(32)
        try:
            s.sendall(_native.encode_request(_native.OP_WRITE, 1, addr, 4) + b"EVIL")
        except OSError:
            pass
        try:
            assert s.recv(64) == b""  # closed, no reply
        except ConnectionResetError:
            pass  # closed with our request unread: reset, still no reply
        s.close()
        with TransferEngine(protocol="tcp") as no_secret:
            with pytest.raises(AuthenticationError):
                no_secret.open_segment(tgt.segment_name)
        with TransferEngine(protocol="tcp", secret="s3cret") as good:
            _, laddr = _registered(good, 4096, seed=4)
            good.transfer_sync(tgt.segment_name, laddr, addr, 4096, OpCode.WRITE)
            assert bytes(buf) != snap
        assert xxhash.xxh3_64_hexdigest(bytes(buf)) != xxhash.xxh3_64_hexdigest(snap)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_garbage_to_tcp_port_leaves_memory_untouched(data: bytes) -> None:
    tgt = _SHARED_TARGET
    s = socket.create_connection(("127.0.0.1", tgt.port), timeout=2)
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(2)
        while s.recv(4096):
            pass
    except OSError:
        pass
    finally:
        s.close()
    assert bytes(_SHARED_BUF) == _SHARED_SNAPSHOT


_SHARED_TARGET = None
_SHARED_BUF = bytearray(4096)
_SHARED_SNAPSHOT = b""


@pytest.fixture(autouse=True, scope="module")
def _shared_target():
    global _SHARED_TARGET, _SHARED_SNAPSHOT
    _SHARED_TARGET = TransferEngine(protocol="tcp", secret="k", timeout_s=1, connect_timeout_s=1)
    addr = _SHARED_TARGET.register_local_memory(_SHARED_BUF)
    _native.fill_pattern(addr, 4096, 8)
    _SHARED_SNAPSHOT = bytes(_SHARED_BUF)
    yield
    # The server still serves good clients after all the garbage.
    with TransferEngine(protocol="tcp", secret="k") as c:
        b = bytearray(4096)
        la = c.register_local_memory(b)
        c.transfer_sync(_SHARED_TARGET.segment_name, la, addr, 4096, OpCode.READ)
        assert bytes(b) == _SHARED_SNAPSHOT
    _SHARED_TARGET.close()


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=256), st.integers(min_value=1, max_value=1 << 40))
def test_frame_decoder_fuzz(data: bytes, max_frame: int) -> None:
    try:
        frames = _native.decode_frames(data, max_frame)
    except ProtocolError:
        return
    for op, _id, _addr, length, status in frames:
        assert op in (1, 2, 3, 4)
        if op == 1:
            assert 0 < length <= max_frame and status == 0


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([1, 2, 3, 4]),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(1, 1 << 20),
)
def test_frame_roundtrip(op: int, rid: int, addr: int, length: int) -> None:
    payload = b"\0" * length if op == 1 else b""
    frames = _native.decode_frames(_native.encode_request(op, rid, addr, length) + payload, 1 << 20)
    assert frames == [(op, rid, addr, length, 0)]


def test_oversized_and_unknown_frames_are_fatal() -> None:
    with pytest.raises(ProtocolError):
        _native.decode_frames(_native.encode_request(1, 0, 0, 1 << 30), 1 << 20)
    with pytest.raises(ProtocolError):
        _native.decode_frames(_native.encode_request(9, 0, 0, 1), 1 << 20)
    with pytest.raises(ProtocolError):
        _native.decode_frames(b"X" * 32, 1 << 20)


def test_view_helper_reads_registered_memory(tcp_engine: TransferEngine) -> None:
    buf, addr = _registered(tcp_engine, 64, seed=9)
    assert bytes(view_at(addr, 64)) == bytes(buf)
