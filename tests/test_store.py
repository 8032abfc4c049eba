"""The distributed store with real processes: master, storage clients and pure clients."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from kvpool import ReplicateConfig, Store, _native
from kvpool.errors import (
    InvalidArgument,
    MasterUnavailable,
    ObjectBusy,
    ObjectCorrupt,
    ObjectExists,
    ObjectNotFound,
    ProtocolError,
    RegistrationError,
    StoreError,
    StoreFull,
)
from kvpool.store.master import Master
from kvpool.store.procs import MasterProcess, StorageProcess, free_port


def pattern(n: int, seed: int) -> bytes:
    buf = bytearray(n)
    if n:
        _native.fill_pattern(_native.buffer_address(buf)[0], n, seed)
    return bytes(buf)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[MasterProcess, StorageProcess]]:
    """A master and one storage client (160 MiB) in their own processes."""
    with MasterProcess() as m, StorageProcess(m.address, 160 << 20) as s:
        yield m, s


@pytest.fixture
def client(cluster: tuple[MasterProcess, StorageProcess]) -> Iterator[Store]:
    """A pure client (contributes nothing)."""
    st = Store.connect(master=cluster[0].address, segment_size=0, buffer_size=8 << 20)
    yield st
    st.remove_all()
    st.close()


SIZES = [1, 100, 4096, 65537, 1 << 20, (8 << 20) + 5, 64 << 20]


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"{n}B")
def test_put_get_integrity(client: Store, size: int) -> None:
    value = pattern(size, size)
    key = f"integrity-{size}"
    client.put(key, value)
    assert client.exists(key) and client.size(key) == size
    assert client.get(key) == value
    buf = bytearray(size + 10)
    assert client.get_into(key, buf) == size
    assert bytes(buf[:size]) == value
    client.remove(key)  # our read leases ended with the reads
    assert not client.exists(key)


def test_missing_keys_and_typed_errors(client: Store) -> None:
    with pytest.raises(ObjectNotFound):
        client.get("never-put")
    assert client.exists("never-put") is False
    with pytest.raises(ObjectNotFound):
        client.remove("never-put")
    client.put("once", b"v1")
    with pytest.raises(ObjectExists):
        client.put("once", b"v2")
    assert client.get("once") == b"v1"  # immutable: the second put changed nothing
    with pytest.raises(InvalidArgument):
        client.put("empty", b"")
    with pytest.raises(InvalidArgument):
        client.put("", b"x")
    with pytest.raises(InvalidArgument):
        client.get_into("once", bytearray(1))  # buffer too small
    with pytest.raises(InvalidArgument):
        client.put("cfg", b"x", ReplicateConfig(cache_class="bogus"))


def test_batch_operations_return_per_key_results(client: Store) -> None:
    keys = [f"b{i}" for i in range(50)]
    values = [pattern(1000 + i, i) for i in range(50)]
    assert client.batch_put(keys, values) == [None] * 50
    res = client.batch_put(["b0", "fresh"], [b"dup", b"new"])
    assert isinstance(res[0], ObjectExists) and res[1] is None
    got = client.batch_get([*keys, "nope"])
    assert got[:50] == values and got[50] is None
    assert client.batch_exists(["b1", "nope", "fresh"]) == [True, False, True]
    bufs = [bytearray(2000) for _ in range(3)]
    out = client.batch_get_into(["b1", "nope", "b2"], bufs, [2000] * 3)
    assert out[0] == 1001 and isinstance(out[1], ObjectNotFound) and out[2] == 1002
    assert bytes(bufs[2][:1002]) == values[2]
    # put_from / get_into from registered memory, no staging copy.
    src = bytearray(pattern(4096, 9))
    addr = client.register_buffer(src)
    assert client.batch_put_from(["pf1", "pf2"], [addr, addr + 1024], [1024, 2048]) == [None, None]
    assert client.get("pf2") == bytes(src[1024:3072])
    client.unregister_buffer(addr)


def test_a_big_value_registered_elsewhere_is_put_through_a_copy(client: Store) -> None:
    """A big put moves the value from where it is, registered for that call only; when its range
    is registered already (e.g. another thread is putting the same bytes object), the value is
    copied into staging instead: the put succeeds with the right bytes and the other
    registration is left as it was."""
    value = pattern(1 << 20, 77)
    addr = _native.buffer_address(value, True)[0]
    client.engine.register_local_memory(addr, len(value))
    try:
        client.put("held-elsewhere", value)
        assert client.get("held-elsewhere") == value
        with pytest.raises(RegistrationError):  # still registered: the put did not undo it
            client.engine.register_local_memory(addr, len(value))
    finally:
        client.engine.unregister_local_memory(addr)
    client.put("held-elsewhere-2", value)  # in place again
    assert client.get("held-elsewhere-2") == value


def test_concurrent_puts_of_one_key_have_exactly_one_outcome(
    cluster: tuple[MasterProcess, StorageProcess],
) -> None:
    clients = [Store.connect(master=cluster[0].address, segment_size=0) for _ in range(4)]
    try:
        for rnd in range(5):
            key = f"race-{rnd}"
            values = [pattern(256 << 10, 100 * rnd + i) for i in range(8)]
            outcome: list[object] = [None] * 8
            barrier = threading.Barrier(8)

            def worker(
                i: int,
                key: str = key,
                values: list[bytes] = values,
                outcome: list[object] = outcome,
                barrier: threading.Barrier = barrier,
            ) -> None:
                barrier.wait()
                try:
                    clients[i % 4].put(key, values[i])
                    outcome[i] = "ok"
                except ObjectExists:
                    outcome[i] = "exists"

            ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            assert outcome.count("ok") == 1 and outcome.count("exists") == 7, outcome
            assert clients[0].get(key) == values[outcome.index("ok")]  # never a torn mix
    finally:
        for c in clients:
            c.close()


def test_leased_and_uncommitted_objects_survive_eviction() -> None:
    with MasterProcess(eviction_high_watermark=0.7, eviction_ratio=0.3, lease_ttl_ms=30000) as m:
        with StorageProcess(m.address, 16 << 20), Store.connect(master=m.address, segment_size=0) as st:
            leased = pattern(1 << 20, 1)
            st.put("leased", leased)
            # A reader in the middle of its read: lease taken, not yet released (raw RPC).
            st._call("get", client=st.client_id, keys=["leased"])
            # An uncommitted put: allocated, never committed (we drive the two-phase RPC by hand).
            r = st._rpc.call("put_start", client=st.client_id, keys=["pending"], sizes=[1 << 20], config={})
            pending_addr = r["results"][0][1][2][0][1]  # [gen, checksum required, [[segment, addr]]]
            for i in range(60):  # 60 MiB through a 16 MiB pool: eviction must run many times
                st.put(f"filler-{i}", pattern(1 << 20, 10 + i))
            stats = st.stats()
            assert stats["counters"]["evictions"] > 0
            assert st.get("leased") == leased
            info = st.info("pending")
            assert info["committed"] is False and info["replicas"][0][1] == pending_addr
            # Nothing else was placed over the pending object's range.
            for key in [f"filler-{i}" for i in range(60)]:
                if st.exists(key):
                    a = st.info(key)["replicas"][0][1]
                    assert a + (1 << 20) <= pending_addr or a >= pending_addr + (1 << 20)
            with pytest.raises(ObjectBusy):
                st.remove("leased")
            st.remove("leased", force=True)


def test_finished_reads_release_their_leases() -> None:
    with MasterProcess(eviction_high_watermark=0.9, eviction_ratio=0.1) as m:
        with StorageProcess(m.address, 1000 * 4096), Store.connect(master=m.address, segment_size=0) as st:
            keys = [f"a{i}" for i in range(900)]
            assert st.batch_put(keys, [b"x" * 4096] * 900) == [None] * 900
            assert st.batch_get(keys) == [b"x" * 4096] * 900
            errs = st.batch_put([f"b{i}" for i in range(200)], [b"y" * 4096] * 200)
            assert errs == [None] * 200  # the read objects were evictable at once
            assert st.stats()["counters"]["evictions"] >= 100


def test_pool_full_with_pinned_objects_is_store_full() -> None:
    with Store.connect(segment_size=4 << 20, buffer_size=1 << 20) as st:
        cfg = ReplicateConfig(cache_class="persistent")
        for i in range(3):
            st.put(f"p{i}", pattern(1 << 20, i), cfg)
        with pytest.raises(StoreFull):
            for i in range(3, 10):
                st.put(f"p{i}", pattern(1 << 20, i), cfg)
        assert st.get("p0") == pattern(1 << 20, 0)  # persistent objects were never dropped


def test_change_replica_up_and_down_and_survive_sigkill() -> None:
    with MasterProcess(client_ttl_s=1.5) as m, StorageProcess(m.address, 64 << 20) as s1:
        s2 = StorageProcess(m.address, 64 << 20)
        with StorageProcess(m.address, 64 << 20) as s3, Store.connect(master=m.address, segment_size=0) as st:
            values = {f"r{i}": pattern(300_000, i) for i in range(20)}
            for k, v in values.items():
                st.put(k, v, ReplicateConfig(replicas=2))
            for k in values:
                segs = {r[0] for r in st.info(k)["replicas"]}
                assert len(segs) == 2  # replicas on distinct segments
            assert st.change_replica("r0", 3) == 3
            assert {r[0] for r in st.info("r0")["replicas"]} == {s1.segment, s2.segment, s3.segment}
            assert st.change_replica("r1", 1) == 1
            values.pop("r1")
            st.remove("r1", force=True)
            s2.kill()  # SIGKILL a storage client holding replicas
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(
                s2.segment in {r[0] for r in st.info(k)["replicas"]} for k in values
            ):
                time.sleep(0.2)
            for k, v in values.items():  # every object still readable from its other replica
                assert st.get(k) == v, k
                assert s2.segment not in {r[0] for r in st.info(k)["replicas"]}
        s2.close()


@pytest.mark.parametrize(
    "edit",
    [
        {"size": 1 << 62},  # a corrupt size: would be mapped as a staging buffer
        {"size": 3},  # shorter than the header
        {"src": ["seg", -1]},
        {"dst": [["seg", "0x10"]]},
        {"epoch": "1"},
        {"dst": "all"},
    ],
)
def test_a_malformed_replica_plan_from_the_master_is_refused_before_any_copy(
    edit: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """change_replica acts on the master's replica_start answer (what to read where, how many
    bytes, where to write): a malformed one raises ProtocolError before anything is read or
    written (not OverflowError/MemoryError from the staging buffer, not a copy to a bad place)."""
    with MasterProcess() as m, StorageProcess(m.address, 32 << 20), StorageProcess(m.address, 32 << 20):
        with Store.connect(master=m.address, segment_size=0) as st:
            st.put("k", pattern(100_000, 1))
            real = st._call

            def call(op: str, **kw: object) -> object:
                r = real(op, **kw)
                if op == "replica_start":
                    r = {**r, **edit}
                return r

            monkeypatch.setattr(st, "_call", call)
            copies = []
            monkeypatch.setattr(st, "_copy", lambda *a: copies.append(a) or [True])
            with pytest.raises(ProtocolError, match="replica_start"):
                st.change_replica("k", 2)
            assert copies == []
            monkeypatch.setattr(st, "_call", real)
            assert st.get("k") == pattern(100_000, 1)


def test_master_killed_mid_put_then_clients_recover() -> None:
    port = free_port()
    m = MasterProcess(port=port)
    with StorageProcess(m.address, 32 << 20, heartbeat_s=0.2) as sp:
        st = Store.connect(master=m.address, segment_size=0, rpc_timeout_s=1.0, heartbeat_s=0.2)
        try:
            st.put("before", b"x" * 1000)
            stop = threading.Event()
            errors: list[BaseException] = []

            def putter() -> None:
                i = 0
                while not stop.is_set():
                    try:
                        st.put(f"during-{i}", pattern(64 << 10, i))
                    except MasterUnavailable as exc:
                        errors.append(exc)
                    except Exception as exc:  # noqa: BLE001
                        errors.append(exc)
                    i += 1

            t = threading.Thread(target=putter)
            t.start()
            time.sleep(0.3)
            m.kill()
            time.sleep(1.5)
            stop.set()
            t.join(10)
            assert errors and all(isinstance(e, MasterUnavailable) for e in errors), errors[:3]
            with pytest.raises(MasterUnavailable):
                st.get("never-put")
            # A small object whose location this client knows is read without the master (checked
            # by its header and checksum in the storage segment, which is still there).
            assert st.get("before") == b"x" * 1000
            m = MasterProcess(port=port)  # a new master on the same address
            deadline = time.monotonic() + 10
            while True:  # the storage client re-registers and re-mounts by itself
                try:
                    st.put("after", b"y" * 1000)
                    break
                except (MasterUnavailable, StoreFull):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert st.get("after") == b"y" * 1000
            assert sp.segment in st.stats()["segments"]
            with pytest.raises(ObjectNotFound):
                st.get("before")  # metadata died with the old master
        finally:
            st.close()
            m.close()


def test_small_puts_use_reservations_which_close_returns(
    cluster: tuple[MasterProcess, StorageProcess],
) -> None:
    with Store.connect(master=cluster[0].address, segment_size=0) as st:
        before = st.stats()["counters"].get("puts", 0)
        for i in range(40):
            st.put(f"resv-{i}", pattern(4096, i))
        stats = st.stats()
        assert stats["counters"]["puts"] - before == 40
        assert stats["pending"] > 0  # unused reservations of this client
        # Pools running low are refilled in the background (`reserve`), not on the put path.
        deadline = time.monotonic() + 5
        while "reserve" not in st.stats()["rpc"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st.stats()["rpc"]["reserve"][0] >= 1
        with pytest.raises(ObjectExists):
            st.put("resv-3", b"x" * 4096)  # a commit on a taken key is refused, the reservation kept
        assert st.get("resv-3") == pattern(4096, 3)
        assert [st.get(f"resv-{i}") for i in range(40)] == [pattern(4096, i) for i in range(40)]
        other = Store.connect(master=cluster[0].address, segment_size=0)
        other.close()
    with Store.connect(master=cluster[0].address, segment_size=0) as st:
        assert st.stats()["pending"] == 0  # closing returned them
        st.remove_all()


def test_equal_sized_batch_puts_commit_through_reservations_in_one_round_trip(
    cluster: tuple[MasterProcess, StorageProcess],
) -> None:
    """A batch of equal-sized values is written into reservations and committed with one `commit`
    that also brings the next batch's reservations; a taken key fails alone; reservations the
    master took back (as it does after put_timeout_s) send their keys the normal way."""
    with Store.connect(master=cluster[0].address, segment_size=0) as st:

        def rpcs() -> dict[str, int]:
            return {
                op: st.stats()["rpc"].get(op, [0])[0] for op in ("put_start", "put_end", "commit", "reserve")
            }

        st.put("taken", b"old" * 1000)
        before = rpcs()
        values = {f"bat-{b}-{j}": pattern(3000, 100 * b + j) for b in range(6) for j in range(32)}
        keys = list(values)
        for b in range(6):
            assert (
                st.batch_put(keys[32 * b : 32 * b + 32], [values[k] for k in keys[32 * b : 32 * b + 32]])
                == [None] * 32
            )
        after = rpcs()
        # The first batch gets its allocations (and the next batch's reservations) with put_start;
        # each later one is written into reservations and committed with one round trip.
        assert after["put_start"] - before["put_start"] == 1 and after["put_end"] - before["put_end"] == 1
        assert after["commit"] - before["commit"] == 5 and after["reserve"] == before["reserve"]
        res = st.batch_put(["b-x0", "taken", "b-x2"], [b"n" * 3000] * 3)
        assert res[0] is None and isinstance(res[1], ObjectExists) and res[2] is None
        assert rpcs()["commit"] == after["commit"] + 1
        # The master takes the held reservations back (written: they stay fenced till the floor).
        held = st._resv.held()
        assert len(held) >= 3
        st._call("put_revoke", items=[[e.gen, True] for e in held], epoch=held[0].epoch)
        late = {f"late-{j}": pattern(3000, 7000 + j) for j in range(3)}
        assert st.batch_put(list(late), list(late.values())) == [None] * 3
        assert rpcs()["put_start"] == after["put_start"] + 1  # their keys went the normal way
        with Store.connect(master=cluster[0].address, segment_size=0) as other:
            for k, v in {**values, **late, "b-x0": b"n" * 3000, "taken": b"old" * 1000}.items():
                assert other.get(k) == v, k
        st.remove_all()


def test_abandoned_put_is_revoked_and_space_freed_once_the_writer_is_done() -> None:
    with Store.connect(segment_size=8 << 20, heartbeat_s=0.1) as st:
        assert st._master is not None
        st._master.config = st._master.config.replace(put_timeout_s=0.3)
        st._master.space.quarantine_s = 0.2
        r = st._rpc.call("put_start", keys=["ghost"], sizes=[4 << 20], config={})
        gen = r["results"][0][1][0]
        st._writes.begin(r["epoch"], [gen])  # as a writer does when the allocation arrives
        assert st.stats()["pending"] == 1
        time.sleep(0.8)
        s = st.stats()
        assert s["pending"] == 0  # revoked after put_timeout_s ...
        assert s["fenced"] == 1 and s["used"] > 4 << 20  # ... but kept while the writer may still write
        st._writes.end(r["epoch"], [gen])  # the writer gave up: its next heartbeat says so
        deadline = time.monotonic() + 5
        while st.stats()["used"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st.stats()["used"] == 0 and st.stats()["fenced"] == 0
        st.put("ghost", b"now it works")
        assert st.get("ghost") == b"now it works"


def test_dead_client_segments_are_unmounted() -> None:
    with (
        MasterProcess(client_ttl_s=1.0) as m,
        Store.connect(master=m.address, segment_size=0, location_cache=0) as st,  # gets ask the master
    ):
        sp = StorageProcess(m.address, 8 << 20)
        st.put("on-dead", b"z" * 100)
        sp.kill()
        deadline = time.monotonic() + 8
        while sp.segment in st.stats()["segments"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sp.segment not in st.stats()["segments"]
        with pytest.raises(ObjectNotFound):
            st.get("on-dead")
        sp.close()


def test_ssd_tier_spill_hit_promote_and_corruption(tmp_path) -> None:
    ssd = tmp_path / "ssd"
    with Store.connect(segment_size=4 << 20, ssd_dir=str(ssd), heartbeat_s=0.1, buffer_size=1 << 20) as st:
        st._master.config = st._master.config.replace(eviction_high_watermark=0.5, eviction_ratio=0.5)
        keep = {f"p{i}": pattern(512 << 10, i) for i in range(4)}
        for k, v in keep.items():
            st.put(k, v, ReplicateConfig(cache_class="persistent"))
        for i in range(8):
            st.put(f"e{i}", pattern(256 << 10, 50 + i), ReplicateConfig(cache_class="ephemeral"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(st.info(k)["ssd"] for k in keep):
            time.sleep(0.1)
        spilled = [k for k in keep if st.info(k)["ssd"]]
        assert spilled, "no persistent object was spilled to the SSD tier"
        files = list(ssd.rglob("*.kvp"))
        assert files
        k = spilled[0]
        # a file of its own per spill (generation and token): no other copy's ever shares its path
        name = os.path.basename(st.info(k)["ssd"])
        assert re.fullmatch(rf"[0-9a-f]{{40}}-{st.info(k)['gen']}-[0-9a-f]{{16}}\.kvp", name), name
        deadline = time.monotonic() + 5
        while st.info(k)["replicas"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert st.info(k)["replicas"] == []  # memory freed after the spill
        assert st.get(k) == keep[k]  # served from SSD, then promoted back to memory
        assert st.info(k)["replicas"], "promotion on hit did not create a memory replica"
        # A corrupt file is a miss, not bad data.
        if len(spilled) > 1:
            k2 = spilled[1]
            deadline = time.monotonic() + 5
            while st.info(k2)["replicas"] and time.monotonic() < deadline:
                time.sleep(0.1)
            path = st.info(k2)["ssd"]
            with open(path, "r+b") as f:
                f.seek(-10, os.SEEK_END)
                f.write(b"XXXXXXXXXX")
            with pytest.raises(ObjectNotFound):
                st.get(k2)


def _ssd_only(st: Store, key: str) -> dict:
    """Put ``key`` (300,000 bytes of pattern 1, persistent), spill it as eviction does and wait
    until its only copy is on SSD; its ``info``."""
    m = st._master
    st.put(key, pattern(300_000, 1), ReplicateConfig(cache_class="persistent"))
    with m._lock:
        m._spill(m.objects[key], m.clients[st.client_id])  # as eviction does
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (st.info(key)["ssd"] is None or st.info(key)["replicas"]):
        time.sleep(0.05)
    info = st.info(key)
    assert info["ssd"] and not info["replicas"]  # SSD only
    return info


def test_an_ssd_only_object_whose_file_is_corrupt_is_let_go_of_and_its_key_can_be_put_again(tmp_path) -> None:
    """A reader on the SSD copy's host finds its file bad: a miss, and the master drops the copy
    (the object with it: no memory replica is left). The key held an object nobody could read:
    ``exists`` said yes and every put of the key was refused (KeyExists) for good."""
    with Store.connect(
        segment_size=4 << 20, ssd_dir=str(tmp_path), heartbeat_s=0.1, promote_on_hit=False
    ) as st:
        info = _ssd_only(st, "k")
        assert st.get("k") == pattern(300_000, 1)
        with open(info["ssd"], "r+b") as f:  # the disk returns other bytes now
            f.seek(-10, os.SEEK_END)
            f.write(b"XXXXXXXXXX")
        with pytest.raises(ObjectNotFound):
            st.get("k")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and st.exists("k"):
            time.sleep(0.05)
        assert not st.exists("k"), "a key whose only copy is unreadable still exists"
        st.put("k", pattern(300_000, 2))
        assert st.get("k") == pattern(300_000, 2)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and os.path.exists(info["ssd"]):
            time.sleep(0.05)
        assert not os.path.exists(info["ssd"])  # the bad file is unlinked


def test_an_ssd_only_object_whose_file_is_missing_is_let_go_of_whoever_reads_it(tmp_path) -> None:
    """The file of an SSD-only object is gone. A reader off the copy's host (its directory may
    not be shared there, so the reader cannot tell) and a reader on it report the miss; the
    copy's client checks the file, finds it missing and reports it, and the master drops the
    object, so that the key can be put again (it stayed for good: exists said yes, every get was
    a miss, every put of the key was refused)."""
    with Store.connect(
        segment_size=4 << 20, ssd_dir=str(tmp_path), heartbeat_s=0.1, promote_on_hit=False
    ) as st:
        m = st._master
        with Store.connect(master=m.address, segment_size=0, heartbeat_s=0.1) as far:
            far.host_id = "another-host"  # a reader on another machine
            for k, reader in (("k1", far), ("k2", st)):
                info = _ssd_only(st, k)
                os.remove(info["ssd"])  # the disk lost it
                with pytest.raises(ObjectNotFound):
                    reader.get(k)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and st.exists(k):
                    time.sleep(0.05)
                assert not st.exists(k), f"{k}: a key whose only copy is gone still exists"
                st.put(k, pattern(300_000, 2))
                assert reader.get(k) == pattern(300_000, 2)


def test_the_file_of_a_spill_whose_object_was_removed_meanwhile_is_removed(tmp_path) -> None:
    """A forced remove while the object spills to the SSD tier: the file the spill writes after
    that belongs to no object and is removed (it stayed on the disk for good)."""
    with Store.connect(segment_size=4 << 20, ssd_dir=str(tmp_path), heartbeat_s=0.1) as st:
        m = st._master
        st.put("k", pattern(300_000, 1), ReplicateConfig(cache_class="persistent"))
        st.put("j", pattern(300_000, 2), ReplicateConfig(cache_class="persistent"))
        with m._lock:  # both spilled (as eviction does), before the client's next heartbeat
            for key in ("k", "j"):
                m._spill(m.objects[key], m.clients[st.client_id])
            paths = {t["key"]: t["path"] for t in m.clients[st.client_id].tasks}
            # k is removed (as a forced remove does) before the spill can have run
            assert m._op_remove({"keys": ["k"], "force": True}, {})["results"] == [[None, None]]
        wait_for_files = time.monotonic() + 10
        while time.monotonic() < wait_for_files and st.info("j")["ssd"] is None:
            time.sleep(0.05)
        assert st.info("j")["ssd"] == paths["j"] and os.path.exists(paths["j"])
        while time.monotonic() < wait_for_files and os.path.exists(paths["k"]):
            time.sleep(0.05)
        assert not os.path.exists(paths["k"]), "the removed object's SSD file was left behind"
        assert sorted(p.name for p in tmp_path.rglob("*.kvp")) == [os.path.basename(paths["j"])]
        assert st.get("j") == pattern(300_000, 2)


def test_a_storage_client_does_not_start_a_task_the_master_gave_up_on(tmp_path) -> None:
    """A spill task past its deadline (the master counted it failed: task_timeout_s) is not run."""
    with Store.connect(segment_size=4 << 20, ssd_dir=str(tmp_path), buffer_size=1 << 20) as st:
        m = st._master
        value = pattern(100_000, 3)
        st.put("k", value)
        with m._lock:  # as eviction does; taken off the queue before a heartbeat hands it out
            m._spill(m.objects["k"], m.clients[st.client_id])
            task = m.clients[st.client_id].tasks.pop()
        late = tmp_path / "late.kvp"
        st._run_task({**task, "task": 10**6, "path": str(late)}, time.monotonic() - 0.1)
        assert not late.exists()
        st._run_task(task, time.monotonic() + 10)
        assert os.path.exists(task["path"]) and st.info("k")["ssd"] == task["path"]
        assert st.get("k") == value


def test_the_file_of_a_spill_that_reports_after_its_task_expired_is_removed(tmp_path) -> None:
    """A spill that ran long (a slow disk) reports after the master gave up on it (task_timeout_s):
    the report counts for nothing, and its file, no object's, is removed (it stayed for good). The
    object's next spill here writes a file of its own, and keeps it."""
    with Store.connect(segment_size=4 << 20, ssd_dir=str(tmp_path), buffer_size=1 << 20) as st:
        m = st._master
        m.config = m.config.replace(task_timeout_s=0.2)
        value = pattern(300_000, 4)
        st.put("k", value, ReplicateConfig(cache_class="persistent"))
        with m._lock:  # as eviction does; taken off the queue before a heartbeat hands it out
            m._spill(m.objects["k"], m.clients[st.client_id])
            late = m.clients[st.client_id].tasks.pop()
        time.sleep(0.3)
        with m._lock:
            m._expire_tasks(time.monotonic())
            assert late["task"] not in m._tasks and m.objects["k"].busy == 0
        st._run_task(late)  # started in time, done too late
        assert m.stats["tasks_late_reports"] == 1 and st.info("k")["ssd"] is None
        assert not os.path.exists(late["path"]), "the file of a spill the master gave up on stayed"
        with m._lock:  # spilled again, to a path of its own
            m._spill(m.objects["k"], m.clients[st.client_id])
            again = m.clients[st.client_id].tasks.pop()
        assert again["path"] != late["path"]
        st._run_task(again)
        assert st.info("k")["ssd"] == again["path"] and os.path.exists(again["path"])
        assert st.get("k") == value


def test_a_task_report_from_an_earlier_master_is_not_taken_for_another_task() -> None:
    """Task ids start again with a restarted master: a storage client finishing a task the earlier
    master handed out must not end the new master's task of the same id (here: commit a hot-key
    copy of "k" into memory that never received it)."""
    m = Master(port=0).start()
    try:
        with (
            Store.connect(master=m.address, segment_size=4 << 20) as a,
            Store.connect(master=m.address, segment_size=4 << 20, heartbeat_s=60) as b,
        ):
            here = ReplicateConfig(preferred_segment=a.segment_name)
            a.put("k", pattern(200_000, 1), here)
            a.put("k2", pattern(200_000, 2), here)
            with m._lock:
                m._replicate(m.objects["k"], 1, time.monotonic())  # a copy of k for b to make
                (task,) = m.clients[b.client_id].tasks  # b's heartbeat has not fetched it yet
            assert task["type"] == "replicate" and task["dst"][0] == b.segment_name
            info = a.info("k2")
            old_master = m.incarnation ^ 2
            stale = {"type": "replicate", "task": task["task"], "epoch": old_master, "key": "k2",
                     "gen": info["gen"], "size": info["size"] + 64, "src": info["replicas"][0][:2],
                     "dst": [b.segment_name, task["dst"][1] + (1 << 20)]}  # fmt: skip
            b._run_task(stale)  # an earlier master's task with the same id ends (its copy went fine)
            assert [r[2] for r in a.info("k")["replicas"]] == [True, False], "k's copy taken as made"
            assert m.stats["tasks_stale_reports"] == 1
            b._run_task(task)  # the real one
            assert [r[2] for r in a.info("k")["replicas"]] == [True, True]
            assert b.get("k") == pattern(200_000, 1)
    finally:
        m.stop()


def test_hot_keys_gain_replicas_and_lose_them_when_cool() -> None:
    opts = {"hot_key_replication": True, "hot_interval_s": 0.3, "hot_window_s": 0.3, "hot_max_replicas": 3}
    with MasterProcess(**opts) as m:
        procs = [StorageProcess(m.address, 16 << 20, heartbeat_s=0.1) for _ in range(3)]
        try:
            with Store.connect(master=m.address, segment_size=0) as st:
                st.put("hot", pattern(100_000, 1))
                st.put("cold", pattern(100_000, 2))
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and sum(r[2] for r in st.info("hot")["replicas"]) < 3:  # noqa: E501
                    for _ in range(20):
                        assert st.get("hot") == pattern(100_000, 1)
                    time.sleep(0.05)
                reps = [r for r in st.info("hot")["replicas"] if r[2]]
                assert len(reps) == 3 and len({r[0] for r in reps}) == 3
                assert len(st.info("cold")["replicas"]) == 1
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and len(st.info("hot")["replicas"]) > 1:
                    time.sleep(0.2)
                assert len(st.info("hot")["replicas"]) == 1
                assert st.get("hot") == pattern(100_000, 1)
        finally:
            for p in procs:
                p.close()


def test_metrics_endpoint() -> None:
    with (
        MasterProcess(metrics_port=0) as m,
        Store.connect(master=m.address, segment_size=2 << 20, location_cache=0) as st,
    ):
        st.put("m1", b"a" * 1000)
        st.get("m1")
        with pytest.raises(ObjectNotFound):
            st.get("m2")
        body = urllib.request.urlopen(f"http://127.0.0.1:{m.info['metrics_port']}/metrics", timeout=5).read()
        text = body.decode()
        assert "kvpool_objects 1.0" in text
        assert "kvpool_hits_total 1.0" in text and "kvpool_misses_total 1.0" in text
        assert "kvpool_segment_used_bytes{segment=" in text
        assert "kvpool_fenced_allocations 0.0" in text and "kvpool_clients_dead_total 0.0" in text
        assert "kvpool_puts_revoked_total 0.0" in text and "kvpool_max_request_seconds " in text
        assert 'kvpool_rpc_calls_total{op="put_start"}' in text


def test_embedded_default_master() -> None:
    with Store.connect() as st:
        st.put("e", b"mbedded")
        assert st.get("e") == b"mbedded"
        assert st.segment_name in st.stats()["segments"]


def test_key_table_same_answers_before_and_after_split() -> None:
    """The master's key table is one dict while small and 64 after SPLIT_AT keys: every lookup
    (one key, many keys, membership, length) answers the same on both sides of the split."""
    import random

    from kvpool.store.objects import KeyTable

    rng = random.Random(7)
    table, ref = KeyTable(), {}
    table.SPLIT_AT = 300  # type: ignore[misc]
    for i in range(5000):
        k = f"k{rng.randrange(800)}"
        if rng.random() < 0.6:
            table[k] = i  # type: ignore[assignment]
            ref[k] = i
        elif k in ref:
            del table[k]
            del ref[k]
        assert (k in table) == (k in ref) and table.get(k) == ref.get(k)
    assert table._mask == KeyTable.SHARDS - 1  # it did split
    assert len(table) == len(ref)
    keys = [f"k{j}" for j in range(900)]
    assert table.get_many(keys) == [ref.get(k) for k in keys]
    assert all(table[k] == v for k, v in ref.items())


def test_key_table_committed_many_matches_a_python_lookup() -> None:
    """``batch_exists`` in C (``KeyTable.committed_many``): True exactly for keys holding a
    committed object, before and after the split; a key that cannot be hashed is a TypeError
    (the master answers INVALID), not a crash."""
    from types import SimpleNamespace

    from kvpool.store.objects import KeyTable

    table = KeyTable()
    table.SPLIT_AT = 200  # type: ignore[misc]
    keys = [f"c{j}" for j in range(600)] + ["", "é"]
    for n in (150, 400):  # below and above SPLIT_AT
        for j in range(n):
            table[f"c{j}"] = SimpleNamespace(committed=j % 3 != 0)  # type: ignore[assignment]
        want = [k in table and table[k].committed for k in keys]
        assert table.committed_many(keys) == want and any(want) and not all(want)
    assert table._mask == KeyTable.SHARDS - 1
    with pytest.raises(TypeError):
        table.committed_many([["not", "hashable"]])


def test_location_cache_entries_round_trip_and_leave_nothing_for_the_gc() -> None:
    """The client's location cache (objects read without asking the master): entries come
    back as remembered (only the replicas written completely), are refused under another master
    epoch or after their TTL, the oldest go past the capacity — and an entry is one packed
    ``bytes`` record, so 20,000 puts leave no objects behind that the garbage collector tracks
    (tuples did: the collector then ran every few batch puts)."""
    import gc
    import time

    from kvpool.store.locations import COMMITTED, LOCAL, SEEN, LocationCache

    cache = LocationCache(capacity=30_000, ttl_s=60.0)
    cache.remember("a", 7, 11, 4096, 99, ["s1", "s3"], [["s1", 1000], ["s2", 2000], ["s3", 3000]])
    loc = cache.get("a", 7)
    assert loc is not None and (loc.epoch, loc.gen, loc.size, loc.csum) == (7, 11, 4096, 99)
    assert loc.replicas == (("s1", 1000), ("s3", 3000))  # s2 was not written: not a replica to read
    assert cache.get("a", 8) is None and cache.get("a", 7) is None  # another master: forgotten
    cache.remember("b", 7, 12, 100, None, ["s1"], [["s1", 5]])  # no checksum: not kept
    cache.remember("c", 7, 13, 100, 5, ["s9"], [["s1", 5]])  # nothing written: not kept
    assert cache.get("b", 7) is None and cache.get("c", 7) is None
    # Big objects without a committed checksum: noted on the first read, the reader's own
    # checksum on the second; a put of the key without a checksum drops the entry.
    cache.remember_read("big", 7, 20, 1 << 20, None, ["s1"], [["s1", 9]])
    assert cache.get("big", 7).kind == SEEN  # type: ignore[union-attr]
    cache.remember_read("big", 7, 20, 1 << 20, 1234, ["s1"], [["s1", 9]])
    big = cache.get("big", 7)
    assert big is not None and (big.csum, big.kind) == (1234, LOCAL)
    cache.remember("big", 7, 21, 1 << 20, None, ["s1"], [["s1", 9]])
    assert cache.get("big", 7) is None
    cache.remember("huge", 7, 22, 8 << 20, 77, ["s1"], [["s1", 9]])  # committed checksum: any size
    assert cache.get("huge", 7).kind == COMMITTED  # type: ignore[union-attr]
    short = LocationCache(capacity=2, ttl_s=0.05)
    short.remember_many(1, [(k, i, 10, 1, ["s"], [["s", i]]) for i, k in enumerate("xyz")])
    assert short.get("x", 1) is None and short.get("y", 1).replicas == (("s", 1),)  # type: ignore[union-attr]
    time.sleep(0.06)
    assert short.get("z", 1) is None  # past its TTL
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for i in range(10_000):
            cache.remember(f"k{i}", 7, i, 4096, i, ["s1"], [["s1", i * 4160]])
        cache.remember_many(7, [(f"m{i}", i, 64, i, ["s1"], [["s1", i]]) for i in range(10_000)])
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert grown < 200, grown
    assert cache.get("k9999", 7).replicas == (("s1", 9999 * 4160),)  # type: ignore[union-attr]


def test_big_objects_read_twice_are_then_read_without_the_master(monkeypatch: pytest.MonkeyPatch) -> None:
    """An object above 64 KiB without a committed checksum: the first get is noted, the second
    (leased, header-checked) gives the reader its own checksum, later gets (get, get_into,
    batch_get) skip the master and are checked against it. Bytes changed in place make the next
    get ask the master again (a read without the master never returns them unchecked); a key
    removed and put again elsewhere is never read at its old place; the reader's own remove
    forgets the location."""
    import ctypes
    import functools

    from kvpool.store.layout import HEADER_SIZE

    size = (256 << 10) + 3
    v1, v2 = pattern(size, 1), pattern(size, 2)
    with (
        Store.connect(segment_size=8 << 20, buffer_size=2 << 20) as a,  # embedded master, segment here
        Store.connect(master=a.master_address, segment_size=0, buffer_size=2 << 20) as b,
    ):
        lookups = []
        orig = b._lookup

        @functools.wraps(orig)
        def counting(keys):  # type: ignore[no-untyped-def]
            lookups.append(list(keys))
            return orig(keys)

        b._lookup = counting  # type: ignore[method-assign]
        a.put("big", v1)
        assert b.get("big") == v1 and b.get("big") == v1
        assert len(lookups) == 2  # read once: only noted; read twice: checksummed by b
        buf = bytearray(size)
        for _ in range(3):
            assert b.get("big") == v1
        assert b.get_into("big", buf) == size and bytes(buf) == v1
        assert b.batch_get(["big"]) == [v1]
        assert len(lookups) == 2, "gets after the second one still asked the master"
        # A get that asks the master anyway reads such an object under its lease (no checksum).
        assert b.batch_get(["big", "nope"]) == [v1, None]
        assert lookups[-1] == ["big", "nope"]

        # A byte of the value changed in place (no committed checksum, so the master cannot
        # tell): b's checksum catches it and b asks the master (which serves what is there).
        seg, addr = a.info("big")["replicas"][0][:2]
        ctypes.memmove(addr + HEADER_SIZE + 1000, b"\xff", 1)
        bad = bytearray(v1)
        bad[1000] = 0xFF
        assert b.get("big") == bytes(bad)
        assert len(lookups) == 4
        ctypes.memmove(addr + HEADER_SIZE + 1000, v1[1000:1001], 1)

        # Removed and put again by another client: b's cached place now holds another object (or
        # nothing): the header check sends b to the master, which names the new place.
        for _ in range(2):
            assert b.get("big") == v1
        n = len(lookups)
        b._flush_releases(b._rpc)  # b's read leases end (a forced remove would hold the space)
        a.remove("big", force=True)
        a.put("filler", v2)  # best fit: likely the freed range
        a.put("big", v2)
        assert a.info("filler")["replicas"][0][1] == addr  # the freed range was reused
        assert b.get("big") == v2
        assert len(lookups) == n + 1

        # b's own remove forgets the place at once.
        for _ in range(2):
            assert b.get("filler") == v2
        b.remove("filler")
        with pytest.raises(ObjectNotFound):
            b.get("filler")

        # Above LOCAL_READ_MAX checksumming costs more than the round trip: always the master.
        import kvpool.store.gets as store_gets

        monkeypatch.setattr(store_gets, "LOCAL_READ_MAX", size - 1)
        n = len(lookups)
        for _ in range(4):
            assert b.get("big") == v2
        assert len(lookups) == n + 4
        a.put("fresh", v1)
        assert b.get("fresh") == v1 and b.get("fresh") == v1
        assert b._loc.get("fresh", b.master_incarnation) is None  # not even noted: no checksum for nothing


def test_an_ssd_sweep_capped_by_file_count_reaches_the_other_files_next_time(tmp_path, monkeypatch) -> None:
    """A directory of more SSD-tier files than one sweep looks at (SWEEP_MAX_FILES, 4 here):
    the first subdirectory's files are all live copies, the second's are nobody's. The next
    sweeps go on from where the capped one stopped and remove those (each sweep looked at the
    same first files again: the others stayed on the disk for good)."""
    from kvpool.store import ssd

    monkeypatch.setattr(ssd, "SWEEP_MAX_FILES", 4)
    old = time.time() - 3600
    known, stray = set(), []
    for sub, names in (("00", known), ("01", None)):
        os.makedirs(tmp_path / sub)
        for i in range(4 if names is not None else 2):
            name = f"{sub}{'0' * 38}-{i}.kvp"
            path = tmp_path / sub / name
            path.write_bytes(b"x")
            os.utime(path, (old, old))
            if names is not None:
                names.add(name)
            else:
                stray.append(path)

    def unknown(names: list[str]) -> tuple[list[str], float]:
        return [n for n in names if n not in known], 60.0

    removed = sum(ssd.sweep_ssd_dir(str(tmp_path), unknown) for _ in range(3))
    assert removed == 2 and not any(p.exists() for p in stray)
    assert sorted(os.listdir(tmp_path / "00")) == sorted(known)  # live copies' files stay


def test_an_ssd_sweep_stops_at_its_time_budget_and_the_next_sweeps_go_on_from_there(tmp_path) -> None:
    """The master is slow to answer a sweep's questions (0.3 s each; an NFS directory is slow to
    stat alike): a sweep of six subdirectories of stray files (one question each) stops about
    at its budget, so that the spills queued behind it on the task thread still start in time;
    the next sweeps go on from where it stopped until every stray file is gone, the live
    copies' files staying (one sweep held the task thread for all six questions, 1.8 s)."""
    from kvpool.store import ssd

    old = time.time() - 3600
    known, stray = set(), []
    for k in range(6):
        sub = f"{k:02x}"
        os.makedirs(tmp_path / sub)
        for i in range(3):
            name = f"{sub}{'0' * 38}-{i}.kvp"
            path = tmp_path / sub / name
            path.write_bytes(b"x")
            os.utime(path, (old, old))
            if i == 0:
                known.add(name)
            else:
                stray.append(path)

    def unknown(names: list[str]) -> tuple[list[str], float]:
        if names:
            time.sleep(0.3)
        return [n for n in names if n not in known], 1.0  # a budget of 0.05 s (a tenth of ~0.5)

    sweeps = 0
    while any(p.exists() for p in stray):
        assert sweeps < 20, "the sweeps did not get through the directory"
        t0 = time.monotonic()
        removed = ssd.sweep_ssd_dir(str(tmp_path), unknown, batch=3)  # the budget the grace gives
        assert time.monotonic() - t0 < 0.9  # one question past the budget, not six
        assert removed >= 1  # each sweep gets on
        sweeps += 1
    assert sweeps >= 3  # a sweep stopped at its budget
    for k in range(6):  # live copies' files stay
        assert os.listdir(tmp_path / f"{k:02x}") == [f"{k:02x}{'0' * 38}-0.kvp"]


def _stray_files(sub_dir, n: int, known_every: int = 0) -> tuple[set[str], list]:
    """``n`` SSD-tier files an hour old in ``sub_dir`` (every ``known_every``-th one a live
    copy's); the live copies' names and the other files' paths."""
    old = time.time() - 3600
    os.makedirs(sub_dir, exist_ok=True)
    known, stray = set(), []
    for i in range(n):
        name = f"{sub_dir.name}{i:038x}-1.kvp"
        (sub_dir / name).write_bytes(b"x")
        os.utime(sub_dir / name, (old, old))
        if known_every and i % known_every == 0:
            known.add(name)
        else:
            stray.append(sub_dir / name)
    return known, stray


def test_an_ssd_sweep_keeps_to_its_budget_in_one_big_subdirectory_of_slow_storage(
    tmp_path, monkeypatch
) -> None:
    """All the stray files are in one subdirectory, on slow storage (a stat takes 20 ms, as on a
    loaded NFS server): a sweep stops about at its budget (0.1 s) in the middle of that
    subdirectory, and the next ones go on from the file it stopped at until every stray file is
    gone, the live copies' files staying. The budget held only past a sweep's first
    subdirectory: the first sweep stat'ed all 60 files (1.2 s on the task thread, the spills
    queued behind it past the master's task_timeout_s)."""
    from kvpool.store import ssd

    known, _ = _stray_files(tmp_path / "00", 60, known_every=5)
    real_lstat, real_stat = os.lstat, os.stat

    def slow(real):
        def stat(path, *a, **kw):
            time.sleep(0.02)
            return real(path, *a, **kw)

        return stat

    monkeypatch.setattr(ssd.os, "lstat", slow(real_lstat))
    monkeypatch.setattr(ssd.os, "stat", slow(real_stat))
    real_scandir = os.scandir

    class SlowEntries:  # an entry's own stat is as slow (what the sweep used before)
        def __init__(self, path):
            self._it = real_scandir(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._it.close()

        def __iter__(self):
            for e in self._it:
                yield SlowEntry(e)

    class SlowEntry:
        def __init__(self, e):
            self._e, self.name, self.path = e, e.name, e.path

        def is_dir(self, **kw):
            return self._e.is_dir(**kw)

        def stat(self, **kw):
            time.sleep(0.02)
            return self._e.stat(**kw)

    monkeypatch.setattr(ssd.os, "scandir", SlowEntries)
    asked: list[int] = []

    def unknown(names: list[str]) -> tuple[list[str], float]:
        asked.append(len(names))
        return [n for n in names if n not in known], 60.0

    sweeps = 0
    while set(os.listdir(tmp_path / "00")) - known:  # (os.stat is the slow one, for everyone)
        assert sweeps < 60, "the sweeps did not get through the directory"
        t0 = time.monotonic()
        removed = ssd.sweep_ssd_dir(str(tmp_path), unknown, budget_s=0.1)
        assert time.monotonic() - t0 < 0.6, "a sweep went on well past its budget"
        assert removed >= 1  # each sweep gets on
        sweeps += 1
    assert sweeps >= 4  # each sweep saw to a part of the subdirectory only
    assert sorted(os.listdir(tmp_path / "00")) == sorted(known)  # live copies' files stay


def test_an_ssd_sweep_stopped_in_a_subdirectory_by_a_slow_master_goes_on_from_there(tmp_path) -> None:
    """One subdirectory of 30 stray files and live copies' files; the master takes 0.2 s a
    question and a question names 4 files: each sweep asks one question past its budget at most
    and the next sweep takes up the subdirectory past the last file seen to, until every stray
    file is gone and the live copies' files stay. The first sweep asked all 10 questions (2 s),
    its first subdirectory being seen to whole whatever its budget."""
    from kvpool.store import ssd

    known, stray = _stray_files(tmp_path / "00", 40, known_every=4)
    _, others = _stray_files(tmp_path / "01", 2)  # the next subdirectory is reached in turn

    def unknown(names: list[str]) -> tuple[list[str], float]:
        if names:
            time.sleep(0.2)
        return [n for n in names if n not in known], 60.0

    sweeps = 0
    while any(p.exists() for p in stray + others):
        assert sweeps < 30, "the sweeps did not get through the directory"
        t0 = time.monotonic()
        assert ssd.sweep_ssd_dir(str(tmp_path), unknown, batch=4, budget_s=0.05) >= 1
        assert time.monotonic() - t0 < 0.5, "more than one question past the budget"
        sweeps += 1
    assert sweeps >= 10
    assert sorted(os.listdir(tmp_path / "00")) == sorted(known)


def test_an_ssd_check_that_cannot_open_the_file_for_lack_of_descriptors_keeps_the_copy(
    tmp_path, monkeypatch
) -> None:
    """The copy's client checks an SSD file a reader could not use, and opening it fails with
    EMFILE (the process is out of file descriptors: the file is fine). The copy is kept, and
    read once descriptors are back (the check reported it corrupt: the master dropped the
    object, its only copy)."""
    import builtins
    import errno

    from kvpool.store import ssd
    from kvpool.store.tasks import run_task

    with Store.connect(
        segment_size=4 << 20, ssd_dir=str(tmp_path), heartbeat_s=0.1, promote_on_hit=False
    ) as st:
        m = st._master
        info = _ssd_only(st, "k")
        with m._lock:
            copy = m.objects["k"].ssd
            task = {"type": "ssd_check", "key": "k", "gen": info["gen"], "path": copy.path, "size": 300_000,
                    "checksum": copy.checksum}  # fmt: skip

        def no_fds(path, *a, **kw):
            if path == copy.path:
                raise OSError(errno.EMFILE, "Too many open files")
            return builtins.open(path, *a, **kw)

        monkeypatch.setattr(ssd, "open", no_fds, raising=False)
        monkeypatch.setattr(ssd, "UNREADABLE_GAP_S", 0.0)
        for _ in range(2 * ssd.UNREADABLE_CHECKS):  # however often: the file may be fine
            run_task(st, task)  # as the task thread runs it
        monkeypatch.undo()
        assert st.exists("k") and st.info("k")["ssd"] == copy.path
        assert st.get("k") == pattern(300_000, 1)


def _ssd_check_task(st: Store, key: str) -> dict:
    """The ssd_check task the master hands ``key``'s SSD copy's client when a reader missed."""
    m = st._master
    with m._lock:
        obj = m.objects[key]
        return {"type": "ssd_check", "key": key, "gen": obj.gen, "path": obj.ssd.path, "size": obj.size,
                "checksum": obj.ssd.checksum}  # fmt: skip


def _deny_reads(monkeypatch, path: str, stat_too: bool = False) -> None:
    """Opening ``path`` fails with EACCES (and so does a stat of it when ``stat_too``: its
    directory not searchable). By its mode when not root; as root, who reads whatever the
    mode, the error is raised at the open (and stat) calls of kvpool.store.ssd."""
    import builtins
    import errno

    from kvpool.store import ssd

    if os.geteuid() != 0 and not stat_too:
        os.chmod(path, 0)
        return

    def denied(p, *a, **kw):
        if str(p) == path:
            raise PermissionError(errno.EACCES, "Permission denied", p)
        return builtins.open(p, *a, **kw)

    monkeypatch.setattr(ssd, "open", denied, raising=False)
    if stat_too:
        real = os.stat

        def stat(p, *a, **kw):
            if str(p) == path:
                raise PermissionError(errno.EACCES, "Permission denied", p)
            return real(p, *a, **kw)

        monkeypatch.setattr(ssd.os, "stat", stat)


def test_an_ssd_file_its_client_cannot_open_on_checks_apart_is_reported_lost(tmp_path, monkeypatch) -> None:
    """An SSD-only object's file can no longer be opened by its client (EACCES: its mode was
    changed; by chmod when not root, injected at the open call as root), the directory fine.
    The checks readers' misses ask for count once per UNREADABLE_GAP_S (0.2 s here): the copy
    is kept until the third such check, then reported, and the master lets go of the object,
    whose key can be put again. It was kept for good: exists said yes, every get was a miss,
    every put of the key was refused."""
    from kvpool.store import ssd
    from kvpool.store.tasks import run_task

    monkeypatch.setattr(ssd, "UNREADABLE_GAP_S", 0.2)
    with Store.connect(
        segment_size=4 << 20, ssd_dir=str(tmp_path), heartbeat_s=0.1, promote_on_hit=False
    ) as st:
        _ssd_only(st, "k")
        task = _ssd_check_task(st, "k")
        _deny_reads(monkeypatch, task["path"])
        for _ in range(ssd.UNREADABLE_CHECKS - 1):
            run_task(st, task)
            run_task(st, task)  # right after: not another count
            assert st.exists("k") and st.info("k")["ssd"] == task["path"]
            time.sleep(0.25)
        run_task(st, task)  # the third check apart: lost
        assert not st.exists("k")
        counters = st._master.stats
        assert counters["ssd_copies_unreadable"] == 1 and counters["ssd_copies_corrupt"] == 0
        st.put("k", b"again")
        assert st.get("k") == b"again"


def test_an_ssd_file_reported_lost_to_an_older_master_is_reported_corrupt(tmp_path, monkeypatch) -> None:
    """A master older than the ``ssd_unreadable`` report ignores that kind (its reply is {}, no
    ``kinds``: the report names no segment of it) and lets go of a copy on ``ssd_corrupt`` only:
    the client reports a file it could not open on checks apart as corrupt to such a master, and
    the copy is let go of there too (else it was kept for good)."""
    from kvpool.store import ssd
    from kvpool.store.tasks import run_task

    monkeypatch.setattr(ssd, "UNREADABLE_GAP_S", 0.0)
    with Store.connect(
        segment_size=4 << 20, ssd_dir=str(tmp_path), heartbeat_s=0.1, promote_on_hit=False
    ) as st:
        m = st._master
        new = m._handlers["report"]
        kinds: list[str] = []

        def older(req: dict, sess: dict) -> dict:
            """_op_report before ssd_unreadable: an unknown kind fell through to the segment
            lookup ("" is no segment's name) and was ignored; every reply was {}."""
            kinds.append(req["kind"])
            if req["kind"] in ("unreachable", "corrupt", "ssd_corrupt", "ssd_missing"):
                new(req, sess)
            return {}

        monkeypatch.setitem(m._handlers, "report", older)
        _ssd_only(st, "k")
        task = _ssd_check_task(st, "k")
        _deny_reads(monkeypatch, task["path"])
        for _ in range(ssd.UNREADABLE_CHECKS):
            run_task(st, task)
        assert kinds == ["ssd_unreadable", "ssd_corrupt"]
        assert not st.exists("k") and m.stats["ssd_copies_corrupt"] == 1
        st.put("k", b"again")
        assert st.get("k") == b"again"


def test_an_ssd_file_unreadable_but_read_in_between_or_in_an_unsearchable_directory_is_kept(
    tmp_path, monkeypatch
) -> None:
    """Opening an SSD file fails with EACCES on checks apart, but a check in between read it
    (the count starts again); and a file whose directory cannot be searched either (a stat of
    it fails too: every copy in it alike, maybe a mount coming back) is never counted: the
    copies are kept and read once the files can be read again."""
    from kvpool.store import ssd
    from kvpool.store.tasks import run_task

    monkeypatch.setattr(ssd, "UNREADABLE_GAP_S", 0.0)
    with Store.connect(
        segment_size=4 << 20, ssd_dir=str(tmp_path), heartbeat_s=0.1, promote_on_hit=False
    ) as st:
        _ssd_only(st, "k")
        task = _ssd_check_task(st, "k")
        for _ in range(3):
            with monkeypatch.context() as mp:
                _deny_reads(mp, task["path"])
                for _ in range(ssd.UNREADABLE_CHECKS - 1):
                    run_task(st, task)
                if os.geteuid() != 0:
                    os.chmod(task["path"], 0o644)
            run_task(st, task)  # read: fine
        with monkeypatch.context() as mp:
            _deny_reads(mp, task["path"], stat_too=True)
            for _ in range(2 * ssd.UNREADABLE_CHECKS):
                run_task(st, task)
        assert st.exists("k") and st.info("k")["ssd"] == task["path"]
        assert st.get("k") == pattern(300_000, 1)


def test_an_ssd_sweep_goes_on_past_a_file_removed_while_it_lists_the_directory(tmp_path, monkeypatch) -> None:
    """A file of the SSD tier is removed between the sweep's listing of its subdirectory and its
    look at it (another client on the directory unlinked it): the sweep goes on with the other
    files of that subdirectory (it gave up on the rest of the subdirectory until the next
    sweep, ssd_sweep_s later)."""
    from kvpool.store import ssd

    old = time.time() - 3600
    os.makedirs(tmp_path / "00")
    paths = []
    for i in range(4):
        p = tmp_path / "00" / f"00{'0' * 38}-{i}.kvp"
        p.write_bytes(b"x")
        os.utime(p, (old, old))
        paths.append(p)
    real = os.scandir

    class Vanishing:  # the first entry listed in a subdirectory is unlinked before it is looked at
        def __init__(self, path: str) -> None:
            self._it = real(path)
            self._first = os.path.basename(path) == "00"

        def __enter__(self) -> Vanishing:
            return self

        def __exit__(self, *exc: object) -> None:
            self._it.close()

        def __iter__(self) -> Vanishing:
            return self

        def __next__(self) -> os.DirEntry[str]:
            e = next(self._it)
            if self._first:
                self._first = False
                os.unlink(e.path)
            return e

    monkeypatch.setattr(ssd.os, "scandir", Vanishing)
    removed = ssd.sweep_ssd_dir(str(tmp_path), lambda names: (list(names), 60.0))
    monkeypatch.undo()
    assert removed == 3 and not any(p.exists() for p in paths)


def test_a_late_unlink_of_a_dropped_ssd_copy_leaves_the_next_copys_file(tmp_path) -> None:
    """Two storage clients on one SSD directory (two servers of a host given the same one). a's
    copy of k is dropped (its file reported bad; k keeps the memory a hit promoted it back into)
    and its unlink handed to a, whose task thread is behind; meanwhile b spills k again. a's
    unlink runs after that spill: b's file, the copy k lives on, stays. The new spill wrote the
    very same path (one per key and generation), so that late unlink removed the new copy's file
    and the SSD-only object could no longer be read."""
    with Store.connect(segment_size=4 << 20, ssd_dir=str(tmp_path), heartbeat_s=60, buffer_size=1 << 20) as a:
        m = a._master
        with Store.connect(master=m.address, segment_size=0, ssd_dir=str(tmp_path), heartbeat_s=60) as b:
            value = pattern(300_000, 6)
            a.put("k", value, ReplicateConfig(cache_class="persistent"))
            with m._lock:  # as eviction does; taken off the queue before a heartbeat hands it out
                m._spill(m.objects["k"], m.clients[a.client_id])
                first = m.clients[a.client_id].tasks.pop()
            a._run_task(first)
            assert a.info("k")["ssd"] == first["path"] and not a.info("k")["replicas"]
            assert a.get("k") == value  # a hit on the SSD tier: promoted back into memory
            assert a.info("k")["replicas"]
            # a reader on the host found a's file bad: the copy is dropped, its unlink handed to a
            a._rpc.call("report", segment="", kind="ssd_corrupt", key="k", gen=first["gen"],
                        path=first["path"])  # fmt: skip
            assert a.info("k")["ssd"] is None and a.info("k")["replicas"]
            with m._lock:
                (unlink,) = [t for t in m.clients[a.client_id].tasks if t["type"] == "unlink"]
                m.clients[a.client_id].tasks.remove(unlink)  # a's task thread runs it later
                m._spill(m.objects["k"], m.clients[b.client_id])  # k spilled again, by b
                again = m.clients[b.client_id].tasks.pop()
            b._run_task(again)
            assert a.info("k")["ssd"] == again["path"] and not a.info("k")["replicas"]  # SSD only
            a._run_task(unlink)  # the old copy's unlink, late
            assert unlink["path"] == first["path"] and os.path.exists(again["path"])
            assert a.info("k")["ssd"] == again["path"]
            assert a.get("k") == value


def test_the_sweep_knows_the_ssd_file_names_of_this_version_and_the_one_before(tmp_path) -> None:
    """The sweep looks at the files a spill names now (``<sha1>-<gen>-<token>.kvp``), at those
    of the naming before it (``<sha1>-<gen>.kvp``, still on disks written by an earlier
    version) and at the temporary files of both; other names are left alone."""
    from kvpool.store.ssd import sweep_ssd_dir

    sub = tmp_path / "ab"
    sub.mkdir()
    digest, tmp = "ab" * 20, "0" * 32
    ours = [f"{digest}-7-0123456789abcdef.kvp", f"{digest}-7.kvp"]
    ours += [f"{n}.{tmp}.tmp" for n in ours]
    others = ["notes.txt", f"{digest}-7-xyz.kvp", f"{digest}-7-0123456789abcdef.kvp.bak", f"{digest}.kvp"]
    for n in ours + others:
        (sub / n).write_bytes(b"x")
        os.utime(sub / n, (time.time() - 60, time.time() - 60))
    asked: list[str] = []

    def unknown(names: list[str]) -> tuple[list[str], float]:
        asked.extend(names)
        return names, 10.0

    assert sweep_ssd_dir(str(tmp_path), unknown) == len(ours)
    assert sorted(asked) == sorted(ours[:2])  # a temporary file is asked about by its file's name
    assert sorted(p.name for p in sub.iterdir()) == sorted(others)


def test_an_ssd_sweep_leaves_the_temporary_file_of_a_spill_in_flight_whatever_its_age(tmp_path) -> None:
    """Two clients share an SSD directory, their clocks apart: b's spill of k is writing its
    temporary file, whose time by a's clock is an hour back, when a sweeps the directory. The
    master has that spill in flight: its temporary file stays, and the spill lands (the sweep
    removed any temporary file older than the grace by its time alone, and b's spill lost its
    file). The temporary file of a spill the master no longer has in flight (a write killed
    midway) is removed."""
    from kvpool.store.tasks import run_task

    with Store.connect(segment_size=4 << 20, ssd_dir=str(tmp_path), heartbeat_s=60) as a:
        m = a._master
        with Store.connect(master=m.address, segment_size=0, ssd_dir=str(tmp_path), heartbeat_s=60) as b:
            value = pattern(300_000, 6)
            a.put("k", value, ReplicateConfig(cache_class="persistent"))
            with m._lock:  # as eviction does; taken off the queue before a heartbeat hands it out
                m._spill(m.objects["k"], m.clients[b.client_id])
                spill = m.clients[b.client_id].tasks.pop()
            old = time.time() - 3600
            writing = f"{spill['path']}.{'1' * 32}.tmp"  # b's write, well under way
            killed = os.path.join(
                os.path.dirname(spill["path"]), f"{'ab' * 20}-9-{'0' * 16}.kvp.{'2' * 32}.tmp"
            )
            for p in (writing, killed):
                os.makedirs(os.path.dirname(p), exist_ok=True)
                with open(p, "wb") as f:
                    f.write(b"x" * 1000)
                os.utime(p, (old, old))
            run_task(a, {"type": "ssd_sweep"})  # as a's task thread runs it
            assert os.path.exists(writing), "a spill in flight lost its temporary file"
            assert not os.path.exists(killed)
            b._run_task(spill)
            assert a.info("k")["ssd"] == spill["path"]
            assert not a.info("k")["replicas"] and a.get("k") == value  # read from b's file


@contextlib.contextmanager
def _two_clients_with_k() -> Iterator[tuple[Store, Store, Master, bytes]]:
    """Clients a (with its own master) and b, each with a 4 MiB segment, checksums on and no
    location cache, and ``k`` (200 kB) put with a replica on each: yields a, b, the master and
    k's value."""
    cfg = {"segment_size": 4 << 20, "heartbeat_s": 60, "checksum": True, "location_cache": 0}
    with Store.connect(**cfg) as a:
        m = a._master
        with Store.connect(master=m.address, **cfg) as b:
            value = pattern(200_000, 7)
            a.put("k", value, ReplicateConfig(replicas=2))
            yield a, b, m, value


def test_a_late_corrupt_report_of_a_dropped_replica_leaves_the_next_one_on_that_segment() -> None:
    """Two readers read k's replica on b's segment and find its bytes bad. The first report drops
    it; k is copied to that segment again (a hot-key copy, at another address); only then does
    the second reader's report arrive. It names the address it read: the new replica, good, is
    kept and read. A report named the segment only, and the late one dropped the new replica."""
    from kvpool.store.datapath import ReadJob
    from kvpool.store.layout import HEADER_SIZE

    with _two_clients_with_k() as (a, b, m, value):
        info = a.info("k")
        (seg, addr, _) = next(r for r in info["replicas"] if r[0] == b.segment_name)
        csum = m.objects["k"].checksum
        ctypes.memset(addr + HEADER_SIZE + 100, 0xFF, 64)  # its bytes go bad (past the header)

        def read_old_replica(reader: Store) -> None:  # a reader that looked k up before
            job = ReadJob("k", info["size"], info["gen"], csum, [[seg, addr]], None, float("inf"))
            reader._data.read(reader.master_incarnation, [job])
            assert isinstance(job.error, ObjectCorrupt), job.error

        def replicas() -> list[tuple[str, int]]:
            return sorted((r[0], r[1]) for r in a.info("k")["replicas"] if r[2])

        read_old_replica(a)  # the first reader's report drops it
        deadline = time.monotonic() + 5
        while len(replicas()) != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seg not in dict(replicas())
        with m._lock:  # a hot-key copy onto b's segment (the only other one), as upkeep does
            m._replicate(m.objects["k"], 1, time.monotonic())
            (task,) = m.clients[b.client_id].tasks
            m.clients[b.client_id].tasks.clear()
        b._run_task(task)
        new = dict(replicas())[seg]
        assert new != addr and len(replicas()) == 2
        read_old_replica(b)  # the second reader's report, late
        time.sleep(0.5)  # (one-way) taken by now
        assert dict(replicas()).get(seg) == new, "the late report dropped the new replica"
        assert m.stats["replicas_corrupt"] == 1
        assert b.get("k") == value and a.get("k") == value


def test_a_reader_reports_the_replica_and_the_mount_it_read() -> None:
    """A reader's report names what its get reply gave it: the replica's id and the segment's
    mount (and the master's epoch), so that the master can tell a late report about a replica
    dropped since (or an earlier mount of the segment) from one about what is there now. A read
    through a cached location (segment and address only) reports nothing: it is retried through
    the master, whose reply names them."""
    from kvpool.store.datapath import ReadJob
    from kvpool.store.layout import HEADER_SIZE

    with _two_clients_with_k() as (a, b, m, value):
        with m._lock:
            r = next(r for r in m.objects["k"].replicas if r.seg.name == b.segment_name)
            rid, mount = r.id, r.seg.mount
        ctypes.memset(r.addr + HEADER_SIZE + 100, 0xFF, 64)  # its bytes go bad (past the header)
        (code, info), epoch, deadline = (lambda x: (x[0][0], x[1], x[2]))(a._lookup(["k"]))
        assert code is None
        rep = next(rep for rep in info["replicas"] if rep[0] == b.segment_name)
        sent: list[tuple[object, ...]] = []
        a._data.report = lambda *x: sent.append(x)  # type: ignore[assignment,method-assign]

        def read(rep: list[object], cached: bool = False) -> ReadJob:
            job = ReadJob("k", info["size"], info["gen"], info["checksum"], [rep], None, deadline,
                          cached=cached)  # fmt: skip
            a._data.read(epoch, [job])
            return job

        assert isinstance(read(rep).error, ObjectCorrupt)
        fields = {
            "key": "k",
            "gen": info["gen"],
            "addr": r.addr,
            "epoch": epoch,
            "replica": rid,
            "mount": mount,
        }
        assert sent == [(b.segment_name, "corrupt", fields)]
        assert read([rep[0], 1 << 62, *rep[2:]]).error is not None  # outside the segment: unreachable
        assert sent[1] == (
            b.segment_name,
            "unreachable",
            {"epoch": epoch, "replica": rid, "mount": mount},
        )
        assert isinstance(read(rep, cached=True).error, ObjectCorrupt) and len(sent) == 2
        a._report_read(*sent[0])  # sent for real: the master drops that replica
        deadline = time.monotonic() + 5
        while len(a.info("k")["replicas"]) != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [x[0] for x in a.info("k")["replicas"]] == [a.segment_name]
        a._flush_releases(a._rpc)
        assert b.get("k") == value


@pytest.mark.parametrize("how", ["put", "batch_put"])
def test_a_late_write_report_leaves_the_segment_mounted_again_since_as_it_is(how: str) -> None:
    """a holds reservations (granted with its first put) on b's segment, the only one. b is
    declared dead, registers again and mounts fresh memory (a new mount of its segment, at other
    addresses). a's next put (or batch put) writes into reservations on the old memory: refused
    (unregistered), a reports the segment unreachable and puts the normal way. The report names
    the mount its reservation was granted on: the master ignores it, the new mount is not
    demoted. A write's report named the segment alone, and the late one demoted the new mount
    for client_ttl_s (used last by every placement and read)."""
    with Store.connect(segment_size=0, heartbeat_s=60, protocol="tcp", location_cache=0) as a:
        m = a._master
        assert m is not None
        with Store.connect(master=m.address, segment_size=4 << 20, heartbeat_s=0.1, protocol="tcp") as b:
            seg = b.segment_name
            a.put("k0", pattern(4096, 0))  # a's first put of this size brings reservations
            held = a._resv.held()
            with m._lock:
                old = m.space.segments[seg].mount
                m._remove_client(b.client_id)  # declared dead (missed heartbeats), as upkeep does
            assert len(held) >= 2 and all(e.mounts == {seg: old} for e in held)

            def mount() -> int | None:
                with m._lock:
                    s = m.space.segments.get(seg)
                    return None if s is None else s.mount

            deadline = time.monotonic() + 10
            while mount() in (None, old) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert mount() not in (None, old), "b did not mount its segment again"
            values = {f"k{i}": pattern(4096, i) for i in range(1, 3 if how == "batch_put" else 2)}
            if how == "put":
                a.put("k1", values["k1"])
            else:
                assert a.batch_put(list(values), list(values.values())) == [None, None]
            # the write into a reservation failed: a let go of those on the old mount
            assert all(e.mounts == {seg: mount()} for e in a._resv.held())
            deadline = time.monotonic() + 5
            while not m.stats["reports_stale"] + m.stats["segments_reported"] and time.monotonic() < deadline:
                time.sleep(0.02)
            with m._lock:
                assert m.space.segments[seg].reported_until <= time.monotonic(), "the new mount was demoted"
            assert m.stats["segments_reported"] == 0 and m.stats["reports_stale"] == 1
            for k, v in values.items():
                assert b.get(k) == v and a.get(k) == v


@pytest.mark.parametrize(
    "bad",
    [
        {"checksum": "0"},
        {"checksum": 1.5},
        {"checksum": -1},
        {"gen": "1"},
        {"gen": -1},
        {"size": 2.0},
        {"size": None},
        {"replicas": "seg"},
        {"replicas": [["seg", "0x1000"]]},
        {"replicas": [[7, 4096]]},
        {"ssd": [1, 2, 3]},
        {"results": "x"},
        {"results": []},
        {"results": [[7, {}]]},
        {"epoch": "e"},
        {"lease_s": "5"},
        {"lease_s": float("nan")},
    ],
    ids=lambda d: "-".join(f"{k}={v!r}" for k, v in d.items()),
)
def test_a_get_reply_of_bad_types_fails_the_get_with_a_protocol_error(bad: dict[str, object]) -> None:
    """A master (hostile, or buggy) answers a get with a field of the wrong type or range: the
    get fails with ProtocolError, a kvpool error, and the client goes on. A checksum that was no
    int failed the get with a TypeError; a generation past 64 bits, with a struct.error."""
    from kvpool.errors import ProtocolError

    with Store.connect(segment_size=4 << 20, location_cache=0) as st:
        m = st._master
        value = pattern(5000, 3)
        st.put("k", value)
        real = m._handlers["get"]

        def get(req: dict[str, object], sess: dict[str, object]) -> dict[str, object]:
            reply = real(req, sess)
            for field, v in bad.items():
                if field in ("results", "epoch", "lease_s"):
                    reply[field] = v
                else:
                    reply["results"][0][1][field] = v  # type: ignore[index]
            return reply

        m._handlers["get"] = get
        with pytest.raises(ProtocolError):
            st.get("k")
        if {"epoch", "lease_s"} & bad.keys() or bad.get("results") in ("x", []):  # the batch fails
            with pytest.raises(ProtocolError):
                st.batch_get_into(["k"], [bytearray(8192)], [8192])
        else:  # one key's answer: that key fails
            assert isinstance(st.batch_get_into(["k"], [bytearray(8192)], [8192])[0], ProtocolError)
        m._handlers["get"] = real
        assert st.get("k") == value


def test_a_get_reply_naming_a_size_no_client_could_hold_fails_that_key_with_a_store_error() -> None:
    """A master (hostile, or buggy) answers a get with a size past this host's memory: the get
    fails with a StoreError before anything is allocated (it ended in a MemoryError, no kvpool
    error), a batch fails that key only, a get into a buffer too small says so; the client goes on."""
    from kvpool.store.gets import HOST_MEMORY

    with Store.connect(segment_size=4 << 20, location_cache=0) as st:
        m = st._master
        big, small = pattern(100 << 10, 1), pattern(5000, 2)
        st.put("big", big)
        st.put("small", small)
        real = m._handlers["get"]

        def get(req: dict[str, object], sess: dict[str, object]) -> dict[str, object]:
            reply = real(req, sess)
            for key, r in zip(req["keys"], reply["results"], strict=True):  # type: ignore[call-overload]
                if key == "big":
                    r[1]["size"] = max(HOST_MEMORY + 1, 1 << 62)
            return reply

        m._handlers["get"] = get
        with pytest.raises(StoreError, match="memory"):
            st.get("big")
        got = st._get(["big", "small"], [None, None])
        assert isinstance(got[0], StoreError) and got[1] == small
        with pytest.raises(InvalidArgument, match="too small"):
            st.get_into("big", bytearray(200 << 10))
        m._handlers["get"] = real
        assert st.get("big") == big


def test_a_value_that_cannot_be_allocated_fails_its_key_with_a_store_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The allocation of a value read into new bytes fails (MemoryError: this client is out of
    memory): that key fails with a StoreError, the other keys of
    its batch are read; a MemoryError ended the get, or the whole batch."""
    with Store.connect(segment_size=8 << 20, location_cache=0) as st:
        a, b, small = pattern(100 << 10, 1), pattern(200 << 10, 2), pattern(5000, 3)
        for k, v in (("a", a), ("b", b), ("small", small)):
            st.put(k, v)
        real, calls = _native.new_bytes, []

        def new_bytes(n: int) -> object:
            calls.append(n)
            if n == len(a):
                raise MemoryError
            return real(n)

        monkeypatch.setattr(_native, "new_bytes", new_bytes)
        with pytest.raises(StoreError, match="no memory"):
            st.get("a")
        assert calls == [len(a)]
        got = st._get(["a", "b", "small"], [None, None, None])
        assert isinstance(got[0], StoreError) and got[1] == b and got[2] == small
        monkeypatch.setattr(_native, "new_bytes", real)
        assert st.get("a") == a


def test_reservations_the_heartbeat_thread_tops_up_name_their_mounts() -> None:
    """Reservations fetched off the put path (the heartbeat thread's refill of a pool running
    low) keep the mount of each segment the master's reply names, as a put's do: a write into
    one that fails then reports that mount (without it, the segment by name: a late report
    demoted a segment mounted again since)."""
    with Store.connect(segment_size=4 << 20, heartbeat_s=60, protocol="tcp") as a:
        m = a._master
        assert m is not None
        # The heartbeat thread refills (and unmarks) a low pool as soon as it is marked: hold it
        # in its refill until this test has done its own, so the mark is seen here.
        real, go = a._refill, threading.Event()

        def held_refill() -> None:
            go.wait(30)
            real()

        a._refill = held_refill  # type: ignore[method-assign]
        for i in range(200):
            a.put(f"k{i}", pattern(4096, i))
            if a._resv.wanted.is_set():
                break
        assert a._resv.wanted.is_set(), "no pool ran low"
        before = {e.gen for e in a._resv.held()}
        real()
        go.set()
        new = [e for e in a._resv.held() if e.gen not in before]
        with m._lock:
            mount = m.space.segments[a.segment_name].mount
        assert new and all(e.mounts == {a.segment_name: mount} for e in new)
