"""Bounded chaos soak of the store: real processes, faults, every value verified.

One ``kvpool master``, ``--storage`` ``kvpool store-server`` processes and ``--writers`` +
``--readers`` client processes on loopback; all puts use ``replicas=2`` (``--replicas 1``: one
copy, the small-put fast path; objects a storage fault took away are then expected to go); even-numbered
writers put one key at a time, odd-numbered ones batches of 16 keys (grouped by size). Values describe
themselves (a 16-byte prefix: xxh3 of the key, xxh3 of the rest; the size follows from the key),
so a reader knows the bytes it got are exactly the ones put under that key.

The run is cut into rounds of ``--round-s`` seconds; each round has its own key prefix and one
fault, in turn:

* ``kill-storage``: SIGKILL a storage server mid-traffic (restarted, empty, at the end of the round)
* ``stop-writer``: SIGSTOP a writer for longer than ``put_timeout_s``, then SIGCONT
* ``stop-reader``: SIGSTOP a reader for longer than its lease, then SIGCONT
* ``stop-storage``: SIGSTOP a storage server for longer than ``client_ttl_s``, then SIGCONT
* ``stop-master``: SIGSTOP the master for longer than ``client_ttl_s``, then SIGCONT
* ``kill-master``: SIGKILL the master and start a new one on the same port (its objects are gone
  by design: that round's keys are reported as dropped, not lost)

Writers are throttled and segments sized (3 x 384 MiB) so that a round's keys fit the pool even
with one storage server down: a key missing at the end of a round was lost, not evicted (the
evictions column says so).

At the end of each round the controller reads back every key a writer reported as put in that
round: one missing is *lost* (a replica should have survived), one with other bytes is *wrong*.
Printed: ops done, wrong bytes returned (reads and checks), objects lost, typed errors by kind,
and per fault the time until a probe client's put and get worked again.

    python benchmarks/store_chaos.py --duration 600 [--round-s 20] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from kvpool import Store
from kvpool._smoke import shorten
from kvpool.child import free_port
from kvpool.errors import KvpoolError
from kvpool.store.procs import MasterProcess, StorageProcess

FAULTS = ("kill-storage", "stop-writer", "stop-reader", "stop-storage", "stop-master", "kill-master")
MASTER_OPTS = {"put_timeout_s": 4.0, "quarantine_s": 3.0, "lease_ttl_ms": 3000, "client_ttl_s": 3.0,
               "fence_hold_s": 10.0}  # fmt: skip
RECOVERY_WAIT_S = 10.0  # after a round, how long a probe that has not recovered yet is waited for
CLIENT_OPTS = {"transfer_timeout_s": 2.0, "rpc_timeout_s": 2.0, "heartbeat_s": 0.3}

# Shared by the worker processes (run with ``python -c``) and the controller.
VALUES = """
import struct, xxhash
from kvpool import _native
SIZES = (4096, 4096, 16384, 65536, 100_000, 300_000)

def size_of(key):
    return SIZES[xxhash.xxh3_64_intdigest(key.encode()) % len(SIZES)]

def make(key):
    n = size_of(key)
    buf = bytearray(n)
    kh = xxhash.xxh3_64_intdigest(key.encode())
    _native.fill_pattern(_native.buffer_address(buf)[0] + 16, n - 16, kh & 0xFFFFFFFF)
    struct.pack_into("<QQ", buf, 0, kh, xxhash.xxh3_64_intdigest(memoryview(buf)[16:]))
    return bytes(buf)

def good(key, data):
    if len(data) != size_of(key):
        return False
    kh, ph = struct.unpack_from("<QQ", data)
    rest = xxhash.xxh3_64_intdigest(memoryview(data)[16:])
    return kh == xxhash.xxh3_64_intdigest(key.encode()) and ph == rest
"""

WORKER = (
    VALUES
    + """
import json, os, random, sys, time
from kvpool import ReplicateConfig, Store
from kvpool.errors import KvpoolError, ObjectNotFound
role, wid, master, state_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
opts = json.loads(sys.argv[5])
cfg = ReplicateConfig(replicas=opts.pop("replicas"))
st = Store.connect(master=master, segment_size=0, **opts)
stats = {"ops": 0, "wrong": 0, "miss": 0, "errors": {}}
acked = []
last = time.monotonic()
progress = {}
i = 0
def state():
    try:
        with open(os.path.join(state_dir, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"round": 0, "progress": {}, "stop": False}
s = state()
while not s.get("stop"):
    rnd = s["round"]
    try:
        if role == "w" and wid % 2:
            # Odd writers put batches: 16 keys at a time, those of one size together (a batch of
            # equal sizes is written into reservations and committed with one round trip).
            keys = [f"r{rnd}-w{wid}-{i + j}" for j in range(16)]
            i += 16
            groups = {}
            for key in keys:
                groups.setdefault(size_of(key), []).append(key)
            for group in groups.values():
                for key, err in zip(group, st.batch_put(group, [make(k) for k in group], cfg)):
                    if err is None:
                        acked.append(key)
                    else:
                        name = type(err).__name__
                        stats["errors"][name] = stats["errors"].get(name, 0) + 1
            stats["ops"] += len(keys) - 1
            time.sleep(0.02 * len(keys))
        elif role == "w":
            key = f"r{rnd}-w{wid}-{i}"
            i += 1
            st.put(key, make(key), cfg)
            acked.append(key)
            time.sleep(0.02)  # about 50 puts/s: a round's keys fit the pool (no eviction)
        else:
            w = random.randrange(int(s.get("writers", 1)))
            p = s["progress"].get(str(w))
            if not p or p[1] == 0:
                time.sleep(0.01)
                raise ObjectNotFound("nothing put yet")
            key = f"r{p[0]}-w{w}-{random.randrange(p[1])}"
            data = st.get(key)
            if not good(key, data):
                stats["wrong"] += 1
                print(json.dumps({"wrong": key}), flush=True)
        stats["ops"] += 1
    except ObjectNotFound:
        stats["miss"] += 1
    except KvpoolError as exc:
        name = type(exc).__name__
        stats["errors"][name] = stats["errors"].get(name, 0) + 1
        time.sleep(0.02)
    now = time.monotonic()
    if now - last > 0.3:
        last = now
        msg = {"role": role, "wid": wid, "round": rnd, "acked": acked, "count": i, **stats}
        print(json.dumps(msg), flush=True)
        acked = []
        s = state()
        if role == "w" and s["round"] != rnd:
            i = 0
msg = {"role": role, "wid": wid, "round": -1, "acked": acked, "count": i, "final": True, **stats}
print(json.dumps(msg), flush=True)
st.close()
"""
)


class Worker:
    """A writer or reader process; its JSON lines are collected by a thread."""

    def __init__(self, role: str, wid: int, master: str, state_dir: str, replicas: int = 2) -> None:
        self.role, self.wid = role, wid
        opts = json.dumps({**CLIENT_OPTS, "replicas": replicas})
        cmd = [sys.executable, "-c", WORKER, role, str(wid), master, state_dir, opts]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.lines: collections.deque[dict[str, Any]] = collections.deque()
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                pass

    def signal(self, sig: int) -> None:
        os.kill(self.p.pid, sig)


def _probe(master: str, events: list[tuple[float, bool]], stop: threading.Event) -> None:
    """A client doing a small put + get every 50 ms; records (time, worked). Every attempt uses
    a fresh key: a put whose answer was lost in a fault (the master committed it while this client
    timed out) leaves its key taken, and retrying that key would fail with ObjectExists forever."""
    st: Store | None = None
    i = 0
    while not stop.is_set():
        ok = False
        key = f"probe-{i}"
        i += 1
        try:
            if st is None:
                st = Store.connect(master=master, segment_size=0, **CLIENT_OPTS)
            st.put(key, key.encode() * 8)
            ok = st.get(key) == key.encode() * 8
        except KvpoolError:
            pass
        events.append((time.monotonic(), ok))
        stop.wait(0.05)
    if st is not None:
        st.close()


def _recovery(events: list[tuple[float, bool]], t0: float, t1: float) -> float | None:
    """Seconds from ``t0`` until the probe worked again after its first failure (0: never failed)."""
    failed_at = None
    for t, ok in events:
        if t < t0 or t > t1:
            continue
        if not ok and failed_at is None:
            failed_at = t
        if ok and failed_at is not None:
            return t - t0
    return 0.0 if failed_at is None else None


def run(duration: float, round_s: float, writers: int, readers: int, storage: int,
        segment_size: int = 384 << 20, rounds: int | None = None,
        replicas: int = 2) -> dict[str, Any]:  # fmt: skip
    """Run the soak (rounds start until ``duration`` passed, or exactly ``rounds``); returns the
    summary. ``replicas=1``: objects on a storage server that a fault took away are expected to go
    (counted as ``lost_single_copy``, not lost); wrong bytes still count."""
    ns: dict[str, Any] = {}
    exec(textwrap.dedent(VALUES), ns)  # noqa: S102 - the same value functions the workers use
    good = ns["good"]
    port = free_port()
    state_dir = tempfile.mkdtemp(prefix="kvpool-chaos-")
    state = {"round": 0, "progress": {}, "stop": False, "writers": writers}

    def publish() -> None:
        tmp = Path(state_dir, "state.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, Path(state_dir, "state.json"))

    publish()
    summary: dict[str, Any] = {"rounds": [], "errors": collections.Counter(), "wrong": 0, "lost": 0,
                               "dropped_by_master_restart": 0, "ops": 0, "misses": 0,
                               "lost_single_copy": 0}  # fmt: skip
    master = MasterProcess(port=port, **MASTER_OPTS)
    servers = [StorageProcess(master.address, segment_size, **CLIENT_OPTS) for _ in range(storage)]
    workers = [Worker("w", i, master.address, state_dir, replicas) for i in range(writers)]
    workers += [Worker("r", i, master.address, state_dir, replicas) for i in range(readers)]
    checker = Store.connect(master=master.address, segment_size=0, location_cache=0, **CLIENT_OPTS)
    events: list[tuple[float, bool]] = []
    stop_probe = threading.Event()
    probe = threading.Thread(target=_probe, args=(master.address, events, stop_probe), daemon=True)
    probe.start()
    acked: dict[int, list[str]] = collections.defaultdict(list)

    def drain() -> None:
        for w in workers:
            while w.lines:
                msg = w.lines.popleft()
                if "role" not in msg:
                    continue  # {"wrong": key}: counted in the worker's stats too
                if msg["role"] == "w":
                    for k in msg["acked"]:
                        acked[int(k.split("-")[0][1:])].append(k)
                    if msg["round"] == state["round"]:
                        state["progress"][str(msg["wid"])] = [msg["round"], msg["count"]]
                if msg.get("final"):
                    summary["ops"] += msg["ops"]
                    summary["wrong"] += msg["wrong"]
                    summary["misses"] += msg["miss"]
                    summary["errors"].update(msg["errors"])

    t_end = time.monotonic() + duration
    rnd = 0
    evicted_before = _counter(checker, "evictions")
    try:
        while (rnd < rounds) if rounds is not None else (time.monotonic() < t_end):
            fault = FAULTS[rnd % len(FAULTS)]
            state["round"], state["progress"] = rnd, {}
            publish()
            t_round = time.monotonic()
            time.sleep(round_s * 0.3)
            drain()
            publish()
            t_fault = time.monotonic()
            victim = ""
            if fault == "kill-storage":
                victim = servers[rnd % storage].segment
                servers[rnd % storage].kill()
            elif fault in ("stop-writer", "stop-reader"):
                w = [x for x in workers if x.role == fault[5]][
                    rnd % (writers if fault == "stop-writer" else readers)
                ]
                victim = f"{w.role}{w.wid}"
                w.signal(signal.SIGSTOP)
                time.sleep(MASTER_OPTS["put_timeout_s"] + 1.5)
                w.signal(signal.SIGCONT)
            elif fault == "stop-storage":
                s = servers[rnd % storage]
                victim = s.segment
                os.kill(s.pid, signal.SIGSTOP)
                time.sleep(MASTER_OPTS["client_ttl_s"] + 1.5)
                os.kill(s.pid, signal.SIGCONT)
            elif fault == "stop-master":
                os.kill(master.pid, signal.SIGSTOP)
                time.sleep(MASTER_OPTS["client_ttl_s"] + 1.5)
                os.kill(master.pid, signal.SIGCONT)
            elif fault == "kill-master":
                master.kill()
                master = MasterProcess(port=port, **MASTER_OPTS)
            while time.monotonic() < t_round + round_s:
                time.sleep(0.2)
                drain()
                publish()
            # End of round: writers move on; every key of this round that was acked is checked.
            state["round"] = rnd + 1
            publish()
            time.sleep(1.0)
            drain()
            keys = acked.pop(rnd, [])
            evicted = _counter(checker, "evictions")
            evictions = evicted - evicted_before if evicted >= evicted_before else evicted  # new master
            evicted_before = evicted
            lost = wrong = 0
            for a in range(0, len(keys), 256):
                chunk = keys[a : a + 256]
                for k, data in zip(chunk, _get_all(checker, chunk), strict=True):
                    if data is None:
                        lost += 1
                    elif not good(k, data):
                        wrong += 1
            rec = _recovery(events, t_fault, time.monotonic())
            wait_until = time.monotonic() + RECOVERY_WAIT_S
            while rec is None and time.monotonic() < wait_until:  # not yet: give it a bounded while
                time.sleep(0.1)
                rec = _recovery(events, t_fault, time.monotonic())
            if fault == "kill-master":
                summary["dropped_by_master_restart"] += lost
                lost_shown = 0
            elif replicas == 1 and fault in ("kill-storage", "stop-storage"):
                summary["lost_single_copy"] += lost  # their only copy went with the server
                lost_shown = 0
            else:
                summary["lost"] += lost
                lost_shown = lost
            summary["wrong"] += wrong
            summary["rounds"].append({"round": rnd, "fault": fault, "victim": victim, "keys": len(keys),
                                      "lost": lost_shown, "wrong_in_check": wrong, "evictions": evictions,
                                      "recovery_s": None if rec is None else round(rec, 2)})  # fmt: skip
            print(json.dumps(summary["rounds"][-1]), file=sys.stderr, flush=True)
            for a in range(0, len(keys), 256):
                for k in keys[a : a + 256]:
                    try:
                        checker.remove(k, force=True)
                    except KvpoolError:
                        pass
            if fault == "kill-storage":
                i = rnd % storage
                servers[i].close()
                servers[i] = StorageProcess(master.address, segment_size, **CLIENT_OPTS)
            rnd += 1
    finally:
        state["stop"] = True
        publish()
        for w in workers:
            try:
                w.signal(signal.SIGCONT)
                w.p.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                w.p.kill()
            w.t.join(5)
        drain()
        stop_probe.set()
        probe.join(10)
        checker.close()
        for s in servers:
            s.close()
        master.close()
    summary["errors"] = dict(summary["errors"])
    return summary


def _counter(st: Store, name: str) -> int:
    """A master counter (0 when the master cannot say: it was just restarted)."""
    for attempt in range(20):
        try:
            return int(st.stats()["counters"].get(name, 0))
        except KvpoolError:
            time.sleep(0.5 * (attempt + 1))
    return 0


def _get_all(st: Store, keys: list[str]) -> list[bytes | None]:
    """Bytes of each key (None when missing); retried through a master restart or stall."""
    for attempt in range(20):
        try:
            return st.batch_get(keys)
        except KvpoolError:
            time.sleep(0.5 * (attempt + 1))
    return st.batch_get(keys)


def main(argv: list[str] | None = None) -> int:
    """Run and print the summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--round-s", type=float, default=20.0)
    ap.add_argument("--writers", type=int, default=3)
    ap.add_argument("--readers", type=int, default=3)
    ap.add_argument("--storage", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=None, help="run exactly this many rounds")
    ap.add_argument("--replicas", type=int, default=2, help="1: one copy (the small-put fast path)")
    ap.add_argument("--json", action="store_true")
    a = shorten(ap.parse_args(argv), rounds=1, round_s=6.5, writers=1, readers=1)
    t0 = time.monotonic()
    res = run(a.duration, a.round_s, a.writers, a.readers, a.storage, rounds=a.rounds, replicas=a.replicas)
    res["elapsed_s"] = round(time.monotonic() - t0, 1)
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"ops {res['ops']:,}  wrong bytes returned {res['wrong']}  objects lost {res['lost']}")
    print(f"dropped by master restart {res['dropped_by_master_restart']}  misses {res['misses']:,}"
          f"  lost with their only copy (replicas=1) {res['lost_single_copy']}")  # fmt: skip
    print(f"typed errors: {json.dumps(res['errors'])}")
    print("| round | fault | keys checked | lost | evictions | recovery s |\n|---|---|---|---|---|---|")
    for r in res["rounds"]:
        cells = (r["round"], r["fault"], r["keys"], r["lost"], r["evictions"], r["recovery_s"])
        print("| " + " | ".join(str(c) for c in cells) + " |")
    return 0 if res["wrong"] == 0 and res["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
