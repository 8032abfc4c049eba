"""The store with GPU buffers, across real processes on the fake CUDA driver: values move between
"device" memory (pointers the CPU cannot touch) and a storage server's segment on this host by
CUDA DMA from/into its shared memory, with the store's header and checksum checks intact."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from typing import Any

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
    import time

    from kvpool.errors import KvpoolError

    drv = load_driver()
    st = Store.connect(
        master=gpu_cluster[0].address, segment_size=0, buffer_size=8 << 20, transfer_timeout_s=0.5
    )
    release = _StreamStop()
    try:
        n, blk = 4, 1 << 20  # big values: DMA between the GPU and the segment (small ones are staged)
        src, dst = drv.alloc(n * blk, 0), drv.alloc(n * blk, 0)
        st.register_buffer(src, n * blk, location="cuda:0")
        st.register_buffer(dst, n * blk, location="cuda:0")
        keys = [f"hung-{k}" for k in range(n)]
        assert st.batch_put_from(keys, [src + k * blk for k in range(n)], [blk] * n) == [None] * n
        release.stop(st)  # the old code waited for the stream until the test let it go
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


class _StreamStop:
    """The CUDA IPC stream of a store's engine stops (:meth:`stop`): no run completes until
    :meth:`set` (fakecuda.SyncHold); ``set`` before ``stop`` does nothing (a test's finally)."""

    def __init__(self) -> None:
        self.hold: Any = None

    def stop(self, st: Store) -> None:
        from kvpool.testing.fakecuda import SyncHold
        from kvpool.transfer.cuda_ipc import CudaIpcTransport

        ipc = next(t for t in st.engine._transports if isinstance(t, CudaIpcTransport))
        self.hold = SyncHold(ipc.driver)

    def set(self) -> None:
        if self.hold is not None:
            self.hold.set()

    def landed(self) -> int:
        """Runs completed since the stream stopped."""
        return self.hold.landed()

    def first_landed_at(self) -> float:
        t = self.hold.first_landed_at()
        assert t is not None, "no run completed"
        return t


class _CudaArray:
    """A ``__cuda_array_interface__`` object over (fake-driver) GPU memory: registered by the store
    for one call only."""

    def __init__(self, addr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (addr, False), "version": 3}


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("registered", [True, False])
def test_a_gpu_get_whose_copies_outlive_the_timeout_raises_its_batch(
    gpu_cluster: tuple[MasterProcess, StorageProcess],
    monkeypatch: pytest.MonkeyPatch,
    n: int,
    registered: bool,
) -> None:
    """A get into GPU memory (one object: read in this thread; four: one batch) whose copies do
    not finish (a hung stream) raises the engine's TransferTimeout with its ``batch_id``: the
    caller can tell when the late copies into its memory ended (``batch_settled``). A single
    read swallowed it into a TransferError naming no batch (and would fail over to another
    replica, into the same memory, while the late copy could still land there). Into memory the
    get registered for the call alone, the unregister's RegistrationError (the copies may still
    land) was raised over it, the batch lost."""
    import time

    from kvpool.errors import TransferTimeout

    drv = load_driver()
    st = Store.connect(
        master=gpu_cluster[0].address, segment_size=0, buffer_size=8 << 20, transfer_timeout_s=0.5
    )
    release = _StreamStop()
    try:
        blk = 1 << 20  # big values: DMA between the GPU and the segment
        src, dst = drv.alloc(n * blk, 0), drv.alloc(n * blk, 0)
        st.register_buffer(src, n * blk, location="cuda:0")
        if registered:
            st.register_buffer(dst, n * blk, location="cuda:0")
        dests: list[Any] = [dst + k * blk if registered else _CudaArray(dst + k * blk, blk) for k in range(n)]
        data = _host(n * blk, 5)
        drv.memcpy(src, _native.buffer_address(data)[0], n * blk)
        keys = [f"late-get-{n}-{registered}-{k}" for k in range(n)]
        assert st.batch_put_from(keys, [src + k * blk for k in range(n)], [blk] * n) == [None] * n
        release.stop(st)
        with pytest.raises(TransferTimeout) as ei:
            if n == 1:
                st.get_into(keys[0], dests[0], blk)
            else:
                st.batch_get_into(keys, dests, [blk] * n)
        bid = ei.value.batch_id
        assert bid is not None and not st.engine.batch_settled(bid) and not release.landed()
        release.set()
        deadline = time.monotonic() + 20
        while not st.engine.batch_settled(bid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.engine.batch_settled(bid) and release.landed()  # the copies ended, then it said so
        back = bytearray(n * blk)
        drv.memcpy(_native.buffer_address(back)[0], dst, n * blk)
        assert back == data  # the late copies landed (the bytes the caller must not have trusted)
    finally:
        release.set()
        st.remove_all()
        st.close()


@pytest.mark.parametrize("n", [1, 4])
def test_a_gpu_get_whose_copies_outlive_the_timeout_ends_its_leases_once_they_ended(
    gpu_cluster: tuple[MasterProcess, StorageProcess], monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """A get into GPU memory whose copies do not finish (a hung stream) raises TransferTimeout;
    its read leases hold (the objects cannot be removed: the late copies still read their
    memory) until the copies ended, then the heartbeat thread ends them: the objects can be
    removed long before the master's 15 s lease deadline. They were never released (held until
    that deadline, keeping the space of every object a timed-out get read)."""
    import time

    from kvpool.errors import ObjectBusy, TransferTimeout

    drv = load_driver()
    st = Store.connect(master=gpu_cluster[0].address, segment_size=0, buffer_size=8 << 20,
                       transfer_timeout_s=0.5, heartbeat_s=0.05, location_cache=0)  # fmt: skip
    w = Store.connect(master=gpu_cluster[0].address, segment_size=0, buffer_size=8 << 20)
    release = _StreamStop()
    try:
        blk = 1 << 20  # big values: DMA between the GPU and the segment
        src, dst = drv.alloc(n * blk, 0), drv.alloc(n * blk, 0)
        st.register_buffer(src, n * blk, location="cuda:0")
        st.register_buffer(dst, n * blk, location="cuda:0")
        keys = [f"late-lease-{n}-{k}" for k in range(n)]
        assert st.batch_put_from(keys, [src + k * blk for k in range(n)], [blk] * n) == [None] * n
        assert w._lease_s >= 10  # the master's lease deadline is far off
        release.stop(st)
        with pytest.raises(TransferTimeout) as ei:
            if n == 1:
                st.get_into(keys[0], dst, blk)
            else:
                st.batch_get_into(keys, [dst + k * blk for k in range(n)], [blk] * n)
        t0 = time.monotonic()
        bid = ei.value.batch_id
        assert bid is not None
        time.sleep(0.3)  # several heartbeats while the copies still run: the leases hold
        assert not st.engine.batch_settled(bid) and not release.landed()
        for k in keys:
            with pytest.raises(ObjectBusy):
                w.remove(k)
        release.set()
        left = list(keys)
        while left and time.monotonic() < t0 + 8:
            try:
                w.remove(left[0])
                left.pop(0)
            except ObjectBusy:
                time.sleep(0.05)
        assert not left and release.landed()  # ended once the copies had, well before the lease deadline
        assert st.batch_exists(keys) == [False] * n
    finally:
        release.set()
        w.close()
        st.remove_all()
        st.close()


@pytest.mark.parametrize("how", ["one", "batch", "reserved"])
def test_a_gpu_put_whose_read_outlives_the_timeout_is_never_committed(
    gpu_cluster: tuple[MasterProcess, StorageProcess], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A put from GPU memory (one object, a batch, a batch into reservations) whose copies do not
    finish (a hung stream) raises the engine's TransferTimeout with its ``batch_id``; no key is
    committed, and its allocations stay in the client's write floor until the copies ended (the
    master reuses their fenced space only above the floor: a late copy never lands in another
    object). They were ended at once (the floor passed them while the GPU could still write
    there), and a single put raised a TransferError naming no batch."""
    import time

    from kvpool.errors import TransferTimeout

    drv = load_driver()
    st = Store.connect(
        master=gpu_cluster[0].address, segment_size=0, buffer_size=8 << 20, transfer_timeout_s=0.5
    )
    release = _StreamStop()
    try:
        n, blk = (1 if how == "one" else 4), 128 << 10  # DMA (> 64 KiB); 4 fit a reservation grant
        src = drv.alloc(n * blk, 0)
        st.register_buffer(src, n * blk, location="cuda:0")
        addrs = [src + k * blk for k in range(n)]
        keys = [f"late-put-{how}-{k}" for k in range(n)]
        if how == "reserved":  # a batch put that brings reservations for the next of its shape
            assert st.batch_put_from([f"warm-{k}" for k in keys], addrs, [blk] * n) == [None] * n
            assert len(st._resv.held()) >= n
        held = len(st._resv.held())
        gens: list[int] = []
        real_write = st._data.write

        def write(epoch: int, jobs: list[Any]) -> None:
            gens.extend(j.gen for j in jobs)
            real_write(epoch, jobs)

        monkeypatch.setattr(st._data, "write", write)
        release.stop(st)
        with pytest.raises(TransferTimeout) as ei:
            if how == "one":
                st.put_from(keys[0], src, blk)
            else:
                st.batch_put_from(keys, addrs, [blk] * n)
        bid = ei.value.batch_id
        assert bid is not None and not st.engine.batch_settled(bid)
        assert len(gens) == n and st.batch_exists(keys) == [False] * n  # nothing committed
        if how == "reserved":
            assert len(st._resv.held()) == held - n  # it was written into reservations
        st._writes.floor()  # as the heartbeat does
        assert all(g in st._writes.inflight for g in gens)  # the late writes hold the floor
        release.set()
        deadline = time.monotonic() + 20
        while any(g in st._writes.inflight for g in gens) and time.monotonic() < deadline:
            time.sleep(0.01)
            st._writes.floor()
        # ended once the copies had
        assert not any(g in st._writes.inflight for g in gens) and release.landed()
        assert st.batch_exists(keys) == [False] * n
        assert st.batch_put_from(keys, addrs, [blk] * n) == [None] * n
    finally:
        release.set()
        st.remove_all()
        st.close()


def test_a_late_gpu_put_whose_revoke_failed_is_fenced_by_the_masters_put_timeout(
    fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put from GPU memory whose copies outlive the timeout (a hung stream) and whose
    ``put_revoke`` then fails (the master unreachable for it): the master takes the allocation
    back at its ``put_timeout_s``, fenced. Its space is not reused while the late copy can still
    land there, even well past ``quarantine_s`` (the writer's floor stays below it): another
    put finds no room in the one-object segment. Once the copy landed, the floor passes it and
    the space is reused: the other put stores and reads back its own bytes."""
    import time

    from kvpool.errors import KvpoolError, MasterUnavailable, TransferTimeout

    drv = load_driver()
    blk = 640 << 10  # DMA (> 64 KiB); one fits the 1 MiB segment, two do not
    with (
        MasterProcess(put_timeout_s=1, quarantine_s=1) as m,
        StorageProcess(m.address, 1 << 20, transfer_timeout_s=1),
    ):
        a = Store.connect(master=m.address, segment_size=0, buffer_size=8 << 20, transfer_timeout_s=0.5,
                          heartbeat_s=0.1)  # fmt: skip
        b = Store.connect(master=m.address, segment_size=0, buffer_size=8 << 20, transfer_timeout_s=1)
        release = _StreamStop()
        try:
            src = drv.alloc(blk, 0)
            a.register_buffer(src, blk, location="cuda:0")
            real_call, revokes = a._call, []

            def call(op: str, **args: Any) -> dict[str, Any]:
                if op == "put_revoke":
                    revokes.append(args["items"])
                    raise MasterUnavailable("the master is unreachable (test)")
                return real_call(op, **args)

            monkeypatch.setattr(a, "_call", call)
            release.stop(a)
            with pytest.raises(TransferTimeout) as ei:
                a.put_from("late", src, blk)
            bid = ei.value.batch_id
            assert bid is not None and revokes and revokes[0][0][1] is True  # tried, fenced, failed
            assert b.stats()["pending"] == 1
            t0 = time.monotonic()
            while b.stats()["counters"].get("put_revoked_timeout", 0) < 1 and time.monotonic() < t0 + 10:
                time.sleep(0.1)
            time.sleep(2.5)  # past quarantine_s and a slow tick: only the writer's floor holds it
            st = b.stats()
            assert st["counters"]["put_revoked_timeout"] == 1 and st["pending"] == 0 and st["fenced"] == 1
            assert not a.engine.batch_settled(bid) and not release.landed()
            with pytest.raises(KvpoolError):
                b.put("other", b"\x55" * blk)  # no room: the fenced space is not handed out
            release.set()
            t0, err = time.monotonic(), None
            while time.monotonic() < t0 + 10:
                try:
                    b.put("other", b"\x55" * blk)
                    break
                except KvpoolError as exc:
                    err = exc
                    time.sleep(0.1)
            else:
                raise AssertionError(f"the fenced space was never reused: {err}")
            assert release.landed() and a.engine.batch_settled(bid)  # the late copy ended before the reuse
            assert b.get("other") == b"\x55" * blk and not b.exists("late")
        finally:
            release.set()
            b.close()
            a.close()


BB, NB = 256 << 10, 8  # store worker tests: bytes per block (big: DMA GPU <-> segment), blocks


def _blocks(g: int, block: int, n: int) -> bytes:
    """The bytes of ``n`` blocks (BB each) from ``block`` of the fake-driver GPU region at ``g``."""
    out = bytearray(n * BB)
    load_driver().memcpy(_native.buffer_address(out)[0], g + block * BB, n * BB)
    return bytes(out)


def _gpu_store_worker(cfg: Any) -> tuple[Any, int]:
    """A vLLM store connector worker (no vLLM model: its config as namespaces) over one region of
    NB blocks of fake-driver GPU memory, its store connected with a 0.5 s transfer timeout;
    (worker, the region's device address). Threads not started."""
    from types import SimpleNamespace

    from kvpool.connectors.vllm.common import Region
    from kvpool.connectors.vllm.store_worker import _StoreWorker

    vc = SimpleNamespace(
        model_config=SimpleNamespace(model="late", dtype="bfloat16"),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        device_config=SimpleNamespace(device_type="cuda"),
    )
    w = _StoreWorker(cfg, vc, SimpleNamespace(num_blocks=NB))
    w.store = Store.connect(master=cfg.master, segment_size=0, buffer_size=8 << 20, transfer_timeout_s=0.5)
    g = load_driver().alloc(NB * BB, 0)
    w.store.register_buffer(g, NB * BB, location="cuda:0")
    w.regions, w.layout = [Region("l0", g, BB, BB, NB)], "fake"
    return w, g


def test_a_store_connector_load_or_save_whose_gpu_copies_outlive_the_timeout_waits_for_them(
    gpu_cluster: tuple[MasterProcess, StorageProcess],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The vLLM store connector's worker, its KV blocks (fake-driver) GPU memory: an asynchronous
    load and a save run while the stream is stopped, and raise TransferTimeout at the timeout
    with their copies still queued. Neither is reported while stopped (the load not finished nor
    its blocks failed: vLLM keeps them allocated and recomputes nothing into them; the save not
    done: vLLM does not free its blocks); once the stream resumed and the copies landed, the
    load is reported finished with its blocks failed (recompute) and the save done, nothing of
    it committed. The old worker reported both at once, and took the save's (and a layer-wise
    save's) timeout for an unreachable master: saves stopped for ``store_retry_s``."""
    import time

    pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.store import KvpoolStoreMetadata

    drv = load_driver()
    bb, nb = BB, NB
    master = gpu_cluster[0].address
    w, g = _gpu_store_worker(VllmConnectorConfig(master=master, transfer_timeout_s=0.5))
    w._start_threads()
    data = _host(nb * bb, 3)
    drv.memcpy(g, _native.buffer_address(data)[0], nb * bb)

    def gpu(block: int, n: int) -> bytes:
        return _blocks(g, block, n)

    def reported() -> tuple[set[str], set[str], set[int]]:
        sent, recvd = w.get_finished()
        return sent or set(), recvd or set(), w.take_load_errors()

    release = _StreamStop()
    try:
        w.start(KvpoolStoreMetadata(saves={"s0": [(0, "late/k0"), (1, "late/k1")]}))
        deadline = time.monotonic() + 20
        while not reported()[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.saved_blocks == 2  # the setup moves bytes
        release.stop(w.store)
        meta = KvpoolStoreMetadata(
            loads={"r1": [(4, "late/k0"), (5, "late/k1")]}, saves={"s1": [(6, "late/k6"), (7, "late/k7")]}
        )
        w.start(meta)
        deadline = time.monotonic() + 20
        while len(w._parked) < 2 and time.monotonic() < deadline:
            assert reported() == (set(), set(), set()), "reported while its copies were still queued"
            time.sleep(0.01)
        assert len(w._parked) == 2, "the load and the save did not time out"
        loads = [
            r.getMessage()
            for r in caplog.records
            if "loading" in r.getMessage() or "load of" in r.getMessage()
        ]
        assert len(loads) == 1 and re.search(r"load of r1 timed out \(batch \d+\)", loads[0]), loads
        time.sleep(0.3)
        assert reported() == (set(), set(), set()) and not release.landed()  # still parked
        assert w._put_layer([(3, "late/k3")], w.regions) == {3}  # a layer-wise save, timed out too
        assert w.breaker.closed()  # a hung GPU stream is no unreachable master: saves go on
        release.set()
        sent: set[str] = set()
        recvd: set[str] = set()
        errors: set[int] = set()
        deadline = time.monotonic() + 20
        while (sent, recvd) != ({"s1"}, {"r1"}) and time.monotonic() < deadline:
            s, r, e = reported()
            assert release.landed() >= len(sent | s) + len(recvd | r), "reported before its copies landed"
            sent, recvd, errors = sent | s, recvd | r, errors | e
            time.sleep(0.01)
        assert (sent, recvd, errors) == ({"s1"}, {"r1"}, {4, 5})  # the load's blocks: recomputed
        assert gpu(4, 2) == gpu(0, 2)  # the late copies landed where vLLM had not reused the blocks
        keys = ["late/k6", "late/k7", "late/k6/fake/l0", "late/k7/fake/l0"]
        assert w.store.batch_exists(keys) == [False] * 4  # the save committed nothing
    finally:
        release.set()
        w.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_an_in_forward_load_whose_gpu_copies_outlive_the_timeout_fails_its_blocks_once_they_ended(
    gpu_cluster: tuple[MasterProcess, StorageProcess],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    layerwise: bool,
) -> None:
    """The vLLM store connector's in-forward loads (``load_async: false``: in ``start_load_kv``,
    or per layer, waited for in ``wait_for_layer_load``), its KV blocks (fake-driver) GPU memory:
    a load runs while the stream is stopped and raises TransferTimeout at the timeout with its
    copies still queued. The hook does not return, nor are the blocks reported failed, while
    stopped (vLLM would recompute into blocks the late copy still writes); once the copies
    landed, it returns with the blocks failed, one warning naming the request. The old worker
    reported them failed and returned at the timeout."""
    import logging
    import threading
    import time

    pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.store import KvpoolStoreMetadata

    drv = load_driver()
    bb, nb = BB, NB
    master, p = gpu_cluster[0].address, f"inforward{int(layerwise)}"
    cfg = VllmConnectorConfig(master=master, transfer_timeout_s=0.5, load_async=False, layerwise=layerwise)
    w, g = _gpu_store_worker(cfg)
    w.layer_loads.set_regions(w.regions)
    w._start_threads()
    data = _host(nb * bb, 5)
    drv.memcpy(g, _native.buffer_address(data)[0], nb * bb)

    def gpu(block: int, n: int) -> bytes:
        return _blocks(g, block, n)

    def forward(meta: KvpoolStoreMetadata) -> None:  # the hooks, in vLLM's order
        w.start(meta)
        if layerwise:
            w.wait_layer_load("l0")

    release = _StreamStop()
    try:
        w.start(KvpoolStoreMetadata(saves={"s0": [(0, f"{p}/k0"), (1, f"{p}/k1")]}))
        deadline = time.monotonic() + 20
        while not w.get_finished()[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.saved_blocks == 2  # the setup moves bytes
        forward(KvpoolStoreMetadata(loads={"r0": [(2, f"{p}/k0"), (3, f"{p}/k1")]}))
        assert w.take_load_errors() == set() and gpu(2, 2) == gpu(0, 2)
        release.stop(w.store)
        caplog.set_level(logging.WARNING, logger="kvpool.connectors.vllm")
        returned: list[float] = []
        hook = threading.Thread(
            target=lambda: (forward(KvpoolStoreMetadata(loads={"r1": [(4, f"{p}/k0"), (5, f"{p}/k1")]})),
                            returned.append(time.monotonic())),
            daemon=True,
        )  # fmt: skip
        hook.start()
        deadline = time.monotonic() + 20
        while not any("r1" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            assert not returned and w.take_load_errors() == set(), "reported while its copies were queued"
            time.sleep(0.01)
        time.sleep(0.5)
        assert not returned and w.take_load_errors() == set() and not release.landed()  # still waiting
        release.set()
        hook.join(20)
        assert returned and release.landed()
        assert release.first_landed_at() <= returned[0]  # it returned once they landed
        assert w.take_load_errors() == {4, 5}  # failed: vLLM recomputes them
        assert gpu(4, 2) == gpu(0, 2)  # the late copies landed where vLLM had not reused the blocks
        # One warning for the event, naming the request and the batch (there were two, the first
        # naming neither).
        waits = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("kvpool")]
        assert len(waits) == 1, [r.getMessage() for r in waits]
        assert "r1" in waits[0].getMessage() and re.search(r"timed out \(batch \d+\)", waits[0].getMessage())
        assert w.store.engine.batches.deferred() == 0
    finally:
        release.set()
        w.close()
