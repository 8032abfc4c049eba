"""The HTTP metadata server under issue 12: authenticated writes, bounds, idle connections.

Real server threads and real sockets on loopback; no timing assertions.
"""

from __future__ import annotations

import http.client
import socket
import time

import pytest

from kvpool.errors import MetadataError
from kvpool.transfer.metadata import AUTH_HEADER, HttpMetadata, auth_header, open_metadata
from kvpool.transfer.metadata_server import MetadataServer

SECRET = "metadata-secret"


def _raw(port: int, method: str, key: str, body: bytes = b"", headers: dict[str, str] | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, f"/metadata?key={key}", body=body or None, headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def test_writes_need_the_secret_reads_do_not() -> None:
    with MetadataServer(secret=SECRET) as srv:
        st, body = _raw(srv.port, "PUT", "seg", b"forged")
        assert st == 401 and SECRET.encode() not in body
        good = HttpMetadata(srv.url, secret=SECRET)
        good.put("seg", b"genuine")
        assert HttpMetadata(srv.url).get("seg") == b"genuine"  # reads are open
        assert _raw(srv.port, "DELETE", "seg")[0] == 401
        with pytest.raises(MetadataError, match="401"):
            HttpMetadata(srv.url, secret="wrong").put("seg", b"forged")
        with pytest.raises(MetadataError, match="401"):
            HttpMetadata(srv.url).delete("seg")
        assert good.get("seg") == b"genuine"
        good.delete("seg")
        assert good.get("seg") is None


def test_a_write_proof_is_bound_to_its_request_and_used_once() -> None:
    with MetadataServer(secret=SECRET) as srv:
        hdr = auth_header(SECRET, "PUT", "seg", b"v1")
        assert SECRET not in hdr
        assert _raw(srv.port, "PUT", "seg", b"v1", {AUTH_HEADER: hdr})[0] == 200
        assert _raw(srv.port, "PUT", "seg", b"v1", {AUTH_HEADER: hdr})[0] == 401  # replayed
        other = auth_header(SECRET, "PUT", "seg", b"v2")
        assert _raw(srv.port, "PUT", "seg", b"evil", {AUTH_HEADER: other})[0] == 401  # other body
        moved = auth_header(SECRET, "PUT", "seg", b"v2")
        assert _raw(srv.port, "PUT", "other", b"v2", {AUTH_HEADER: moved})[0] == 401  # other key
        stale = auth_header(SECRET, "PUT", "seg", b"v3").replace("ts=", "ts=1", 1)
        assert _raw(srv.port, "PUT", "seg", b"v3", {AUTH_HEADER: stale})[0] == 401
        assert HttpMetadata(srv.url).get("seg") == b"v1"


def test_key_and_byte_bounds() -> None:
    with MetadataServer(max_keys=3, max_total_bytes=10_000) as srv:
        m = HttpMetadata(srv.url)
        for i in range(3):
            m.put(f"k{i}", b"x" * 100)
        m.put("k0", b"y" * 100)  # replacing is not a new key
        with pytest.raises(MetadataError, match="507"):
            m.put("k3", b"z")
        m.delete("k2")
        m.put("k3", b"z")
        with pytest.raises(MetadataError, match="507"):
            m.put("k0", b"w" * 20_000)
        assert m.get("k0") == b"y" * 100


def _wait_closed(s: socket.socket) -> bytes:
    s.settimeout(30)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_connection_bounds_and_idle_timeout() -> None:
    with MetadataServer(max_connections=3, max_connections_per_client=2, idle_timeout_s=0.5) as srv:
        held = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
        third = socket.create_connection(("127.0.0.1", srv.port))
        assert _wait_closed(third).startswith(b"HTTP/1.1 503")  # per-client bound
        # Idle connections are closed by the server, which frees the slots.
        for s in held:
            assert _wait_closed(s) == b""
            s.close()
        ok = HttpMetadata(srv.url)
        ok.put("k", b"v")
        assert ok.get("k") == b"v"
        trickler = socket.create_connection(("127.0.0.1", srv.port))
        trickler.sendall(b"GE")  # never completes its request line
        assert _wait_closed(trickler) == b""
        # One byte every 0.2 s resets the socket timeout each time, not the request's deadline.
        slow = socket.create_connection(("127.0.0.1", srv.port))
        closed = False
        for ch in b"GET /metadata?key=" + b"k" * 200:
            try:
                slow.sendall(bytes([ch]))
            except OSError:
                closed = True
                break
            time.sleep(0.2)
            slow.setblocking(False)
            try:
                closed = slow.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed = True
            slow.setblocking(True)
            if closed:
                break
        assert closed, "a trickled request outlived the whole-request deadline"


def test_keep_alive_requests_share_a_connection() -> None:
    """A kept-alive client gets every answer on the same connection (the latency fix is in
    benchmarks/metadata_latency.py)."""
    with MetadataServer() as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        for i in range(20):
            conn.request("PUT", f"/metadata?key=k{i}", body=b"v" * 2048)
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b"metadata updated\n")
            conn.request("GET", f"/metadata?key=k{i}")
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b"v" * 2048)
        conn.close()


# ------------------------------------------------------------------ signed descriptors


def _desc(**kw):
    from kvpool.transfer.types import BufferDescriptor, SegmentDescriptor

    d = dict(name="seg", hostname="127.0.0.1", port=1234, host_id="h", pid=42, incarnation=7)
    d.update(kw)
    return SegmentDescriptor(buffers=[BufferDescriptor(addr=4096, length=8192)], **d)


def test_signed_descriptor_round_trip_and_forgeries() -> None:
    import msgpack

    from kvpool.errors import AuthenticationError
    from kvpool.transfer.types import SIGNED, SegmentDescriptor, descriptor_mac

    blob = _desc().to_bytes(SECRET)
    assert SECRET.encode() not in blob
    assert SegmentDescriptor.from_bytes(blob, SECRET) == _desc()
    assert SegmentDescriptor.from_bytes(blob) == _desc()  # no secret: read unverified (trusted network)
    with pytest.raises(AuthenticationError, match="not signed with this cluster's secret"):
        SegmentDescriptor.from_bytes(blob, "another-secret")
    with pytest.raises(AuthenticationError, match="unsigned"):
        SegmentDescriptor.from_bytes(_desc(pid=1).to_bytes(), SECRET)
    # A forged body (another pid, a port pointing elsewhere) under the genuine signature.
    env = msgpack.unpackb(blob, raw=False)
    env["body"] = _desc(pid=1, port=9999).to_bytes()
    with pytest.raises(AuthenticationError):
        SegmentDescriptor.from_bytes(msgpack.packb(env, use_bin_type=True), SECRET)
    # Signed by whoever holds the secret: accepted, whatever it says.
    body = _desc(pid=5).to_bytes()
    ok = msgpack.packb({SIGNED: 1, "body": body, "mac": descriptor_mac(SECRET, body)}, use_bin_type=True)
    assert SegmentDescriptor.from_bytes(ok, SECRET).pid == 5


@pytest.mark.parametrize("backend", ["http_metadata_url", "etcd_url", "redis_url"])
def test_signed_descriptors_through_every_backend(backend: str, request: pytest.FixtureRequest) -> None:
    """etcd and redis carry the engine's signed descriptors too: a forged one planted straight in
    the store is refused by an engine holding the secret, a genuine one works."""
    from kvpool import OpCode, TransferEngine
    from kvpool.errors import AuthenticationError
    from kvpool.transfer.metadata import open_metadata
    from kvpool.transfer.types import SegmentDescriptor

    url = request.getfixturevalue(backend)
    name = f"signed-{backend}"
    with (
        TransferEngine(protocol="tcp", metadata=url, name=name, secret=SECRET) as tgt,
        TransferEngine(protocol="tcp", metadata=url, name=f"{name}-ini", secret=SECRET) as ini,
    ):
        buf = bytearray(4096)
        addr = tgt.register_local_memory(buf)
        src = bytearray(b"SIGNED!!" * 512)
        a = ini.register_local_memory(src)
        ini.transfer_sync(name, a, addr, 4096, OpCode.WRITE)
        assert bytes(buf) == bytes(src)
        store = open_metadata(url, timeout_s=5, secret=SECRET)
        assert store is not None
        genuine = store.get(name)
        assert genuine is not None and SECRET.encode() not in genuine
        forged = SegmentDescriptor.from_bytes(genuine, SECRET)
        forged.name = f"{name}-forged"
        store.put(f"{name}-forged", forged.to_bytes())  # unsigned
        with pytest.raises(AuthenticationError, match="unsigned"):
            ini.open_segment(f"{name}-forged")
        # another key: a segment whose fetch failed is not fetched again for a while
        forged.name = f"{name}-forged2"
        store.put(f"{name}-forged2", forged.to_bytes("not-the-secret"))
        with pytest.raises(AuthenticationError, match="not signed with this cluster's secret"):
            ini.open_segment(f"{name}-forged2")
        store.delete(f"{name}-forged")
        store.delete(f"{name}-forged2")


def test_engines_publish_through_a_metadata_server_with_a_secret() -> None:
    from kvpool import OpCode, TransferEngine

    with MetadataServer(secret=SECRET) as ms:
        with (
            TransferEngine(protocol="tcp", metadata=ms.url, name="a", secret=SECRET) as a,
            TransferEngine(protocol="tcp", metadata=ms.url, name="b", secret=SECRET) as b,
        ):
            buf = bytearray(4096)
            addr = a.register_local_memory(buf)
            src = bytearray(b"x" * 4096)
            b.transfer_sync("a", b.register_local_memory(src), addr, 4096, OpCode.WRITE)
            assert bytes(buf) == bytes(src)
            # An engine without the secret cannot publish (nor overwrite "a").
            with pytest.raises(MetadataError, match="401"):
                TransferEngine(protocol="tcp", metadata=ms.url, name="a")
        assert HttpMetadata(ms.url).get("a") is None  # withdrawn on close (a signed DELETE)


def test_secrets_never_reach_reprs_or_error_messages() -> None:
    """Config reprs, config errors and metadata-URL errors go into logs and tracebacks."""
    from kvpool.config import MasterConfig, StoreConfig, TransferConfig
    from kvpool.errors import ConfigError, InvalidArgument
    from kvpool.transfer.metadata import open_metadata

    s = "TOPSECRET-abc123"
    for cls in (TransferConfig, MasterConfig, StoreConfig):
        assert s not in repr(cls(secret=s)) and cls(secret=s).secret == s
    with pytest.raises(ConfigError, match="secret") as ei:
        TransferConfig(secret=[s])
    assert s not in str(ei.value)
    for url in (f"redis://:{s}@/0", f"http://u:{s}@:80/metadata", f"etcd://u:{s}@127.0.0.1:bad"):
        with pytest.raises(InvalidArgument) as ei:
            open_metadata(url)
        assert s not in str(ei.value) and "***" in str(ei.value)
    with pytest.raises(MetadataError) as ei:  # nothing listens on port 1
        open_metadata(f"redis://127.0.0.1:1/0?password={s}", timeout_s=0.5).get("x")
    assert s not in str(ei.value) and "password=***" in str(ei.value)


def test_credentials_over_plain_http_warn_once_per_remote_host(caplog: pytest.LogCaptureFixture) -> None:
    """``http://user:password@host`` sends the password in clear (Basic auth), and so does a
    ``token=`` query parameter: one warning per host naming it (never the credentials), none for
    loopback or https:// (it was silent for every host)."""
    import logging

    pw = "PW-sekrit-42"
    caplog.set_level(logging.WARNING, logger="kvpool.transfer.metadata")
    silent = [
        f"http://u:{pw}@127.0.0.1:8080/metadata",
        f"http://u:{pw}@localhost:8080/metadata",
        f"http://u:{pw}@[::1]:8080/metadata",
        f"https://u:{pw}@10.213.7.1:8443/metadata",
        "http://10.213.7.2:8080/metadata",  # no credentials
    ]
    for url in silent:
        HttpMetadata(url)
    open_metadata(f"etcd://alice:{pw}@127.0.0.1:2379")  # etcd's password to /v3/auth/authenticate
    assert not caplog.records, caplog.text
    HttpMetadata(f"http://alice:{pw}@10.213.7.3:8080/metadata")
    HttpMetadata(f"http://alice:{pw}@10.213.7.3:8080/metadata")  # the same host: no second line
    HttpMetadata(f"http://meta.example:9000/metadata?token={pw}")
    open_metadata(f"etcd://alice:{pw}@127.0.0.1:2379,10.213.7.4:2379")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings
    assert "10.213.7.3:8080" in warnings[0] and "http://" in warnings[0]
    assert "meta.example:9000" in warnings[1]
    assert "10.213.7.4:2379" in warnings[2]
    assert pw not in caplog.text and "alice" not in caplog.text


def test_a_redis_password_over_plain_redis_warns_and_is_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    """``redis://:password@host`` (or ``?password=``) sends the AUTH password in clear: one warning
    per remote host naming it, none for loopback or ``rediss://`` (TLS); the password is in no
    log line, repr or error (it warned for no host)."""
    import logging

    pytest.importorskip("redis", reason="redis-py is installed by scripts/test.sh")
    pw = "PW-redis-7"
    caplog.set_level(logging.WARNING, logger="kvpool.transfer.metadata")
    silent = [
        f"redis://:{pw}@127.0.0.1:6379/0",
        f"redis://:{pw}@localhost:6379/0",
        f"rediss://:{pw}@10.213.9.1:6380/0",
        f"rediss://10.213.9.1:6380/0?password={pw}",
        "redis://10.213.9.2:6379/0",  # no password
    ]
    for url in silent:
        assert pw not in repr(open_metadata(url))
    assert not caplog.records, caplog.text
    metas = [open_metadata(f"redis://:{pw}@10.213.9.3:6379/0") for _ in range(2)]  # one line
    metas.append(open_metadata(f"redis://alice:{pw}@10.213.9.4:6379/1"))
    metas.append(open_metadata(f"redis://10.213.9.5:6379/0?password={pw}"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings
    for w, host in zip(warnings, ("10.213.9.3:6379", "10.213.9.4:6379", "10.213.9.5:6379"), strict=True):
        assert host in w and "redis://" in w and "rediss://" in w
    assert pw not in caplog.text and "alice" not in caplog.text
    assert all(pw not in repr(m) and "***" in repr(m) for m in metas)
    with pytest.raises(MetadataError) as ei:  # nothing listens on port 1
        open_metadata(f"redis://:{pw}@127.0.0.1:1/0", timeout_s=0.5).get("x")
    assert pw not in str(ei.value) and ":***@127.0.0.1:1" in str(ei.value)


def test_config_reprs_and_errors_redact_metadata_and_master_urls() -> None:
    """A metadata/master URL may hold a password (``user:pw@``, ``?password=``/``secret=``/
    ``token=``): every config object's repr and str, and a config error repeating the URL, show it
    redacted (they showed it whole), while the field keeps the real value; the vLLM connector's
    ``secret`` and the router's ``store_secret`` are left out of their reprs (they were shown)."""
    from kvpool.conductor.live import RouterConfig
    from kvpool.config import StoreConfig, TransferConfig
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.errors import ConfigError

    pw, qpw, sec, tok = "PW-user-1", "PW-query-2", "SEC-query-3", "TOK-query-4"
    url = f"http://alice:{pw}@10.213.8.1:8080/metadata?password={qpw}&secret={sec}&token={tok}&x=1"
    configs = [
        TransferConfig(metadata=url),
        StoreConfig(metadata=url, master="127.0.0.1:50051"),
        VllmConnectorConfig(metadata=url, master="127.0.0.1:50051", secret=sec),
    ]
    for cfg in configs:
        for text in (repr(cfg), str(cfg)):
            for s in (pw, qpw, sec, tok):
                assert s not in text, text
            for k in ("password", "secret", "token"):
                assert f"{k}=***" in text
            assert "alice:***@10.213.8.1:8080" in text and "x=1" in text
        assert cfg.metadata == url
    assert "master='127.0.0.1:50051'" in repr(configs[1])
    assert repr(TransferConfig()).count("metadata='p2p'") == 1
    rc = RouterConfig(store_master="127.0.0.1:50051", store_secret=sec)
    assert sec not in repr(rc) and rc.store_secret == sec
    with pytest.raises(ConfigError) as ei:
        TransferConfig(metadata=f"ftp://alice:{pw}@10.213.8.1/x?token={tok}")
    assert pw not in str(ei.value) and tok not in str(ei.value) and "alice:***@" in str(ei.value)
