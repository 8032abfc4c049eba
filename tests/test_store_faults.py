"""Store integrity under faults (issue 11): one test per failure the issue lists, each with real
``kvpool master`` / ``kvpool store-server`` / client processes on loopback and real faults
(SIGKILL, SIGSTOP, stalls, crafted requests). Every value read is compared with what was put."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from kvpool import ReplicateConfig, Store, _native
from kvpool._rpc import RpcClient, frame
from kvpool.errors import KvpoolError, ObjectNotFound, StoreFull
from kvpool.store.procs import MasterProcess, StorageProcess, free_port
from tests.test_rdma_double import double  # noqa: F401  (fixture: the fake-verbs registry)


def pattern(n: int, seed: int) -> bytes:
    buf = bytearray(n)
    _native.fill_pattern(_native.buffer_address(buf)[0], n, seed)
    return bytes(buf)


def wait_for(cond: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Child:
    """A client process running ``script`` (which talks over stdout lines and reads stdin lines)."""

    def __init__(self, script: str, *args: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def line(self, timeout: float = 30.0) -> Any:
        assert self.p.stdout is not None
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError("child said nothing in time")
        text = self.p.stdout.readline()
        if not text:
            raise AssertionError(f"child exited ({self.p.wait()})")
        return json.loads(text)

    def say(self, msg: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(msg + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        os.kill(self.p.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.p.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
            self.p.kill()
        self.p.wait(10)


def stats(master: str) -> dict[str, Any]:
    return RpcClient(master, 5).call("stats")["stats"]


# ---------------------------------------------------------------------- wrong bytes, silently
def test_master_restart_old_reservations_never_overwrite_new_objects() -> None:
    """After a master restart a client drops the space it had reserved from the old master; even
    bytes written into that old space afterwards cannot reach objects the new master placed."""
    port = free_port()
    m = MasterProcess(port=port, client_ttl_s=2.0)
    try:
        with StorageProcess(m.address, 32 << 20, heartbeat_s=0.2, protocol="tcp") as sp:
            a = Store.connect(master=m.address, segment_size=0, heartbeat_s=0.2)
            try:
                for i in range(8):
                    a.put(f"a{i}", pattern(4096, i))
                old = a._resv.held()
                assert old, "the client holds reservations from the first master"
                m.kill()
                m = MasterProcess(port=port, client_ttl_s=2.0)
                wait_for(lambda: sp.segment in stats(m.address)["segments"], what="the segment remounted")
                with Store.connect(master=m.address, segment_size=0) as b:
                    values = {f"b{i}": pattern(4096, 1000 + i) for i in range(300)}
                    for k, v in values.items():
                        b.put(k, v)
                    # A writer that kept the old master's space writes into it now.
                    junk = bytearray(b"\xee" * 8192)
                    jaddr = a.engine.register_local_memory(junk, remote_accessible=False)
                    for e in old:
                        for seg, addr in e.replicas:
                            try:
                                a.engine.transfer_sync(seg, jaddr, addr, 4096 + 64)
                            except KvpoolError:
                                pass  # refused: that memory is not registered any more
                    a.put("a-new", b"fresh")  # the client itself goes on with the new master
                    assert all(e.epoch == a.master_incarnation for e in a._resv.held())
                    b._loc.clear()  # every get below asks the new master
                    for k, v in values.items():
                        assert b.get(k) == v
                    assert a.get("a-new") == b"fresh"
                    with pytest.raises(ObjectNotFound):
                        a.get("a3")  # the old master's objects are gone, not half-there
            finally:
                a.close()
    finally:
        m.close()


_STALLED_WRITER = """
    import json, sys, time
    from kvpool import Store
    from kvpool.store.datapath import WriteJob
    st = Store.connect(master=sys.argv[1], segment_size=0, heartbeat_s=0.2, location_cache=0,
                       transfer_timeout_s=2)
    r = st._call("put_start", keys=["w-key"], sizes=[1 << 20], config={})
    gen, verify, reps = r["results"][0][1]
    st._writes.begin(r["epoch"], [gen])  # what put() does when the allocation arrives
    print(json.dumps({"gen": gen, "reps": reps}), flush=True)
    time.sleep(1.0)  # the test stops this process here, past put_timeout_s
    job = WriteJob("w-key", 1 << 20, memoryview(b"\\xee" * (1 << 20)), gen, verify, reps)
    st._data.write(r["epoch"], [job])  # the late write lands in its old allocation
    end = st._rpc.call("put_end", items=[["w-key", gen, job.csum, job.written]], epoch=r["epoch"])
    st._writes.end(r["epoch"], [gen])
    print(json.dumps({"written": job.written, "end": end["results"][0][0]}), flush=True)
    sys.stdin.readline()
    st.close()
"""


def test_stalled_writer_past_put_timeout_cannot_hit_reused_space() -> None:
    opts = {"put_timeout_s": 1.0, "quarantine_s": 2.0, "client_ttl_s": 30.0}
    with (
        MasterProcess(**opts) as m,
        StorageProcess(m.address, 24 << 20, heartbeat_s=0.2, transfer_timeout_s=2),
    ):
        w = Child(_STALLED_WRITER, m.address)
        try:
            alloc = w.line()
            w.stop()
            wait_for(lambda: stats(m.address)["pending"] == 0, what="the stalled put revoked")
            assert stats(m.address)["fenced"] == 1  # its space is held, not reused
            with Store.connect(master=m.address, segment_size=0, location_cache=0, transfer_timeout_s=2) as b:
                values = {f"v{i}": pattern(1 << 20, i) for i in range(40)}
                for k, v in values.items():  # more than the pool: eviction reuses every free range
                    b.put(k, v)
                for k in values:
                    if b.exists(k):
                        addr = b.info(k)["replicas"][0][1]
                        assert (
                            addr + (1 << 20) + 64 <= alloc["reps"][0][1]
                            or addr >= alloc["reps"][0][1] + (1 << 20) + 64
                        )
                w.cont()
                late = w.line()
                assert late["end"] == "NOT_FOUND"  # its late commit is refused
                for k, v in values.items():
                    if b.exists(k):
                        assert b.get(k) == v  # nobody's bytes were hit
                assert not b.exists("w-key")
                # Its next heartbeat reports it is done: the fence goes.
                wait_for(lambda: stats(m.address)["fenced"] == 0, what="the fence released")
                w.say("bye")
        finally:
            w.close()


def test_a_stopped_storages_late_bytes_never_reach_the_next_object_placed_there() -> None:
    """A put into a storage process stopped past quarantine_s (not declared dead: client_ttl_s is
    longer) times out with its value's bytes waiting in that process's socket; they land when it
    runs again. Its space stays fenced until the storage ran since, so they never land in the next
    object put there (same host: written straight into the stopped process's memory). The space
    was reused once quarantine_s passed and the writer's floor did, and the next get of that
    object returned the timed-out put's bytes under the new object's header."""
    with (
        MasterProcess(client_ttl_s=60, quarantine_s=1, put_timeout_s=2) as m,
        StorageProcess(m.address, 64 << 20, heartbeat_s=0.2, transfer_timeout_s=1) as sp,
    ):
        a = Store.connect(master=m.address, segment_size=0, heartbeat_s=0.2, protocol="tcp",
                          transfer_timeout_s=1, location_cache=0)  # fmt: skip
        b = Store.connect(master=m.address, segment_size=0, heartbeat_s=0.2, transfer_timeout_s=1,
                          location_cache=0)  # fmt: skip
        n = 16 << 20
        try:
            b.put("warm-b", b"x" * 100)  # both have the segment open
            a.put("warm-a", b"y" * 100)
            os.kill(sp.proc.pid, signal.SIGSTOP)
            with pytest.raises(KvpoolError):
                a.put("k1", b"\xee" * n)  # over TCP: its value waits in the stopped process
            time.sleep(3)  # past quarantine_s; a's floor passed its allocation
            held = stats(m.address)["fenced"]
            v = pattern(n, 7)
            b.put("k2", v)  # same host: written while the storage is stopped
            os.kill(sp.proc.pid, signal.SIGCONT)
            time.sleep(1.0)  # the late bytes land
            assert b.get("k2") == v
            assert held >= 1  # the fences were held: the storage had not run since
            wait_for(lambda: stats(m.address)["fenced"] == 0, what="the fence released once it ran")
        finally:
            os.kill(sp.proc.pid, signal.SIGCONT)
            a.close()
            b.close()


_LOST_WRITER = """
    import json, sys
    from kvpool import Store
    from kvpool.transfer.types import OpCode
    st = Store.connect(master=sys.argv[1], segment_size=0, heartbeat_s=0.2, location_cache=0,
                       transfer_timeout_s=0.5)
    r = st._call("put_start", keys=["w-key"], sizes=[1 << 20], config={"preferred_segment": sys.argv[2]})
    gen, verify, reps = r["results"][0][1]
    st._writes.begin(r["epoch"], [gen])
    print(json.dumps({"reps": reps}), flush=True)
    sys.stdin.readline()  # stopped meanwhile: declared dead, its fence held to the end
    (seg, addr), n = reps[0], 256 << 10
    local, view, _ = st._staging.take(n)
    view[:] = b"\\xee" * n
    ok = st._data.sync(seg, local, addr + 64 + (256 << 10), n, OpCode.WRITE)  # the rest of its value
    print(json.dumps({"late_write": ok}), flush=True)
    sys.stdin.readline()
"""


def test_a_lost_writers_late_write_never_reaches_a_copy_of_an_object_without_a_checksum() -> None:
    """A writer stopped mid-put is declared dead; after fence_hold_s its range is reused, as
    suspect space. A replica copy (change_replica) of a big object without a checksum must not go
    there: its readers check only the header, so the writer's late write into the value (here:
    resumed with SIGCONT) would be returned as the object's bytes."""
    opts = {"client_ttl_s": 1.0, "quarantine_s": 0.5, "fence_hold_s": 1.0}
    with (
        MasterProcess(**opts) as m,
        StorageProcess(m.address, 8 << 20, heartbeat_s=0.2, transfer_timeout_s=0.5) as a,
        StorageProcess(m.address, 8 << 20, heartbeat_s=0.2, transfer_timeout_s=0.5) as b,
    ):
        w = Child(_LOST_WRITER, m.address, a.segment)
        try:
            assert w.line()["reps"][0][0] == a.segment
            w.stop()
            wait_for(lambda: stats(m.address)["clients"] == 2 and stats(m.address)["fenced"] == 0,
                     what="the stopped writer declared dead and its fence gone")  # fmt: skip
            reader = {"segment_size": 0, "location_cache": 0, "transfer_timeout_s": 0.5, "heartbeat_s": 0.2}
            with Store.connect(master=m.address, **reader) as r:
                value = pattern(1 << 20, 7)
                r.put("big", value, ReplicateConfig(preferred_segment=b.segment))
                assert r.info("big")["checksum"] is None
                r.change_replica("big", 2)  # a copy on a: placed elsewhere than the suspect range
                for _ in range(3):
                    assert r.get("big") == value  # read from b (same host: the first replica)
                r.change_replica("big", 1)  # the most read replica (b's) goes
                w.cont()
                w.say("write")
                assert w.line()["late_write"]
                got = [r.get("big") == value for _ in range(3)]
                assert all(got), "a lost writer's late write was returned as the object's bytes"
                w.say("bye")
        finally:
            w.close()


def test_late_or_foreign_put_end_never_commits_another_put() -> None:
    with MasterProcess(put_timeout_s=0.5) as m, StorageProcess(m.address, 16 << 20):
        a = Store.connect(master=m.address, segment_size=0)
        b = Store.connect(master=m.address, segment_size=0)
        c = Store.connect(master=m.address, segment_size=0)
        try:
            ra = a._call("put_start", keys=["k"], sizes=[4096], config={})
            ga, _, repa = ra["results"][0][1]
            wait_for(lambda: stats(m.address)["pending"] == 0, what="a's put revoked")
            rb = b._call("put_start", keys=["k"], sizes=[4096], config={})
            gb, _, repb = rb["results"][0][1]
            seg_a, seg_b = [x[0] for x in repa], [x[0] for x in repb]
            late = a._call("put_end", items=[["k", ga, 1, seg_a]], epoch=ra["epoch"])
            assert late["results"][0][0] == "NOT_FOUND"  # a's late commit
            foreign = c._call("put_end", items=[["k", gb, 1, seg_b]], epoch=rb["epoch"])
            assert foreign["results"][0][0] == "NOT_FOUND"  # c never started this put
            with pytest.raises(KvpoolError, match="belongs to client"):
                c._rpc.call("put_end", client=b.client_id, items=[["k", gb, 1, seg_b]])
            assert not b.exists("k")  # b's put is still b's to commit ...
            ok = b._call("put_end", items=[["k", gb, 1, seg_b]], epoch=rb["epoch"])
            assert ok["results"] == [[None, None]]  # ... and only b commits it
        finally:
            for st in (a, b, c):
                st.close()


_STALLED_READER = """
    import json, sys, time
    import xxhash
    from kvpool import Store
    st = Store.connect(master=sys.argv[1], segment_size=0, location_cache=0)
    read = st._data.read
    def paused(epoch, jobs):
        print(json.dumps({"looked_up": [j.gen for j in jobs]}), flush=True)
        time.sleep(1.0)  # the test stops this process here, past the lease
        return read(epoch, jobs)
    st._data.read = paused
    try:
        out = {"ok": xxhash.xxh3_64_hexdigest(st.get("k"))}
    except Exception as exc:
        out = {"err": type(exc).__name__}
    print(json.dumps(out), flush=True)
    st._data.read = read
    st.close()
"""


def test_reader_stalled_past_its_lease_never_gets_the_next_objects_bytes() -> None:
    with MasterProcess(lease_ttl_ms=800) as m, StorageProcess(m.address, 8 << 20):
        with Store.connect(master=m.address, segment_size=0, location_cache=0) as w:
            v1, v2 = pattern(1 << 20, 1), pattern(1 << 20, 2)
            w.put("k", v1)
            addr = w.info("k")["replicas"][0][1]
            r = Child(_STALLED_READER, m.address)
            try:
                r.line()  # looked up "k", lease taken
                r.stop()
                time.sleep(1.2)  # past the lease
                w.remove("k")
                w.put("k2", v2)  # reuses k's range (same size, the most recently freed block)
                assert w.info("k2")["replicas"][0][1] == addr
                r.cont()
                r.line()  # the retry looks "k" up again ...
                out = r.line()
                assert out == {"err": "ObjectNotFound"}, out  # ... and never returns k2's bytes
            finally:
                r.close()
            assert w.get("k2") == v2


# ---------------------------------------------------------------------- losing the whole pool
def test_huge_request_is_refused_fast_and_nobody_is_declared_dead() -> None:
    with MasterProcess(client_ttl_s=2.0) as m, StorageProcess(m.address, 8 << 20, heartbeat_s=0.2):
        with Store.connect(master=m.address, segment_size=0) as st:
            for i in range(50):
                st.put(f"k{i}", pattern(10_000, i))
            rpc = RpcClient(m.address, 30)
            keys = [f"key-{i}" for i in range(150_000)]  # ~1.5 MB, under the master's message limit
            with pytest.raises(KvpoolError, match="split it"):
                rpc.call("get", keys=keys)
            with pytest.raises(KvpoolError, match="exceeds the limit"):
                rpc.call("get", keys=keys * 3)  # over the message limit: refused before sending
            time.sleep(2.5)
            s = stats(m.address)
            assert s["counters"].get("clients_dead", 0) == 0 and s["objects"] == 50
            assert all(st.get(f"k{i}") == pattern(10_000, i) for i in range(50))


def test_impossible_put_evicts_nothing() -> None:
    with MasterProcess() as m, StorageProcess(m.address, 8 << 20):
        with Store.connect(master=m.address, segment_size=0) as st:
            for i in range(20):
                st.put(f"k{i}", pattern(100_000, i))
            with pytest.raises(StoreFull, match="do not fit into any mounted segment"):
                st.put("huge", b"x" * (9 << 20))
            s = stats(m.address)
            assert s["counters"].get("evictions", 0) == 0 and s["objects"] == 20


def test_eviction_works_in_bounded_steps() -> None:
    opts = {"evict_batch": 32, "eviction_high_watermark": 0.5, "eviction_ratio": 0.2}
    with MasterProcess(**opts) as m, StorageProcess(m.address, 8 << 20):
        with Store.connect(master=m.address, segment_size=0) as st:
            keys = [f"k{i}" for i in range(3000)]
            for a in range(0, 3000, 200):
                assert (
                    st.batch_put(keys[a : a + 200], [pattern(2048, i) for i in range(a, a + 200)])
                    == [None] * 200
                )
            c = stats(m.address)["counters"]
            # Every step is bounded: evict_batch, or twice the keys of the put that needed room.
            assert c["evictions"] > 32 and c["evict_steps"] > 1 and c["evict_looked_max"] <= 400
            got = st.batch_get(keys)
            assert all(g is None or g == pattern(2048, i) for i, g in enumerate(got))


def test_master_stopped_longer_than_client_ttl_keeps_its_clients() -> None:
    with MasterProcess(client_ttl_s=1.0) as m, StorageProcess(m.address, 8 << 20, heartbeat_s=0.2) as sp:
        with Store.connect(master=m.address, segment_size=0, location_cache=0) as st:
            st.put("k", pattern(100_000, 7))
            os.kill(m.pid, signal.SIGSTOP)
            time.sleep(3.0)
            os.kill(m.pid, signal.SIGCONT)
            time.sleep(1.5)
            s = stats(m.address)
            assert s["counters"].get("clients_dead", 0) == 0 and sp.segment in s["segments"]
            assert s["counters"]["master_stalls"] >= 1
            assert st.get("k") == pattern(100_000, 7)


# ---------------------------------------------------------------------- reads it could serve
def test_reads_fail_over_to_the_other_replica_when_a_storage_server_dies() -> None:
    with MasterProcess(client_ttl_s=5.0) as m:
        s1 = StorageProcess(m.address, 32 << 20, protocol="tcp")
        with StorageProcess(m.address, 32 << 20, protocol="tcp") as s2:
            with Store.connect(master=m.address, segment_size=0, protocol="tcp") as st:
                values = {f"r{i}": pattern(100_000, i) for i in range(200)}
                for k, v in values.items():
                    st.put(k, v, ReplicateConfig(replicas=2))
                s1.kill()
                failed = [k for k, v in values.items() if st.get(k) != v]
                assert failed == []
                assert stats(m.address)["counters"]["segments_reported"] >= 1
                # Readers that never touched the dead segment are pointed at the live one first.
                with Store.connect(master=m.address, segment_size=0, protocol="tcp", location_cache=0) as r2:
                    for k in list(values)[:20]:
                        assert r2._lookup([k])[0][0][1]["replicas"][0][0] == s2.segment
                    wait_for(lambda: s1.segment not in stats(m.address)["segments"], 15, "s1 declared dead")
                    assert [k for k, v in values.items() if r2.get(k) != v] == []
                    assert stats(m.address)["counters"].get("objects_lost", 0) == 0
        s1.close()


def test_a_dead_storage_servers_memory_is_not_kept_by_its_clients() -> None:
    """A client that wrote into a same-host storage server maps its shared memory; once that
    server is killed its memory is let go of at the client's next heartbeat — not kept alive by
    the mapping (each restart of a storage server under a new name left one segment's memory
    behind in every client)."""
    size = 48 << 20
    dead: set[str] = set()
    with MasterProcess(client_ttl_s=2.0) as m:
        with Store.connect(master=m.address, segment_size=0, heartbeat_s=0.2) as st:
            for round_ in range(3):
                with StorageProcess(m.address, size, heartbeat_s=0.2) as sp:
                    wait_for(lambda: sp.segment in stats(m.address)["segments"], what="segment mounted")
                    # The client still holds reservations (single and batch shapes) on the dead
                    # segments: a put whose write fails there is put the normal way, and the
                    # pool's other reservations there are given back.
                    keys = [f"b{round_}-{i}" for i in range(4)]
                    for step in ("single", "batch") if round_ % 2 else ("batch", "single"):
                        if step == "single":
                            st.put(f"k{round_}", pattern(4096, round_))
                        else:
                            assert st.batch_put(keys, [pattern(2048, i) for i in range(4)]) == [None] * 4
                    assert not [e for e in st._resv.held() if e.replicas[0][0] in dead]
                    assert st.get(f"k{round_}") == pattern(4096, round_)
                    assert [e for e in st._resv.held() if e.replicas[0][0] == sp.segment]
                    dead.add(sp.segment)
                    h = st.engine.open_segment(sp.segment)
                    assert st.engine.shared_buffers_mapped(h) == 1
                    sp.kill()
                    wait_for(lambda h=h: st.engine.shared_buffers_mapped(h) == 0, 5, "dead segment unmapped")
            mapped = [line for line in open("/proc/self/maps") if "memfd:" in line]
            sizes = [int(b, 16) - int(a, 16) for a, b in (line.split()[0].split("-") for line in mapped)]
            assert size not in sizes, mapped  # none of the three servers' memory is mapped here


# ---------------------------------------------------------------------- unbounded growth
_RSS_MASTER = """
    import sys, threading
    from kvpool.store.master import Master
    m = Master(port=0, secret="s").start()
    print(m.port, flush=True)
    sys.stdin.readline()
"""


def _rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


def test_hostile_connections_do_not_grow_the_master() -> None:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_RSS_MASTER)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    socks: list[socket.socket] = []
    try:
        assert p.stdout is not None
        addr = f"127.0.0.1:{int(p.stdout.readline())}"
        good = RpcClient(addr, 5, "s")
        good.call("ping")
        base = _rss(p.pid)
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", int(addr.rsplit(":")[1])))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            socks.append(s)
            if i % 3 == 0:  # announces 60 MiB before authenticating
                s.sendall(struct.pack("<I", 60 << 20) + b"\0" * 2000)
            elif i % 3 == 1:  # authenticates, then starts a 15 MiB message and stalls
                c = RpcClient(addr, 5, "s")
                c.call("ping")
                assert c._sock is not None
                socks.append(c._sock)
                c._sock.sendall(struct.pack("<I", 15 << 20) + b"\x81" + b"\0" * 60_000)
            else:  # authenticates, asks for replies and never reads them
                c = RpcClient(addr, 5, "s")
                c.call("ping")
                assert c._sock is not None
                socks.append(c._sock)
                c._sock.setblocking(False)
                try:
                    for _ in range(200):
                        c._sock.send(frame({"op": "stats", "id": 1, "pad": b"p" * 2000}))
                except BlockingIOError:
                    pass
        time.sleep(1.0)
        grown = _rss(p.pid) - base
        assert good.call("ping")["ok"]  # a well-behaved client is still served
        assert grown < 48 << 20, f"master grew by {grown >> 20} MiB"
    finally:
        for s in socks:
            s.close()
        p.stdin.close()  # type: ignore[union-attr]
        p.wait(10)


# ---------------------------------------------------------------------- identity
def test_a_client_cannot_act_as_another() -> None:
    with MasterProcess(secret="ë") as m, StorageProcess(m.address, 8 << 20, secret="ë") as sp:
        with Store.connect(master=m.address, segment_size=0, secret="ë") as a:
            for op, args in (
                ("heartbeat", {}),
                ("unregister", {}),
                ("unmount", {"segment": sp.segment}),
                ("put_end", {"items": []}),
            ):
                with pytest.raises(KvpoolError, match="belongs to client"):
                    a._rpc.call(op, client=sp.client, **args)
            with pytest.raises(KvpoolError, match="not mounted by this client"):
                a._rpc.call("unmount", segment=sp.segment)
            # A connection that knows the secret but registered no client cannot drop replicas.
            a.put("k", pattern(10_000, 5))
            gen = a.info("k")["gen"]
            anon = RpcClient(m.address, 5, "ë")
            with pytest.raises(KvpoolError):
                anon.call("report", segment=sp.segment, kind="corrupt", key="k", gen=gen)
            assert [r[2] for r in a.info("k")["replicas"]] == [True] and a.get("k") == pattern(10_000, 5)
            s = RpcClient(m.address, 5, "ë").call("stats")["stats"]
            assert sp.segment in s["segments"] and s["clients"] == 2


# ---------------------------------------------------------------------- all of it at once
@pytest.mark.parametrize("replicas", [2, 1])
def test_chaos_soak_short(replicas: int) -> None:
    """benchmarks/store_chaos.py, one round per fault (under a minute): writers and readers
    through a storage server SIGKILL, stopped writer, reader, storage server and master, and a
    master SIGKILL + restart. No wrong bytes, every fault recovered from; with replicas=2 no object
    lost, with one copy (the small-put fast path) none lost but to the storage faults."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import store_chaos

    res = store_chaos.run(0, 6.5, writers=2, readers=2, storage=3, segment_size=128 << 20, rounds=6,
                          replicas=replicas)  # fmt: skip
    assert [r["fault"] for r in res["rounds"]] == list(store_chaos.FAULTS)
    assert res["wrong"] == 0 and res["lost"] == 0, res
    assert res["ops"] > 1000 and all(r["keys"] > 0 for r in res["rounds"]), res
    assert all(r["recovery_s"] is not None for r in res["rounds"]), res["rounds"]


def test_spills_that_fail_for_want_of_disk_leave_no_partial_files_and_no_ssd_copy(tmp_path) -> None:
    """A storage server whose disk takes no more (its file size limit, set from outside with
    prlimit: every write past it fails with EFBIG, as one on a full disk fails with ENOSPC):
    failed spills leave no partial file behind (they kept their bytes, so a full disk stayed
    full), no object is recorded on the SSD tier, every value is still read as it was put, and
    that disk gets spills again only after a while (it got the same ones many times a second),
    doubling while they fail."""
    import resource

    ssd = tmp_path / "ssd"
    with MasterProcess(eviction_high_watermark=0.5, eviction_ratio=0.1) as m:
        with StorageProcess(m.address, 8 << 20, ssd_dir=str(ssd), heartbeat_s=0.1) as sp:
            resource.prlimit(sp.pid, resource.RLIMIT_FSIZE, (32 << 10, resource.RLIM_INFINITY))
            with Store.connect(master=m.address, segment_size=0) as st:
                vals = {f"p{i}": pattern(512 << 10, i) for i in range(9)}
                for k, v in vals.items():
                    st.put(k, v, ReplicateConfig(cache_class="persistent"))
                # persistent objects over the watermark are spilled; the spills fail
                wait_for(lambda: stats(m.address)["counters"].get("spills", 0) >= 1, what="a spill")
                time.sleep(1)
                before = stats(m.address)["counters"]["spills"]
                time.sleep(3)
                again = stats(m.address)["counters"]["spills"] - before
                assert again <= 12, f"{again} spills handed to a failing disk in 3 s"
                left = [p.name for p in ssd.rglob("*") if p.is_file()]
                assert left == [], f"failed spills left files behind: {left}"
                assert all(st.info(k)["ssd"] is None for k in vals)
                assert {k: st.get(k) for k in vals} == vals
                assert stats(m.address)["counters"]["spill_disk_errors"] >= 1
                # the disk takes writes again: spills go on after the backoff
                resource.prlimit(sp.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
                wait_for(lambda: any(st.info(k)["ssd"] for k in vals), 20, what="a spill after the backoff")
                assert {k: st.get(k) for k in vals} == vals


def test_a_task_stuck_on_a_stopped_source_does_not_stop_the_clients_heartbeats() -> None:
    """A hot-key copy whose source storage server is SIGSTOPped waits up to transfer_timeout_s
    (4 s here). It runs on the client's task thread, so the client's heartbeats go on and the
    master (client_ttl_s 1.5 s) keeps a healthy client and its segment; tasks used to run on the
    heartbeat thread, and the client was declared dead, its segment unmounted."""
    from kvpool.store.master import Master

    m = Master(port=0, client_ttl_s=1.5).start()
    try:
        with StorageProcess(m.address, 8 << 20, heartbeat_s=0.2, protocol="tcp") as src:
            with Store.connect(master=m.address, segment_size=8 << 20, heartbeat_s=0.2,
                               transfer_timeout_s=4.0, protocol="tcp") as st:  # fmt: skip
                key = None
                for i in range(64):  # an object whose one replica is on the source server
                    st.put(f"k{i}", pattern(100_000, i))
                    if st.info(f"k{i}")["replicas"][0][0] == src.segment:
                        key = f"k{i}"
                        break
                assert key is not None
                info = st.info(key)
                os.kill(src.pid, signal.SIGSTOP)
                try:
                    with m._lock:  # what hot-key replication hands out (Master._replicate)
                        obj = m.objects[key]
                        mine = m.space.segments[st.segment_name]
                        obj.busy += 1
                        task = {"type": "replicate", "key": key, "gen": info["gen"], "size": info["size"],
                                "src": info["replicas"][0][:2],
                                "dst": [mine.name, mine.base + mine.size - info["size"] - 4096]}  # fmt: skip
                        assert m._give_task(st.client_id, task) is not None
                    time.sleep(3.0)  # the copy is still waiting for the stopped source
                    with m._lock:
                        assert st.client_id in m.clients
                        assert st.segment_name in m.space.segments
                        assert not m.space.segments[st.segment_name].dead
                    assert m.snapshot()["counters"].get("clients_dead", 0) <= 1  # the stopped source only
                finally:
                    os.kill(src.pid, signal.SIGCONT)
                st.put("after", pattern(1000, 99))
                assert st.get("after") == pattern(1000, 99)
    finally:
        m.stop()


def test_datapath_batch_whose_later_run_is_refused_settles_the_queued_run_first(double, peer) -> None:  # noqa: F811
    """A data-path batch to an RDMA segment (fake-verbs TEST DOUBLE) and a TCP peer process, the
    TCP request from GPU memory (CUDA TEST DOUBLE) bigger than the staging pool: the submit queues
    the RDMA run, then the staged TCP run is refused. The RDMA request is not done a second time
    beside the queued copy (it was: every request went again one by one, the queued one still in
    flight, and freeing the batch could raise BatchInFlight over the result); the TCP request is
    done in this thread (staged in rounds); both land, and the batch is freed."""
    import xxhash

    from kvpool import OpCode, TransferEngine, TransferRequest
    from kvpool.store.datapath import DataPath
    from kvpool.testing import fake_verbs as fv
    from kvpool.testing import fakecuda

    mib = 1 << 20
    rt = fakecuda.counting_runtime(fakecuda.build())
    dev = rt.alloc(2 * mib)
    with (
        TransferEngine(protocol="rdma", verbs=fv) as t,
        TransferEngine(
            protocol="auto",
            same_host=False,
            verbs=fv,
            device_runtime=rt,
            staging_pool_size=mib,
            timeout_s=5.0,
        ) as i,
    ):
        kv = bytearray(4 * mib)
        base = t.register_local_memory(kv)
        src = bytearray(os.urandom(mib))
        la = i.register_local_memory(src)
        gpu = i.register_local_memory(dev, remote_accessible=False)
        value = os.urandom(2 * mib)
        rt.copy_h2d(gpu, _native.buffer_address(value, True)[0], 2 * mib)
        rseg, tseg = i.open_segment(t.segment_name), i.open_segment(peer.segment)
        data = DataPath(i, None, lambda *a: None, False)  # type: ignore[arg-type]  # run() stages nothing
        ok = data.run(
            [
                TransferRequest(OpCode.WRITE, la, rseg, base, mib),  # queued first (RDMA)
                TransferRequest(OpCode.WRITE, gpu, tseg, peer.addr, 2 * mib),  # staged: refused
            ]
        )
        assert ok == [True, True]
        assert sum(i.rdma.nic_bytes) == mib  # the RDMA request went once
        assert kv[:mib] == src
        assert peer.checksum(0, 2 * mib) == xxhash.xxh3_64_hexdigest(value)
        assert i.batches.deferred() == 0 and i.staging.pool.in_use == 0
    rt.free(dev)


def test_ssd_files_no_copy_has_are_swept_by_the_next_client_on_the_directory(tmp_path) -> None:
    """A storage server with spilled objects is SIGKILLed and never comes back: the master lets
    go of its SSD copies, and their files stayed on the disk for good (nobody was left to unlink
    them), as did the file of a spill whose report was lost. The next client on that directory
    sweeps it: every file no copy has, once older than twice the master's task_timeout_s, is
    removed; a younger one, files of another name and the files of its own copies stay."""
    ssd = tmp_path / "ssd"
    opts = {"eviction_high_watermark": 0.5, "eviction_ratio": 0.1, "task_timeout_s": 2.0, "client_ttl_s": 1.5}
    with MasterProcess(**opts) as m:
        with Store.connect(master=m.address, segment_size=0) as st:
            sp1 = StorageProcess(m.address, 8 << 20, ssd_dir=str(ssd), heartbeat_s=0.1, ssd_sweep_s=0)
            try:
                vals = {f"p{i}": pattern(512 << 10, i) for i in range(9)}
                for k, v in vals.items():
                    st.put(k, v, ReplicateConfig(cache_class="persistent"))
                wait_for(lambda: sum(1 for k in vals if st.info(k)["ssd"]) >= 2, 20, what="spills")
            finally:
                sp1.kill()
            theirs = sorted(ssd.rglob("*.kvp"))
            assert len(theirs) >= 2
            sub = ssd / "ab"
            sub.mkdir(exist_ok=True)
            lost = sub / f"{'ab' * 20}-999999.kvp"  # a spill whose report never reached the master
            other = sub / "notes.txt"  # not a name of the SSD tier
            for p in (lost, other):
                p.write_bytes(b"x" * 100)
                os.utime(p, (time.time() - 60, time.time() - 60))

            def copies() -> set[str]:
                return {st.info(k)["ssd"] for k in vals if st.exists(k)} - {None}

            wait_for(lambda: not copies(), 10, what="the dead server's copies let go")
            with StorageProcess(m.address, 8 << 20, ssd_dir=str(ssd), heartbeat_s=0.1, ssd_sweep_s=0.2):
                young = sub / f"{'cd' * 20}-999998.kvp"
                young.write_bytes(b"y" * 100)  # as a spill's file before its report is taken
                wait_for(
                    lambda: not lost.exists() and all(not p.exists() or str(p) in copies() for p in theirs),
                    20,
                    what="the files no copy has removed",
                )
                assert other.exists() and young.exists()
                assert all(os.path.exists(p) for p in copies())  # the copies' files stay
                for k in vals:  # whatever is still there reads as it was put
                    if st.exists(k):
                        assert st.get(k) == vals[k]


def test_a_late_report_of_a_dropped_ssd_copy_leaves_the_objects_next_copy(tmp_path) -> None:
    """An object's SSD file is reported bad by two readers on its host. The first report drops
    that copy (the object keeps the memory a hit promoted it back into); the object is spilled
    again, and only then does the second report arrive, naming the old copy's file: the new copy
    and its file stay, and the object reads as it was put. The new spill wrote the very same path
    (one per key and generation), so the late report dropped the new copy and unlinked its file,
    and the object, on the SSD tier only by then, was lost."""
    ssd = tmp_path / "ssd"
    with MasterProcess(eviction_high_watermark=0.5, eviction_ratio=0.1) as m:
        with StorageProcess(m.address, 8 << 20, ssd_dir=str(ssd), heartbeat_s=0.1):
            with Store.connect(master=m.address, segment_size=0) as st:
                persistent = ReplicateConfig(cache_class="persistent")
                vals = {f"p{i}": pattern(512 << 10, i) for i in range(9)}
                for k, v in vals.items():
                    st.put(k, v, persistent)

                def ssd_only(k: str) -> bool:
                    info = st.info(k)
                    return bool(info["ssd"]) and not info["replicas"]

                wait_for(lambda: any(ssd_only(k) for k in vals), 20, what="an object on the SSD tier only")
                k = next(k for k in vals if ssd_only(k))
                old, gen = st.info(k)["ssd"], st.info(k)["gen"]
                assert st.get(k) == vals[k]  # a hit on the SSD tier: promoted back into memory
                assert st.info(k)["replicas"]
                bad = {"segment": "", "kind": "ssd_corrupt", "key": k, "gen": gen, "path": old}
                st._rpc.call("report", **bad)  # the first reader's report
                assert st.info(k)["ssd"] is None and st.info(k)["replicas"]
                for i in range(64):  # more persistent objects, until k is spilled again
                    if ssd_only(k):
                        break
                    st.put(f"fill{i}", pattern(512 << 10, 100 + i), persistent)
                    time.sleep(0.2)
                wait_for(lambda: ssd_only(k), 10, what=f"{k} spilled again")
                new = st.info(k)["ssd"]
                assert os.path.exists(new)
                st._rpc.call("report", **bad)  # the second reader's, late
                time.sleep(1.0)  # an unlink it handed out would have run by now
                assert st.exists(k) and st.info(k)["ssd"] == new and os.path.exists(new)
                assert st.get(k) == vals[k]
                assert stats(m.address)["counters"]["ssd_copies_corrupt"] == 1
