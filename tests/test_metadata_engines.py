"""Engines publishing and finding each other through every metadata backend, against real servers."""

from __future__ import annotations

import pytest
import xxhash

from kvpool import OpCode, TransferEngine, _native
from kvpool.errors import SegmentNotFound
from kvpool.transfer.peer import PeerProcess


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
