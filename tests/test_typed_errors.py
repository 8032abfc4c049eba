"""Public calls refuse wrong types and values with typed errors that name the parameter and say what
to do; ``Store.connect`` recognises a server that is not a kvpool master at once."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from kvpool import OpCode, ReplicateConfig, Store, TransferEngine, TransferRequest
from kvpool._rpc import PRE_AUTH_MAX, _looks_like_hello
from kvpool.child import free_port_range
from kvpool.errors import InvalidArgument, InvalidType, ProtocolError
from kvpool.store.procs import MasterProcess


def test_engine_arguments(tcp_engine: TransferEngine) -> None:
    with pytest.raises(InvalidType, match="addr_or_buffer .*not str") as ei:
        tcp_engine.register_local_memory("abc")
    assert isinstance(ei.value, TypeError)  # still a TypeError for callers that catch that
    buf = bytearray(4096)
    addr = tcp_engine.register_local_memory(buf)
    h = tcp_engine.open_segment(tcp_engine.segment_name)
    bid = tcp_engine.allocate_batch_id(2)
    with pytest.raises(InvalidArgument, match="local_addr must be a non-negative int"):
        tcp_engine.transfer_sync(tcp_engine.segment_name, "x", addr, 8, OpCode.WRITE)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"5 request\(s\) do not fit: 2 of its 2 slots are free; "
                       r"allocate_batch_id\(5\)"):  # fmt: skip
        tcp_engine.submit_transfer(bid, [TransferRequest(OpCode.WRITE, addr, h, addr, 8)] * 5)
    tcp_engine.free_batch_id(bid)


def test_store_arguments() -> None:
    with Store.connect(segment_size=1 << 20, buffer_size=1 << 20, protocol="tcp") as st:
        buf = bytearray(4096)
        addr = st.register_buffer(buf)
        with pytest.raises(InvalidArgument, match=r"'k' has a negative size \(-5\)"):
            st.put_from("k", addr, -5)
        with pytest.raises(InvalidArgument, match="'k' is empty"):
            st.put("k", b"")
        with pytest.raises(InvalidArgument, match="addr must be a positive int"):
            st.put_from("k", "abc", 5)  # type: ignore[arg-type]
        with pytest.raises(InvalidType, match="size of 'k' must be an int"):
            st.put_from("k", addr, 5.0)  # type: ignore[arg-type]
        with pytest.raises(InvalidType, match="tensor must be a torch.Tensor, not list"):
            st.put_tensor("t", [1, 2, 3])
        with pytest.raises(InvalidArgument, match="value must be bytes-like, got int"):
            st.put("k", 5)
        for call in (lambda: st.get(5), lambda: st.put(5, b"x"), lambda: st.exists(None),
                     lambda: st.remove(3), lambda: st.get_into(b"k", bytearray(8))):  # fmt: skip
            with pytest.raises(InvalidType, match="key must be a str"):
                call()
        with pytest.raises(InvalidType, match="config must be a ReplicateConfig"):
            st.put("k", b"x", config="two")  # type: ignore[arg-type]
        for bad in ({"replicas": 0}, {"cache_class": "bogus"}, {"soft_pin_ttl_s": 0}):
            with pytest.raises(InvalidArgument, match="ReplicateConfig"):
                ReplicateConfig(**bad)
        st.put("k", b"fine", ReplicateConfig(replicas=1))
        assert st.get("k") == b"fine"


class _Http(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("n", [0, -3, 1001, 2.5, "4"])
def test_free_port_range_arguments(n: object) -> None:
    with pytest.raises(InvalidArgument):
        free_port_range(n)  # type: ignore[arg-type]


def test_free_port_range_gives_consecutive_free_ports() -> None:
    base = free_port_range(4)
    socks = [socket.socket() for _ in range(4)]
    try:
        for i, s in enumerate(socks):
            s.bind(("127.0.0.1", base + i))  # all four bind
    finally:
        for s in socks:
            s.close()


def test_connect_to_what_is_not_a_master() -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Http)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    eng = TransferEngine(protocol="tcp")
    try:
        for address, says in ((f"127.0.0.1:{httpd.server_address[1]}", "is an HTTP server"),
                              (f"127.0.0.1:{eng.port}", "not a kvpool master")):  # fmt: skip
            t0 = time.monotonic()
            with pytest.raises(ProtocolError, match=says):
                Store.connect(master=address, segment_size=0, rpc_timeout_s=60)
            assert time.monotonic() - t0 < 30  # refused long before the 60 s RPC timeout
    finally:
        eng.close()
        httpd.shutdown()
        httpd.server_close()


def test_a_real_hello_looks_like_one() -> None:
    with MasterProcess() as m, socket.create_connection(("127.0.0.1", m.port), timeout=10) as s:
        data = b""
        while len(data) < 5:
            data += s.recv(64)
        assert _looks_like_hello(data)
    assert not _looks_like_hello(b"-ERR unknown command")
    assert not _looks_like_hello((PRE_AUTH_MAX + 1).to_bytes(4, "little") + b"\x81")
