"""Real-GPU suite (``pytest -m gpu``): the CUDA IPC transport and the store with GPU buffers on a
real CUDA driver, across two processes, byte-exact. No doubles: skipped with a one-line reason
where no CUDA driver sees a GPU (the same logic runs in the CPU suite on the fake driver:
tests/test_cuda_ipc.py, tests/test_gpu_store.py). Run on the GPU machine with the recipe in
docs/gpu.md."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool import OpCode, Store, TransferEngine, _native
from kvpool.errors import RemoteAccessError, TransferError
from kvpool.transfer.cuda_driver import load_driver
from tests.cuda_ipc_peer import Peer

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
SIZE = 64 << 20


def _real_driver():  # noqa: ANN202
    if "fakecuda" in (os.environ.get("KVPOOL_CUDA_DRIVER") or ""):
        return None
    return load_driver()


@pytest.fixture(scope="module")
def drv():  # noqa: ANN201
    d = _real_driver()
    if d is None:
        pytest.skip("no CUDA driver with a GPU on this machine (real-GPU suite)")
    return d


@pytest.fixture
def peer(drv) -> Iterator[Peer]:  # noqa: ANN001
    p = Peer(1, SIZE)
    yield p
    p.close()


def _sha(drv, addr: int, n: int) -> str:  # noqa: ANN001
    buf = bytearray(n)
    drv.memcpy(_native.buffer_address(buf)[0], addr, n)
    return hashlib.sha256(buf).hexdigest()


def _fill(drv, addr: int, n: int, seed: int) -> None:  # noqa: ANN001
    buf = bytearray(n)
    _native.fill_pattern(_native.buffer_address(buf)[0], n, seed)
    drv.memcpy(addr, _native.buffer_address(buf)[0], n)


def test_scattered_blocks_gpu_to_gpu_both_directions(drv, peer: Peer) -> None:  # noqa: ANN001
    with TransferEngine() as eng:
        mine, back = drv.alloc(SIZE, 0), drv.alloc(SIZE, 0)
        eng.register_local_memory(mine, SIZE, location="cuda:0", remote_accessible=False)
        eng.register_local_memory(back, SIZE, location="cuda:0", remote_accessible=False)
        _fill(drv, mine, SIZE, 1)
        h = bytearray(SIZE)  # the source before anything moved (a copy the wrong way changes it)
        drv.memcpy(_native.buffer_address(h)[0], mine, SIZE)
        blk = 32 << 10
        n = SIZE // blk
        perm = np.random.default_rng(0).permutation(n)
        locs = [mine + k * blk for k in range(n)]
        rems = [peer.gpu[0] + int(p) * blk for p in perm]
        assert eng.batch_transfer_sync(peer.name, locs, rems, [blk] * n) == SIZE
        assert eng.batch_transfer_sync(peer.name, [back + k * blk for k in range(n)], rems, [blk] * n,
                                       OpCode.READ) == SIZE  # fmt: skip
        assert _sha(drv, back, SIZE) == _sha(drv, mine, SIZE) == hashlib.sha256(h).hexdigest()
        expect = bytearray(SIZE)
        for k, p in enumerate(perm):
            expect[int(p) * blk : (int(p) + 1) * blk] = h[k * blk : (k + 1) * blk]
        assert peer.ask(f"dump {peer.gpu[0]} {SIZE}") == hashlib.sha256(expect).hexdigest()


def test_gpu_and_peer_host_memory(drv, peer: Peer) -> None:  # noqa: ANN001
    with TransferEngine() as eng:
        g = drv.alloc(SIZE, 0)
        eng.register_local_memory(g, SIZE, location="cuda:0")
        _fill(drv, g, SIZE, 2)
        eng.transfer_sync(peer.name, g, peer.shm, 16 << 20)
        assert peer.ask(f"dump {peer.shm} {16 << 20}") == _sha(drv, g, 16 << 20)
        host = bytearray(1 << 20)
        _native.fill_pattern(_native.buffer_address(host)[0], len(host), 3)
        eng.transfer_sync(peer.name, eng.register_local_memory(host), peer.gpu[0], 1 << 20)
        assert peer.ask(f"dump {peer.gpu[0]} {1 << 20}") == hashlib.sha256(host).hexdigest()


@pytest.mark.parametrize("size", [1 << 20, SIZE])
def test_tcp_gpu_to_gpu_staged_on_both_sides(drv, peer: Peer, size: int) -> None:  # noqa: ANN001
    """protocol='tcp' (no CUDA IPC): our GPU memory is staged through pinned host memory on our
    staging thread (the pointer's context made current there), the peer's C++ server stages its
    GPU region on its own stream, pipelined over 1 MiB halves for the 64 MiB case. Whole ranges
    and scattered blocks, both directions, byte-exact."""
    with TransferEngine(protocol="tcp") as eng:
        mine, back = drv.alloc(size, 0), drv.alloc(size, 0)
        eng.register_local_memory(mine, size, location="cuda:0", remote_accessible=False)
        eng.register_local_memory(back, size, location="cuda:0", remote_accessible=False)
        _fill(drv, mine, size, 5)
        eng.transfer_sync(peer.name, mine, peer.gpu[0], size)
        assert peer.ask(f"dump {peer.gpu[0]} {size}") == _sha(drv, mine, size)
        eng.transfer_sync(peer.name, back, peer.gpu[0], size, OpCode.READ)
        assert _sha(drv, back, size) == _sha(drv, mine, size)
        blk = 32 << 10
        n = size // blk
        perm = np.random.default_rng(1).permutation(n)
        rems = [peer.gpu[0] + int(p) * blk for p in perm]
        _fill(drv, mine, size, 6)
        assert eng.batch_transfer_sync(peer.name, [mine + k * blk for k in range(n)], rems, [blk] * n) == size
        assert eng.batch_transfer_sync(peer.name, [back + k * blk for k in range(n)], rems, [blk] * n,
                                       OpCode.READ) == size  # fmt: skip
        assert _sha(drv, back, size) == _sha(drv, mine, size)


def test_tcp_host_memory_to_and_from_a_peer_gpu(drv, peer: Peer) -> None:  # noqa: ANN001
    """protocol='tcp', host memory here: only the peer's server stages (H2D for a WRITE into its
    GPU region, D2H for a READ of it)."""
    with TransferEngine(protocol="tcp") as eng:
        host = bytearray(8 << 20)
        got = bytearray(8 << 20)
        _native.fill_pattern(_native.buffer_address(host)[0], len(host), 7)
        eng.transfer_sync(peer.name, eng.register_local_memory(host), peer.gpu[0] + 4096, len(host))
        assert peer.ask(f"dump {peer.gpu[0] + 4096} {len(host)}") == hashlib.sha256(host).hexdigest()
        eng.transfer_sync(
            peer.name, eng.register_local_memory(got), peer.gpu[0] + 4096, len(got), OpCode.READ
        )
        assert got == host


def test_unregistered_gpu_target_refused(drv, peer: Peer) -> None:  # noqa: ANN001
    with TransferEngine() as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)
        assert peer.ask(f"unregister {peer.gpu[0]}") == "ok"
        with pytest.raises((RemoteAccessError, TransferError)):
            eng.transfer_sync(peer.name, g, peer.gpu[0], 4096)


def test_store_get_into_gpu(drv) -> None:  # noqa: ANN001
    from kvpool.store.procs import MasterProcess, StorageProcess

    with MasterProcess() as m, StorageProcess(m.address, 256 << 20):
        st = Store.connect(master=m.address, segment_size=0)
        try:
            src, dst = drv.alloc(8 << 20, 0), drv.alloc(8 << 20, 0)
            st.register_buffer(src, 8 << 20, location="cuda:0")
            st.register_buffer(dst, 8 << 20, location="cuda:0")
            _fill(drv, src, 8 << 20, 4)
            for size in (4096, 1 << 20, 8 << 20):
                st.put_from(f"k{size}", src, size)
                assert st.get_into(f"k{size}", dst, size) == size
                assert _sha(drv, dst, size) == _sha(drv, src, size)
        finally:
            st.remove_all()
            st.close()


def test_torch_tensors_inside_one_allocation(drv) -> None:  # noqa: ANN001
    """vLLM/SGLang register torch tensors: the caching allocator hands out slices of one cudaMalloc
    block, so a registered tensor rarely starts at its allocation's base (the IPC handle is the
    block's; the offset must be applied on the other side). Both sides torch, both directions."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    size = 8 << 20
    p = Peer(2, size, env=dict(os.environ, KVPOOL_TEST_PEER_ALLOC="torch"))
    try:
        with TransferEngine() as eng:
            big = torch.randint(0, 256, (2 * size + 8192,), dtype=torch.uint8, device="cuda:0")
            t = big[8192:]
            back = torch.zeros(2 * size, dtype=torch.uint8, device="cuda:0")
            eng.register_local_memory(t)
            eng.register_local_memory(back)
            a, b = t.data_ptr(), back.data_ptr()
            pairs = [p.gpu[1], p.gpu[0]]
            assert eng.batch_transfer_sync(p.name, [a, a + size], pairs, [size, size]) == 2 * size
            h = t.cpu().numpy().tobytes()
            assert p.ask(f"dump {p.gpu[1]} {size}") == hashlib.sha256(h[:size]).hexdigest()
            assert p.ask(f"dump {p.gpu[0]} {size}") == hashlib.sha256(h[size:]).hexdigest()
            eng.batch_transfer_sync(p.name, [b, b + size], [p.gpu[1], p.gpu[0]], [size, size], OpCode.READ)
            assert torch.equal(back, t)
    finally:
        p.close()


def test_owner_killed_mid_traffic_fails_cleanly(drv) -> None:  # noqa: ANN001
    """The target process is SIGKILLed: later transfers to its GPU memory raise a kvpool error (its
    mappings closed), none hangs, and the initiator's own memory stays intact."""
    from kvpool.errors import KvpoolError

    p = Peer(1, SIZE)
    try:
        with TransferEngine(timeout_s=5.0) as eng:
            g = drv.alloc(SIZE, 0)
            eng.register_local_memory(g, SIZE, location="cuda:0", remote_accessible=False)
            _fill(drv, g, SIZE, 9)
            before = _sha(drv, g, SIZE)
            eng.transfer_sync(p.name, g, p.gpu[0], SIZE)
            p.p.kill()
            p.p.wait()
            with pytest.raises(KvpoolError):
                for _ in range(50):  # the death is seen within the engine's peer checks
                    eng.transfer_sync(p.name, g, p.gpu[0], SIZE)
            assert _sha(drv, g, SIZE) == before
    finally:
        p.close()
