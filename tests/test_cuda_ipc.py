"""CUDA IPC transport and the CUDA driver wrapper, across real processes on the fake CUDA driver
(kvpool.testing.fakecuda: the driver entry points over memfd-backed "device" memory whose device
pointers the CPU cannot touch). Only the driver differs on a GPU: tests/test_gpu_real.py runs the
same paths on real CUDA (``pytest -m gpu``)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool import OpCode, TransferEngine, TransferRequest, TransferState, _native
from kvpool.errors import (
    InvalidArgument,
    KvpoolError,
    RemoteAccessError,
    SegmentNotFound,
    TransferError,
    TransferTimeout,
)
from kvpool.testing import fakecuda
from kvpool.testing.fakecuda import SyncHold
from kvpool.transfer.cuda_driver import CudaDriver, CudaError, load_driver
from kvpool.transfer.cuda_ipc import CudaIpcTransport
from tests.cuda_ipc_peer import Peer

ROOT = Path(__file__).resolve().parents[1]
SIZE = 4 << 20


@pytest.fixture
def peer(fake_driver: str) -> Iterator[Peer]:
    p = Peer(2, SIZE)
    yield p
    p.close()


def _sha(drv: CudaDriver, addr: int, n: int) -> str:
    buf = bytearray(n)
    drv.memcpy(_native.buffer_address(buf)[0], addr, n)
    return hashlib.sha256(buf).hexdigest()


def _fill(drv: CudaDriver, addr: int, n: int, seed: int) -> None:
    buf = bytearray(n)
    _native.fill_pattern(_native.buffer_address(buf)[0], n, seed)
    drv.memcpy(addr, _native.buffer_address(buf)[0], n)


def _ipc(eng: TransferEngine) -> CudaIpcTransport:
    return next(t for t in eng._transports if isinstance(t, CudaIpcTransport))


def _tamper(monkeypatch: pytest.MonkeyPatch, ipc: CudaIpcTransport, edit: Callable[[Any], Any]) -> None:
    """The transport attaches every peer descriptor as ``edit`` returns it (a hostile peer's)."""
    real = ipc.attach
    monkeypatch.setattr(ipc, "attach", lambda handle, name, desc: real(handle, name, edit(desc)))


# ----------------------------------------------------------------------------- the driver wrapper
def test_driver_ipc_handle_across_processes(fake_driver: str) -> None:
    drv = CudaDriver(fake_driver)
    assert drv.count == 2
    p = drv.alloc(1 << 20, 1)
    assert drv.pointer_device(p) == 1 and drv.pointer_device(p + (1 << 20) - 1) == 1
    host = bytearray(16)
    assert drv.pointer_device(_native.buffer_address(host)[0]) is None  # pageable host memory
    assert drv.address_range(p + 100) == (p, 1 << 20)
    _fill(drv, p, 1 << 20, 7)
    handle = drv.ipc_handle(p)
    with pytest.raises(CudaError):
        drv.ipc_handle(p + 16)  # IPC handles name allocation bases only
    child = textwrap.dedent(
        f"""
        import ctypes, hashlib, sys
        from kvpool import _native
        from kvpool.transfer.cuda_driver import CudaDriver
        drv = CudaDriver({fake_driver!r})
        q = drv.ipc_open(bytes.fromhex(sys.argv[1]), 0)
        buf = bytearray(1 << 20)
        drv.memcpy(_native.buffer_address(buf)[0], q, len(buf))
        print(hashlib.sha256(buf).hexdigest())
        _native.fill_pattern(_native.buffer_address(buf)[0], len(buf), 99)
        drv.memcpy(q, _native.buffer_address(buf)[0], len(buf))
        drv.ipc_close(q)
        """
    )
    before = _sha(drv, p, 1 << 20)
    out = subprocess.run(
        [sys.executable, "-c", child, handle.hex()], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == before  # the child read our bytes through the handle
    expect = bytearray(1 << 20)
    _native.fill_pattern(_native.buffer_address(expect)[0], len(expect), 99)
    assert _sha(drv, p, 1 << 20) == hashlib.sha256(expect).hexdigest()  # and we see its write
    drv.free(p)


def test_device_uuids_are_read_whole(fake_driver: str) -> None:
    """A device UUID is 16 raw bytes, zero bytes included: it was read through a ctypes char
    array, which stops at the first zero byte, and padded back with zeros, so devices whose
    UUIDs agree up to a zero byte had the same UUID (every device of the fake driver, whose UUIDs
    differ in their last byte): a peer's GPU buffer was mapped for the wrong device."""
    import ctypes

    drv = CudaDriver(fake_driver)
    raw = ctypes.create_string_buffer(16)
    ctypes.CDLL(fake_driver).cuDeviceGetUuid(raw, 1)
    assert drv.uuid(1) == raw.raw and len(drv.uuid(1)) == 16
    assert drv.uuid(0) != drv.uuid(1)


def test_fake_device_memory_is_not_host_memory(fake_driver: str) -> None:
    """The fake hands out device pointers the CPU cannot touch (as on a GPU): host code that
    dereferences one crashes instead of passing by accident."""
    code = f"""
from kvpool.transfer.cuda_driver import CudaDriver
import ctypes
drv = CudaDriver({fake_driver!r}); p = drv.alloc(4096, 0)
ctypes.string_at(p, 16)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert out.returncode == -signal.SIGSEGV


def test_driver_errors_are_typed(fake_driver: str, tmp_path: Path) -> None:
    from kvpool.errors import ProtocolUnavailable

    with pytest.raises(ProtocolUnavailable, match="cannot load the CUDA driver"):
        CudaDriver(str(tmp_path / "missing.so"))
    with pytest.raises(InvalidArgument, match="missing.so"):  # named explicitly: never silently off
        load_driver(str(tmp_path / "missing.so"))
    with pytest.raises(InvalidArgument, match="missing.so"):
        TransferEngine(cuda_driver=str(tmp_path / "missing.so"))
    drv = CudaDriver(fake_driver)
    with pytest.raises(CudaError, match="cuIpcOpenMemHandle"):
        drv.ipc_open(b"\0" * 64, 0)


def test_no_driver_keeps_cpu_behaviour(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no driver named, a machine without libcuda.so.1 (or without a device) runs the CPU
    paths; one with a working driver offers CUDA IPC."""
    monkeypatch.delenv("KVPOOL_CUDA_DRIVER", raising=False)
    gpu = load_driver() is not None
    with TransferEngine() as eng:
        assert ("cuda_ipc" in eng.local_descriptor().protocols) == gpu
        assert any(isinstance(t, CudaIpcTransport) for t in eng._transports) == gpu


# ----------------------------------------------------------------------------- the transport
def test_scattered_gpu_blocks_one_launch_both_directions(peer: Peer, fake_driver: str) -> None:
    drv = load_driver()
    with TransferEngine(timeout_s=10.0) as eng:
        assert "cuda_ipc" in eng.local_descriptor().protocols
        src = drv.alloc(SIZE, 0)
        back = drv.alloc(SIZE, 0)
        eng.register_local_memory(src, SIZE, location="cuda:0", remote_accessible=False)
        eng.register_local_memory(back, SIZE, location="cuda:0", remote_accessible=False)
        _fill(drv, src, SIZE, 5)
        h = bytearray(SIZE)  # the source's bytes before anything moved (a swapped copy direction
        drv.memcpy(_native.buffer_address(h)[0], src, SIZE)  # would change them: checked below)
        blk, n = 4096, 512  # scattered: block k of ours -> block (k * 7) % 1024 of the peer's buffer
        rem = peer.gpu[1]  # on the peer's cuda:1: a peer-device copy
        locs = [src + k * blk for k in range(n)]
        rems = [rem + ((k * 7) % 1024) * blk for k in range(n)]
        ipc = _ipc(eng)
        launches = ipc.launches
        assert eng.batch_transfer_sync(peer.name, locs, rems, [blk] * n) == n * blk
        assert ipc.launches == launches + 1  # 512 blocks, one kernel launch
        assert eng.batch_transfer_sync(peer.name, [back + k * blk for k in range(n)], rems, [blk] * n,
                                       OpCode.READ) == n * blk  # fmt: skip
        assert _sha(drv, back, n * blk) == _sha(drv, src, n * blk) == hashlib.sha256(h[: n * blk]).hexdigest()
        # byte-exact in the peer's own memory, where we put each block
        expect = bytearray(SIZE)
        for k in range(n):
            d = ((k * 7) % 1024) * blk
            expect[d : d + blk] = h[k * blk : (k + 1) * blk]
        # blocks we did not write stay zero in the fresh allocation
        assert peer.ask(f"dump {rem} {SIZE}") == hashlib.sha256(expect).hexdigest()


def test_gpu_to_peer_shared_host_and_host_to_peer_gpu(peer: Peer, fake_driver: str) -> None:
    drv = load_driver()
    with TransferEngine(timeout_s=10.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        _fill(drv, g, 1 << 20, 11)
        want = _sha(drv, g, 16 * 8192)  # before the copy: a copy the wrong way would change g
        before = _ipc(eng).launches + _ipc(eng).memcpy_runs
        eng.batch_transfer_sync(peer.name, [g + k * 8192 for k in range(16)],
                                [peer.shm + k * 8192 for k in range(16)], [8192] * 16)  # fmt: skip
        assert _ipc(eng).launches + _ipc(eng).memcpy_runs == before + 1  # GPU -> mapped shm, no staging
        assert eng.staging.pool_if_made is None
        assert peer.ask(f"dump {peer.shm} {16 * 8192}") == want == _sha(drv, g, 16 * 8192)
        host = bytearray(1 << 20)
        _native.fill_pattern(_native.buffer_address(host)[0], len(host), 3)
        sent = hashlib.sha256(host[: 1 << 19]).hexdigest()
        h = eng.register_local_memory(host)
        eng.transfer_sync(peer.name, h, peer.gpu[0] + 4096, 1 << 19)  # pageable host -> peer GPU
        assert (
            peer.ask(f"dump {peer.gpu[0] + 4096} {1 << 19}")
            == sent
            == hashlib.sha256(host[: 1 << 19]).hexdigest()
        )


def test_mixed_batch_keeps_request_order(peer: Peer, fake_driver: str) -> None:
    """GPU copies and plain host requests to the same peer in one batch: statuses in order."""
    drv = load_driver()
    with TransferEngine(timeout_s=10.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        host = bytearray(1 << 20)
        hb = eng.register_local_memory(host)
        seg = eng.open_segment(peer.name)
        reqs = [
            TransferRequest(OpCode.WRITE, g, seg, peer.gpu[0], 4096),
            TransferRequest(OpCode.WRITE, hb, seg, peer.shm + 65536, 100),
            TransferRequest(OpCode.WRITE, g + 4096, seg, peer.gpu[0] + 8192, 300),
        ]
        bid = eng.allocate_batch_id(3)
        eng.submit_transfer(bid, reqs)
        assert eng.wait_batch(bid, 10).ok
        assert [eng.get_transfer_status(bid, i).transferred_bytes for i in range(3)] == [4096, 100, 300]
        eng.free_batch_id(bid)


def test_sync_round_whose_staged_part_times_out_waits_for_its_gpu_run(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """batch_transfer_sync READs into our GPU buffer from the peer's GPU memory (a CUDA IPC run,
    queued first) and from its plain host memory (staged) while another transfer holds the whole
    staging pool: the staged part's wait ends at timeout_s (TransferTimeout), and the call raises
    only once the queued run finished, its batch freed. It raised at once, the batch left
    allocated (its free refused and the error swallowed) and the run still reading into the
    caller's memory. A run that does not finish within timeout_s more: TransferTimeout saying so,
    and its batch is freed by the first allocation after the run finished (it leaked)."""
    import threading

    from kvpool.errors import TransferTimeout

    drv = load_driver()
    with TransferEngine(timeout_s=1.0, staging_pool_size=1 << 20) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        _fill(drv, g, 1 << 20, 1)
        assert peer.ask(f"fill {peer.gpu[0]} 4096 9") == "ok"
        ipc, pool = _ipc(eng), eng.staging.pool
        held = pool.try_alloc([pool.size])  # another transfer's staging
        assert held is not None
        release = SyncHold(ipc.driver)  # the run's completion waits for the test
        out: dict[str, object] = {}
        locs, rems = [g, g + 8192], [peer.gpu[0], peer.host]  # GPU memory (IPC), then host (staged)

        def call() -> None:
            try:
                out["n"] = eng.batch_transfer_sync(peer.name, locs, rems, [4096, 4096], OpCode.READ)
            except Exception as exc:  # noqa: BLE001 - asserted below
                out["exc"] = exc

        t = threading.Thread(target=call)
        t.start()
        assert release.wait_held(10)  # the IPC run is queued and in flight
        run_batch = ipc._runs[0].batch_id
        t.join(1.6)  # the staged part's pool wait ends at 1.0 s
        returned_early = not t.is_alive()
        release.set()
        t.join(10)
        assert not returned_early, out  # it raised with the run still in flight
        assert isinstance(out.get("exc"), TransferTimeout) and "staging" in str(out["exc"]), out
        assert _sha(drv, g, 4096) == peer.ask(f"dump {peer.gpu[0]} 4096")  # the run's bytes landed
        with pytest.raises(KvpoolError):
            eng.free_batch_id(run_batch)  # freed by the call

        # a run that outlives timeout_s more: the call ends anyway, and says so
        release.clear()
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="queued before it did not finish within 1 s"):
            eng.batch_transfer_sync(peer.name, locs, rems, [4096, 4096], OpCode.READ)
        assert release.waiting() and 1.8 < time.monotonic() - t0 < 10
        hung = ipc._runs[0].batch_id  # its batch is freed once the run finishes (it stayed for good)
        assert eng.batches.pending(hung) and eng.batches.deferred() == 1
        eng.free_batch_id(eng.allocate_batch_id(1))  # an allocation while it still copies: kept
        assert eng.batches.pending(hung) and eng.batches.deferred() == 1
        release.set()
        assert eng.wait_batch(hung, 10).state != TransferState.PENDING
        eng.free_batch_id(eng.allocate_batch_id(1))  # the next allocation frees it
        assert eng.batches.deferred() == 0
        with pytest.raises(KvpoolError, match="unknown batch"):
            eng.free_batch_id(hung)
        pool.release(held[0], pool.size)


def test_unregistered_target_is_never_written(peer: Peer, fake_driver: str) -> None:
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # opens and caches the mapping
        assert peer.ask(f"unregister {peer.gpu[0]}") == "ok"
        with pytest.raises((RemoteAccessError, TransferError)):
            eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # the cached descriptor's pin fails
        with pytest.raises((RemoteAccessError, TransferError)):
            eng.batch_transfer_sync(peer.name, [g + k * 4096 for k in range(64)],
                                    [peer.gpu[0] + k * 4096 for k in range(64)], [4096] * 64)  # fmt: skip


@pytest.mark.parametrize("field", ["length", "offset"])
def test_a_descriptor_past_its_allocation_is_refused_before_any_copy(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    """A peer's descriptor is untrusted: a GPU buffer published with a length or an offset that
    runs past the allocation its IPC handle opens. The old code copied through the mapping plus
    the offset unchecked: past the mapping's end (an illegal address: on a GPU a sticky error
    that ends every later CUDA call of the process; on the fake, of our stream), or into other
    memory of ours mapped there. Now opening the buffer checks offset + length against the
    allocation: RemoteAccessError, nothing queued, and other buffers still copy."""
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        ipc = _ipc(eng)

        def hostile(desc: Any) -> Any:
            for b in desc.cuda_ipc["bufs"]:
                if b[0] == peer.gpu[0]:
                    b[1 if field == "length" else 4] += 4096
            return desc

        _tamper(monkeypatch, ipc, hostile)
        launches = fakecuda.stats(fake_driver)
        rem = peer.gpu[0] + SIZE - (4096 if field == "length" else 8192)  # to 4 KiB past the end
        with pytest.raises(RemoteAccessError, match="allocation"):
            eng.transfer_sync(peer.name, g, rem, 8192, OpCode.READ)
        assert fakecuda.stats(fake_driver) == launches and not ipc._runs  # nothing copied
        assert peer.ask(f"fill {peer.gpu[1]} 4096 5") == "ok"
        eng.transfer_sync(peer.name, g, peer.gpu[1], 4096, OpCode.READ)  # other buffers still copy
        assert _sha(drv, g, 4096) == peer.ask(f"dump {peer.gpu[1]} 4096")


def test_a_shared_host_buffer_past_its_file_is_refused_typed(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's shared host buffer published longer than the file behind it (or naming a
    descriptor it does not hold): mapping it for a GPU copy raised mmap's ValueError (or an
    OSError) out of the submit, untyped. Now RemoteAccessError, nothing queued."""
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        ipc = _ipc(eng)

        def hostile(desc: Any) -> Any:
            bufs = [dataclasses.replace(b, length=b.length + (1 << 20)) if b.addr == peer.shm else b
                    for b in desc.buffers]  # fmt: skip
            return dataclasses.replace(desc, buffers=bufs)

        _tamper(monkeypatch, ipc, hostile)
        with pytest.raises(RemoteAccessError, match="shared"):
            eng.transfer_sync(peer.name, g, peer.shm, 4096, OpCode.READ)
        assert not ipc._runs


def test_runs_from_memory_on_two_devices_each_record_their_own_event(peer: Peer, fake_driver: str) -> None:
    """Runs alternate between local GPU memory on device 0 and on device 1 (one stream each): a
    finished run's event went back to one pool for all devices and the next run took it whatever
    its device, but an event records only on a stream of its own context (the driver refuses
    with CUDA_ERROR_INVALID_HANDLE): every run on the other device failed after its copies were
    queued. Spare events are now kept per device."""
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g0, g1 = drv.alloc(1 << 20, 0), drv.alloc(1 << 20, 1)
        eng.register_local_memory(g0, 1 << 20, location="cuda:0")
        eng.register_local_memory(g1, 1 << 20, location="cuda:1")
        r = peer.gpu[0]
        for k in range(4):
            g = (g0, g1)[k % 2]
            _fill(drv, g, 4096, 20 + k)
            assert eng.transfer_sync(peer.name, g, r + k * 4096, 4096) == 4096
            assert peer.ask(f"dump {r + k * 4096} 4096") == _sha(drv, g, 4096)


@pytest.mark.parametrize(
    "bad",
    [{3: "not a handle"}, {2: None}, {1: -4096}, {0: (1 << 64) - 4096}, {4: 1 << 64}, {6: "gen"}, {}, None],
)
def test_a_malformed_gpu_buffer_in_a_descriptor_is_refused_typed(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch, bad: dict[int, object] | None
) -> None:
    """A peer's descriptor is untrusted: a GPU buffer entry of the wrong shape or types (a
    handle or UUID that is no bytes, a negative length, a range past 2**64) made attach raise
    TypeError, ValueError or OverflowError out of open_segment (and a handle given as a huge
    int made it allocate that many zero bytes: bytes(n)). Now MetadataError, nothing attached."""
    from kvpool.errors import MetadataError

    with TransferEngine(timeout_s=5.0) as eng:
        ipc = _ipc(eng)

        def hostile(desc: Any) -> Any:
            if bad is None:  # no list at all
                desc.cuda_ipc["bufs"] = 7
                return desc
            (entry, *_) = desc.cuda_ipc["bufs"]
            for k, v in bad.items():
                entry[k] = v
            if not bad:
                entry.append(0)  # one field too many
            return desc

        _tamper(monkeypatch, ipc, hostile)
        with pytest.raises(MetadataError, match="GPU buffer"):
            eng.open_segment(peer.name)
        assert not ipc._peers


def test_a_submit_refused_partway_queues_nothing(peer: Peer, fake_driver: str) -> None:
    """A submit whose later CUDA IPC part is refused (RemoteAccessError: the owner unregistered
    that buffer) after earlier parts (a GPU run, a staged request): the earlier parts were queued
    and ran after submit_transfer raised (the caller, told nothing was submitted, may reuse the
    memory they read into), and the engine's retry submitted them a second time. Every part is
    now checked and pinned before the first is queued: the submit raises with nothing queued
    and nothing copied."""
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # caches the descriptor, maps gpu[0]
        seg = eng.open_segment(peer.name)
        assert peer.ask(f"unregister {peer.gpu[1]}") == "ok"  # our cached descriptor still has it
        bid = eng.allocate_batch_id(16)
        reqs = [
            TransferRequest(OpCode.READ, g, seg, peer.gpu[0], 4096),  # a GPU run
            TransferRequest(OpCode.READ, g + 4096, seg, peer.host, 4096),  # staged
            TransferRequest(OpCode.READ, g + 8192, seg, peer.gpu[1], 4096),  # its pin fails
        ]
        _fill(drv, g, 3 * 4096, 7)
        before = _sha(drv, g, 3 * 4096)
        copies = fakecuda.stats(fake_driver)[1]
        with pytest.raises(RemoteAccessError):
            eng.submit_transfer(bid, reqs)
        time.sleep(0.3)  # a queued part would have landed by now
        assert eng.batches.reserve(bid, []) == 0  # nothing queued (was 2, and 5 before f21539a)
        assert fakecuda.stats(fake_driver)[1] == copies and _sha(drv, g, 3 * 4096) == before
        eng.free_batch_id(bid)  # nothing pending
        # the owner's pins were given back: it unregisters the buffer of the first part at once
        assert peer.ask(f"unregister {peer.gpu[0]}") == "ok"


def test_a_kernel_run_from_another_device_enables_its_peer_access(peer: Peer, fake_driver: str) -> None:
    """A peer's GPU buffer mapped for a run from our memory on device 0 is reused by a gather
    kernel run from our memory on device 1: peer access was enabled only for the device of the
    run that opened the mapping, and a kernel reaching another device's memory without it is an
    illegal address (on a GPU a sticky error that ends the context). Each run's device now gets
    peer access to the device of every GPU buffer it uses (once per pair)."""
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g0, g1 = drv.alloc(1 << 20, 0), drv.alloc(1 << 20, 1)
        eng.register_local_memory(g0, 1 << 20, location="cuda:0")
        eng.register_local_memory(g1, 1 << 20, location="cuda:1")
        r, n = peer.gpu[0], 8  # the peer's buffer on device 0; 8 small ranges: one kernel launch
        rems = [r + k * 4096 for k in range(n)]
        for g in (g0, g1):
            _fill(drv, g, n * 4096, 30 + (g == g1))
            assert (
                eng.batch_transfer_sync(peer.name, [g + k * 4096 for k in range(n)], rems, [4096] * n)
                == n * 4096
            )
            assert peer.ask(f"dump {r} {n * 4096}") == _sha(drv, g, n * 4096)
        assert _ipc(eng).launches == 2


def test_owner_killed_mid_batch_fails_cleanly(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)
        monkeypatch.setenv("FAKECUDA_DELAY_US", "300000")  # each queued GPU operation takes 0.3 s
        bid = eng.allocate_batch_id(64)
        seg = eng.open_segment(peer.name)
        base = peer.gpu[0]
        eng.submit_transfer(bid, [TransferRequest(OpCode.WRITE, g + k * 4096, seg, base + k * 4096, 4096)
                                  for k in range(64)])  # fmt: skip
        peer.p.send_signal(signal.SIGKILL)
        peer.p.wait(10)
        t0 = time.monotonic()
        st = eng.wait_batch(bid, 10)
        assert time.monotonic() - t0 < 10
        assert not st.ok and "exited" in (eng.get_transfer_status(bid, 0).error or "")
        eng.free_batch_id(bid)
        monkeypatch.delenv("FAKECUDA_DELAY_US")
        with pytest.raises((SegmentNotFound, TransferError, RemoteAccessError)):
            eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)


def test_restarted_owner_gets_its_own_bytes(fake_driver: str) -> None:
    """An owner SIGKILLed and restarted under the same segment name (same port): the first request
    after the restart fails, typed - whether its address is one the old descriptor knew (then it is
    never copied into the dead owner's cached mapping) or one only the new owner has - so the
    caller learns of the restart, as over TCP; then the segment is re-fetched and the bytes land in
    the new owner's memory; the old owner's addresses are refused."""
    drv = load_driver()
    old = Peer(2, SIZE)
    procs = [old]  # closed whatever fails
    port = int(old.name.rsplit(":", 1)[1])
    try:
        with TransferEngine(timeout_s=5.0) as eng:
            g = drv.alloc(1 << 20, 0)
            eng.register_local_memory(g, 1 << 20, location="cuda:0")
            _fill(drv, g, 1 << 20, 21)
            eng.transfer_sync(old.name, g, old.gpu[0], 65536)  # opens and caches the old owner's mapping
            assert old.ask(f"dump {old.gpu[0]} 65536") == _sha(drv, g, 65536)
            for first_to_old_address in (True, False):
                old.p.send_signal(signal.SIGKILL)
                old.p.wait(10)
                new = Peer(2, SIZE, port=port)
                procs.append(new)
                assert new.name == old.name
                _fill(drv, g, 1 << 20, 22 + first_to_old_address)
                first = old.gpu[0] if first_to_old_address else new.gpu[0] + 8192
                with pytest.raises((TransferError, SegmentNotFound), match="restarted|closed|exited"):
                    eng.transfer_sync(new.name, g + 4096, first, 65536)
                assert eng.get_segment_descriptor(new.name).pid == new.p.pid  # then re-fetched
                eng.transfer_sync(new.name, g + 4096, new.gpu[0] + 8192, 65536)
                assert new.ask(f"dump {new.gpu[0] + 8192} 65536") == _sha(drv, g + 4096, 65536)
                if old.gpu[0] not in new.gpu:
                    with pytest.raises(RemoteAccessError):  # the old owner's address means nothing now
                        eng.transfer_sync(new.name, g, old.gpu[0], 4096)
                old = new
    finally:
        for p in procs:
            p.close()


def test_unregister_waits_for_copies_in_flight(fake_driver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner decides: our unregister of a GPU buffer returns only after a peer's copy into it
    finished (the peer pinned its fence slot)."""
    drv = load_driver()
    with TransferEngine(timeout_s=10.0) as target:  # the initiator is a child: CUDA IPC is between processes
        t = drv.alloc(1 << 20, 0)
        target.register_local_memory(t, 1 << 20, location="cuda:0")
        code = textwrap.dedent(
            f"""
            import sys
            from kvpool import TransferEngine, OpCode, TransferRequest
            from kvpool.transfer.cuda_driver import load_driver
            drv = load_driver()
            with TransferEngine(timeout_s=10.0) as eng:
                g = drv.alloc(1 << 20, 0)
                eng.register_local_memory(g, 1 << 20, location="cuda:0")
                bid = eng.allocate_batch_id(4)
                seg = eng.open_segment({target.segment_name!r})
                reqs = [TransferRequest(OpCode.WRITE, g, seg, {t} + k * 4096, 4096) for k in range(4)]
                eng.submit_transfer(bid, reqs)
                print("submitted", flush=True)
                print(eng.wait_batch(bid, 20).ok, flush=True)
            """
        )
        env = dict(os.environ, FAKECUDA_DELAY_US="500000")
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        assert child.stdout.readline().strip() == "submitted"
        t0 = time.monotonic()
        target.unregister_local_memory(t)  # waits for the child's pinned copy (>= ~1 s of delay)
        waited = time.monotonic() - t0
        assert child.stdout.readline().strip() == "True"
        assert child.wait(20) == 0
        assert waited > 0.2  # it did wait for the copy in flight


def test_unregister_under_a_stopped_same_host_gpu_copier_finishes_and_raises(fake_driver: str) -> None:
    """A same-host peer SIGSTOPped inside its CUDA IPC copy into our GPU buffer (its fence pin
    held; each fake-driver operation takes 2 s there, so the stop lands inside the copy): the
    fence retire cannot be confirmed within timeout_s, and unregister finishes all the same
    (gone from the registry, the descriptor and the CUDA IPC exports, the buffer kept referenced)
    and raises RegistrationError, as on the CPU path. It raised BatchInFlight and left the
    registration and its export published, a later unregister failing the same way."""
    from kvpool.errors import AddressNotRegistered, RegistrationError

    drv = load_driver()
    with TransferEngine(timeout_s=0.5) as target:
        t = drv.alloc(1 << 20, 0)
        target.register_local_memory(t, 1 << 20, location="cuda:0")
        code = textwrap.dedent(
            f"""
            from kvpool import TransferEngine, OpCode, TransferRequest
            from kvpool.transfer.cuda_driver import load_driver
            drv = load_driver()
            with TransferEngine(timeout_s=30.0) as eng:
                g = drv.alloc(1 << 20, 0)
                eng.register_local_memory(g, 1 << 20, location="cuda:0")
                bid = eng.allocate_batch_id(1)
                seg = eng.open_segment({target.segment_name!r})
                eng.submit_transfer(bid, [TransferRequest(OpCode.WRITE, g, seg, {t}, 4096)])
                print("submitted", flush=True)  # the run is queued: its fence pin is held
                print(eng.wait_batch(bid, 30).ok, flush=True)
            """
        )
        env = dict(os.environ, FAKECUDA_DELAY_US="2000000")
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "submitted"
            os.kill(child.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with open(f"/proc/{child.pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "T":
                        break
                time.sleep(0.01)
            t0 = time.monotonic()
            with pytest.raises(RegistrationError, match="stopped inside a copy"):
                target.unregister_local_memory(t)
            assert 0.4 < time.monotonic() - t0 < 5  # the fence wait ended at timeout_s
            assert target._registry.get(t) is None and len(target._fenced) == 1
            assert t not in [b.addr for b in target.local_descriptor().buffers]
            assert not _ipc(target).describe()["cuda_ipc"]["bufs"]  # the export is unpublished
            with pytest.raises(AddressNotRegistered):
                target.unregister_local_memory(t)  # gone everywhere, not half-registered
            os.kill(child.pid, signal.SIGCONT)
            assert child.stdout.readline().strip() == "True"  # the copy in flight was not cut short
            assert child.wait(30) == 0
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGCONT)
                child.kill()
            child.wait()


def test_reattaching_the_same_peer_keeps_one_pidfd(fake_driver: str) -> None:
    """Re-opening a segment of the same process (a refreshed descriptor) keeps its pidfd: a new
    one per re-attach leaked descriptors, and past 1,024 the liveness check (select) raised a
    plain ValueError on every transfer; it polls now."""
    with TransferEngine() as target, TransferEngine() as eng:
        target.register_local_memory(bytearray(1 << 20))
        h = eng.open_segment(target.segment_name)
        assert isinstance(eng._routes[h.id], CudaIpcTransport)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(50):
            eng._open(target.segment_name)
        assert len(os.listdir("/proc/self/fd")) - before < 5
        peer = _ipc(eng)._peers[h.id]
        assert peer.alive()


def test_driver_copies_make_a_context_current_on_any_thread(fake_driver: str) -> None:
    """The staging thread never called ``use``: DriverRuntime's copies make the pointer's device
    context current there first (the driver answers CUDA_ERROR_INVALID_CONTEXT without one, which
    the fake driver now models per thread)."""
    import ctypes
    import threading

    from kvpool.transfer.cuda_driver import DriverRuntime

    drv = CudaDriver(fake_driver)
    rt = DriverRuntime(drv)
    g = drv.alloc(8192, 1)
    src, dst = bytearray(range(256)) * 32, bytearray(8192)
    errors: list[BaseException] = []
    raw: list[int] = []

    def bare() -> None:  # no context on a fresh thread: the fake refuses, like a GPU
        raw.append(drv.lib.cuMemcpy(_native.buffer_address(dst)[0], g, 16))

    def staging() -> None:
        try:
            rt.copy_h2d(g, _native.buffer_address(src)[0], 8192)
            rt.copy_d2h(_native.buffer_address(dst)[0], g, 8192)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    for fn in (bare, staging):
        th = threading.Thread(target=fn)
        th.start()
        th.join(10)
    assert raw == [201]
    assert not errors and bytes(dst) == src
    ctx = ctypes.c_void_p()
    got: list[int] = []

    def fresh() -> None:
        rt.copy_d2h(_native.buffer_address(dst)[0], g, 16)
        got.append(drv.lib.cuCtxGetCurrent(ctypes.byref(ctx)))

    th = threading.Thread(target=fresh)
    th.start()
    th.join(10)
    assert got == [0] and ctx.value  # the device's primary context is current on that thread


def test_fake_event_sync_reports_a_stream_error(fake_driver: str) -> None:
    """A copy that failed on a stream is reported by waiting on an event recorded after it."""
    import ctypes

    drv = CudaDriver(fake_driver)
    g = drv.alloc(4096, 0)
    host = bytearray(4096)
    s, ev = drv.stream(0), drv.event()
    ctypes.CDLL(fake_driver).fakecuda_fail_next(700)
    drv.memcpy_async(g, _native.buffer_address(host)[0], 4096, s)
    drv.record(ev, s)
    with pytest.raises(CudaError) as err:
        drv.event_sync(ev)
    assert err.value.code == 700
    with pytest.raises(CudaError):
        drv.query(ev)


def test_a_run_not_waited_for_keeps_its_pins_and_times_out(peer: Peer, fake_driver: str) -> None:
    """The completion thread could not make the device's context current to wait for a run's
    event (cuCtxSetCurrent failing on it): the copies may still run, so the owner's fence slots
    stay pinned and the slots are neither completed nor failed; past timeout_s they time out
    ("may still land"). Once a wait succeeds the pins go and the run is over (the old code
    unpinned at once and failed the slots: TransferError while the copies could still land)."""
    drv = load_driver()
    drv.use(0)  # this thread's context is current: only new threads' (the completer's) fail
    fakecuda.fail_context(fake_driver, 201)
    with TransferEngine(timeout_s=1.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        _fill(drv, g, 8192, 11)
        seg = eng.open_segment(peer.name)
        bid = eng.allocate_batch_id(1)
        t0 = time.monotonic()
        eng.submit_transfer(bid, [TransferRequest(OpCode.WRITE, g, seg, peer.gpu[0], 8192)])
        st = eng.get_transfer_status(bid, 0)
        while st.state == TransferState.PENDING and time.monotonic() - t0 < 10:
            time.sleep(0.01)
            st = eng.get_transfer_status(bid, 0)
        assert st.state == TransferState.TIMEOUT and "may still land" in (st.error or ""), st
        assert time.monotonic() - t0 > 0.9  # at timeout_s, not failed at once
        ipc = _ipc(eng)
        run = ipc._runs[0]  # still queued: its mappings and spares stay too
        assert run.pins and all(run.peer.fence.pinned(slot) for slot, _ in run.pins)
        time.sleep(0.3)  # retried meanwhile, pins still held
        assert all(run.peer.fence.pinned(slot) for slot, _ in run.pins)
        fakecuda.fail_context(fake_driver, 0, 0)  # the context can be made current again
        deadline = time.monotonic() + 5
        while ipc._runs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ipc._runs
        assert not any(run.peer.fence.pinned(slot) for slot, _ in run.pins)
        assert peer.ask(f"dump {peer.gpu[0]} 8192") == _sha(drv, g, 8192)
        eng.free_batch_id(bid)
        assert eng.transfer_sync(peer.name, g + 8192, peer.gpu[0] + 8192, 4096) == 4096


@pytest.mark.parametrize("waited", [True, False], ids=["sync-caller", "completer"])
def test_a_run_with_a_sticky_stream_error_fails_at_once(
    peer: Peer, fake_driver: str, waited: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's copy failing with a sticky error (700: the context is dead, none of its copies
    runs any more): the run is over, its slots fail with the error at once and its pins go —
    ended by a synchronous caller itself or by the completer (submit_transfer)."""
    import ctypes

    import kvpool.transfer.cuda_ipc_complete as complete

    monkeypatch.setattr(complete, "_SPIN_US", (10_000_000, 10_000_000))  # the caller's path, however slow
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # opens the mapping
        ipc = _ipc(eng)
        pushed, here = ipc._pushed, ipc.finished_here
        ctypes.CDLL(fake_driver).fakecuda_fail_next(700)
        t0 = time.monotonic()
        if waited:
            with pytest.raises(TransferError, match="copy failed") as err:
                eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)
            assert not isinstance(err.value, TransferTimeout)
        else:
            bid = eng.allocate_batch_id(1)
            seg = eng.open_segment(peer.name)
            eng.submit_transfer(bid, [TransferRequest(OpCode.WRITE, g, seg, peer.gpu[0], 4096)])
            assert eng.wait_batch(bid, 5).state == TransferState.FAILED
            assert "copy failed" in (eng.get_transfer_status(bid, 0).error or "")
            eng.free_batch_id(bid)
        assert time.monotonic() - t0 < 2
        assert (ipc._pushed, ipc.finished_here) == ((pushed, here + 1) if waited else (pushed + 1, here))
        deadline = time.monotonic() + 5
        while ipc._runs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ipc._runs


def _warm_gpu(eng: TransferEngine, peer: Peer, seed: int | None = None) -> tuple[int, int, CudaIpcTransport]:
    """1 MiB of local GPU memory registered (filled with ``seed``'s pattern when given), the
    peer's first GPU buffer and the CUDA IPC transport, its mapping opened by a 4 KiB WRITE."""
    drv = load_driver()
    g = drv.alloc(1 << 20, 0)
    eng.register_local_memory(g, 1 << 20, location="cuda:0")
    if seed is not None:
        _fill(drv, g, 1 << 20, seed)
    r, ipc = peer.gpu[0], _ipc(eng)
    eng.transfer_sync(peer.name, g, r, 4096)
    return g, r, ipc


def test_a_synchronous_run_ends_in_the_callers_thread_and_an_asynchronous_one_in_the_completer(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synchronous transfer's run that ends within the spin is ended by the caller itself (no
    hand-off to the completion threads: nothing pushed), bytes right both ways; a submit_transfer
    (nobody waits in the submit) goes through the completer as before."""
    import numpy as np

    import kvpool.transfer.cuda_ipc_complete as complete

    monkeypatch.setattr(complete, "_SPIN_US", (10_000_000, 10_000_000))  # a loaded machine's fake may lag
    drv = load_driver()
    with TransferEngine(timeout_s=10.0) as eng:
        g, r, ipc = _warm_gpu(eng, peer, 21)
        here, pushed = ipc.finished_here, ipc._pushed
        assert eng.transfer_sync(peer.name, g, r, 65536) == 65536
        u64 = np.uint64
        locs = np.arange(64, dtype=u64) * u64(4096) + u64(g + 65536)
        rems = (np.arange(64, dtype=u64) * u64(7) % u64(64)) * u64(4096) + u64(r + 65536)
        assert eng.batch_transfer_sync(peer.name, locs, rems, np.full(64, 4096, dtype=u64)) == 64 * 4096
        assert (ipc.finished_here, ipc._pushed) == (here + 2, pushed)
        assert peer.ask(f"dump {r} 65536") == _sha(drv, g, 65536)
        back = drv.alloc(1 << 20, 0)
        eng.register_local_memory(back, 1 << 20, location="cuda:0", remote_accessible=False)
        into, lens = locs - u64(g) + u64(back), np.full(64, 4096, dtype=u64)
        assert eng.batch_transfer_sync(peer.name, into, rems, lens, OpCode.READ) == 64 * 4096
        assert _sha(drv, back + 65536, 64 * 4096) == _sha(drv, g + 65536, 64 * 4096)
        assert (ipc.finished_here, ipc._pushed) == (here + 3, pushed)
        seg = eng.open_segment(peer.name)
        bid = eng.allocate_batch_id(1)
        eng.submit_transfer(bid, [TransferRequest(OpCode.WRITE, g, seg, r, 8192)])
        assert eng.wait_batch(bid, 10).ok
        eng.free_batch_id(bid)
        assert (ipc.finished_here, ipc._pushed) == (here + 3, pushed + 1)
        assert _native.IpcCompleter is not None and ipc._completer.queued == 0


def test_a_synchronous_run_not_ended_within_the_spin_goes_to_the_completer(
    peer: Peer, fake_driver: str
) -> None:
    """The caller waits for its run only a moment: a stream stopped longer (here: held for 0.2 s)
    hands the run to the completer, pins and all, and the call returns when it ends there."""
    drv = load_driver()
    with TransferEngine(timeout_s=10.0) as eng:
        g, r, ipc = _warm_gpu(eng, peer, 22)
        here, pushed = ipc.finished_here, ipc._pushed
        hold = SyncHold(ipc.driver)
        timer = threading.Timer(0.2, hold.set)
        timer.start()
        try:
            t0 = time.monotonic()
            assert eng.transfer_sync(peer.name, g, r, 65536) == 65536
            assert time.monotonic() - t0 >= 0.15  # it waited for the stream, in the completer
        finally:
            timer.join()
            hold.set()
        assert (ipc.finished_here, ipc._pushed) == (here, pushed + 1)
        assert peer.ask(f"dump {r} 65536") == _sha(drv, g, 65536)


def test_a_synchronous_run_whose_owner_exited_during_the_copy_fails_in_the_callers_thread(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller ends its own run as the completer would: an owner that exited while the copy
    ran (SIGKILLed here between the enqueue and the caller's look at the event) fails the call
    with a typed error rather than report bytes that nobody holds."""
    import kvpool.transfer.cuda_ipc as cuda_ipc

    with TransferEngine(timeout_s=5.0) as eng:
        g, r, ipc = _warm_gpu(eng, peer)
        real = _native.ipc_finish_here
        seen: list[Any] = []

        def kill_first(*a: Any) -> None:
            peer.p.send_signal(signal.SIGKILL)
            peer.p.wait(10)
            real(*a)
            seen.append(tuple(a[-1].tolist()))  # out: ended, CUresult, owner alive

        monkeypatch.setattr(cuda_ipc._native, "ipc_finish_here", kill_first)
        with pytest.raises(TransferError, match="exited during the copy"):
            eng.transfer_sync(peer.name, g, r, 4096)
        assert seen == [(1, 0, 0)]  # ended in the caller's thread, the owner seen gone
        assert not ipc._runs and ipc._completer.queued == 0


class _Interrupted(BaseException):
    """What a signal handler raises in the tests below (as KeyboardInterrupt would)."""


@contextlib.contextmanager
def _interrupted_as_it_returns(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[None]:
    """``_native.<name>`` sends this process SIGUSR1 as it returns, whose handler raises
    :class:`_Interrupted` (handled as the call returns, as a Ctrl-C during a native call is);
    the old handler is back on exit."""
    real = getattr(_native, name)

    def handler(*_: Any) -> None:
        raise _Interrupted

    def signalled(*a: Any) -> Any:
        try:
            return real(*a)
        finally:
            os.kill(os.getpid(), signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, handler)
    monkeypatch.setattr(_native, name, signalled)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, old)


def _settle_interrupted(eng: TransferEngine, ipc: CudaIpcTransport) -> None:
    """Wait until the interrupted call's runs ended and its batch (given up on) was freed."""
    deadline = time.monotonic() + 5
    while (ipc._runs or eng.batches.deferred()) and time.monotonic() < deadline:
        eng.free_batch_id(eng.allocate_batch_id(1))  # frees a settled deferred batch
        time.sleep(0.01)
    assert not ipc._runs and eng.batches.deferred() == 0


@pytest.mark.parametrize("held", [True, False], ids=["run-in-flight", "run-ended"])
def test_a_signal_as_the_callers_wait_returns_neither_loses_the_run_nor_its_end(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    """A signal handler that raises (Ctrl-C) runs as the caller's wait for its run returns. A run
    still in flight then (its stream held) must still go to the completer: its pin is dropped when
    it ends, so the owner can unregister the buffer; a run that ended must still have its slots
    finished. Either way the call raises the handler's exception and the batch is freed once
    settled."""
    import kvpool.transfer.cuda_ipc_complete as complete

    if not held:
        monkeypatch.setattr(complete, "_SPIN_US", (10_000_000, 10_000_000))  # ends in the caller
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g, r, ipc = _warm_gpu(eng, peer, 23)
        hold = SyncHold(ipc.driver) if held else None
        pushed, here = ipc._pushed, ipc.finished_here
        try:
            with _interrupted_as_it_returns(monkeypatch, "ipc_finish_here"), pytest.raises(_Interrupted):
                eng.transfer_sync(peer.name, g, r, 65536)
        finally:
            if hold is not None:
                hold.set()
        assert (ipc._pushed, ipc.finished_here) == ((pushed + 1, here) if held else (pushed, here + 1))
        _settle_interrupted(eng, ipc)
        assert peer.ask(f"dump {r} 65536") == _sha(drv, g, 65536)  # the copy landed
        assert peer.ask(f"unregister {r}") == "ok"  # no pin left behind


def test_a_signal_as_a_run_is_queued_keeps_it_queued_and_pinned(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal handler that raises as ``ipc_enqueue`` returns (its copies queued, the stream
    held): the run still goes to the completer with its pin held until the copies ended — it was
    unpinned at once, so the owner could have unregistered and reused memory our copy still
    wrote — and the call raises the handler's exception."""
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g, r, ipc = _warm_gpu(eng, peer, 24)
        _settle_interrupted(eng, ipc)  # on a loaded machine the warm-up's run may be the completer's still
        rec = next(iter(ipc._peers.values()))
        slot = next(b.slot for b in rec.bufs if b.addr <= r < b.addr + b.length)
        hold = SyncHold(ipc.driver)
        try:
            with _interrupted_as_it_returns(monkeypatch, "ipc_enqueue"), pytest.raises(_Interrupted):
                eng.transfer_sync(peer.name, g, r, 65536)
            assert len(ipc._runs) == 1 and rec.fence.pinned(slot)  # in flight: still pinned
        finally:
            hold.set()
        _settle_interrupted(eng, ipc)
        assert not rec.fence.pinned(slot)
        assert peer.ask(f"dump {r} 65536") == _sha(drv, g, 65536)
        assert peer.ask(f"unregister {r}") == "ok"


def test_unregister_waits_for_our_reads_into_the_buffer(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unregistering a local GPU buffer returns only after the CUDA IPC copies of a READ queued
    into it ran (they landed in memory the caller may free once unregister returned)."""
    from kvpool.testing import fakecuda

    drv = load_driver()
    with TransferEngine(timeout_s=10.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # opens the mapping
        seg = eng.open_segment(peer.name)
        monkeypatch.setenv("FAKECUDA_DELAY_US", "300000")
        bid = eng.allocate_batch_id(4)
        r = peer.gpu[0]
        eng.submit_transfer(
            bid, [TransferRequest(OpCode.READ, g + k * 4096, seg, r + k * 4096, 4096) for k in range(4)]
        )
        eng.unregister_local_memory(g)
        copies = fakecuda.stats(fake_driver)[1]
        monkeypatch.delenv("FAKECUDA_DELAY_US")
        assert eng.wait_batch(bid, 10).ok
        time.sleep(0.5)
        assert fakecuda.stats(fake_driver)[1] == copies  # nothing copied after unregister returned
        eng.free_batch_id(bid)


def test_a_run_failing_midway_waits_for_its_queued_copies(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA call failing partway through queuing a run: the copies queued before it finish
    before the pins and mappings are released (they kept copying into the peer's memory after
    the owner was told it could free it)."""
    from kvpool.testing import fakecuda

    drv = load_driver()
    with TransferEngine(timeout_s=10.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # opens the mapping
        fakecuda.fail_enqueue(fake_driver, fakecuda.COPY, after=2, rc=2)  # the third copy: out of memory
        monkeypatch.setenv("FAKECUDA_DELAY_US", "300000")
        r = peer.gpu[0]
        with pytest.raises(TransferError):
            eng.batch_transfer_sync(peer.name, [g + k * 4096 for k in range(4)],
                                    [r + k * 4096 for k in range(4)], [4096] * 4)  # fmt: skip
        copies = fakecuda.stats(fake_driver)[1]
        time.sleep(0.8)
        assert fakecuda.stats(fake_driver)[1] == copies  # nothing still copying after the failure
        assert fakecuda.enqueue_faults_left(fake_driver, fakecuda.COPY) == 0


def test_a_submit_failing_after_a_part_was_queued_names_its_batch(peer: Peer, fake_driver: str) -> None:
    """submit_transfer whose GPU run is queued before its staged part finds no room in the
    staging pool (a failure only queuing can find): it raised the plain InvalidArgument, the
    caller believing nothing was submitted while the run still read into its memory. It now
    raises SubmitIncomplete naming the batch (late_batch), whose queued slot is PENDING until
    the run ends, so the caller can wait for it."""
    from kvpool.errors import SubmitIncomplete, late_batch

    drv = load_driver()
    with TransferEngine(timeout_s=5.0, staging_pool_size=1 << 20) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # opens the mapping
        assert peer.ask(f"fill {peer.gpu[0]} 4096 5") == "ok"
        ipc, pool, seg = _ipc(eng), eng.staging.pool, eng.open_segment(peer.name)
        held = pool.try_alloc([pool.size])  # another transfer's staging: the pool is full
        assert held is not None
        release = SyncHold(ipc.driver)  # the GPU run stays in flight until the test lets it go
        bid = eng.allocate_batch_id(4)
        reqs = [
            TransferRequest(OpCode.READ, g, seg, peer.gpu[0], 4096),  # a GPU run: queued
            TransferRequest(OpCode.READ, g + 8192, seg, peer.host, 4096),  # staged: no room
        ]
        try:
            with pytest.raises(
                SubmitIncomplete, match=f"1 of the 2 requests were queued into batch {bid}"
            ) as ei:
                eng.submit_transfer(bid, reqs)
            assert late_batch(ei.value) == bid and isinstance(ei.value.__cause__, InvalidArgument)
            assert eng.batches.reserve(bid, []) == 1 and eng.batches.pending(bid)
            assert not eng.batch_settled(bid)
        finally:
            release.set()
        assert eng.wait_batch(bid, 10).ok and eng.batch_settled(bid)
        assert _sha(drv, g, 4096) == peer.ask(f"dump {peer.gpu[0]} 4096")  # the run's bytes landed
        eng.free_batch_id(bid)
        pool.release(held[0], pool.size)


def test_a_failed_enqueue_behind_a_slow_stream_does_not_block_the_submitter(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA call failing while a run is queued, on a stream still busy with an earlier run:
    the submitter waited for the whole stream (cuStreamSynchronize, no bound: forever behind a
    hung run), blocking the thread that submitted (an event loop, a connector hook). It now
    returns at once: SubmitIncomplete naming the batch, whose slots stay PENDING while the copies
    queued before the failure may run, then end FAILED; nothing copies after that."""
    from kvpool.errors import SubmitIncomplete, late_batch

    drv = load_driver()
    with TransferEngine(timeout_s=1.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # opens the mapping
        seg, r = eng.open_segment(peer.name), peer.gpu[0]
        monkeypatch.setenv("FAKECUDA_DELAY_US", "1500000")  # every stream operation takes 1.5 s
        first = eng.allocate_batch_id(1)
        eng.submit_transfer(first, [TransferRequest(OpCode.READ, g + (1 << 19), seg, r, 4096)])  # ~3 s
        fakecuda.fail_enqueue(fake_driver, fakecuda.COPY, after=2, rc=2)  # the third copy: out of memory
        bid = eng.allocate_batch_id(4)
        reqs = [TransferRequest(OpCode.READ, g + k * 4096, seg, r + k * 4096, 4096) for k in range(4)]
        t0 = time.monotonic()
        with pytest.raises(SubmitIncomplete, match="not queued|out of memory") as ei:
            eng.submit_transfer(bid, reqs)
        took = time.monotonic() - t0
        assert took < 1.0, took  # it waited for the stream (>= 6 s)
        assert late_batch(ei.value) == bid and isinstance(ei.value.__cause__, TransferError)
        assert eng.batches.pending(bid)  # the two copies queued before the failure may still run
        st = eng.wait_batch(bid, 20)
        assert st.state == TransferState.FAILED, st
        for i in range(4):
            si = eng.get_transfer_status(bid, i)
            assert si.state == TransferState.FAILED and "not queued" in (si.error or ""), si
        assert eng.wait_batch(first, 20).ok
        copies = fakecuda.stats(fake_driver)[1]
        time.sleep(0.5)
        assert fakecuda.stats(fake_driver)[1] == copies  # nothing still copying
        assert fakecuda.enqueue_faults_left(fake_driver, fakecuda.COPY) == 0
        eng.free_batch_id(bid)
        eng.free_batch_id(first)


def test_mapping_at_an_offset_is_closed_by_its_base(fake_driver: str) -> None:
    """A peer registers GPU memory that starts inside its allocation: our mapping is opened at the
    allocation's base plus that offset, and closing it must name the base (the driver refused the
    offset address, unchecked: the mapping stayed for the life of the process)."""
    drv = load_driver()
    code = textwrap.dedent(
        """
        import sys
        from kvpool import TransferEngine
        from kvpool.transfer.cuda_driver import load_driver
        drv = load_driver()
        with TransferEngine(timeout_s=10.0) as eng:
            p = drv.alloc(2 << 20, 0)
            eng.register_local_memory(p + (1 << 20), 1 << 20, location="cuda:0")
            print(eng.segment_name, p + (1 << 20), flush=True)
            sys.stdin.readline()
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=ROOT)  # fmt: skip
    try:
        name, addr = child.stdout.readline().split()
        with TransferEngine(timeout_s=10.0) as eng:
            g = drv.alloc(1 << 20, 0)
            eng.register_local_memory(g, 1 << 20, location="cuda:0")
            eng.transfer_sync(name, g, int(addr), 4096)
            (buf,) = [b for p in _ipc(eng)._peers.values() for b in p.bufs if b.gpu and b.mapped]
            assert buf.offset == 1 << 20
            mapped = buf.mapped
            assert drv.pointer_device(mapped) == 0
        assert drv.pointer_device(mapped) is None  # the engine closed: the mapping is gone
    finally:
        child.stdin.close()
        child.wait(20)


def test_release_exited_closes_a_dead_peers_mappings(peer: Peer, fake_driver: str) -> None:
    """release_exited_peers lets go of a dead same-host peer's CUDA IPC mappings (they kept its
    GPU memory allocated), and the next open re-fetches the segment."""
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # maps the peer's GPU buffer
        mapped = [b.mapped for p in _ipc(eng)._peers.values() for b in p.bufs if b.gpu and b.mapped]
        assert mapped and drv.pointer_device(mapped[0]) == 0
        assert eng.release_exited_peers() == 0  # alive: kept
        assert drv.pointer_device(mapped[0]) == 0
        peer.p.send_signal(signal.SIGKILL)
        peer.p.wait(10)
        assert eng.release_exited_peers() >= 1
        assert drv.pointer_device(mapped[0]) is None  # unmapped
        assert not _ipc(eng)._peers
        with pytest.raises((SegmentNotFound, TransferError)):
            eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)


def _stop_stream(monkeypatch: pytest.MonkeyPatch, ipc: CudaIpcTransport) -> SyncHold:
    """Stop our GPU stream: every run's completion waits until the returned hold is let go
    (``set``; a hung stream; its copies already ran on the fake driver, so the bytes are right
    once let go). The old code's release_exited / close_segment / close waited for it."""
    return SyncHold(ipc.driver)


def _quiet(ipc: CudaIpcTransport) -> None:
    """Wait until no run is left in the transport's queue: a completed run's caller wakes as soon
    as the native completer finished its slots, before the Python bookkeeping takes it out."""
    deadline = time.monotonic() + 10
    while ipc._runs and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not ipc._runs


def _returns_within(call: Callable[[], object], seconds: float) -> list[object]:
    """Run ``call`` in a thread; assert it returned (or raised) within ``seconds``; its outcome."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:  # noqa: BLE001 - the caller checks it
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    out.append(time.monotonic() - t0)
    return out


@pytest.mark.parametrize("how", ["release_exited", "close_segment", "reattach_then_close_segment"])
def test_letting_a_peer_go_under_a_stopped_stream_does_not_wait_nor_unmap(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """release_exited_peers (a store client's heartbeat thread) and close_segment of a peer whose
    CUDA IPC run is still queued on a stopped GPU stream return at once: they waited for the
    stream forever (the heartbeat stopped, and the master dropped the client's leases). The
    peer's mappings and pidfd stay open while the run is queued (its copies still use them; the
    completion thread asks the pidfd whether the peer exited during the copy), and are closed
    by the completion thread once the run ended; an exited peer's run fails, typed. Also when the
    run was queued through an earlier record of the same attachment (a refreshed descriptor of
    the same process keeps the mapping): the old code closed it under that run at once."""
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # maps the peer's GPU buffer
        ipc, seg = _ipc(eng), eng.open_segment(peer.name)
        _quiet(ipc)
        (rec,) = ipc._peers.values()
        (mapped,) = [b.mapped for b in rec.bufs if b.gpu and b.mapped]
        closed: list[int] = []
        real_close = ipc.driver.ipc_close
        monkeypatch.setattr(ipc.driver, "ipc_close", lambda base: (closed.append(base), real_close(base)))
        release = _stop_stream(monkeypatch, ipc)
        try:
            bid = eng.allocate_batch_id(1)
            eng.submit_transfer(bid, [TransferRequest(OpCode.READ, g, seg, peer.gpu[0] + 4096, 4096)])
            assert len(ipc._runs) == 1
            if how.startswith("reattach"):
                eng._open(peer.name)  # the same process: a new record sharing the mapping and pidfd
                (rec,) = ipc._peers.values()
                assert rec is not ipc._runs[0].peer and mapped in [b.mapped for b in rec.bufs]
            if how == "release_exited":
                peer.p.send_signal(signal.SIGKILL)
                peer.p.wait(10)
                count, took = _returns_within(eng.release_exited_peers, 2)
                assert count == 1 and took < 1
            else:
                result, took = _returns_within(lambda: eng.close_segment(seg), 2)
                assert result is None and took < 1
            assert not ipc._peers and len(ipc._runs) == 1  # let go, its run still queued
            time.sleep(0.2)
            assert not closed and drv.pointer_device(mapped) == 0 and rec.pidfd >= 0  # nothing closed
        finally:
            release.set()
        st = eng.wait_batch(bid, 10)
        if how == "release_exited":
            assert not st.ok and "exited" in (eng.get_transfer_status(bid, 0).error or "")
        else:
            assert st.ok
        deadline = time.monotonic() + 5
        while rec.pidfd >= 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closed and drv.pointer_device(mapped) is None and rec.pidfd == -1  # closed after the run


def _submitter(eng: TransferEngine, bid: int, req: TransferRequest) -> tuple[threading.Thread, list[object]]:
    """A thread (named "submitter", not started) that submits ``req`` into batch ``bid``, and the
    list it appends None or the KvpoolError raised to."""
    out: list[object] = []

    def submit() -> None:
        try:
            eng.submit_transfer(bid, [req])
            out.append(None)
        except KvpoolError as exc:
            out.append(exc)

    return threading.Thread(target=submit, name="submitter", daemon=True), out


def _pause_in(
    monkeypatch: pytest.MonkeyPatch, obj: object, name: str, thread: str
) -> tuple[threading.Event, threading.Event]:
    """Stop the first call of ``obj.name`` made by the thread named ``thread`` before it runs:
    (entered, go) - the call waits for ``go`` once it set ``entered``."""
    real, entered, go = getattr(obj, name), threading.Event(), threading.Event()

    def paused(*args: object, **kw: object) -> object:
        if threading.current_thread().name == thread and not entered.is_set():
            entered.set()
            go.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(obj, name, paused)
    return entered, go


@pytest.mark.parametrize("when", ["before_open", "in_open", "in_open_reattach", "before_queue"])
def test_letting_a_peer_go_during_a_submit_never_unmaps_under_it(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """close_segment (or a re-attach) while a submit to the peer is between taking its record and
    queuing its run: the old code closed the mappings under the submit (its copies then went to
    an unmapped address - or, reused by a later open, to another peer's buffer) or let it map a
    buffer of the retired record that nobody closed again. Now the submit either finishes its
    copy (the mapping closed by the completion thread after the run; a re-attach hands it to the
    new record) or, when it had yet to map a buffer of the retired record, is refused, typed,
    with nothing mapped; close_segment never waits for the submit's copies."""
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        ipc, seg = _ipc(eng), eng.open_segment(peer.name)
        if when == "before_queue":
            eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # maps the peer's GPU buffer
        (rec,) = ipc._peers.values()
        mapped = [b.mapped - b.offset for b in rec.bufs if b.gpu and b.mapped]  # before_queue's
        opened: list[int] = []
        closed: list[int] = []
        real_open, real_close = ipc.driver.ipc_open, ipc.driver.ipc_close
        monkeypatch.setattr(ipc.driver, "ipc_open", lambda h, d: opened.append(real_open(h, d)) or opened[-1])
        monkeypatch.setattr(ipc.driver, "ipc_close", lambda base: (closed.append(base), real_close(base)))
        call = {"before_open": "use", "in_open": "ipc_open", "in_open_reattach": "ipc_open"}.get(when)
        # before_queue: the mapping opened, the run's event taken, nothing queued yet
        obj = ipc.driver if call else ipc._spares
        entered, go = _pause_in(monkeypatch, obj, call or "event", "submitter")
        bid = eng.allocate_batch_id(1)
        sub, out = _submitter(eng, bid, TransferRequest(OpCode.READ, g, seg, peer.gpu[0] + 4096, 4096))
        sub.start()
        try:
            assert entered.wait(10)
            if when == "in_open_reattach":  # the same process: waits for the open, then keeps it
                let_go = threading.Thread(target=eng._open, args=(peer.name,), daemon=True)
            else:
                let_go = threading.Thread(target=eng.close_segment, args=(seg,), daemon=True)
            t0 = time.monotonic()
            let_go.start()
            let_go.join(0.5 if when.startswith("in_open") else 2)
            if not when.startswith("in_open"):  # nothing of ours to wait for: returns at once
                assert not let_go.is_alive() and time.monotonic() - t0 < 2
            assert not closed  # the submit is inside: nothing unmapped under it
        finally:
            go.set()
        sub.join(10)
        let_go.join(10)
        assert not sub.is_alive() and not let_go.is_alive()
        if when == "before_open":  # the retired record maps nothing: refused, nothing queued
            assert isinstance(out[0], SegmentNotFound) and not opened and not ipc._runs
            assert rec.pidfd == -1 and not ipc._doomed
            return
        assert out == [None] and eng.wait_batch(bid, 10).ok
        assert _sha(drv, g, 4096) == peer.ask(f"dump {peer.gpu[0] + 4096} 4096")
        (base,) = mapped or opened  # the mapping the copy used
        if when == "in_open_reattach":  # handed to the new record: kept, used by the next copy
            (new,) = ipc._peers.values()
            assert new is not rec and base in [b.mapped - b.offset for b in new.bufs]
            eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)
            assert len(opened) == 1 and not closed and drv.pointer_device(base) == 0
            return
        deadline = time.monotonic() + 5
        while rec.pidfd >= 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closed == [base] and drv.pointer_device(base) is None and rec.pidfd == -1  # after the run


def test_a_submit_during_a_reattach_goes_through_the_new_record(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit to a peer whose segment is being re-attached (a refreshed descriptor), arriving
    after the old record was retired: the old code stored the new record only after retiring
    the old one (and mapping its fence, opening a pidfd), so the submit found the retired record
    and failed with SegmentNotFound. Now the re-attach puts the new record in place in the same
    step as it retires the old one: the submit copies through the new record (the mapping handed
    over), and the re-attach still closes nothing under it."""
    drv = load_driver()
    with TransferEngine(timeout_s=5.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        ipc, seg = _ipc(eng), eng.open_segment(peer.name)
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # maps the peer's GPU buffer
        (rec,) = ipc._peers.values()
        closed: list[int] = []
        real_close = ipc.driver.ipc_close
        monkeypatch.setattr(ipc.driver, "ipc_close", lambda base: (closed.append(base), real_close(base)))
        entered, go = _pause_in(monkeypatch, ipc, "_retire", "reattacher")
        again = threading.Thread(target=eng._open, args=(peer.name,), name="reattacher", daemon=True)
        again.start()
        bid = eng.allocate_batch_id(1)
        try:
            assert entered.wait(10) and rec.retired
            eng.submit_transfer(bid, [TransferRequest(OpCode.READ, g, seg, peer.gpu[0] + 4096, 4096)])
        finally:
            go.set()
            again.join(10)
        assert not again.is_alive() and eng.wait_batch(bid, 10).ok
        assert _sha(drv, g, 4096) == peer.ask(f"dump {peer.gpu[0] + 4096} 4096")
        (new,) = ipc._peers.values()
        assert new is not rec and not new.retired and not closed  # the mapping was handed over


def test_engine_close_under_a_stopped_stream_raises_and_keeps_the_mappings(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TransferEngine.close with a CUDA IPC run queued on a stopped GPU stream raises
    TransferTimeout once no run completed for timeout_s (it waited forever), after closing the
    rest of the engine; the peer's mapping stays while the run is queued and is closed, with
    our streams, by the completion thread once the run ended."""
    from kvpool.errors import TransferTimeout

    drv = load_driver()
    eng = TransferEngine(timeout_s=0.5)
    g = drv.alloc(1 << 20, 0)
    eng.register_local_memory(g, 1 << 20, location="cuda:0")
    eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)
    ipc, seg = _ipc(eng), eng.open_segment(peer.name)
    (rec,) = ipc._peers.values()
    (mapped,) = [b.mapped for b in rec.bufs if b.gpu and b.mapped]
    destroyed: list[int] = []
    real_destroy = ipc.driver.stream_destroy
    monkeypatch.setattr(ipc.driver, "stream_destroy", lambda s: (destroyed.append(s), real_destroy(s)))
    release = _stop_stream(monkeypatch, ipc)
    try:
        bid = eng.allocate_batch_id(1)
        eng.submit_transfer(bid, [TransferRequest(OpCode.READ, g, seg, peer.gpu[0] + 4096, 4096)])
        error, took = _returns_within(eng.close, 5)
        assert isinstance(error, TransferTimeout) and "did not finish within 0.5 s" in str(error)
        assert 0.4 < took < 3
        host, port = eng.segment_name.rsplit(":", 1)
        with pytest.raises(OSError):  # the rest closed: the engine stopped serving
            socket.create_connection((host, int(port)), timeout=2).close()
        time.sleep(0.2)
        assert drv.pointer_device(mapped) == 0 and rec.pidfd >= 0 and not destroyed  # still in use
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while not destroyed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert destroyed and drv.pointer_device(mapped) is None and rec.pidfd == -1
    assert _sha(drv, g, 4096) == peer.ask(f"dump {peer.gpu[0] + 4096} 4096")  # the copy itself ran


def test_engine_close_during_a_submit_waits_for_its_run(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TransferEngine.close while a CUDA IPC submit is between taking the peer's record and
    queuing its run: the old close saw no run queued and tore down (the native completer shut,
    our streams destroyed), then the submit queued its copy on the destroyed stream and failed
    to hand the run over ("completer: closed"): the caller was told the submit failed while its
    READ still landed, the slot stayed PENDING for good and the owner's fence pin was never
    dropped. Now close refuses new submits, waits for those in flight and their runs, then
    tears down."""
    drv = load_driver()
    eng = TransferEngine(timeout_s=5.0)
    g = drv.alloc(1 << 20, 0)
    eng.register_local_memory(g, 1 << 20, location="cuda:0")
    eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)  # maps the peer's buffer, makes the stream
    ipc, seg = _ipc(eng), eng.open_segment(peer.name)
    destroyed: list[int] = []  # destroyed at the end: the old close destroyed it under the submit
    real_destroy = ipc.driver.stream_destroy
    monkeypatch.setattr(ipc.driver, "stream_destroy", destroyed.append)
    entered, go = _pause_in(monkeypatch, _native, "ipc_enqueue", "submitter")
    bid = eng.allocate_batch_id(1)
    sub, out = _submitter(eng, bid, TransferRequest(OpCode.READ, g, seg, peer.gpu[0] + 4096, 4096))
    closer = threading.Thread(target=eng.close, daemon=True)
    sub.start()
    try:
        assert entered.wait(10)
        closer.start()
        closer.join(0.5)
        early, destroyed_early = not closer.is_alive(), list(destroyed)
    finally:
        go.set()
    sub.join(10)
    closer.join(10)
    assert not sub.is_alive() and not closer.is_alive()
    assert out == [None]  # the old code: InvalidArgument, with the copy queued
    assert not early and not destroyed_early  # close waited for the submit and its run
    assert eng.wait_batch(bid, 5).ok and destroyed and not ipc._runs
    assert _sha(drv, g, 4096) == peer.ask(f"dump {peer.gpu[0] + 4096} 4096")
    for s in destroyed:
        real_destroy(s)


def test_failed_kernel_launches_give_their_address_tables_back(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose gather-kernel launch fails returns the device address table it took: each
    failure kept one (device and pinned memory), and on a device with room for a few tables every
    run failed after that many failures."""
    from kvpool.testing import fakecuda

    drv = load_driver()
    with TransferEngine(timeout_s=10.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        r, n = peer.gpu[0], 8  # 8 small GPU ranges: one kernel launch
        locs, rems = [g + k * 4096 for k in range(n)], [r + k * 4096 for k in range(n)]
        eng.transfer_sync(peer.name, g, r, 4096)  # opens the mapping
        real_alloc, allocs = drv.alloc, []

        def small_device(size: int, device: int = 0) -> int:  # room for 2 address tables
            if len(allocs) >= 2:
                raise CudaError("cuMemAlloc failed: CUDA error 2 (out of memory)", 2)
            allocs.append(size)
            return real_alloc(size, device)

        monkeypatch.setattr(drv, "alloc", small_device)
        fakecuda.fail_enqueue(fake_driver, fakecuda.LAUNCH, after=0, rc=701, times=5)  # out of resources
        for _ in range(5):
            with pytest.raises(TransferError, match="701"):
                eng.batch_transfer_sync(peer.name, locs, rems, [4096] * n)
        _fill(drv, g, 1 << 20, 11)
        assert eng.batch_transfer_sync(peer.name, locs, rems, [4096] * n) == n * 4096
        assert peer.ask(f"dump {r} {n * 4096}") == _sha(drv, g, n * 4096)
        assert len(allocs) == 1 and _ipc(eng).launches == 1


def test_unregister_waits_for_a_submit_between_its_check_and_its_run(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A READ into our GPU buffer that passed the registration check but has not queued its run
    yet when unregister starts: unregister waits for that run too (it saw no run queued, returned,
    and the copies then landed in memory the caller may have freed, reported COMPLETED)."""
    import threading

    from kvpool.testing import fakecuda

    drv = load_driver()
    with TransferEngine(timeout_s=10.0) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        r, n = peer.gpu[0], 8
        eng.transfer_sync(peer.name, g, r, 4096)  # opens the mapping
        assert peer.ask(f"fill {r} {n * 4096} 13") == "ok"
        ipc, seg = _ipc(eng), eng.open_segment(peer.name)
        real, checked, go = ipc._prepare_gpu, threading.Event(), threading.Event()

        def between_check_and_queue(*args: object) -> object:
            checked.set()
            go.wait(10)
            return real(*args)

        monkeypatch.setattr(ipc, "_prepare_gpu", between_check_and_queue)
        bid = eng.allocate_batch_id(n)
        reqs = [TransferRequest(OpCode.READ, g + k * 4096, seg, r + k * 4096, 4096) for k in range(n)]
        at_return: list[tuple[int, int, int]] = []
        sub = threading.Thread(target=eng.submit_transfer, args=(bid, reqs))
        unreg = threading.Thread(
            target=lambda: (eng.unregister_local_memory(g), at_return.append(fakecuda.stats(fake_driver)))
        )
        try:
            sub.start()
            assert checked.wait(10)  # the submit checked the registration, its run is not queued
            unreg.start()
            unreg.join(0.5)
            early = bool(at_return)  # unregister returned before the run was queued
        finally:
            go.set()
            sub.join(10)
            unreg.join(10)
        assert at_return and eng.wait_batch(bid, 10).ok
        time.sleep(0.3)
        assert fakecuda.stats(fake_driver) == at_return[0]  # nothing copied after unregister returned
        assert not early
        assert _sha(drv, g, n * 4096) == peer.ask(f"dump {r} {n * 4096}")  # the bytes landed before
        eng.free_batch_id(bid)


def test_unregister_of_a_buffer_under_a_hung_stream_raises_at_the_timeout(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our copies into a GPU buffer outlive the engine's timeout (a hung stream: each copy 1 s
    here): unregister does not wait forever; it finishes unregistering (no new copy, nothing
    published), keeps the buffer referenced and raises RegistrationError."""
    from kvpool.errors import AddressNotRegistered, RegistrationError

    drv = load_driver()
    with TransferEngine(timeout_s=0.3) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        r = peer.gpu[0]
        eng.transfer_sync(peer.name, g, r, 4096)  # opens the mapping
        seg = eng.open_segment(peer.name)
        monkeypatch.setenv("FAKECUDA_DELAY_US", "1000000")
        bid = eng.allocate_batch_id(2)
        eng.submit_transfer(bid, [TransferRequest(OpCode.READ, g + k * 4096, seg, r, 4096) for k in range(2)])
        t0 = time.monotonic()
        with pytest.raises(RegistrationError, match="did not finish within 0.3 s"):
            eng.unregister_local_memory(g)
        assert 0.25 < time.monotonic() - t0 < 5
        assert eng._registry.get(g) is None and len(eng._fenced) == 1
        with pytest.raises(AddressNotRegistered):
            eng.submit_transfer(bid, [TransferRequest(OpCode.READ, g, seg, r, 4096)])
        monkeypatch.delenv("FAKECUDA_DELAY_US")
        assert eng.wait_batch(bid, 10).ok  # the copies were never cut short
        eng.free_batch_id(bid)


def test_unregister_under_a_hung_stream_and_a_pinned_peer_gives_up_within_one_timeout(
    peer: Peer, fake_driver: str
) -> None:
    """Our own READ into the buffer hangs (a stopped stream) and a same-host peer holds a fence pin
    on its slot (a peer stopped inside its copy): unregister gives up within ONE timeout_s and
    raises RegistrationError naming both. It drained our runs for timeout_s and then waited
    timeout_s again for the pin (twice the timeout). The pin is a test double: a lane of the
    engine's own fence table mapped here, pinned at the export's generation as an initiator
    does (the retire's liveness check sees this live process)."""
    from kvpool.errors import RegistrationError

    drv = load_driver()
    timeout = 0.6
    with TransferEngine(timeout_s=timeout) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        ipc = _ipc(eng)
        r = peer.gpu[0]
        eng.transfer_sync(peer.name, g, r, 4096)  # opens the mapping
        seg = eng.open_segment(peer.name)
        export = ipc._exports[g]
        fence = _native.FenceMap.map(os.getpid(), eng._native.fence_fd)
        assert fence is not None and fence.pin(export.slot, export.gen)  # the stopped peer's pin
        hold = SyncHold(ipc.driver)  # our stream stops: the READ's run stays queued
        bid = eng.allocate_batch_id(1)
        try:
            eng.submit_transfer(bid, [TransferRequest(OpCode.READ, g, seg, r, 4096)])
            t0 = time.monotonic()
            with pytest.raises(RegistrationError) as err:
                eng.unregister_local_memory(g)
            took = time.monotonic() - t0
            assert "stopped inside a copy" in str(err.value) and f"within {timeout:g} s" in str(err.value)
            assert timeout - 0.1 < took < 1.5 * timeout  # one deadline, not drain + retire back to back
            assert not fence.pin(export.slot, export.gen)  # the slot is retired: no new pin
            assert eng._registry.get(g) is None and len(eng._fenced) == 1
        finally:
            fence.unpin(export.slot)
            hold.set()
        assert eng.wait_batch(bid, 10).ok  # the READ was never cut short
        eng.free_batch_id(bid)


def test_sync_transfers_under_a_hung_stream_raise_at_the_timeout(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transfer_sync, batch_transfer_sync (lists and columns) and batch_transfer_sync_multi whose
    CUDA IPC run does not finish (a hung stream: its event never completes here until the test
    lets it) raise TransferTimeout at the engine's timeout; they waited for the stream forever.
    The error names the batch, which ``batch_settled`` reports unsettled while the stream is
    stopped and settled (freed) once its copies finished; a batch nobody asks about is freed by
    the first allocation after its copies finished, and the bytes land."""

    import numpy as np

    from kvpool.errors import TransferTimeout

    drv = load_driver()
    with TransferEngine(timeout_s=0.3) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        r = peer.gpu[0]
        assert peer.ask(f"fill {r} 65536 5") == "ok"
        eng.transfer_sync(peer.name, g + 65536, r + 65536, 4096)  # opens the mapping
        ipc = _ipc(eng)
        release = SyncHold(ipc.driver)  # the old code waited for it: the test's finally lets it go
        host = bytearray(8192)
        h = _native.buffer_address(host)[0]
        u64 = np.uint64
        calls = [
            lambda: eng.transfer_sync(peer.name, g, r, 4096, OpCode.READ),
            lambda: eng.batch_transfer_sync(peer.name, [g + 4096, g + 8192], [r + 4096, r + 8192], [4096] * 2,
                                            OpCode.READ),
            lambda: eng.batch_transfer_sync(peer.name, np.array([g + 12288], dtype=u64),
                                            np.array([r + 12288], dtype=u64), np.array([4096], dtype=u64),
                                            OpCode.READ),
            # host memory here, the peer's GPU memory there: one GPU run per part, one batch
            lambda: eng.batch_transfer_sync_multi(
                [(peer.name, [h], [r], [4096]), (peer.name, [h + 4096], [r + 4096], [4096])], OpCode.READ
            ),
        ]  # fmt: skip
        hung: list[int] = []  # their batches
        try:
            for k, call in enumerate(calls):
                if k == 3:  # batch_transfer_sync_multi gathers in one batch only with no GPU registered
                    release.set()
                    assert all(eng.wait_batch(b, 10).ok for b in hung)
                    assert all(eng.batch_settled(b) for b in hung) and eng.batches.deferred() == 0  # freed
                    assert _sha(drv, g, 16384) == peer.ask(f"dump {r} 16384")  # the bytes landed
                    eng.unregister_local_memory(g)
                    eng.register_local_memory(h, len(host))
                    release.clear()
                t0 = time.monotonic()
                with pytest.raises(TransferTimeout, match="did not finish within 0.3 s") as err:
                    call()
                assert 0.25 < time.monotonic() - t0 < 5, k
                hung.append(ipc._runs[-1].batch_id)
                assert err.value.batch_id == hung[-1] and not eng.batch_settled(hung[-1])
                assert eng.batches.pending(hung[-1]) and eng.batches.deferred() >= 1
        finally:
            release.set()
        assert eng.wait_batch(hung[-1], 10).ok
        eng.free_batch_id(eng.allocate_batch_id(1))  # the first allocation after: frees them
        assert eng.batches.deferred() == 0
        assert hashlib.sha256(host).hexdigest() == peer.ask(f"dump {r} 8192")  # the multi's bytes
        eng.unregister_local_memory(h)


def test_sync_transfer_behind_a_long_moving_queue_waits_and_one_behind_a_stopped_stream_times_out(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transfer_sync whose CUDA IPC run is queued behind 16 runs on the same stream that finish
    slowly but steadily (0.1 s each, all together three times timeout_s) waits for them and
    returns its bytes: it raised TransferTimeout at timeout_s as under a hung stream. When the
    stream then stops (its 9th run never finishes until the test lets it), the call raises
    TransferTimeout about timeout_s after the last run finished, not before."""

    from kvpool.errors import TransferTimeout

    drv = load_driver()
    with TransferEngine(timeout_s=0.5) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        r = peer.gpu[0]
        assert peer.ask(f"fill {r} {34 * 4096} 6") == "ok"
        eng.transfer_sync(peer.name, g, r, 4096, OpCode.READ)  # opens the mapping
        seg, ipc = eng.open_segment(peer.name), _ipc(eng)
        release = SyncHold(ipc.driver, after=1 << 30)  # the stream stops once that many runs finished
        monkeypatch.setenv("FAKECUDA_DELAY_US", "50000")  # each copy and event 50 ms: a run 0.1 s
        bids = []
        try:
            for phase in range(2):
                if phase:
                    release.stop_after(8)
                for k in range(17 * phase, 17 * phase + 16):
                    bids.append(eng.allocate_batch_id(1))
                    req = TransferRequest(OpCode.READ, g + k * 4096, seg, r + k * 4096, 4096)
                    eng.submit_transfer(bids[-1], [req])
                t0 = time.monotonic()
                k = 17 * phase + 16
                if not phase:
                    assert eng.transfer_sync(peer.name, g + k * 4096, r + k * 4096, 4096, OpCode.READ) == 4096
                    assert time.monotonic() - t0 > 1.4  # it waited for the 16 runs ahead
                    continue
                with pytest.raises(TransferTimeout, match="did not finish within 0.5 s"):
                    eng.transfer_sync(peer.name, g + k * 4096, r + k * 4096, 4096, OpCode.READ)
                assert 1.2 < time.monotonic() - t0 < 6  # 8 runs (0.8 s), then timeout_s without one
        finally:
            release.set()
        monkeypatch.delenv("FAKECUDA_DELAY_US")
        assert all(eng.wait_batch(b, 20).ok for b in bids)
        deadline = time.monotonic() + 20  # the timed-out transfer's run (not in bids) ends too
        while ipc._runs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _sha(drv, g, 34 * 4096) == peer.ask(f"dump {r} {34 * 4096}")  # every run's bytes landed


def test_sync_transfer_whose_two_staged_submits_wait_in_turn_is_hung_only_after_a_still_look(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """batch_transfer_sync READs into our GPU buffer from the peer's plain host memory (staged),
    its GPU memory (a CUDA IPC run) and its host memory again: one batch, two staged submits.
    The first submit's host-to-device copy takes 0.6 s, the second's never ends until the test
    lets it: the call raises TransferTimeout a whole timeout_s after the copies stopped moving
    (1.5 s), not at the second look (1.0 s): the first look's answer (the first submit waits for
    its copy alone) and the second's (the second one does) were about different submits, and
    two such answers in a row counted as one copy stuck for timeout_s."""
    import threading

    from kvpool.errors import TransferTimeout

    drv = load_driver()
    with TransferEngine(timeout_s=0.5) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        assert peer.ask(f"fill {peer.host} 8192 3") == "ok"
        assert peer.ask(f"fill {peer.gpu[0]} 4096 4") == "ok"
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096, OpCode.READ)  # opens the mapping
        rt = eng.device_runtime
        real_h2d, release, calls = rt.copy_h2d, threading.Event(), []

        def h2d(dst: int, src: int, n: int) -> None:  # the first copy is slow, the second hangs
            calls.append(n)
            if len(calls) == 1:
                time.sleep(0.6)
            else:
                release.wait(20)
            real_h2d(dst, src, n)

        monkeypatch.setattr(rt, "copy_h2d", h2d)
        locs, rems = [g, g + 4096, g + 8192], [peer.host, peer.gpu[0], peer.host + 4096]
        t0 = time.monotonic()
        try:
            with pytest.raises(TransferTimeout, match="did not finish within 0.5 s"):
                eng.batch_transfer_sync(peer.name, locs, rems, [4096] * 3, OpCode.READ)
            took = time.monotonic() - t0
        finally:
            release.set()
        assert len(calls) == 2 and 1.3 < took < 6, (calls, took)
        (bid,) = eng.batches._deferred
        assert eng.wait_batch(bid, 10).ok
        for k, r in enumerate(rems):
            assert _sha(drv, g + k * 4096, 4096) == peer.ask(f"dump {r} 4096")  # every part landed


def test_the_unregister_gate_refuses_only_submits_touching_the_closed_range():
    """A submit whose ranges lie on both sides of a registration being unregistered (a KV cache
    batch over buffers A and C while B, between them, goes) is not refused nor waited for."""
    import collections
    import threading

    import numpy as np

    from kvpool.errors import AddressNotRegistered
    from kvpool.transfer.cuda_ipc_state import _Gate
    from kvpool.transfer.memory import LocalRegistry, Registration
    from kvpool.transfer.types import BufferDescriptor

    registry = LocalRegistry()
    regs = [Registration(BufferDescriptor(base, 4096), None) for base in (0x10000, 0x20000, 0x30000)]
    for r in regs:
        registry.add(r)
    gate = _Gate(threading.Condition(), collections.deque(), registry)
    a_and_c = gate.enter(np.array([0x10000, 0x30000], dtype=np.uint64), np.array([64, 64], dtype=np.uint64))
    assert gate.drain(regs[1], 0.05)  # B: the submit in the gate touches A and C only
    gate.leave(a_and_c)
    gate.leave(gate.enter(np.array([0x10000, 0x30000], dtype=np.uint64), np.array([64, 64], dtype=np.uint64)))
    with pytest.raises(AddressNotRegistered):
        gate.enter(np.array([0x20000 + 4000], dtype=np.uint64), np.array([64], dtype=np.uint64))
    inside = gate.enter(np.array([0x30000 + 100], dtype=np.uint64), np.array([8], dtype=np.uint64))
    assert not gate.drain(regs[2], 0.05)  # C has a submit inside: the wait ends at its deadline
    gate.leave(inside)
    assert gate.drain(regs[2], 0.05)


def test_native_completer_completes_runs_in_order_and_lets_a_hung_one_go_on_shutdown(
    fake_driver: str,
) -> None:
    """The native completion thread (csrc/ipc_complete.cpp): a run whose event completed has its
    slots completed there (with its lengths) and is reported (seq, rc, owner alive) in queue
    order; a run whose owner's pidfd says it exited is reported not alive, its slots left to the
    Python side (which fails them with the reason). Shutdown with a run still queued (a hung
    stream) returns at once, later pushes raise, and when that stream ends the detached thread
    touches the engine no more: the slot stays pending."""
    import numpy as np

    drv = load_driver()
    assert _native.cuda_init(drv.path) and _native.cuda_loaded_path() == drv.path
    with TransferEngine() as eng:
        native = eng._native
        comp = _native.IpcCompleter(native)
        stream = drv.stream(0)
        bid = eng.allocate_batch_id(3)
        first = native.reserve_slots_buf(bid, np.array([5, 7, 9], dtype=np.uint64))
        events = [drv.event() for _ in range(3)]
        drv.record(events[0], stream)
        comp.push(1, 0, events[0], bid, first, np.array([5, 7], dtype=np.uint64), None, [], -1)
        got = comp.wait(5000)
        assert got == [(1, 0, True)]
        assert [eng.batches.status(bid, first + k).transferred_bytes for k in range(2)] == [5, 7]
        assert eng.batches.status(bid, first + 2).state == TransferState.PENDING

        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        pidfd = os.pidfd_open(dead.pid)
        dead.wait()
        drv.record(events[1], stream)
        comp.push(2, 0, events[1], bid, first + 2, np.array([9], dtype=np.uint64), None, [], pidfd)
        assert comp.wait(5000) == [(2, 0, False)]  # the owner exited during the copy
        assert eng.batches.status(bid, first + 2).state == TransferState.PENDING  # Python fails it
        os.close(pidfd)

        hold = SyncHold(drv)
        drv.record(events[2], stream)
        comp.push(3, 0, events[2], bid, first + 2, np.array([9], dtype=np.uint64), None, [], -1)
        assert hold.wait_held(5) and comp.queued == 1
        t0 = time.monotonic()
        comp.shutdown()
        assert time.monotonic() - t0 < 1  # detached: it never waits for a hung stream
        with pytest.raises(KvpoolError, match="closed"):
            comp.push(4, 0, events[2], bid, first + 2, np.array([9], dtype=np.uint64), None, [], -1)
        hold.set()
        deadline = time.monotonic() + 5
        while hold.landed() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert hold.landed() == 1  # the event completed ...
        assert eng.batches.status(bid, first + 2).state == TransferState.PENDING  # ... engine untouched
        assert comp.wait(0) == []
        native.finish_range_buf(bid, first + 2, np.array([9], dtype=np.uint64), 0)
        eng.free_batch_id(bid)
        for e in events:
            drv.event_destroy(e)
        drv.stream_destroy(stream)


def test_a_synchronous_transfer_to_a_peer_a_gpu_copy_reaches_whole_classifies_once(
    peer: Peer, fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """needs_staging classified every synchronous transfer's requests before the submit
    classified them again; for a peer whose every remote-accessible buffer a GPU copy reaches
    (GPU memory, shared host buffers) no request can be staged, so it answers without a pass:
    one classify per transfer, the bytes right. A peer with a plain host buffer (the ``peer``
    fixture's ``host``) still stages a GPU range to it, in rounds."""
    import json

    import kvpool.transfer.cuda_ipc as cuda_ipc_mod

    code = textwrap.dedent(
        """
        import json, sys
        from kvpool import TransferEngine, _native
        from kvpool.transfer.cuda_driver import load_driver
        drv = load_driver()
        with TransferEngine() as eng:
            g = drv.alloc(1 << 20, 0)
            eng.register_local_memory(g, 1 << 20, location="cuda:0")
            host = bytearray(1 << 20)
            _native.fill_pattern(_native.buffer_address(host)[0], len(host), 21)
            drv.memcpy(g, _native.buffer_address(host)[0], len(host))
            shm = eng.alloc_shared_buffer(1 << 20)
            print(json.dumps({"name": eng.segment_name, "gpu": g}), flush=True)
            sys.stdin.read()
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=ROOT)  # fmt: skip
    try:
        info = json.loads(child.stdout.readline())  # type: ignore[union-attr]
        drv = load_driver()
        plans = []
        real_plan = cuda_ipc_mod._plan
        monkeypatch.setattr(cuda_ipc_mod, "_plan", lambda *a: plans.append(a[2] is None) or real_plan(*a))
        with TransferEngine(timeout_s=10.0) as eng:
            g = drv.alloc(1 << 20, 0)
            eng.register_local_memory(g, 1 << 20, location="cuda:0")
            n = 64
            locs = [g + k * 8192 for k in range(n)]
            rems = [info["gpu"] + k * 4096 for k in range(n)]
            assert eng.batch_transfer_sync(info["name"], locs, rems, [4096] * n, OpCode.READ) == n * 4096
            assert _ipc(eng)._peers and all(p.all_reachable for p in _ipc(eng)._peers.values())
            assert plans == [False]  # one pass, the submit's (ops given)
            want = bytearray(1 << 20)
            _native.fill_pattern(_native.buffer_address(want)[0], len(want), 21)
            got = bytearray(4096)
            for k in (0, 17, 63):
                drv.memcpy(_native.buffer_address(got)[0], g + k * 8192, 4096)
                assert got == want[k * 4096 : (k + 1) * 4096]

            plans.clear()  # a peer with a plain host buffer: staged, classified first
            _fill(drv, g, 1 << 20, 5)
            assert eng.transfer_sync(peer.name, g, peer.host, 65536) == 65536
            assert plans and plans[0] is True
            assert not next(p for p in _ipc(eng)._peers.values() if p.pid == peer.p.pid).all_reachable
            assert peer.ask(f"dump {peer.host} 65536") == _sha(drv, g, 65536)
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(10)


def test_native_completer_shutdown_returns_only_once_done_with_the_engine(fake_driver: str) -> None:
    """The native thread completes a run's slots (finish_range) outside the completer's lock, so
    pushes and waits never queue behind thousands of slots; shutdown racing with it returns only
    once the thread is done with the engine (Python may destroy it then): no slot completes after
    shutdown returned, while the detached thread goes on through the runs left."""
    import numpy as np

    drv = load_driver()
    assert _native.cuda_init(drv.path) and _native.cuda_loaded_path() == drv.path
    runs, per = 40, 10000
    lens = np.full(per, 8, dtype=np.uint64)
    with TransferEngine() as eng:
        native = eng._native
        stream = drv.stream(0)
        ev = drv.event()
        drv.record(ev, stream)
        drv.event_sync(ev)  # every run's event has completed: the thread only finishes slots
        for _ in range(5):
            comp = _native.IpcCompleter(native)
            bid = eng.allocate_batch_id(runs * per)
            firsts = [native.reserve_slots_buf(bid, lens) for _ in range(runs)]
            for k, first in enumerate(firsts):
                comp.push(k + 1, 0, ev, bid, first, lens, None, [], -1)
                if k == runs // 2:
                    time.sleep(0.001)  # the thread is busy completing runs meanwhile
            comp.shutdown()
            seen = [native.status(bid, f + per - 1)[0] for f in firsts]  # each run's last slot
            time.sleep(0.05)
            assert [native.status(bid, f + per - 1)[0] for f in firsts] == seen
            assert comp.queued == 0  # the detached thread went through the runs left


def test_threads_submitting_to_one_peer_while_the_heartbeat_looks_for_exited_ones(
    fake_driver: str, peer: Peer
) -> None:
    """Three threads copy to the same peer while a fourth calls ``release_exited_peers`` (a store
    client's heartbeat): every copy lands and nothing raises (a poll object shared by the
    threads' owner-alive checks raised RuntimeError('concurrent poll() invocation'))."""
    drv = load_driver()
    errors: list[BaseException] = []
    with TransferEngine(timeout_s=10.0) as eng:
        mine = drv.alloc(1 << 20, 0)
        eng.register_local_memory(mine, 1 << 20, location="cuda:0", remote_accessible=False)
        for k in range(3):
            _fill(drv, mine + k * 4096, 4096, seed=k + 1)

        def copy(k: int) -> None:
            try:
                for _ in range(150):
                    eng.transfer_sync(peer.name, mine + k * 4096, peer.gpu[0] + k * 4096, 4096)
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

        def beat() -> None:
            try:
                for _ in range(600):
                    eng.release_exited_peers()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=copy, args=(k,)) for k in range(3)]
        threads.append(threading.Thread(target=beat))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        for k in range(3):
            assert peer.ask(f"dump {peer.gpu[0] + k * 4096} 4096") == _sha(drv, mine + k * 4096, 4096)
