"""GPU memory locations (``cuda:N``). Every test with ``double`` in its name runs the production
:class:`~kvpool.transfer.cuda_driver.DriverRuntime` on the CUDA TEST DOUBLE (the fake driver library,
:mod:`kvpool.testing.fakecuda`: memfd "device" memory the CPU cannot touch, counters added by
``fakecuda.counting_runtime``) and, for RDMA, on the fake-verbs test double (device memory made
CPU-visible, as GPUDirect makes it visible to the NIC): they check registration validation, staging
through pinned host buffers, per-request status and the RDMA registration path, never a real GPU or
NIC."""

from __future__ import annotations

import os
import signal
import types

import pytest

from kvpool import OpCode, TransferConfig, TransferEngine, TransferRequest, TransferState
from kvpool.errors import (
    BatchInFlight,
    ConfigError,
    InvalidArgument,
    ProtocolUnavailable,
    RegistrationError,
    RemoteAccessError,
    TransferError,
)
from kvpool.testing import fake_verbs as fv
from kvpool.testing import fakecuda
from kvpool.transfer.peer import PeerProcess
from tests.conftest import run_batch

MiB = 1 << 20
KiB = 1 << 10


FAKE = fakecuda.build()


@pytest.fixture
def rt():
    """The driver runtime over the fake driver, with staging counters (one per test)."""
    return fakecuda.counting_runtime(FAKE)


@pytest.fixture(scope="module")
def cpu_peer():
    """A target engine in another process with a plain CPU buffer (no test double there)."""
    with PeerProcess(16 * MiB, timeout_s=5.0) as p:
        yield p


def _gpu_engine(rt, **kw) -> TransferEngine:
    kw.setdefault("timeout_s", 5.0)
    return TransferEngine(device_runtime=rt, cuda_driver=FAKE, **kw)


# ----------------------------------------------------------------------------- registration
def test_no_cuda_runtime_is_protocol_unavailable():
    """Not the test double: the real runtime selection ("auto") on a machine without CUDA."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with TransferEngine(protocol="tcp") as eng:
        with pytest.raises(ProtocolUnavailable, match="needs a CUDA runtime"):
            eng.register_local_memory(0x7F0000000000, 4096, location="cuda:0", remote_accessible=False)
        with pytest.raises(ProtocolUnavailable):
            eng.register_local_memory(bytearray(16), location="cuda:0")
    for kind in ("torch", "cupy"):
        with TransferEngine(protocol="tcp", device_runtime=kind) as eng:
            with pytest.raises(ProtocolUnavailable):
                eng.register_local_memory(0x7F0000000000, 4096, location="cuda", remote_accessible=False)


def test_double_is_injected_never_selected_by_name(monkeypatch):
    """Configuration cannot name the double; a test passes the runtime object to the engine."""
    assert TransferConfig().device_runtime == "auto"
    with pytest.raises(ConfigError):
        TransferConfig(device_runtime="fake")
    monkeypatch.setenv("KVPOOL_DEVICE_RUNTIME", "fake")
    with pytest.raises(ConfigError):
        TransferConfig.from_env()
    rt = fakecuda.counting_runtime(FAKE)
    with TransferEngine(protocol="tcp", device_runtime=rt) as eng:
        assert eng.device_runtime is rt


def test_double_registration_validation(rt):
    d0 = rt.alloc(MiB, device=0)
    d1 = rt.alloc(MiB, device=1)
    with _gpu_engine(rt, protocol="tcp") as eng:
        # a __cuda_array_interface__ object (cupy-like): location inferred from the pointer
        a = eng.register_local_memory(d0, remote_accessible=False)
        assert a == d0.ptr and eng._registry.get(a).desc.location == "cuda:0"
        # raw address with an explicit location
        b = eng.register_local_memory(d1.ptr, 4096, location="cuda:1", remote_accessible=False)
        assert eng._registry.get(b).desc.location == "cuda:1"
        with pytest.raises(RegistrationError, match="overlaps"):
            eng.register_local_memory(d1.ptr + 1024, 4096, location="cuda:1", remote_accessible=False)
        # wrong device, device that does not exist, host memory, range past the allocation
        with pytest.raises(InvalidArgument, match="memory of cuda:1"):
            eng.register_local_memory(d1.ptr + 8192, 4096, location="cuda:0", remote_accessible=False)
        with pytest.raises(InvalidArgument, match="does not exist"):
            eng.register_local_memory(d1.ptr + 8192, 4096, location="cuda:7", remote_accessible=False)
        host = bytearray(4096)
        with pytest.raises(InvalidArgument):
            eng.register_local_memory(host, location="cuda:0", remote_accessible=False)
        from kvpool import _native

        with pytest.raises(InvalidArgument, match="not CUDA device memory"):
            haddr = _native.buffer_address(memoryview(host))[0]
            eng.register_local_memory(haddr, 4096, location="cuda:0", remote_accessible=False)
        with pytest.raises(InvalidArgument, match="not all memory of cuda:1"):
            eng.register_local_memory(d1.ptr + MiB - 4096, 8192, location="cuda:1", remote_accessible=False)
        with pytest.raises(InvalidArgument):
            eng.register_local_memory(d1.ptr, 4096, location="cuda:x", remote_accessible=False)
        # local-only GPU memory is not published; unregistering works by address and by object
        assert all(bd.addr not in (a, b) for bd in eng.local_descriptor().buffers)
        eng.unregister_local_memory(d0)
        eng.unregister_local_memory(b)
        assert eng._registry.gpu_count == 0


def test_double_torch_like_cuda_tensor_infers_location(rt):
    """A CUDA torch tensor stand-in (no CUDA here): data_ptr/element_size/device like torch.Tensor."""
    d1 = rt.alloc(64 * KiB, device=1)
    t = types.SimpleNamespace(
        data_ptr=lambda: d1.ptr,
        element_size=lambda: 2,
        numel=lambda: 32 * KiB,
        is_contiguous=lambda: True,
        device=types.SimpleNamespace(type="cuda", index=1),
    )
    with _gpu_engine(rt, protocol="tcp") as eng:
        with pytest.raises(InvalidArgument, match="tensor is on cuda:1"):
            eng.register_local_memory(t, location="cuda:0", remote_accessible=False)
        a = eng.register_local_memory(t, remote_accessible=False)  # default location: inferred
        reg = eng._registry.get(a).desc
        assert reg.location == "cuda:1" and reg.length == 64 * KiB


class _ForeignRuntime:
    """A device runtime the engine's C++ server cannot serve (not backed by the driver it loads),
    delegating to the fake driver runtime."""

    def __init__(self, rt) -> None:
        self._rt = rt

    def __getattr__(self, name: str):
        return getattr(self._rt, name)


def test_double_remote_accessible_gpu_memory_refused_on_tcp(rt):
    """Remote-accessible GPU memory over TCP needs the server to serve it (test_gpu_tcp.py covers
    that); with a runtime the server cannot use, registration is refused with what to do."""
    d = rt.alloc(MiB)
    with TransferEngine(protocol="tcp", device_runtime=_ForeignRuntime(rt), timeout_s=5.0) as eng:
        with pytest.raises(ProtocolUnavailable, match="remote_accessible=False") as ei:
            eng.register_local_memory(d)  # remote_accessible defaults to True
        assert "protocol='rdma'" in str(ei.value) and "GPUDirect" in str(ei.value)
        assert eng._registry.gpu_count == 0


# ----------------------------------------------------------------------------- staging (TCP, same host)
@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_double_write_from_device_to_peer_process_and_read_back(rt, cpu_peer, protocol):
    """Fake device memory -> CPU segment of another process (TCP or same-host) and back, bytes checked."""
    import xxhash

    src = rt.alloc(4 * MiB, device=0)
    data = os.urandom(4 * MiB)
    src.write(data)
    dst = rt.alloc(4 * MiB, device=1)
    with _gpu_engine(rt, protocol=protocol) as eng:
        a = eng.register_local_memory(src, remote_accessible=False)
        b = eng.register_local_memory(dst, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        assert eng.uses_same_host_path(seg) == (protocol == "auto")
        assert eng.batch_transfer_sync(cpu_peer.segment, [a], [cpu_peer.addr], [4 * MiB]) == 4 * MiB
        assert cpu_peer.checksum(0, 4 * MiB) == xxhash.xxh3_64_hexdigest(data)
        n = eng.batch_transfer_sync(cpu_peer.segment, [b], [cpu_peer.addr], [4 * MiB], OpCode.READ)
        assert n == 4 * MiB and dst.read() == data
        # transfer_sync takes the staged path too
        assert eng.transfer_sync(cpu_peer.segment, b + MiB, cpu_peer.addr + 8 * MiB, MiB, OpCode.WRITE) == MiB
        assert cpu_peer.checksum(8 * MiB, MiB) == xxhash.xxh3_64_hexdigest(data[MiB : 2 * MiB])
        assert rt.d2h_bytes == 5 * MiB and rt.h2d_bytes == 4 * MiB  # every byte went through staging
        assert eng.staging.pool_if_made is not None and eng.staging.pool.in_use == 0


def test_double_batch_mixed_cpu_and_device_sources(rt, cpu_peer):
    """One batch: a CPU source, a device source (WRITE) and a READ into device memory; per-request status."""
    dev = rt.alloc(2 * MiB)
    ddata = os.urandom(MiB)
    dev.write(ddata)
    hdata = os.urandom(MiB)
    host = bytearray(hdata)
    with _gpu_engine(rt, protocol="tcp") as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        h = eng.register_local_memory(host, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        base = cpu_peer.addr
        st, per = run_batch(
            eng,
            [
                TransferRequest(OpCode.WRITE, h, seg, base, MiB),
                TransferRequest(OpCode.WRITE, a, seg, base + MiB, MiB),
            ],
        )
        assert st.ok and [p.state for p in per] == [TransferState.COMPLETED] * 2
        assert [p.transferred_bytes for p in per] == [MiB, MiB]
        # READ both back: the CPU half into device memory, the device half into host memory
        st, per = run_batch(
            eng,
            [
                TransferRequest(OpCode.READ, a + MiB, seg, base, MiB),
                TransferRequest(OpCode.READ, h, seg, base + MiB, MiB),
            ],
        )
        assert st.ok and all(p.ok for p in per)
        assert dev.read(MiB, MiB) == hdata and bytes(host) == ddata
        assert eng.staging.pool.in_use == 0


def test_double_read_into_device_then_status_per_request(rt, cpu_peer):
    """Status of a staged READ slot says COMPLETED only once its bytes are in (fake) device memory."""
    cpu_peer.fill(7)
    import xxhash

    dev = rt.alloc(MiB)
    with _gpu_engine(rt, protocol="tcp") as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        bid = eng.allocate_batch_id(2)
        eng.submit_transfer(bid, [TransferRequest(OpCode.READ, a, seg, cpu_peer.addr, MiB)])
        while True:  # poll the slot, as Mooncake users do
            s = eng.get_transfer_status(bid, 0)
            if s.state != TransferState.PENDING:
                break
        assert s.state == TransferState.COMPLETED and s.transferred_bytes == MiB
        assert xxhash.xxh3_64_hexdigest(dev.read()) == cpu_peer.checksum(0, MiB)
        assert eng.get_transfer_status(bid, 1).state == TransferState.WAITING
        assert eng.get_batch_status(bid).ok
        eng.free_batch_id(bid)
        assert eng.staging.pool.in_use == 0 and rt.h2d_calls == 1
        # unregistering GPU memory that a queued staged READ still targets is refused
        bid = eng.allocate_batch_id(1)
        eng.submit_transfer(bid, [TransferRequest(OpCode.READ, a, seg, cpu_peer.addr, MiB)])
        try:
            eng.unregister_local_memory(a)  # completed already (copied) or BatchInFlight
        except BatchInFlight:
            eng.wait_batch(bid)
            eng.unregister_local_memory(a)
        assert rt.h2d_calls == 2 and eng._registry.gpu_count == 0
        eng.free_batch_id(bid)


def test_double_concurrent_staged_and_plain_submits_to_one_batch(rt, cpu_peer):
    """Threads submitting device (staged) and CPU requests into one batch while another polls:
    every slot maps to the right staged request, every READ lands in (fake) device memory."""
    import threading

    n = 16
    cpu_peer.fill(3)
    import xxhash

    dev = rt.alloc(n * 64 * KiB)
    host = bytearray(n * 64 * KiB)
    with _gpu_engine(rt, protocol="tcp") as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        h = eng.register_local_memory(host, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        bid = eng.allocate_batch_id(2 * n)
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                for k in range(2 * n):
                    eng.get_transfer_status(bid, k)

        def submit(base_addr: int) -> None:
            for i in range(n):
                off = i * 64 * KiB
                eng.submit_transfer(
                    bid, [TransferRequest(OpCode.READ, base_addr + off, seg, cpu_peer.addr + off, 64 * KiB)]
                )

        threads = [threading.Thread(target=poll)] + [
            threading.Thread(target=submit, args=(x,)) for x in (a, h)
        ]
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join()
        st = eng.wait_batch(bid, 30)
        stop.set()
        threads[0].join()
        assert st.ok and all(eng.get_transfer_status(bid, k).ok for k in range(2 * n))
        want = cpu_peer.checksum(0, n * 64 * KiB)
        assert xxhash.xxh3_64_hexdigest(dev.read()) == want
        assert xxhash.xxh3_64_hexdigest(bytes(host)) == want
        eng.free_batch_id(bid)
        assert eng.staging.pool.in_use == 0 and rt.h2d_calls == n


@pytest.mark.parametrize("protocol", ["tcp", "auto"])
def test_double_large_staged_write_is_pipelined_in_pieces(rt, cpu_peer, protocol):
    """A staged WRITE of >= 2 pieces goes piece by piece (each sent once its device-to-host copy is
    done), next to a small staged WRITE and a host request in one batch; the caller sees one slot per
    request with every byte; an invalid batch with a large WRITE sends nothing."""
    import xxhash

    from kvpool.transfer.staging import PIPE_CHUNK

    big = 4 * PIPE_CHUNK + 3  # five pieces, the last one 3 bytes
    dev = rt.alloc(big + MiB, device=0)
    data = os.urandom(big + MiB)
    dev.write(data)
    host = bytearray(os.urandom(64 * KiB))
    with _gpu_engine(rt, protocol=protocol) as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        h = eng.register_local_memory(host, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        small_at = cpu_peer.addr + big + 5
        host_at = small_at + 2 * KiB
        st, per = run_batch(
            eng,
            [
                TransferRequest(OpCode.WRITE, a, seg, cpu_peer.addr, big),
                TransferRequest(OpCode.WRITE, a + big, seg, small_at, 2 * KiB),
                TransferRequest(OpCode.WRITE, h, seg, host_at, 64 * KiB),
            ],
        )
        assert st.state == TransferState.COMPLETED, st
        assert [p.transferred_bytes for p in per] == [big, 2 * KiB, 64 * KiB]
        assert rt.d2h_calls == 5 + 1 and rt.d2h_bytes == big + 2 * KiB  # five pieces, one small copy
        assert cpu_peer.checksum(0, big) == xxhash.xxh3_64_hexdigest(data[:big])
        assert cpu_peer.checksum(big + 5, 2 * KiB) == xxhash.xxh3_64_hexdigest(data[big : big + 2 * KiB])
        assert cpu_peer.checksum(host_at - cpu_peer.addr, 64 * KiB) == xxhash.xxh3_64_hexdigest(bytes(host))
        before = cpu_peer.checksum(0, big)
        rt.reset_counters()
        with pytest.raises(RemoteAccessError):  # the small one runs past the peer's buffer
            eng.batch_transfer_sync(
                cpu_peer.segment, [a, a + big], [cpu_peer.addr, cpu_peer.addr + 16 * MiB - 1], [big, 2 * KiB]
            )
        assert rt.d2h_calls == 0 and cpu_peer.checksum(0, big) == before  # nothing copied, nothing sent
        assert eng.staging.pool.in_use == 0


def test_double_host_to_device_copy_failure_fails_only_that_request(rt, cpu_peer):
    dev = rt.alloc(2 * MiB)
    host = bytearray(MiB)
    with _gpu_engine(rt, protocol="tcp") as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        h = eng.register_local_memory(host, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        rt.fail_next_h2d = "injected: device lost"
        st, per = run_batch(
            eng,
            [
                TransferRequest(OpCode.READ, h, seg, cpu_peer.addr, MiB),
                TransferRequest(OpCode.READ, a, seg, cpu_peer.addr, MiB),
            ],
        )
        assert st.state == TransferState.FAILED
        assert per[0].state == TransferState.COMPLETED
        assert per[1].state == TransferState.FAILED and "injected: device lost" in per[1].error
        assert "host to device" in per[1].error
        rt.fail_next_h2d = "injected again"
        with pytest.raises(TransferError, match="injected again"):
            eng.batch_transfer_sync(cpu_peer.segment, [a], [cpu_peer.addr], [MiB], OpCode.READ)
        assert eng.staging.pool.in_use == 0


@pytest.mark.parametrize("big", [False, True])
def test_double_device_to_host_copy_failure_is_a_typed_error(rt, cpu_peer, big):
    """A staged WRITE whose device-to-host copy fails raises TransferError naming the copy (the
    pipelined path for large WRITEs raised the runtime's own exception); nothing is sent and the
    staging pool is given back."""
    from kvpool.transfer.staging import PIPE_CHUNK

    n = 3 * PIPE_CHUNK if big else 64 * KiB
    dev = rt.alloc(n)
    dev.write(os.urandom(n))
    with _gpu_engine(rt, protocol="tcp") as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        before = cpu_peer.checksum(0, n)
        rt.fail_next_d2h = "injected: device lost"
        with pytest.raises(TransferError, match="device to host.*injected: device lost"):
            eng.batch_transfer_sync(cpu_peer.segment, [a], [cpu_peer.addr], [n], OpCode.WRITE)
        assert cpu_peer.checksum(0, n) == before
        assert eng.staging.pool.in_use == 0


def test_double_staging_pool_bound(rt, cpu_peer):
    """Pool of 1 MiB: an async batch needing more raises InvalidArgument (nothing queued, nothing held);
    batch_transfer_sync moves 6 MiB (incl. a 3 MiB request) in rounds and never holds more than the pool."""
    import xxhash

    dev = rt.alloc(8 * MiB)
    data = os.urandom(6 * MiB)
    dev.write(data)
    with _gpu_engine(rt, protocol="tcp", staging_pool_size=MiB) as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        bid = eng.allocate_batch_id(4)
        half = 512 * KiB
        reqs = [TransferRequest(OpCode.WRITE, a + k * half, seg, cpu_peer.addr, half) for k in range(3)]
        with pytest.raises(InvalidArgument, match="staging_pool_size"):
            eng.submit_transfer(bid, reqs)
        assert eng.get_transfer_status(bid, 0).state == TransferState.WAITING
        assert eng.staging.pool.in_use == 0 and rt.d2h_calls == 0
        os.kill(cpu_peer.pid, signal.SIGSTOP)  # the target stalls: the batch stays in flight
        try:
            eng.submit_transfer(bid, reqs[:2])  # exactly the pool
            with pytest.raises(InvalidArgument):
                eng.submit_transfer(bid, reqs[2:])  # held by the batch in flight
            assert eng.get_batch_status(bid).state == TransferState.PENDING
        finally:
            os.kill(cpu_peer.pid, signal.SIGCONT)
        assert eng.wait_batch(bid).ok
        assert eng.staging.pool.in_use == 0  # released when the batch finished
        eng.submit_transfer(bid, reqs[2:])
        assert eng.wait_batch(bid).ok
        eng.free_batch_id(bid)
        lens = [3 * MiB, 512 * KiB, 512 * KiB, 2 * MiB]
        locs = [a, a + 3 * MiB, a + 3 * MiB + 512 * KiB, a + 4 * MiB]
        rems = [cpu_peer.addr + (x - a) for x in locs]
        assert eng.batch_transfer_sync(cpu_peer.segment, locs, rems, lens) == 6 * MiB
        assert cpu_peer.checksum(0, 6 * MiB) == xxhash.xxh3_64_hexdigest(data)
        assert eng.staging.pool.peak <= MiB and eng.staging.pool.in_use == 0
        assert rt.pinned_bytes >= MiB


# ----------------------------------------------------------------------------- RDMA (GPUDirect) path
NICS4 = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]


@pytest.fixture
def double(tmp_path, monkeypatch):
    """The fake-verbs test double (4 NICs per process); the fake driver's device memory is made
    CPU-visible, since the fake NIC moves bytes with a CPU copy."""
    monkeypatch.setenv("FAKECUDA_CPU_VISIBLE", "1")
    for k in (fv.ENV_DIR, fv.ENV_NICS, fv.ENV_MTU):
        monkeypatch.setenv(k, "x")
    fv.configure(str(tmp_path / "verbs"), NICS4, 4096)
    yield
    fv._injected.clear()
    fv._kill_after.clear()


def _rdma(rt, **kw) -> TransferEngine:
    return TransferEngine(protocol="rdma", verbs=fv, device_runtime=rt, cuda_driver=FAKE, **kw)


def test_double_rdma_registers_device_memory_directly(rt, double):
    """RDMA: GPU memory is registered as an MR (GPUDirect through peer memory), no staging; the
    location's cuda:0 preferred NIC carries the bytes; remote-accessible GPU memory is published."""
    topo = '{"cpu:0": [["mlx5_0", "mlx5_1"], ["mlx5_2", "mlx5_3"]], "cuda:0": [["mlx5_2"], ["mlx5_3"]]}'
    tgt_dev = rt.alloc(8 * MiB, device=1)
    with _rdma(rt) as t, _rdma(rt, rdma_topology=topo) as i:
        base = t.register_local_memory(tgt_dev)  # remote-accessible GPU memory: fine over RDMA
        desc_buf = [b for b in t.local_descriptor().buffers if b.addr == base][0]
        assert desc_buf.location == "cuda:1" and desc_buf.remote_accessible
        src = rt.alloc(4 * MiB, device=0)
        data = os.urandom(4 * MiB)
        src.write(data)
        a = i.register_local_memory(src, remote_accessible=False)
        seg = i.open_segment(t.segment_name)
        st, per = run_batch(i, [TransferRequest(OpCode.WRITE, a, seg, base, 4 * MiB)])
        assert st.ok and per[0].transferred_bytes == 4 * MiB
        assert tgt_dev.read(0, 4 * MiB) == data
        assert i.rdma.nic_bytes[2] == 4 * MiB and sum(i.rdma.nic_bytes) == 4 * MiB  # cuda:0 -> mlx5_2
        back = rt.alloc(4 * MiB, device=0)
        b = i.register_local_memory(back, remote_accessible=False)
        assert i.batch_transfer_sync(t.segment_name, [b], [base], [4 * MiB], OpCode.READ) == 4 * MiB
        assert back.read() == data
        assert rt.d2h_bytes == 0 and rt.h2d_bytes == 0 and i.staging.pool_if_made is None  # no staging


def test_double_rdma_gpu_registration_failure_gives_hint(rt, double, monkeypatch):
    """Without peer memory (plain MR on a device pointer fails) and without DMA-BUF: the hint."""
    real_mr = fv.mr.MR

    def mr(pd, length, access, address=None, **kw):
        if rt.pointer_device(address) is not None:
            raise fv.PyverbsRDMAError("Failed to register a MR", 14)  # EFAULT, as without nvidia-peermem
        return real_mr(pd, length, access, address=address, **kw)

    monkeypatch.setattr(fv.mr, "MR", mr)
    d = rt.alloc(MiB)
    with _rdma(rt) as eng:
        with pytest.raises(RegistrationError, match="nvidia-peermem") as ei:
            eng.register_local_memory(d, remote_accessible=False)
        assert "DMA-BUF" in str(ei.value) and "cuda:0" in str(ei.value)
        assert eng._registry.gpu_count == 0
        eng.register_local_memory(bytearray(MiB))  # host memory still registers


def test_double_rdma_gpu_registration_falls_back_to_dmabuf(rt, double, monkeypatch):
    """Plain MR fails, a DMA-BUF export exists: DmaBufMR(fd, offset, iova=address) on every NIC, fd closed."""
    real_mr = fv.mr.MR
    calls = []

    def mr(pd, length, access, address=None, **kw):
        if rt.pointer_device(address) is not None:
            raise fv.PyverbsRDMAError("Failed to register a MR", 14)
        return real_mr(pd, length, access, address=address, **kw)

    class DmaBufMR(real_mr):
        def __init__(self, pd, length, access, dmabuf=None, offset=0, iova=None):
            calls.append((dmabuf, offset, iova))
            super().__init__(pd, length, access, address=iova)

    r, w = os.pipe()
    os.close(w)
    monkeypatch.setattr(fv.mr, "MR", mr)
    monkeypatch.setattr(fv.mr, "DmaBufMR", DmaBufMR, raising=False)
    monkeypatch.setattr(rt, "dmabuf_fd", lambda addr, n: (r, addr % 4096))
    d = rt.alloc(MiB)
    with _rdma(rt) as eng:
        a = eng.register_local_memory(d.ptr + 64, MiB - 64, location="cuda:0", remote_accessible=False)
        assert len(calls) == 4 and all(c == (r, 64, a) for c in calls)
        with pytest.raises(OSError):
            os.fstat(r)  # the engine closed the exported fd after registering
        # a pyverbs-style DmaBufMR (no iova: it registers with iova = offset) is refused with the hint
        monkeypatch.setattr(fv.mr, "DmaBufMR", lambda pd, length, access, dmabuf=None, offset=0: None)
        r2, w2 = os.pipe()
        os.close(w2)
        monkeypatch.setattr(rt, "dmabuf_fd", lambda addr, n: (r2, 0))
        d2 = rt.alloc(MiB)
        with pytest.raises(RegistrationError, match="cannot set the iova"):
            eng.register_local_memory(d2, remote_accessible=False)


def test_double_staging_pool_of_any_size_moves_a_larger_range(rt, cpu_peer):
    """A staging pool whose size is not a multiple of 4 KiB: a GPU range larger than it goes in
    rounds of pieces that fit (pieces the pool's size, rounded up to 4 KiB, never fitted)."""
    import xxhash

    n = 3 * MiB
    dev = rt.alloc(n)
    data = os.urandom(n)
    dev.write(data)
    with _gpu_engine(rt, protocol="tcp", staging_pool_size=1_000_000) as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        assert eng.transfer_sync(cpu_peer.segment, a, cpu_peer.addr, n, OpCode.WRITE) == n
        assert cpu_peer.checksum(0, n) == xxhash.xxh3_64_hexdigest(data)


def test_double_pipelined_write_source_is_busy_from_submit(rt, cpu_peer, monkeypatch):
    """A pipelined WRITE copies its GPU source piece by piece inside submit (each device-to-host
    copy 0.1 s here): unregistering that buffer meanwhile is refused (BatchInFlight) rather than
    done under the copies; once the batch finished it unregisters."""
    import threading
    import time

    from kvpool.errors import BatchInFlight
    from kvpool.transfer.staging import PIPE_CHUNK

    big = 4 * PIPE_CHUNK
    dev = rt.alloc(big, device=0)
    real = rt.copy_d2h

    def slow(dst: int, src: int, n: int) -> None:
        time.sleep(0.1)
        real(dst, src, n)

    monkeypatch.setattr(rt, "copy_d2h", slow)
    with _gpu_engine(rt, protocol="tcp", timeout_s=10.0) as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        bid = eng.allocate_batch_id(1)
        done: dict = {}

        def go() -> None:
            try:
                eng.submit_transfer(bid, [TransferRequest(OpCode.WRITE, a, seg, cpu_peer.addr, big)])
                done["ok"] = True
            except Exception as exc:  # noqa: BLE001 - asserted below
                done["err"] = exc

        t = threading.Thread(target=go)
        t.start()
        time.sleep(0.15)
        assert t.is_alive(), done  # still copying pieces inside submit
        with pytest.raises(BatchInFlight):
            eng.unregister_local_memory(a)
        t.join(30)
        assert done.get("ok"), done
        assert eng.wait_batch(bid, 30).state == TransferState.COMPLETED
        eng.free_batch_id(bid)
        eng.unregister_local_memory(a)


def test_double_unregister_is_ordered_against_staged_submits(rt, cpu_peer, monkeypatch):
    """A staged READ into GPU memory submitted after unregister found no staged transfer on it but
    before the registration went (a hook there): the submit is refused (it was queued, and its
    host-to-device copy landed in memory whose unregister had returned). A submit that checked
    the registration before unregister began, and stages after it returned, is refused too."""
    import time

    from kvpool.errors import AddressNotRegistered

    dev = rt.alloc(MiB)
    with _gpu_engine(rt, protocol="tcp") as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        bid = eng.allocate_batch_id(2)
        read = [TransferRequest(OpCode.READ, a, seg, cpu_peer.addr, MiB)]
        real_forget, seen = eng._forget, {}

        def between_check_and_removal(addr, reg):  # in unregister: checked, not removed yet
            try:
                eng.submit_transfer(bid, read)
                seen["queued"] = True
            except AddressNotRegistered as exc:
                seen["refused"] = str(exc)
            real_forget(addr, reg)

        monkeypatch.setattr(eng, "_forget", between_check_and_removal)
        eng.unregister_local_memory(a)
        h2d = rt.h2d_calls
        time.sleep(0.3)
        assert rt.h2d_calls == h2d == 0  # nothing lands in the unregistered memory
        assert "being unregistered" in seen.get("refused", ""), seen
        assert eng.get_transfer_status(bid, 0).state == TransferState.WAITING
        monkeypatch.undo()

        # the other order: the submit checked the registration, then unregister ran whole
        a = eng.register_local_memory(dev, remote_accessible=False)
        real_needed = eng.staging.needed

        def checked_then_unregistered(locs, lens):
            out = real_needed(locs, lens)
            eng.unregister_local_memory(a)
            return out

        monkeypatch.setattr(eng.staging, "needed", checked_then_unregistered)
        with pytest.raises(AddressNotRegistered):
            eng.submit_transfer(bid, read)
        time.sleep(0.3)
        assert rt.h2d_calls == 0 and eng.staging.pool.in_use == 0
        st = eng.get_transfer_status(bid, 0)  # staged as host memory: refused before it was sent
        assert st.state == TransferState.FAILED and "not inside registered memory" in st.error
        eng.free_batch_id(bid)


@pytest.mark.parametrize("op", [OpCode.WRITE, OpCode.READ])
def test_double_auto_sync_to_same_host_host_buffer_stages_in_rounds(rt, cpu_peer, op):
    """protocol="auto" (the CUDA IPC route) to a same-host peer's host buffer: a synchronous GPU
    transfer larger than the staging pool goes in rounds that fit it, like over TCP (it failed
    with InvalidArgument: the pool was asked for the whole range at once)."""
    import xxhash

    n = 3 * MiB
    dev = rt.alloc(n)
    data = os.urandom(n)
    with _gpu_engine(rt, protocol="auto", staging_pool_size=MiB) as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        assert eng.uses_same_host_path(seg)
        if op == OpCode.WRITE:
            dev.write(data)
            assert eng.transfer_sync(cpu_peer.segment, a, cpu_peer.addr, n, op) == n
            assert cpu_peer.checksum(0, n) == xxhash.xxh3_64_hexdigest(data)
        else:
            want = cpu_peer.checksum(0, n)
            assert eng.transfer_sync(cpu_peer.segment, a, cpu_peer.addr, n, op) == n
            assert xxhash.xxh3_64_hexdigest(dev.read()) == want
        halves = [a, a + n // 2], [cpu_peer.addr, cpu_peer.addr + n // 2], [n // 2] * 2
        assert eng.batch_transfer_sync(cpu_peer.segment, *halves, op) == n


def _held_staging(rt, monkeypatch):
    """copy_d2h made to hold the staging pool: the first copy sets ``holding`` and waits for
    ``go`` (the other copies run at once)."""
    import threading

    holding, go, real = threading.Event(), threading.Event(), rt.copy_d2h

    def held(dst: int, src: int, n: int) -> None:
        if not holding.is_set():
            holding.set()
            go.wait(30)
        real(dst, src, n)

    monkeypatch.setattr(rt, "copy_d2h", held)
    return holding, go


def test_double_auto_sync_waits_for_staging_another_transfer_holds(rt, cpu_peer, monkeypatch):
    """The CUDA IPC route's staged rounds (GPU memory to a same-host peer's host memory), two
    synchronous transfers bigger than the pool at once: a round that finds the pool busy waits
    for it (it failed InvalidArgument at once), and both move the right bytes."""
    import threading

    import xxhash

    n = 3 * MiB
    devs = [rt.alloc(n), rt.alloc(n)]
    data = [os.urandom(n), os.urandom(n)]
    for d, b in zip(devs, data, strict=True):
        d.write(b)
    holding, go = _held_staging(rt, monkeypatch)
    with _gpu_engine(rt, protocol="auto", staging_pool_size=MiB, timeout_s=20.0) as eng:
        addrs = [eng.register_local_memory(d, remote_accessible=False) for d in devs]
        assert eng.uses_same_host_path(eng.open_segment(cpu_peer.segment))
        out: dict[int, object] = {}

        def send(k: int) -> None:
            try:
                out[k] = eng.transfer_sync(cpu_peer.segment, addrs[k], cpu_peer.addr + k * n, n, OpCode.WRITE)
            except Exception as exc:  # noqa: BLE001 - asserted below
                out[k] = exc

        first = threading.Thread(target=send, args=(0,))
        first.start()
        assert holding.wait(10)  # the first transfer's round holds the whole pool
        second = threading.Thread(target=send, args=(1,))
        second.start()
        second.join(0.5)
        assert second.is_alive() and 1 not in out  # waiting for the pool, not failed
        go.set()
        first.join(30)
        second.join(30)
        assert out == {0: n, 1: n}
        for k in range(2):
            assert cpu_peer.checksum(k * n, n) == xxhash.xxh3_64_hexdigest(data[k])
        assert eng.staging.pool.peak <= MiB and eng.staging.pool.in_use == 0


def test_double_auto_sync_staging_wait_ends_at_the_deadline(rt, cpu_peer, monkeypatch):
    """A staged round of the CUDA IPC route that gets no staging within the transfer's timeout
    fails TransferTimeout (typed), sending nothing; the transfer holding the pool completes."""
    import threading
    import time

    import xxhash

    from kvpool.errors import TransferTimeout

    n = MiB
    dev = rt.alloc(2 * n)
    dev.write(b"\x5a" * n + b"\xa5" * n)
    before = cpu_peer.checksum(n, n)
    holding, go = _held_staging(rt, monkeypatch)
    with _gpu_engine(rt, protocol="auto", staging_pool_size=MiB, timeout_s=0.5) as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        out: dict[str, object] = {}
        first = threading.Thread(
            target=lambda: out.update(
                n=eng.transfer_sync(cpu_peer.segment, a, cpu_peer.addr, n, OpCode.WRITE)
            )
        )
        first.start()
        assert holding.wait(10)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="staging"):
            eng.transfer_sync(cpu_peer.segment, a + n, cpu_peer.addr + n, n, OpCode.WRITE)
        assert 0.4 < time.monotonic() - t0 < 5
        go.set()
        first.join(30)
        assert out == {"n": n}
        assert cpu_peer.checksum(0, n) == xxhash.xxh3_64_hexdigest(b"\x5a" * n)
        assert cpu_peer.checksum(n, n) == before  # the timed-out round sent nothing
        assert eng.staging.pool.in_use == 0


def test_double_sync_staged_read_whose_host_to_device_copy_hangs_raises_at_the_timeout(
    rt, cpu_peer, monkeypatch
):
    """A synchronous staged READ whose host-to-device copy does not finish (a hung stream: the
    copy blocks here until the test lets it go) raises TransferTimeout once the copy alone was
    waited for for timeout_s; it waited for the stream forever. Its batch is freed by the first
    allocation after the copy finished, and the bytes land."""
    import threading
    import time

    import xxhash

    from kvpool.errors import TransferTimeout

    cpu_peer.fill(3)
    dev = rt.alloc(MiB)
    real_h2d, release, copying = rt.copy_h2d, threading.Event(), threading.Event()

    def hung(dst: int, src: int, n: int) -> None:
        copying.set()
        release.wait(20)  # the old code waited for this: the test's finally lets it go
        real_h2d(dst, src, n)

    monkeypatch.setattr(rt, "copy_h2d", hung)
    with _gpu_engine(rt, protocol="tcp", timeout_s=0.3) as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout, match="did not finish within 0.3 s"):
                eng.transfer_sync(cpu_peer.segment, a, cpu_peer.addr, MiB, OpCode.READ)
            assert copying.is_set() and 0.25 < time.monotonic() - t0 < 5
            assert eng.batches.deferred() == 1
            (hung_bid,) = eng.batches._deferred
        finally:
            release.set()
        assert eng.wait_batch(hung_bid, 10).ok  # the copy was not cut short
        eng.free_batch_id(eng.allocate_batch_id(1))  # the first allocation after: frees it
        assert eng.batches.deferred() == 0
        assert xxhash.xxh3_64_hexdigest(dev.read()) == cpu_peer.checksum(0, MiB)


def test_double_engine_close_under_a_hung_staged_copy_raises_at_the_timeout(rt, cpu_peer, monkeypatch):
    """TransferEngine.close while a staged READ's host-to-device copy does not finish (a hung
    GPU) raises TransferTimeout once no staged copy finished for timeout_s, after closing the
    rest: it returned after 5 s as if done, with the copy still to write the caller's GPU
    memory. The staging thread finishes the copy and the slot when the copy ends."""
    import threading
    import time

    import xxhash

    from kvpool.errors import TransferTimeout

    cpu_peer.fill(5)
    dev = rt.alloc(MiB)
    real_h2d, release, copying = rt.copy_h2d, threading.Event(), threading.Event()

    def hung(dst: int, src: int, n: int) -> None:
        copying.set()
        release.wait(20)
        real_h2d(dst, src, n)

    monkeypatch.setattr(rt, "copy_h2d", hung)
    freed = _count_pinned_frees(rt, monkeypatch)
    eng = _gpu_engine(rt, protocol="tcp", timeout_s=0.3)
    try:
        a = eng.register_local_memory(dev, remote_accessible=False)
        bid = eng.allocate_batch_id(1)
        seg = eng.open_segment(cpu_peer.segment)
        eng.submit_transfer(bid, [TransferRequest(OpCode.READ, a, seg, cpu_peer.addr, MiB)])
        assert copying.wait(10)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="did not finish within 0.3 s"):
            eng.close()
        assert 0.25 < time.monotonic() - t0 < 3
        assert eng.batches.status(bid, 0).state == TransferState.PENDING  # not reported done
        time.sleep(0.2)
        assert freed == []  # the hung copy still reads the pool: not freed under it
    finally:
        release.set()
    assert eng.wait_batch(bid, 10).ok  # the copy was not cut short
    assert xxhash.xxh3_64_hexdigest(dev.read()) == cpu_peer.checksum(0, MiB)
    deadline = time.monotonic() + 10
    while not freed and time.monotonic() < deadline:  # the staging thread frees it as it ends
        time.sleep(0.01)
    assert freed == [eng.staging.pool.base]


def _count_pinned_frees(rt, monkeypatch) -> list[int]:
    """The addresses ``cuMemFreeHost`` is called on through ``rt``'s driver, in order."""
    freed: list[int] = []
    real = rt.driver.free_host

    def free_host(addr: int) -> None:
        freed.append(addr)
        real(addr)

    monkeypatch.setattr(rt.driver, "free_host", free_host)
    return freed


def _staged_once(rt, cpu_peer):
    """A TCP engine that staged one 1 MiB WRITE of GPU memory to ``cpu_peer`` (its pool
    allocated): the engine and the GPU buffer's address."""
    dev = rt.alloc(MiB)
    dev.write(os.urandom(MiB))
    eng = _gpu_engine(rt, protocol="tcp")
    a = eng.register_local_memory(dev, remote_accessible=False)
    assert eng.batch_transfer_sync(cpu_peer.segment, [a], [cpu_peer.addr], [MiB]) == MiB
    return eng, a


def test_double_engine_close_frees_the_staging_pool_and_refuses_later_staging(rt, cpu_peer, monkeypatch):
    """TransferEngine.close frees the pinned staging pool through the driver (cuMemFreeHost), once:
    it stayed allocated until the engine was garbage-collected. A staged submit after close is
    refused (TransferError) instead of staging into the freed pool."""
    import gc

    from kvpool.errors import TransferError
    from kvpool.transfer.transport import WRITE, Requests

    freed = _count_pinned_frees(rt, monkeypatch)
    eng, a = _staged_once(rt, cpu_peer)
    pool = eng.staging.pool
    assert rt.pinned_bytes == pool.size and freed == []
    seg = eng.open_segment(cpu_peer.segment)
    inner, bid = eng._transports[0], eng.allocate_batch_id(1)  # TCP
    eng.close()
    assert pool.freeing is not None
    pool.freeing.join(5)  # on a thread of its own: cuMemFreeHost may wait for the whole device
    assert freed == [pool.base]
    reqs = Requests([WRITE], [a], [seg], [cpu_peer.addr], [MiB])
    with pytest.raises(TransferError, match="closed"):
        eng.staging.submit(inner, bid, reqs)
    gc.collect()
    assert freed == [pool.base]  # not a second time


def test_double_sync_staged_read_behind_moving_copies_waits_and_behind_stopped_ones_times_out(
    rt, cpu_peer, monkeypatch
):
    """A synchronous staged READ whose host-to-device copy waits behind another submit's 16
    copies that finish slowly but steadily (0.1 s each, three times timeout_s together) waits for
    them and lands its bytes: it raised TransferTimeout at twice timeout_s as under a hung stream.
    When the copies then stop (the 9th never finishes until the test lets it), it raises
    TransferTimeout a look after the last copy finished, not before."""
    import threading
    import time

    import xxhash

    from kvpool.errors import TransferTimeout

    cpu_peer.fill(4)
    dev = rt.alloc(MiB)
    real_h2d, release, left = rt.copy_h2d, threading.Event(), [1 << 30]

    def slow(dst: int, src: int, n: int) -> None:  # 0.1 s a copy; none after `left` more
        left[0] -= 1
        if left[0] < 0:
            release.wait(20)
        time.sleep(0.1)
        real_h2d(dst, src, n)

    monkeypatch.setattr(rt, "copy_h2d", slow)
    with _gpu_engine(rt, protocol="tcp", timeout_s=0.5) as eng:
        a = eng.register_local_memory(dev, remote_accessible=False)
        seg = eng.open_segment(cpu_peer.segment)
        bids = []
        try:
            for phase in range(2):
                if phase:
                    left[0] = 8
                base = 17 * phase * 4096
                bids.append(eng.allocate_batch_id(16))
                offs = [base + k * 4096 for k in range(16)]
                reqs = [TransferRequest(OpCode.READ, a + o, seg, cpu_peer.addr + o, 4096) for o in offs]
                eng.submit_transfer(bids[-1], reqs)
                time.sleep(0.05)  # its READs arrived: the staging thread copies them
                t0 = time.monotonic()
                last = base + 16 * 4096
                if not phase:
                    n = eng.transfer_sync(cpu_peer.segment, a + last, cpu_peer.addr + last, 4096, OpCode.READ)
                    assert n == 4096 and time.monotonic() - t0 > 1.4  # it waited for the 16 copies ahead
                    continue
                with pytest.raises(TransferTimeout, match="did not finish within 0.5 s"):
                    eng.transfer_sync(cpu_peer.segment, a + last, cpu_peer.addr + last, 4096, OpCode.READ)
                assert 1.2 < time.monotonic() - t0 < 6  # 8 copies (0.8 s), then a look without one
        finally:
            release.set()
        assert all(eng.wait_batch(b, 20).ok for b in bids)
        deadline = time.monotonic() + 10
        while eng.batches.deferred() and time.monotonic() < deadline:
            time.sleep(0.05)
            eng.free_batch_id(eng.allocate_batch_id(1))  # frees the timed-out call's batch once done
        assert eng.batches.deferred() == 0
        assert xxhash.xxh3_64_hexdigest(dev.read()[: 34 * 4096]) == cpu_peer.checksum(0, 34 * 4096)


def test_double_engine_close_does_not_wait_for_a_pinned_free_that_blocks(rt, cpu_peer, monkeypatch):
    """Freeing the staging pool may wait for the whole device (cuMemFreeHost synchronizes: a GPU
    stream hung elsewhere holds it): TransferEngine.close returns all the same, the pool is given
    back on a thread of its own once the free returns."""
    import threading
    import time

    gate, calls = threading.Event(), []
    real = rt.driver.free_host

    def free_host(addr: int) -> None:
        calls.append(addr)
        gate.wait(20)
        real(addr)

    monkeypatch.setattr(rt.driver, "free_host", free_host)
    eng, a = _staged_once(rt, cpu_peer)
    pool = eng.staging.pool
    t0 = time.monotonic()
    eng.close()
    assert time.monotonic() - t0 < 5  # it returned while the free still waits
    assert pool.freeing is not None and pool.freeing.is_alive()
    gate.set()
    pool.freeing.join(5)
    assert calls == [pool.base] and not pool.freeing.is_alive()
