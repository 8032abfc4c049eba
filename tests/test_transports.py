"""The Transport interface seams: batch slots completed by Python transports, one batch spanning
several transports (TCP to a real peer process + RDMA over the fake-verbs TEST DOUBLE), GPU staging
as a wrapper (CUDA TEST DOUBLE), and test doubles that production code never selects by name."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
import xxhash

import kvpool
from kvpool import OpCode, TransferConfig, TransferEngine, TransferRequest, TransferState
from kvpool.errors import BatchInFlight, ConfigError, InvalidArgument, RemoteAccessError
from kvpool.testing import fake_verbs as fv
from kvpool.testing import fakecuda
from kvpool.transfer.transport import Transport
from kvpool.transfer.types import TransferStatus
from tests.conftest import run_batch
from tests.test_rdma_double import double  # noqa: F401  (fixture: the fake-verbs registry)

MiB = 1 << 20


def test_python_transport_slots_complete_from_another_thread() -> None:
    """Slots a Python transport reserves are PENDING until it finishes them (once each), from any
    thread; wait/status/free see them like native slots, with the transport's reason."""
    with TransferEngine(protocol="tcp") as eng:
        b = eng.batches
        bid = eng.allocate_batch_id(4)
        assert b.reserve(bid, [10, 20]) == 0
        assert eng.get_transfer_status(bid, 1).state == TransferState.PENDING
        assert eng.get_transfer_status(bid, 2).state == TransferState.WAITING
        assert eng.wait_batch(bid, 0).state == TransferState.PENDING
        with pytest.raises(BatchInFlight):
            eng.free_batch_id(bid)

        def complete() -> None:
            b.finish(bid, 0, 10)
            b.finish(bid, 1, 5, "link down", TransferState.TIMEOUT)

        t = threading.Thread(target=complete)
        t.start()
        st = eng.wait_batch(bid)  # returns once both slots are finished
        t.join()
        assert st.state == TransferState.TIMEOUT and st.transferred_bytes == 15
        assert eng.get_transfer_status(bid, 0) == TransferStatus(TransferState.COMPLETED, 10)
        assert eng.get_transfer_status(bid, 1) == TransferStatus(TransferState.TIMEOUT, 5, "link down")
        with pytest.raises(InvalidArgument, match="not a reserved pending slot"):
            b.finish(bid, 1, 0)  # only once
        with pytest.raises(InvalidArgument, match="not a reserved pending slot"):
            b.finish(bid, 2, 0)  # never reserved
        with pytest.raises(InvalidArgument, match="batch is full"):
            b.reserve(bid, [1, 1, 1])
        assert b.reserve(bid, [1]) == 2
        b.finish(bid, 2, 0, "refused", TransferState.FAILED)
        assert eng.get_batch_status(bid).state == TransferState.TIMEOUT  # the first failure, in slot order
        eng.free_batch_id(bid)
        with pytest.raises(InvalidArgument):
            b.reserve(bid, [1])  # freed


def test_double_one_batch_spans_rdma_and_tcp_segments(double, peer) -> None:  # noqa: F811
    """One submit call with requests to an RDMA segment (fake-verbs double) and to a TCP-only peer
    process: each goes over its own transport, into consecutive slots of one batch. A call with one
    invalid request sends nothing, whichever transport the valid ones would take."""
    with (
        TransferEngine(protocol="rdma", verbs=fv) as t,
        TransferEngine(protocol="auto", same_host=False, verbs=fv, timeout_s=5.0) as i,
    ):
        kv = bytearray(4 * MiB)
        theirs = os.urandom(MiB)
        kv[2 * MiB : 3 * MiB] = theirs
        base = t.register_local_memory(kv)
        src = bytearray(os.urandom(2 * MiB))
        back = bytearray(MiB)
        la = i.register_local_memory(src)
        lb = i.register_local_memory(back)
        rseg = i.open_segment(t.segment_name)
        tseg = i.open_segment(peer.segment)
        assert not i.uses_same_host_path(tseg)
        st, per = run_batch(
            i,
            [
                TransferRequest(OpCode.WRITE, la, rseg, base, MiB),
                TransferRequest(OpCode.WRITE, la + MiB, tseg, peer.addr, MiB),
                TransferRequest(OpCode.READ, lb, rseg, base + 2 * MiB, MiB),
            ],
        )
        assert st.ok and [p.transferred_bytes for p in per] == [MiB] * 3
        assert kv[:MiB] == src[:MiB] and back == theirs
        assert peer.checksum(0, MiB) == xxhash.xxh3_64_hexdigest(bytes(src[MiB:]))
        assert sum(i.rdma.nic_bytes) == 2 * MiB  # the TCP request did not go over RDMA
        bid = i.allocate_batch_id(2)
        kv[:MiB] = bytes(MiB)
        with pytest.raises(RemoteAccessError, match="request 1"):
            i.submit_transfer(
                bid,
                [
                    TransferRequest(OpCode.WRITE, la, rseg, base, MiB),
                    TransferRequest(OpCode.WRITE, la, tseg, peer.addr + (1 << 40), MiB),
                ],
            )
        assert i.get_transfer_status(bid, 0).state == TransferState.WAITING
        assert i.wait_batch(bid, 0).state == TransferState.WAITING and kv[:MiB] == bytes(MiB)
        i.free_batch_id(bid)


def test_double_staged_submit_refused_by_the_transport_sends_nothing(peer) -> None:
    """GPU staging wraps TCP: when TCP refuses the request, the staging range goes back, the caller
    gets the transport's error and the reserved slot ends FAILED with it (CUDA test double)."""
    rt = fakecuda.counting_runtime(fakecuda.build())
    dev = rt.alloc(MiB)
    with TransferEngine(protocol="tcp", device_runtime=rt, timeout_s=5.0) as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        seg = eng.open_segment(peer.segment)
        bid = eng.allocate_batch_id(1)
        with pytest.raises(RemoteAccessError):
            eng.submit_transfer(bid, [TransferRequest(OpCode.WRITE, a, seg, peer.addr + (1 << 40), MiB)])
        st = eng.get_transfer_status(bid, 0)
        assert st.state == TransferState.FAILED and "not submitted" in st.error
        assert eng.staging.pool.in_use == 0
        eng.free_batch_id(bid)
    rt.free(dev)


def test_transports_implement_the_interface() -> None:
    from kvpool.transfer.rdma.transport import RdmaTransport
    from kvpool.transfer.same_host import SameHostTransport
    from kvpool.transfer.tcp import TcpTransport

    for cls in (TcpTransport, SameHostTransport, RdmaTransport):
        assert issubclass(cls, Transport) and not getattr(cls, "__abstractmethods__", None)
    assert {c.name for c in (TcpTransport, SameHostTransport, RdmaTransport)} == {"tcp", "same_host", "rdma"}
    assert "cuda" in RdmaTransport.locations and "cuda" not in TcpTransport.locations


def test_production_code_never_names_a_test_double() -> None:
    """Doubles are injected by tests: no import of kvpool.testing outside it, no config value for one."""
    root = Path(kvpool.__file__).parent
    importing = re.compile(
        r"^\s*(from\s+kvpool\.testing|import\s+kvpool\.testing|from\s+kvpool\s+import\s+testing)", re.M
    )
    offenders = [
        str(f.relative_to(root))
        for f in root.rglob("*.py")
        if "testing" not in f.relative_to(root).parts and importing.search(f.read_text())
    ]
    assert offenders == []
    assert "rdma_verbs" not in TransferConfig.model_fields
    for bad in ({"device_runtime": "fake"}, {"rdma_verbs": "double"}):
        with pytest.raises(ConfigError):
            TransferConfig(**bad)
