"""Metadata backends (http, etcd, redis) against real servers, and the HTTP metadata server itself."""

from __future__ import annotations

import http.client
import itertools
import random
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator

import pytest

from kvpool.errors import InvalidArgument, MetadataError
from kvpool.transfer.metadata import (
    EtcdMetadata,
    HttpMetadata,
    MetadataBackend,
    RedisMetadata,
    open_metadata,
)
from kvpool.transfer.metadata_server import MetadataServer
from tests.servers import etcd_url, free_port, http_metadata_url, redis_url  # noqa: F401

BACKENDS = ["http", "etcd", "redis"]
URL_FIXTURES = {"http": "http_metadata_url", "etcd": "etcd_url", "redis": "redis_url"}
BACKEND_TYPES = {"http": HttpMetadata, "etcd": EtcdMetadata, "redis": RedisMetadata}
ONE_MIB = 1 << 20


def _unique(prefix: str = "seg") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _dead_url(kind: str, port: int) -> str:
    return {
        "http": f"http://127.0.0.1:{port}/metadata",
        "etcd": f"etcd://127.0.0.1:{port}",
        "redis": f"redis://127.0.0.1:{port}",
    }[kind]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[MetadataBackend]:
    url = request.getfixturevalue(URL_FIXTURES[request.param])
    meta = open_metadata(url, timeout_s=5.0)
    assert isinstance(meta, BACKEND_TYPES[request.param])
    try:
        yield meta
    finally:
        meta.close()


# -- roundtrips against real servers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [b"", b"\x00", bytes(range(256)), random.Random(7).randbytes(ONE_MIB)],
    ids=["empty", "nul", "all-bytes", "1MiB"],
)
def test_put_get_delete_roundtrip(backend: MetadataBackend, value: bytes) -> None:
    name = _unique()
    backend.put(name, value)
    got = backend.get(name)
    assert isinstance(got, bytes)
    assert got == value
    backend.delete(name)
    assert backend.get(name) is None


def test_put_overwrites(backend: MetadataBackend) -> None:
    name = _unique()
    backend.put(name, b"first")
    backend.put(name, bytearray(b"second"))
    assert backend.get(name) == b"second"
    backend.delete(name)


def test_missing_key_is_none(backend: MetadataBackend) -> None:
    assert backend.get(_unique("missing")) is None


def test_delete_absent_is_ok(backend: MetadataBackend) -> None:
    name = _unique("absent")
    backend.delete(name)
    backend.delete(name)
    assert backend.get(name) is None


@pytest.mark.parametrize("suffix", ["a/b:c d", "x?key=y&z=1", "100%+%2F#frag", "ünï©ødé/段", "../..\\etc"])
def test_odd_names(backend: MetadataBackend, suffix: str) -> None:
    name = f"{_unique()}/{suffix}"
    other = f"{_unique()}/a/b"
    backend.put(name, b"odd:" + suffix.encode())
    backend.put(other, b"other")
    assert backend.get(name) == b"odd:" + suffix.encode()
    assert backend.get(other) == b"other"
    backend.delete(name)
    assert backend.get(name) is None
    assert backend.get(other) == b"other"
    backend.delete(other)


def test_names_are_isolated(backend: MetadataBackend) -> None:
    a, b = _unique(), _unique()
    backend.put(a, b"A")
    assert backend.get(b) is None
    backend.put(b, b"B")
    assert (backend.get(a), backend.get(b)) == (b"A", b"B")
    backend.delete(a)
    assert backend.get(b) == b"B"
    backend.delete(b)


def test_concurrent_use(backend: MetadataBackend) -> None:
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(10):
                name = f"{_unique()}-{i}-{j}"
                backend.put(name, f"{i}:{j}".encode())
                assert backend.get(name) == f"{i}:{j}".encode()
                backend.delete(name)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_bad_arguments(backend: MetadataBackend) -> None:
    with pytest.raises(InvalidArgument):
        backend.get("")
    with pytest.raises(InvalidArgument):
        backend.put(_unique(), "not bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        backend.delete(123)  # type: ignore[arg-type]


def test_etcd_keys_use_prefix(etcd_url: str, http_metadata_url: str) -> None:  # noqa: F811
    import base64
    import json
    import urllib.request

    meta = open_metadata(etcd_url)
    assert meta is not None
    name = _unique()
    meta.put(name, b"v")
    endpoint = etcd_url.replace("etcd://", "http://")
    key = base64.b64encode(f"kvpool/segments/{name}".encode()).decode()
    req = urllib.request.Request(
        f"{endpoint}/v3/kv/range", data=json.dumps({"key": key}).encode(), method="POST"
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=5) as resp:
        kvs = json.loads(resp.read())["kvs"]
    assert base64.b64decode(kvs[0]["value"]) == b"v"
    meta.delete(name)


def test_redis_keys_use_prefix(redis_url: str) -> None:  # noqa: F811
    import redis

    meta = open_metadata(redis_url)
    assert meta is not None
    name = _unique()
    meta.put(name, b"v")
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.get(f"kvpool/segments/{name}") == b"v"
    finally:
        client.close()
    meta.delete(name)
    meta.close()


# -- failures ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("op", ["get", "put", "delete"])
def test_closed_port_raises_quickly(kind: str, op: str) -> None:
    timeout_s = 1.0
    url = _dead_url(kind, free_port())
    meta = open_metadata(url, timeout_s=timeout_s)
    assert meta is not None
    start = time.monotonic()
    with pytest.raises(MetadataError) as info:
        if op == "put":
            meta.put("x", b"y")
        else:
            getattr(meta, op)("x")
    elapsed = time.monotonic() - start
    assert elapsed < timeout_s + 1.0
    assert url in str(info.value)
    meta.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener accepts connections (kernel backlog) but never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("kind", BACKENDS)
def test_silent_server_times_out(kind: str, silent_port: int) -> None:
    timeout_s = 0.5
    url = _dead_url(kind, silent_port)
    meta = open_metadata(url, timeout_s=timeout_s)
    assert meta is not None
    start = time.monotonic()
    with pytest.raises(MetadataError) as info:
        meta.get("x")
    elapsed = time.monotonic() - start
    assert elapsed < timeout_s + 1.0
    assert url in str(info.value)
    meta.close()


def _assert_trickle_times_out(head: bytes, drip: Iterator[bytes], match: str | None = None) -> None:
    """Serve one connection: ``head`` at once, then ``drip`` a chunk every 0.1 s; a get with a
    1 s budget must raise MetadataError (matching ``match``) within 2 s."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(head)
                for chunk in drip:
                    if stop.is_set():
                        return
                    conn.sendall(chunk)
                    time.sleep(0.1)
            except OSError:
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        meta = open_metadata(f"http://127.0.0.1:{port}/metadata", timeout_s=1.0)
        assert meta is not None
        start = time.monotonic()
        with pytest.raises(MetadataError, match=match):
            meta.get("x")
        assert time.monotonic() - start < 2.0
    finally:
        stop.set()
        listener.close()
        thread.join(5)


def test_trickling_http_server_respects_deadline() -> None:
    """A server that drips its body byte by byte cannot stretch a call past the timeout."""
    _assert_trickle_times_out(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", itertools.repeat(b"x"))


def test_trickling_http_headers_respect_deadline() -> None:
    """A server that drips its status line and headers a byte at a time cannot stretch a call past
    the timeout either (a per-recv timeout restarted with every byte: 37 s for a 1 s budget)."""
    pad = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 1000
    _assert_trickle_times_out(b"", (bytes([b]) for b in pad), match="timed out")


def test_wrong_service_is_a_metadata_error(http_metadata_url: str, redis_url: str) -> None:  # noqa: F811
    # etcd URL pointing at the HTTP metadata server: 404 on /v3/kv/range is a bad answer, not "absent".
    port = urllib.parse.urlsplit(http_metadata_url).port
    with pytest.raises(MetadataError, match="etcd"):
        EtcdMetadata(f"etcd://127.0.0.1:{port}", timeout_s=2.0).get("x")
    # HTTP metadata URL pointing at redis: not HTTP at all.
    redis_port = urllib.parse.urlsplit(redis_url).port
    with pytest.raises(MetadataError):
        HttpMetadata(f"http://127.0.0.1:{redis_port}/metadata", timeout_s=2.0).put("x", b"y")
    # Wrong path on the HTTP server: PUT is refused with 404.
    wrong = http_metadata_url.replace("/metadata", "/nope")
    with pytest.raises(MetadataError, match="404"):
        HttpMetadata(wrong, timeout_s=2.0).put("x", b"y")


# -- open_metadata ---------------------------------------------------------------------------------------


def test_open_p2p_is_none() -> None:
    assert open_metadata("p2p") is None
    assert open_metadata("P2P") is None


@pytest.mark.parametrize("url", ["ftp://x", "", "localhost:2379", "http://", "etcd://", "redis://"])
def test_open_bad_url(url: str) -> None:
    with pytest.raises(InvalidArgument):
        open_metadata(url)


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan")])
def test_open_bad_timeout(timeout_s: float) -> None:
    with pytest.raises(InvalidArgument):
        open_metadata("http://127.0.0.1:1/metadata", timeout_s=timeout_s)


def test_open_does_not_connect() -> None:
    port = free_port()
    for kind in BACKENDS:
        meta = open_metadata(_dead_url(kind, port), timeout_s=1.0)
        assert isinstance(meta, BACKEND_TYPES[kind])
        meta.close()


def test_password_is_not_in_errors() -> None:
    meta = open_metadata(f"redis://:s3cret@127.0.0.1:{free_port()}/0", timeout_s=1.0)
    assert meta is not None
    with pytest.raises(MetadataError) as info:
        meta.get("x")
    assert "s3cret" not in str(info.value)
    meta.close()


# -- the HTTP metadata server ---------------------------------------------------------------------------


def _raw(
    url: str, method: str, key: str | None, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    parts = urllib.parse.urlsplit(url)
    path = parts.path + (f"?key={urllib.parse.quote(key, safe='')}" if key is not None else "")
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_server_protocol(http_metadata_url: str) -> None:  # noqa: F811
    key = _unique()
    assert _raw(http_metadata_url, "GET", key)[0] == 404
    assert _raw(http_metadata_url, "DELETE", key)[0] == 404
    assert _raw(http_metadata_url, "PUT", key, b"\x00data")[0] == 200
    assert _raw(http_metadata_url, "GET", key) == (200, b"\x00data")
    assert _raw(http_metadata_url, "DELETE", key)[0] == 200
    assert _raw(http_metadata_url, "GET", key)[0] == 404
    assert _raw(http_metadata_url, "GET", None)[0] == 400
    assert _raw(http_metadata_url.replace("/metadata", "/other"), "GET", key)[0] == 404


def test_server_accepts_chunked_put(http_metadata_url: str) -> None:  # noqa: F811
    key = _unique()
    parts = urllib.parse.urlsplit(http_metadata_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("PUT", f"{parts.path}?key={key}", body=iter([b"ab", b"", b"cd"]), encode_chunked=True)
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    assert _raw(http_metadata_url, "GET", key) == (200, b"abcd")


def test_server_413_on_oversized_body(http_metadata_url: str) -> None:  # noqa: F811
    # Announce 16 MiB + 1 without sending it: the server must refuse from the headers alone.
    parts = urllib.parse.urlsplit(http_metadata_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.putrequest("PUT", f"{parts.path}?key=big")
        conn.putheader("Content-Length", str(16 * ONE_MIB + 1))
        conn.endheaders()
        assert conn.getresponse().status == 413
    finally:
        conn.close()
    assert _raw(http_metadata_url, "GET", "big")[0] == 404


def test_client_reports_413(http_metadata_url: str) -> None:  # noqa: F811
    meta = HttpMetadata(http_metadata_url, timeout_s=10.0)
    with pytest.raises(MetadataError, match="413"):
        meta.put(_unique(), bytes(16 * ONE_MIB + 1))


def test_server_in_process_lifecycle() -> None:
    server = MetadataServer(max_body_bytes=1024)
    assert server.url == f"http://127.0.0.1:{server.port}/metadata"
    with server:
        meta = HttpMetadata(server.url, timeout_s=5.0)
        meta.put("k", b"v" * 1024)
        assert meta.get("k") == b"v" * 1024
        with pytest.raises(MetadataError, match="413"):
            meta.put("k", b"v" * 1025)
        assert meta.get("k") == b"v" * 1024
        status, _ = _raw(
            server.url, "PUT", "k", b"x", headers={"Expect": "100-continue", "Content-Length": "4096"}
        )
        assert status == 413
    server.stop()  # idempotent
    with pytest.raises(MetadataError):
        HttpMetadata(server.url, timeout_s=1.0).get("k")


def test_server_serve_forever_and_stop_from_other_thread() -> None:
    server = MetadataServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    meta = HttpMetadata(server.url, timeout_s=5.0)
    deadline = time.monotonic() + 5
    while True:
        try:
            meta.put("k", b"v")
            break
        except MetadataError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert meta.get("k") == b"v"
    server.stop()
    thread.join(5)
    assert not thread.is_alive()


def test_server_main_bad_port_returns_error(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.transfer.metadata_server import main

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert main(["--port", str(port)]) == 1
    assert "cannot bind" in capsys.readouterr().err
