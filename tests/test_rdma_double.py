"""RDMA transport tests. Every test here whose name contains ``double`` runs the transport over the
fake-verbs TEST DOUBLE (kvpool.testing.fake_verbs), not over a real RDMA device: they check the
logic above the verbs line (handshake, slicing, spreading, chained posting, completion
aggregation, failover, endpoint pool), never the hardware."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import xxhash

from kvpool import OpCode, TransferEngine, TransferRequest, TransferState
from kvpool.errors import ProtocolUnavailable, RemoteAccessError
from kvpool.testing import fake_verbs as fv
from kvpool.testing.rdma_peer import RdmaPeer
from kvpool.transfer.rdma.endpoints import SievePool
from kvpool.transfer.rdma.state import slice_plan
from tests.conftest import run_batch

NICS4 = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
MiB = 1 << 20


@pytest.fixture
def double(tmp_path, monkeypatch):
    """Configure the fake-verbs test double (4 NICs per process) for this test and its children."""

    def setup(nics=NICS4, mtu=4096):
        for k in (fv.ENV_DIR, fv.ENV_NICS, fv.ENV_MTU):
            monkeypatch.setenv(k, "x")  # restored after the test
        fv.configure(str(tmp_path / "verbs"), nics, mtu)

    setup()
    yield setup
    fv._injected.clear()
    fv._kill_after.clear()


def _engine(**kw):
    return TransferEngine(protocol="rdma", verbs=fv, **kw)


def _pair(**kw):
    t = _engine()
    i = _engine(**kw)
    kv = bytearray(64 * MiB)
    base = t.register_local_memory(kv)
    return t, i, kv, base


def test_slice_plan_merges_small_tails():
    assert slice_plan(100, 64) == [(0, 64), (64, 36)]  # tail 36 >= half a slice: its own slice
    assert slice_plan(90, 64) == [(0, 90)]  # tail 26 < 32: merged
    assert slice_plan(64 * 4, 64) == [(0, 64), (64, 64), (128, 64), (192, 64)]
    assert slice_plan(64 * 4 + 10, 64) == [(0, 64), (64, 64), (128, 64), (192, 74)]  # merged
    assert slice_plan(64 * 4 + 40, 64) == [(0, 64), (64, 64), (128, 64), (192, 64), (256, 40)]
    assert sum(n for _, n in slice_plan(16 * MiB + 5, 64 << 10)) == 16 * MiB + 5


def test_double_handshake_publishes_nics_and_connects_qps(double):
    t, i, kv, base = _pair()
    with t, i:
        seg = i.open_segment(t.segment_name)
        desc = i.get_segment_descriptor(seg)
        assert "rdma" in desc.protocols
        nics = desc.rdma["nics"]
        assert [n["name"] for n in nics] == NICS4
        v4 = "0000:0000:0000:0000:0000:ffff:"  # RoCE v2, IPv4-mapped: picked automatically (index 3)
        assert all(n["gid_index"] == 3 and n["gid"].startswith(v4) for n in nics)
        assert desc.rdma["mrs"][0][0] == base and len(desc.rdma["mrs"][0][2]) == 4  # one rkey per NIC
        assert desc.rdma["topology"]["cpu:0"][0] == NICS4
        src = bytearray(os.urandom(MiB))
        la = i.register_local_memory(src)
        assert i.transfer_sync(t.segment_name, la, base, MiB) == MiB
        assert kv[:MiB] == src
        assert i.rdma.stats["connects"] >= 1
        assert len(t.rdma._passive) == i.rdma.endpoint_count()  # the target holds the other QP ends


def test_double_spreads_16mib_requests_evenly_over_4_nics_across_processes(double):
    """Test double, two processes: 8 x 16 MiB WRITEs into a peer process, then READ back."""
    with RdmaPeer(128 * MiB) as peer, _engine() as ini:
        src = bytearray(os.urandom(16 * MiB))
        la = ini.register_local_memory(src)
        seg = ini.open_segment(peer.segment)
        st, per = run_batch(ini, [TransferRequest(OpCode.WRITE, la, seg, peer.addr + k * 16 * MiB, 16 * MiB)
                             for k in range(8)])  # fmt: skip
        assert st.state == TransferState.COMPLETED and st.transferred_bytes == 128 * MiB
        assert all(p.transferred_bytes == 16 * MiB for p in per)
        by_nic = ini.rdma.nic_bytes
        mean = sum(by_nic) / 4
        spread = max(abs(b - mean) / mean for b in by_nic)
        print(f"bytes per NIC: {by_nic}, max deviation {spread:.1%}")
        assert spread <= 0.10
        want = xxhash.xxh3_64_hexdigest(src)
        assert all(peer.ask(f"checksum {k * 16 * MiB} {16 * MiB}")["xxh3"] == want for k in range(8))
        dst = bytearray(16 * MiB)
        lb = ini.register_local_memory(dst)
        st, _ = run_batch(ini, [TransferRequest(OpCode.READ, lb, seg, peer.addr + 16 * MiB, 16 * MiB)])
        assert st.state == TransferState.COMPLETED and dst == src


def test_double_completion_aggregation_per_request(double):
    t, i, kv, base = _pair(rdma_slice_size=64 << 10)
    with t, i:
        sizes = [1, 4096, (64 << 10) + 7, 3 * (64 << 10) + 40000, 5 * MiB + 3]
        src = bytearray(os.urandom(sum(sizes)))
        la = i.register_local_memory(src)
        seg = i.open_segment(t.segment_name)
        reqs, off = [], 0
        for n in sizes:
            reqs.append(TransferRequest(OpCode.WRITE, la + off, seg, base + off, n))
            off += n
        bid = i.allocate_batch_id(len(sizes) + 2)
        i.submit_transfer(bid, reqs)
        st = i.wait_batch(bid, 30)
        assert st.state == TransferState.COMPLETED and st.transferred_bytes == sum(sizes)
        for k, n in enumerate(sizes):
            s = i.get_transfer_status(bid, k)
            assert s.state == TransferState.COMPLETED and s.transferred_bytes == n and s.error is None
        assert i.get_transfer_status(bid, len(sizes)).state == TransferState.WAITING  # unused slot
        i.free_batch_id(bid)
        assert kv[: sum(sizes)] == src
        assert i.rdma.stats["posts"] < i.rdma.stats["slices"]  # WRs were chained


def test_double_error_completion_is_retried_on_another_nic(double):
    t, i, kv, base = _pair()
    with t, i:
        src = bytearray(os.urandom(4 * MiB))
        la = i.register_local_memory(src)
        seg = i.open_segment(t.segment_name)
        fv.inject_errors("mlx5_1", 3)
        st, per = run_batch(i, [TransferRequest(OpCode.WRITE, la, seg, base, 4 * MiB)])
        assert st.state == TransferState.COMPLETED, per
        assert kv[: 4 * MiB] == src
        assert i.rdma.stats["error_completions"] >= 1 and i.rdma.stats["retries"] >= 1


def test_double_nic_killed_mid_batch_all_requests_complete(double):
    """Test double, two processes: this process's mlx5_2 dies after 20 work requests of the batch."""
    with RdmaPeer(128 * MiB) as peer, _engine() as ini:
        src = bytearray(os.urandom(16 * MiB))
        la = ini.register_local_memory(src)
        seg = ini.open_segment(peer.segment)
        fv.kill_after("mlx5_2", 20)
        st, per = run_batch(ini, [TransferRequest(OpCode.WRITE, la, seg, peer.addr + k * 16 * MiB, 16 * MiB)
                             for k in range(8)])  # fmt: skip
        assert st.state == TransferState.COMPLETED, [p for p in per if not p.ok][:1]
        assert ini.rdma.stats["error_completions"] >= 1
        assert ini.rdma.nic_bytes[2] < 128 * MiB / 4  # the dead NIC carried less than its share
        want = xxhash.xxh3_64_hexdigest(src)
        assert all(peer.ask(f"checksum {k * 16 * MiB} {16 * MiB}")["xxh3"] == want for k in range(8))
        # new transfers avoid the paused NIC
        before = ini.rdma.nic_bytes[2]
        st, _ = run_batch(ini, [TransferRequest(OpCode.WRITE, la, seg, peer.addr, 16 * MiB)])
        assert st.ok and ini.rdma.nic_bytes[2] == before


def test_double_all_nics_dead_fails_with_reason(double):
    t, i, kv, base = _pair(rdma_retry_limit=3, rdma_nic_pause_s=0.05)
    with t, i:
        src = bytearray(MiB)
        la = i.register_local_memory(src)
        seg = i.open_segment(t.segment_name)
        for n in NICS4:
            fv.kill_nic(n, os.getpid())
        st, per = run_batch(i, [TransferRequest(OpCode.WRITE, la, seg, base, MiB)])
        assert st.state == TransferState.FAILED
        assert per[0].state == TransferState.FAILED
        assert "every path failed" in per[0].error and "retry counter exceeded" in per[0].error
        for n in NICS4:
            fv.revive_nic(n, os.getpid())
        time.sleep(0.1)  # pause over: the NICs are probed again
        st, _ = run_batch(i, [TransferRequest(OpCode.WRITE, la, seg, base, MiB)])
        assert st.ok


def test_sieve_pool_evicts_unvisited_first():
    evicted = []
    pool = SievePool(3, lambda k, v: evicted.append(k))
    for k in "abc":
        pool.put(k, k)
    pool.get("a")  # visited: survives the next sweep
    pool.put("d", "d")
    assert evicted == ["b"]
    pool.put("e", "e")  # the hand stays where it stopped (at c), unlike LRU/CLOCK restarts
    assert evicted == ["b", "c"]
    pool.put("f", "f")  # hand moves on towards the head: d (new, unvisited) goes before a wraps
    assert evicted == ["b", "c", "d"]
    pool.put("g", "g")  # and on: the once-visited a outlives every newer unvisited entry
    assert evicted == ["b", "c", "d", "e"] and "a" in pool
    busy = SievePool(1, lambda k, v: evicted.append(k), busy=lambda v: True)
    busy.put(1, 1)
    busy.put(2, 2)  # everything busy: goes over the cap rather than failing
    assert len(busy) == 2


def test_double_sieve_eviction_under_endpoint_cap(double):
    t, i, kv, base = _pair(rdma_max_endpoints=2)
    with t, i:
        src = bytearray(os.urandom(64 << 10))
        la = i.register_local_memory(src)
        i.open_segment(t.segment_name)
        for k in range(8):  # one slice each: the round-robin walks all 4 NIC pairs
            assert i.transfer_sync(t.segment_name, la, base + k * (64 << 10), 64 << 10) == 64 << 10
        assert i.rdma.endpoint_count() <= 2
        assert i.rdma.stats["evictions"] >= 2
        deadline = time.time() + 5
        while len(t.rdma._passive) != i.rdma.endpoint_count() and time.time() < deadline:
            time.sleep(0.01)
        assert len(t.rdma._passive) == i.rdma.endpoint_count()  # evicted on both sides
        assert bytes(kv[7 * (64 << 10) : 8 * (64 << 10)]) == bytes(src)


def test_double_dropped_endpoint_is_remade(double):
    double(["mlx5_0"])
    t, i, kv, base = _pair(rdma_nic_pause_s=0)
    with t, i:
        src = bytearray(os.urandom(MiB))
        la = i.register_local_memory(src)
        i.open_segment(t.segment_name)
        i.transfer_sync(t.segment_name, la, base, MiB)
        assert i.rdma.stats["connects"] == 1
        assert fv.drop_qps() >= 2  # both ends lost
        src[:] = os.urandom(MiB)
        assert i.transfer_sync(t.segment_name, la, base, MiB) == MiB
        assert kv[:MiB] == src
        assert i.rdma.stats["connects"] == 2 and i.rdma.stats["broken_endpoints"] >= 1


def test_double_bounds_are_enforced_with_remote_access_error(double):
    t, i, kv, base = _pair()
    with t, i:
        src = bytearray(2 * MiB)
        la = i.register_local_memory(src)
        seg = i.open_segment(t.segment_name)
        bid = i.allocate_batch_id(1)
        with pytest.raises(RemoteAccessError):  # initiator check against the descriptor
            i.submit_transfer(bid, [TransferRequest(OpCode.WRITE, la, seg, base + 63 * MiB, 2 * MiB)])
        i.free_batch_id(bid)
        # the target withdraws its buffer; our cached descriptor still lists it: the NIC (here the
        # double) refuses the rkey and the request fails with a remote access error, not retried
        t.unregister_local_memory(kv)
        st, per = run_batch(i, [TransferRequest(OpCode.WRITE, la, seg, base, MiB)])
        assert st.state == TransferState.FAILED
        assert "remote access error" in per[0].error


def test_double_mtu_and_gid_index_errors_are_explained(double):
    double(NICS4, mtu=1024)
    with pytest.raises(ProtocolUnavailable, match="rdma_gid_index=9"):
        _engine(rdma_gid_index=9)
    t = _engine(rdma_mtu=4096)
    i = _engine(rdma_mtu=4096, rdma_retry_limit=1)
    with t, i:
        base = t.register_local_memory(bytearray(MiB))
        la = i.register_local_memory(bytearray(MiB))
        seg = i.open_segment(t.segment_name)
        st, per = run_batch(i, [TransferRequest(OpCode.WRITE, la, seg, base, MiB)])
        assert st.state == TransferState.FAILED
        err = per[0].error
        assert "INIT->RTR failed" in err and "MTU 4096" in err and "GID index" in err


def test_double_topology_prefers_location_nics(double):
    topo = '{"cpu:0": [["mlx5_0", "mlx5_1"], ["mlx5_2", "mlx5_3"]]}'
    t, i, kv, base = _pair(rdma_topology=topo)
    with t, i:
        src = bytearray(os.urandom(8 * MiB))
        la = i.register_local_memory(src)
        seg = i.open_segment(t.segment_name)
        st, _ = run_batch(i, [TransferRequest(OpCode.WRITE, la, seg, base, 8 * MiB)])
        assert st.ok
        assert i.rdma.nic_bytes[2] == i.rdma.nic_bytes[3] == 0  # secondaries only on failure
        assert i.rdma.nic_bytes[0] == i.rdma.nic_bytes[1] == 4 * MiB


def test_double_batch_api_typed_errors(double):
    t, i, kv, base = _pair()
    with t, i:
        la = i.register_local_memory(bytearray(MiB))
        seg = i.open_segment(t.segment_name)
        bid = i.allocate_batch_id(1)
        i.submit_transfer(bid, [TransferRequest(OpCode.READ, la, seg, base, MiB)])
        from kvpool.errors import BatchInFlight, InvalidArgument

        try:
            i.free_batch_id(bid)  # may be done already; if not, BatchInFlight
        except BatchInFlight:
            i.wait_batch(bid)
            i.free_batch_id(bid)
        with pytest.raises(InvalidArgument):
            i.get_transfer_status(bid, 0)  # freed


def _hold_progress(eng):
    """Park ``eng``'s RDMA progress thread until the returned event is set (slices stay queued)."""
    gate, parked = threading.Event(), threading.Event()
    eng.rdma._run_in_progress(lambda: (parked.set(), gate.wait(10)))
    assert parked.wait(5)
    return gate


def _restart(t, kv, monkeypatch):
    """Close target ``t`` and start a new incarnation on its port over the same memory, whose NIC
    hands out the same rkeys again (real HCAs reuse mkey indices): old slices would land there."""
    port = int(t.segment_name.rsplit(":", 1)[1])
    monkeypatch.setattr(fv, "_keys", itertools.count(7_000_000))
    t.close()
    monkeypatch.setattr(fv, "_keys", itertools.count(7_000_000))
    t2 = _engine(port=port)
    kv[:] = b"N" * len(kv)  # the new incarnation's own data
    t2.register_local_memory(kv)
    return t2


def test_double_slices_queued_for_a_restarted_peer_fail_and_never_reach_the_new_one(double, monkeypatch):
    """Slices queued for a peer's old incarnation (its addresses and rkeys) are failed when the
    descriptor shows a new instance: never posted to the new process (they overwrote its memory
    and the request reported COMPLETED)."""
    monkeypatch.setattr(fv, "_keys", itertools.count(7_000_000))
    t = _engine()
    kv = bytearray(MiB)
    base = t.register_local_memory(kv)
    i = _engine()
    t2 = None
    try:
        src = bytearray(b"A" * MiB)
        la = i.register_local_memory(src)
        seg = i.open_segment(t.segment_name)
        old = i.get_segment_descriptor(seg).incarnation
        gate = _hold_progress(i)
        bid = i.allocate_batch_id(2)
        i.submit_transfer(bid, [TransferRequest(OpCode.WRITE, la, seg, base, MiB)])
        t2 = _restart(t, kv, monkeypatch)
        assert i._open(t.segment_name) == seg  # what open_segment does once it sees the restart
        assert i.get_segment_descriptor(seg).incarnation != old
        gate.set()
        i.wait_batch(bid, 10)
        st = i.get_transfer_status(bid, 0)
        assert st.state == TransferState.FAILED and "restarted" in st.error
        assert kv == b"N" * MiB  # the new incarnation's memory is untouched
        # a request planned for the new incarnation goes through
        i.submit_transfer(bid, [TransferRequest(OpCode.WRITE, la, seg, base, MiB)])
        i.wait_batch(bid, 10)
        assert i.get_transfer_status(bid, 1).state == TransferState.COMPLETED and kv == src
        i.free_batch_id(bid)
    finally:
        i.close()
        (t2 or t).close()


def test_double_slices_waiting_on_an_endpoint_fail_when_the_peer_restarts(double, monkeypatch):
    """Slices already given to an endpoint (waiting to be posted) when the peer restarts are
    failed, not retried against the new incarnation."""
    monkeypatch.setattr(fv, "_keys", itertools.count(7_000_000))
    t = _engine()
    kv = bytearray(MiB)
    base = t.register_local_memory(kv)
    i = _engine(rdma_slice_size=4096, rdma_sq_depth=1, rdma_chain=1)
    t2 = None
    try:
        la = i.register_local_memory(bytearray(b"A" * MiB))
        seg = i.open_segment(t.segment_name)
        assert i.transfer_sync(t.segment_name, la, base, 4 * 4096) == 4 * 4096  # 4 endpoints made
        kv[:] = bytes(MiB)
        gate = _hold_progress(i)
        bid = i.allocate_batch_id(1)
        i.submit_transfer(bid, [TransferRequest(OpCode.WRITE, la, seg, base, MiB)])
        gate2, parked2 = threading.Event(), threading.Event()
        i.rdma._run_in_progress(i.rdma._dispatch)  # slices to the endpoint, none posted yet
        i.rdma._run_in_progress(lambda: (parked2.set(), gate2.wait(10)))
        gate.set()
        assert parked2.wait(5)
        assert not i.rdma._incoming and sum(len(ep.pending) for ep in i.rdma._pool.values()) == 256
        t2 = _restart(t, kv, monkeypatch)
        i._open(t.segment_name)
        gate2.set()
        i.wait_batch(bid, 10)
        st = i.get_transfer_status(bid, 0)
        assert st.state == TransferState.FAILED and "restarted" in st.error
        assert kv == b"N" * MiB
        i.free_batch_id(bid)
    finally:
        i.close()
        (t2 or t).close()


@pytest.mark.parametrize("same_rpc_port", [False, True], ids=["new-rpc-port", "same-rpc-port"])
def test_double_peer_restarted_on_the_same_address_is_reached_again(double, monkeypatch, same_rpc_port):
    """A target restarts on its port; its RDMA RPC server listens on another port (the cached
    descriptor's is refused) or on the same one (another instance answers). The first transfer
    fails typed; the next open_segment re-fetches the descriptor (peer_gone) and transfers move the
    right bytes again (every later request failed "not reachable" forever)."""
    from kvpool import _rpc_server
    from kvpool.errors import TransferError

    t = _engine()
    kv = bytearray(MiB)
    base = t.register_local_memory(kv)
    i = _engine(rdma_nic_pause_s=0)
    t2 = None
    try:
        src = bytearray(os.urandom(MiB))
        la = i.register_local_memory(src)
        assert i.transfer_sync(t.segment_name, la, base, MiB) == MiB and kv == src
        old_rpc = t.rdma.rpc_addr
        if same_rpc_port:
            port = t.rdma._rpc.port

            class SamePort(_rpc_server.RpcServer):
                def __init__(self, host, _port, *a, **kw):
                    super().__init__(host, port, *a, **kw)

            monkeypatch.setattr(_rpc_server, "RpcServer", SamePort)
        t2 = _restart(t, kv, monkeypatch)
        assert (t2.rdma.rpc_addr == old_rpc) == same_rpc_port
        assert not i.rdma.peer_gone(i.open_segment(t.segment_name).id)
        with pytest.raises(TransferError, match="restarted" if same_rpc_port else "not reachable"):
            i.transfer_sync(t.segment_name, la, base, MiB)
        assert kv == b"N" * MiB  # nothing reached the new incarnation
        seg = i.open_segment(t.segment_name)  # sees peer_gone: fetches the new descriptor
        assert not i.rdma.peer_gone(seg.id)
        assert i.get_segment_descriptor(seg).rdma["rpc"] == t2.rdma.rpc_addr
        src[:] = os.urandom(MiB)
        st, per = run_batch(i, [TransferRequest(OpCode.WRITE, la, seg, base, MiB)])
        assert st.state == TransferState.COMPLETED, per
        assert kv == src
        src[:] = os.urandom(MiB)
        assert i.transfer_sync(t.segment_name, la, base, MiB) == MiB and kv == src
    finally:
        i.close()
        (t2 or t).close()


def test_double_a_hung_peer_does_not_stall_transfers_to_other_peers(double):
    """A peer whose RDMA RPC port accepts TCP and never answers (its process stopped) held the
    one progress thread for connect_timeout_s per connect: a transfer to a healthy, connected
    peer took 24.8 s with connect_timeout_s=5. Connects run off the progress thread, one at a time
    per peer: other peers (connected or not) go on; the hung peer's request fails typed, in about
    one connect timeout (the connects queued behind a timed-out one fail at once)."""
    import signal

    t, i, kv, base = _pair(connect_timeout_s=5, rdma_retry_limit=1)
    t3 = _engine()
    kv3 = bytearray(MiB)
    base3 = t3.register_local_memory(kv3)
    with RdmaPeer(MiB) as hung, t, i, t3:
        src = bytearray(os.urandom(MiB))
        la = i.register_local_memory(src)
        assert i.transfer_sync(t.segment_name, la, base, MiB) == MiB  # t is connected
        hseg = i.open_segment(hung.segment)  # its descriptor; no connect yet
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 5  # stopped before it can answer our connect
            while open(f"/proc/{hung.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
                assert time.monotonic() < deadline
                time.sleep(0.001)
            bid = i.allocate_batch_id(1)
            t0 = time.monotonic()
            i.submit_transfer(bid, [TransferRequest(OpCode.WRITE, la, hseg, hung.addr, MiB)])
            time.sleep(0.3)  # its connect waits for the stopped peer
            for target, b, dst in ((t, base, kv), (t3, base3, kv3)):  # connected, not yet connected
                src[:] = os.urandom(MiB)
                s0 = time.monotonic()
                assert i.transfer_sync(target.segment_name, la, b, MiB) == MiB
                assert time.monotonic() - s0 < 1.0, (target is t, time.monotonic() - s0)
                assert dst[:MiB] == src
            assert i.get_transfer_status(bid, 0).state == TransferState.PENDING
            i.wait_batch(bid, 20)
            st = i.get_transfer_status(bid, 0)
            assert st.state == TransferState.FAILED and "did not answer" in st.error, st
            assert time.monotonic() - t0 < 9, st  # one connect timeout, not one per attempt
            i.free_batch_id(bid)
        finally:
            os.kill(hung.pid, signal.SIGCONT)


def test_double_local_unregister_mid_transfer_fails_it_without_pausing_nics(double):
    """Local memory unregistered while its slices are queued: they are not posted (with the closed
    MRs' lkeys) and the request fails at once. That is not a path problem: it is not retried on
    every NIC pair, no NIC is paused and other memory still moves over all 4 (each retry broke an
    endpoint and paused a healthy NIC pair for rdma_nic_pause_s)."""
    t, i, kv, base = _pair()
    with t, i:
        src = bytearray(os.urandom(8 * MiB))
        la = i.register_local_memory(src)
        seg = i.open_segment(t.segment_name)
        assert i.transfer_sync(t.segment_name, la, base, 4 * MiB) == 4 * MiB  # endpoints on 4 pairs
        gate = _hold_progress(i)
        bid = i.allocate_batch_id(1)
        i.submit_transfer(bid, [TransferRequest(OpCode.WRITE, la, seg, base, 8 * MiB)])
        i.unregister_local_memory(src)
        gate.set()
        i.wait_batch(bid, 10)
        st = i.get_transfer_status(bid, 0)
        assert st.state == TransferState.FAILED and "unregistered" in st.error, st
        assert "every path failed" not in st.error  # failed at once, not after rdma_retry_limit tries
        now = time.monotonic()
        assert not [n for n, until in i.rdma._paused.items() if until > now]
        assert not [n for n, until in i.rdma._peers[seg.id].paused.items() if until > now]
        other = bytearray(os.urandom(4 * MiB))
        lb = i.register_local_memory(other)
        before = list(i.rdma.nic_bytes)
        assert i.transfer_sync(t.segment_name, lb, base, 4 * MiB) == 4 * MiB and kv[: 4 * MiB] == other
        assert all(a > b for a, b in zip(i.rdma.nic_bytes, before, strict=True))
        i.free_batch_id(bid)


def test_double_slices_queued_before_a_local_unregister_never_reach_a_new_registration(double, monkeypatch):
    """A READ queued into local memory that is unregistered and registered again at the same
    address, whose new MRs get the same lkeys (real HCAs reuse mkey indices; the fake is told to):
    the queued slices are not posted, the request fails and the new registration's bytes stay
    (they were posted with the old lkeys, landed in the new registration and reported COMPLETED)."""
    t, i, kv, base = _pair()
    with t, i:
        kv[:MiB] = b"R" * MiB
        dst = bytearray(MiB)
        la = i.register_local_memory(dst)
        first = min(i.rdma.regions.local(la, MiB)[2])
        seg = i.open_segment(t.segment_name)
        gate = _hold_progress(i)
        bid = i.allocate_batch_id(1)
        i.submit_transfer(bid, [TransferRequest(OpCode.READ, la, seg, base, MiB)])
        i.unregister_local_memory(dst)
        monkeypatch.setattr(fv, "_keys", itertools.count(first))  # the same lkeys again
        dst[:] = b"N" * MiB  # the new registration's own data
        assert i.register_local_memory(dst) == la
        assert i.rdma.regions.local(la, MiB)[2] == list(range(first, first + len(NICS4)))
        gate.set()
        i.wait_batch(bid, 10)
        st = i.get_transfer_status(bid, 0)
        assert st.state == TransferState.FAILED and "unregistered" in st.error, st
        assert dst == b"N" * MiB
        i.free_batch_id(bid)
        assert i.transfer_sync(t.segment_name, la, base, MiB, OpCode.READ) == MiB and dst == kv[:MiB]


def test_double_close_segment_cancels_its_queued_requests(double):
    t, i, kv, base = _pair()
    with t, i:
        la = i.register_local_memory(bytearray(b"A" * MiB))
        seg = i.open_segment(t.segment_name)
        gate = _hold_progress(i)
        bid = i.allocate_batch_id(1)
        i.submit_transfer(bid, [TransferRequest(OpCode.WRITE, la, seg, base, MiB)])
        i.close_segment(seg)
        gate.set()
        i.wait_batch(bid, 10)
        st = i.get_transfer_status(bid, 0)
        assert st.state == TransferState.CANCELED and "closed" in st.error
        assert kv[:MiB] == bytes(MiB)


def _connect_raw(rpc, nic, initiator, qpn, origin=""):
    """One ``connect`` RPC as an initiator sends it (a hostile one may send any number)."""
    return rpc.call("connect", nic="mlx5_0", qpn=qpn, psn=1, gid=nic.gid, lid=nic.lid, mtu=nic.mtu,
                    ethernet=nic.ethernet, initiator=initiator, origin=origin)  # fmt: skip


def test_double_passive_qps_are_capped_per_initiator_and_in_total(double):
    """A target makes a QP per ``connect``: at most 2 x min(rdma_max_endpoints, 16 x its NICs) per
    initiator instance and 16 x rdma_max_endpoints in all; over a cap the connect is refused with
    ObjectBusy (2,000 connects from one initiator held 2,000 QPs)."""
    from kvpool._rpc import RpcClient
    from kvpool.errors import ObjectBusy

    double(["mlx5_0"])
    t = _engine(rdma_max_endpoints=4)  # per initiator 8, in all 64
    i = _engine()
    with t, i:
        nic = i.rdma.nics[0]
        rpc = RpcClient(t.rdma.rpc_addr, 5.0, None)
        try:
            for n in range(8):
                _connect_raw(rpc, nic, 1, 1000 + n)
            with pytest.raises(ObjectBusy, match="initiator"):
                _connect_raw(rpc, nic, 1, 2000)
            assert len(t.rdma._passive) == 8
            rpc.call("disconnect", initiator=1, gid=nic.gid, qpn=1000)  # frees its room
            _connect_raw(rpc, nic, 1, 2001)
            for ini in range(2, 9):  # 7 more initiators fill the target: 64 in all
                for n in range(8):
                    _connect_raw(rpc, nic, ini, n)
            assert len(t.rdma._passive) == 64
            with pytest.raises(ObjectBusy, match="passive QPs"):
                _connect_raw(rpc, nic, 99, 1)
            assert len(t.rdma._passive) == 64
        finally:
            rpc.close()
        # a real initiator over the cap tries other paths and fails its request typed, in time
        base = t.register_local_memory(bytearray(MiB))
        ini = _engine(rdma_retry_limit=1, rdma_nic_pause_s=0)
        with ini:
            la = ini.register_local_memory(bytearray(MiB))
            seg = ini.open_segment(t.segment_name)
            st, per = run_batch(ini, [TransferRequest(OpCode.WRITE, la, seg, base, MiB)], timeout=10)
            assert st.state == TransferState.FAILED and "passive QPs" in per[0].error


def test_double_a_new_initiator_instance_replaces_its_old_passive_qps(double):
    """An initiator restarted under the same segment name (it never sent ``disconnect``): the
    target closes the old instance's QPs at its first connect instead of keeping them forever."""
    double(["mlx5_0"])
    t = _engine()
    kv = bytearray(MiB)
    base = t.register_local_memory(kv)
    with t:
        port = None
        for _ in range(3):
            ini = _engine(**({"port": port} if port else {}))
            port = int(ini.segment_name.rsplit(":", 1)[1])
            src = bytearray(os.urandom(MiB))
            la = ini.register_local_memory(src)
            assert ini.transfer_sync(t.segment_name, la, base, MiB) == MiB and kv == src
            assert len(t.rdma._passive) == ini.rdma.endpoint_count() == 1  # the old ones closed
            ini.close()  # sends no disconnect (as a process that dies)
        assert len(t.rdma._passive) == 1
