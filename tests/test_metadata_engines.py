"""Engines publishing and finding each other through every metadata backend, against real servers."""

from __future__ import annotations

import base64
import json
import time
import urllib.request

import pytest
import xxhash

from kvpool import OpCode, TransferEngine, _native
from kvpool.errors import MetadataError, SegmentNotFound
from kvpool.transfer.metadata import KEY_PREFIX, open_metadata
from kvpool.transfer.peer import PeerProcess
from tests.servers import etcd_server


def _roundtrip(metadata: str, name: str) -> None:
    with (
        PeerProcess(1 << 20, metadata=metadata, name=name) as p,
        TransferEngine(protocol="tcp", metadata=metadata, name=f"{name}-initiator") as eng,
    ):
        assert p.segment == name
        buf = bytearray(65536)
        addr = eng.register_local_memory(buf)
        _native.fill_pattern(addr, len(buf), 21)
        eng.transfer_sync(name, addr, p.addr + 7, len(buf), OpCode.WRITE)
        assert p.checksum(7, len(buf)) == xxhash.xxh3_64_hexdigest(buf)
        desc = eng.get_segment_descriptor(name)
        assert desc.pid == p.pid and desc.buffers[0].addr == p.addr
        # The initiator is published too, under its own name.
        other = TransferEngine(protocol="tcp", metadata=metadata)
        try:
            assert other.get_segment_descriptor(f"{name}-initiator").port == eng.port
        finally:
            other.close()
    # Closed engines withdraw their descriptors.
    with TransferEngine(protocol="tcp", metadata=metadata) as eng2:
        with pytest.raises(SegmentNotFound):
            eng2.open_segment(name)


def test_p2p_metadata() -> None:
    with PeerProcess(1 << 20) as p, TransferEngine(protocol="tcp") as eng:
        assert p.segment == f"127.0.0.1:{p.port}"
        desc = eng.get_segment_descriptor(p.segment)
        assert desc.port == p.port and desc.buffers[0].length == 1 << 20


def test_http_metadata(http_metadata_url: str) -> None:
    _roundtrip(http_metadata_url, "seg-http")


def test_etcd_metadata(etcd_url: str) -> None:
    _roundtrip(etcd_url, "seg-etcd")


def _etcd_auth_on(url: str, user: str, password: str) -> None:
    """Turn etcd's authentication on (root + ``user`` with read/write on kvpool's key prefix), through
    the same JSON gateway etcdctl's ``user add`` / ``role grant-permission`` / ``auth enable`` use."""
    base = "http://" + url.removeprefix("etcd://")
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    prefix = KEY_PREFIX.encode()
    for path, body in [
        ("user/add", {"name": "root", "password": "root-pw"}),
        ("role/add", {"name": "root"}),
        ("user/grant", {"user": "root", "role": "root"}),
        ("user/add", {"name": user, "password": password}),
        ("role/add", {"name": "kvpool-rw"}),
        ("role/grant", {"name": "kvpool-rw", "perm": {"permType": "READWRITE", "key": b64(prefix),
                                                       "range_end": b64(prefix[:-1] + b"0")}}),
        ("user/grant", {"user": user, "role": "kvpool-rw"}),
        ("enable", {}),
    ]:  # fmt: skip
        req = urllib.request.Request(f"{base}/v3/auth/{path}", json.dumps(body).encode(), method="POST")
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5) as resp:
            assert "error" not in json.loads(resp.read()), path


def test_etcd_with_authentication_refuses_anonymous_writes_and_deletes(tmp_path) -> None:
    """With etcd's authentication on, only the URL's user may publish or delete a descriptor (anyone
    reaching an open etcd could delete one: SegmentNotFound for its peers); the password never shows
    in errors, reprs or a child's command line, and an expired token is renewed."""
    pw = "pw-a9f3-secret"
    with etcd_server(tmp_path, ["--auth-token-ttl", "1"]) as url:
        _etcd_auth_on(url, "kv", pw)
        authed = url.replace("etcd://", f"etcd://kv:{pw}@")
        with PeerProcess(1 << 20, metadata=authed, name="seg-etcd-auth") as p:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                assert pw.encode() not in f.read()
            anon = open_metadata(url)
            for call in (
                lambda: anon.delete("seg-etcd-auth"),
                lambda: anon.put("x", b"y"),
                lambda: anon.get("x"),
            ):
                with pytest.raises(MetadataError, match="authentication on"):
                    call()
            with pytest.raises(MetadataError, match="refused user") as ei:
                open_metadata(url.replace("etcd://", "etcd://kv:wrong@")).get("seg-etcd-auth")
            assert "wrong" not in str(ei.value)
            meta = open_metadata(authed)
            assert pw not in repr(meta) and meta.get("seg-etcd-auth") is not None
            time.sleep(2.5)  # the token expired: renewed once, transparently
            assert meta.get("seg-etcd-auth") is not None
            with TransferEngine(protocol="tcp", metadata=authed) as eng:
                buf = bytearray(4096)
                addr = eng.register_local_memory(buf)
                _native.fill_pattern(addr, len(buf), 5)
                eng.transfer_sync("seg-etcd-auth", addr, p.addr, len(buf), OpCode.WRITE)
                assert p.checksum(0, len(buf)) == xxhash.xxh3_64_hexdigest(buf)


def test_redis_metadata(redis_url: str) -> None:
    _roundtrip(redis_url, "seg-redis")


def test_registration_changes_are_republished(http_metadata_url: str) -> None:
    with (
        TransferEngine(protocol="tcp", metadata=http_metadata_url, name="seg-live") as tgt,
        TransferEngine(protocol="tcp", metadata=http_metadata_url) as ini,
    ):
        a = bytearray(4096)
        tgt.register_local_memory(a)
        h = ini.open_segment("seg-live")
        assert len(ini.get_segment_descriptor(h).buffers) == 1
        b = bytearray(4096)
        baddr = tgt.register_local_memory(b)
        # A new buffer shows up after the peer is re-opened (descriptor re-fetched when stale or on restart).
        ini.close_segment(h)
        assert baddr in [x.addr for x in ini.get_segment_descriptor("seg-live").buffers]
