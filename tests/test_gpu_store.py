"""The store with GPU buffers, across real processes on the fake CUDA driver: values move between
"device" memory (pointers the CPU cannot touch) and a storage server's segment on this host by
CUDA DMA from/into its shared memory, with the store's header and checksum checks intact."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from kvpool import Store, _native
from kvpool.errors import InvalidArgument
from kvpool.store.procs import MasterProcess, StorageProcess
from kvpool.transfer.cuda_driver import load_driver


@pytest.fixture(scope="module")
def gpu_cluster(fake_driver: str) -> Iterator[tuple[MasterProcess, StorageProcess]]:
    """Master and storage server started with KVPOOL_CUDA_DRIVER naming the fake driver."""
    with MasterProcess() as m, StorageProcess(m.address, 64 << 20) as s:
        yield m, s


def _host(n: int, seed: int) -> bytearray:
    buf = bytearray(n)
    _native.fill_pattern(_native.buffer_address(buf)[0], n, seed)
    return buf


@pytest.mark.parametrize("size", [100, 4096, 65536, 65537, 1 << 20, (3 << 20) + 7])
def test_put_from_and_get_into_gpu_memory(
    gpu_cluster: tuple[MasterProcess, StorageProcess], size: int
) -> None:
    drv = load_driver()
    st = Store.connect(master=gpu_cluster[0].address, segment_size=0, buffer_size=8 << 20)
    try:
        src, dst = drv.alloc(4 << 20, 0), drv.alloc(4 << 20, 1)
        st.register_buffer(src, 4 << 20, location="cuda:0")
        st.register_buffer(dst, 4 << 20, location="cuda:1")
        data = _host(size, size)
        drv.memcpy(src + 8, _native.buffer_address(data)[0], size)
        st.put_from(f"gpu-{size}", src + 8, size)
        assert st.get(f"gpu-{size}") == bytes(data)  # what the pool holds: exactly the GPU bytes
        assert st.get_into(f"gpu-{size}", dst + 16, size) == size
        back = bytearray(size)
        drv.memcpy(_native.buffer_address(back)[0], dst + 16, size)
        assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
        with pytest.raises(InvalidArgument, match="too small"):
            st.get_into(f"gpu-{size}", dst, size - 1)  # exact sizes: a short GPU buffer is refused
        if size > 65536:  # big values go by DMA straight between the GPU and the segment: no staging
            assert st.engine.staging.pool_if_made is None
    finally:
        st.remove_all()
        st.close()


def test_batch_gpu_put_get(gpu_cluster: tuple[MasterProcess, StorageProcess]) -> None:
    drv = load_driver()
    st = Store.connect(master=gpu_cluster[0].address, segment_size=0, buffer_size=8 << 20)
    try:
        n, blk = 32, 32 << 10
        src, dst = drv.alloc(n * blk, 0), drv.alloc(n * blk, 0)
        st.register_buffer(src, n * blk, location="cuda:0")
        st.register_buffer(dst, n * blk, location="cuda:0")
        data = _host(n * blk, 9)
        drv.memcpy(src, _native.buffer_address(data)[0], n * blk)
        keys = [f"blk-{k}" for k in range(n)]
        assert st.batch_put_from(keys, [src + k * blk for k in range(n)], [blk] * n) == [None] * n
        order = list(reversed(range(n)))  # scattered on the way back
        got = st.batch_get_into([keys[k] for k in order], [dst + i * blk for i in range(n)], [blk] * n)
        assert got == [blk] * n
        back = bytearray(n * blk)
        drv.memcpy(_native.buffer_address(back)[0], dst, n * blk)
        for i, k in enumerate(order):
            assert back[i * blk : (i + 1) * blk] == data[k * blk : (k + 1) * blk]
    finally:
        st.remove_all()
        st.close()


def test_batch_gpu_get_under_a_hung_stream_ends_at_the_timeout(
    gpu_cluster: tuple[MasterProcess, StorageProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched get into GPU memory whose CUDA IPC run never finishes (a hung stream: its event
    does not complete until the test lets it) ends about ``transfer_timeout_s`` later with a
    typed error; the data path waited for the stream forever."""
    import threading
    import time

    from kvpool.errors import KvpoolError
    from kvpool.transfer.cuda_ipc import CudaIpcTransport

    drv = load_driver()
    st = Store.connect(
        master=gpu_cluster[0].address, segment_size=0, buffer_size=8 << 20, transfer_timeout_s=0.5
    )
    release = threading.Event()
    try:
        n, blk = 4, 1 << 20  # big values: DMA between the GPU and the segment (small ones are staged)
        src, dst = drv.alloc(n * blk, 0), drv.alloc(n * blk, 0)
        st.register_buffer(src, n * blk, location="cuda:0")
        st.register_buffer(dst, n * blk, location="cuda:0")
        keys = [f"hung-{k}" for k in range(n)]
        assert st.batch_put_from(keys, [src + k * blk for k in range(n)], [blk] * n) == [None] * n
        ipc = next(t for t in st.engine._transports if isinstance(t, CudaIpcTransport))
        real_sync = ipc.driver.event_sync

        def hung(event: int) -> None:
            release.wait(20)  # the old code waited here until the test let it go
            real_sync(event)

        monkeypatch.setattr(ipc.driver, "event_sync", hung)
        t0 = time.monotonic()
        try:
            got = st.batch_get_into(keys, [dst + k * blk for k in range(n)], [blk] * n)
        except KvpoolError:
            got = None
        assert time.monotonic() - t0 < 8
        assert got is None or all(g != blk for g in got), got  # nothing reported read
    finally:
        release.set()
        st.remove_all()
        st.close()
