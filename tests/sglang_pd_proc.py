"""One SGLang disaggregation role in a plain process (run by the SGLang interpreter; no model,
no scheduler): real SGLang 0.5.23 KVArgs/bootstrap server/Common* classes resolved through the
plugin, kvpool's manager/sender/receiver, KV laid out as SGLang's MHATokenToKVPool lays it out
(per layer one K and one V buffer of ``(pages * page_size, kv_heads, head_dim)`` bf16, one page
per ``item_len``) plus aux rows. Prints JSON lines.

    python tests/sglang_pd_proc.py prefill|prefill-bounds|prefill-late|bootstrap|decode|decode-badaddr \\
        <bootstrap_port> <scenario>
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "2")
os.environ.setdefault("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "2")

LAYERS, PAGE, HEADS, HEAD_DIM = 4, 16, 2, 64
PAGES = 96
AUX_SLOTS, AUX_ITEMS = 8, (8, 64)  # two aux buffers, bytes per request slot
# room -> pages; 1: transferred in 3 chunks, 2: aborted by decode, 3: TP mismatch, 4: the decode
# gives SHORT destination pages fewer than the prefill sends
ROOMS = {1: 40, 2: 8, 3: 8, 4: 16}
SHORT = 4
CHUNKS = (13, 17, 10)


def out(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def pages(rng, n: int, run_start: int):
    """n distinct page ids (page 0 is SGLang's padding page): a contiguous run of 10, then random."""
    import numpy as np

    run = np.arange(run_start, run_start + 10)
    rest = rng.permutation(np.setdiff1d(np.arange(1, PAGES), run))
    return np.concatenate([run, rest])[:n].astype(np.int32)


def digests(bufs: list, pages, item: int) -> list[list[str]]:
    """xxh3-64 of every page of every buffer, in page order (every byte compared)."""
    import torch
    import xxhash

    views = [t.reshape(-1).view(torch.uint8).numpy() for t in bufs]
    return [[xxhash.xxh3_64_hexdigest(v[p * item : (p + 1) * item]) for p in pages] for v in views]


def setup(mode: str, port: int, policy: str = "early"):
    import numpy as np
    import torch
    from sglang.srt.plugins import load_plugins

    load_plugins()  # finds kvpool's entry point (group sglang.srt.plugins)
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    backend = TransferBackend("kvpool")
    sa = ServerArgs(
        model_path="dummy",
        host="127.0.0.1",
        port=30000 if mode == "prefill" else 30001,
        disaggregation_mode="prefill" if mode == "prefill" else "decode",
        disaggregation_transfer_backend="kvpool",
        disaggregation_bootstrap_port=port,
        device="cpu",
        disaggregation_decode_allocation_policy=policy,
    )
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    get_parallel().override_permanently(pp_group=None)
    g = torch.Generator().manual_seed(7)
    k = [torch.zeros(PAGES * PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.zeros(PAGES * PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    aux = [np.zeros(AUX_SLOTS * n, np.uint8) for n in AUX_ITEMS]
    if mode == "prefill":
        for t in k + v:
            t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
        for i, a in enumerate(aux):
            a[:] = np.arange(a.size, dtype=np.uint8) + 17 * (i + 1)
    bufs = k + v
    item = PAGE * HEADS * HEAD_DIM * 2

    def kv_args():
        a = get_kv_class(backend, KVClassType.KVARGS)()
        a.engine_rank, a.pp_rank, a.system_dp_rank, a.rust_http_port = 0, 0, 0, None
        a.kv_cache_dtype_str, a.kv_layout = "bfloat16", None
        a.kv_data_ptrs = [t.data_ptr() for t in bufs]
        a.kv_data_lens = [t.numel() * 2 for t in bufs]
        a.kv_item_lens = [item] * len(bufs)
        a.kv_layer_ids, a.num_draft_entries = [], 0
        a.kv_head_num = a.total_kv_head_num = HEADS
        a.page_size = PAGE
        a.prefill_start_layer, a.prefill_end_layer = 0, LAYERS
        a.aux_data_ptrs = [x.ctypes.data for x in aux]
        a.aux_data_lens = [x.nbytes for x in aux]
        a.aux_item_lens = list(AUX_ITEMS)
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        a.state_layer_ids, a.state_dim_per_tensor, a.state_slice_outer_counts = [], [], []
        a.ib_device, a.gpu_id = None, 0
        return a

    mgr_cls = get_kv_class(backend, KVClassType.MANAGER)
    return np, backend, get_kv_class, KVClassType, DisaggregationMode, sa, kv_args, mgr_cls, bufs, aux, item


def prefill(port: int, scenario: str) -> None:
    from sglang.srt.disaggregation.base import KVPoll

    np, backend, get_kv_class, T, Mode, sa, kv_args, mgr_cls, bufs, aux, item = setup("prefill", port)
    server = get_kv_class(backend, T.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    mgr = mgr_cls(kv_args(), Mode.PREFILL, sa, False)
    out(event="ready", manager=type(mgr).__name__, sender=get_kv_class(backend, T.SENDER).__name__,
        rank_port=mgr.rank_port)  # fmt: skip
    rooms = ROOMS if scenario == "main" else {1: ROOMS[1]}
    senders = {
        r: get_kv_class(backend, T.SENDER)(mgr=mgr, bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=r)
        for r in rooms
    }
    rng = np.random.default_rng(3)
    src_pages = {r: pages(rng, n, 20) for r, n in rooms.items()}
    out(
        event="src",
        kv={r: digests(bufs, p.tolist(), item) for r, p in src_pages.items()},
        aux=[bytes(a[2 * n : 3 * n]).hex() for a, n in zip(aux, AUX_ITEMS, strict=True)],
    )
    t0 = time.monotonic()
    pending = set(rooms)
    started: set[int] = set()
    while pending and time.monotonic() - t0 < 60:
        for r in sorted(pending):
            s = senders[r].poll()
            if s == KVPoll.WaitingForInput and r not in started:
                if scenario in ("abort-inflight", "auth"):  # the test acts (stops the decode), then says go
                    out(event="waiting-go", room=r)
                    while not os.path.exists(os.environ["KVPOOL_TEST_GO"]):
                        time.sleep(0.01)
                started.add(r)
                senders[r].init(len(src_pages[r]), 2)
                chunks = (len(src_pages[r]),) if r != 1 or scenario == "abort-inflight" else CHUNKS
                i = 0
                for j, n in enumerate(chunks):
                    senders[r].send(src_pages[r][i : i + n])
                    i += n
                    if scenario == "kill" and j == 0:
                        time.sleep(0.5)
                        out(event="first-chunk-sent", room=r)
                        time.sleep(600)  # the test kills this process now
                if scenario == "abort-inflight":  # the test aborts the room once its write runs
                    while not mgr._in_flight.get(r) and time.monotonic() - t0 < 60:
                        time.sleep(0.01)
                    out(event="writing", room=r)
            elif s in (KVPoll.Success, KVPoll.Failed):
                reason = None
                if s == KVPoll.Failed:
                    try:
                        senders[r].failure_exception()
                    except Exception as exc:  # noqa: BLE001 - KVTransferError carries the reason
                        reason = str(exc)
                refused = dict(server.bootstrap_auth.dropped) if hasattr(server, "bootstrap_auth") else {}
                out(event="done", room=r, status=int(s), reason=reason, calls=mgr.transfer_calls,
                    dropped=dict(mgr.control_auth.dropped), bootstrap_dropped=refused)  # fmt: skip
                pending.discard(r)
        time.sleep(0.01)
    # abort-inflight: the room failed at the abort, its WRITE still runs; stay up until it drained.
    time.sleep(30.0 if scenario == "abort-inflight" else 1.0)
    server.close()


def prefill_bounds(port: int) -> None:
    """A prefill whose control socket gets metadata and registrations over ZMQ from here, as decode
    ranks send them, under small bounds (KVPOOL_SGLANG_MAX_ROOMS, KVPOOL_SGLANG_ROOM_TTL_S,
    KVPOOL_SGLANG_MAX_PEERS from the test); the
    Failed statuses it sends back come to a socket of this process. Prints one "bounds" event."""
    import msgpack
    import zmq

    np, backend, get_kv_class, T, Mode, sa, kv_args, mgr_cls, bufs, aux, item = setup("prefill", port)
    server = get_kv_class(backend, T.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    mgr = mgr_cls(kv_args(), Mode.PREFILL, sa, False)
    # A request of this prefill holds room 100.
    get_kv_class(backend, T.SENDER)(mgr=mgr, bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=100)
    ctx = zmq.Context()
    status = ctx.socket(zmq.PULL)
    status_port = status.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{mgr.rank_port}")

    def meta(room: int, session: str, need: int = 1) -> None:
        kv = np.arange(4, dtype=np.int32).tobytes()
        body = {"room": room, "ip": "127.0.0.1", "port": status_port, "session": session, "need": need,
                "dummy": False, "kv": kv, "aux": None, "prefix": 0}  # fmt: skip
        push.send_multipart([b"KVPOOL_META", msgpack.packb(body)])

    def statuses(n: int) -> list:
        """(room, status, reason) of the next n status messages (fewer when none comes in 10 s)."""
        got = []
        while len(got) < n and status.poll(10000):
            m = status.recv_multipart()
            got.append([int(m[0]), int(m[1]), m[3].decode()])
        return got

    res: dict = {}
    for session in ("s0", "s1", "s2", "s3"):  # room 50 needs 2 decode ranks
        meta(50, session, need=2)
    res["sessions"] = statuses(2)
    res["room50"] = sorted(mgr.transfer_infos.get(50, {}))
    for room in (100, 101, 102, 103, 104):
        meta(room, "s0")
    res["rooms_refused"] = statuses(2)
    res["rooms"] = sorted(mgr.transfer_infos)
    time.sleep(float(os.environ["KVPOOL_SGLANG_ROOM_TTL_S"]) + 0.5)
    meta(300, "s0")
    t0 = time.monotonic()
    while 300 not in mgr.transfer_infos and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    res["after_ttl"] = sorted(mgr.transfer_infos)
    res["status_after_ttl"] = sorted(mgr.request_status)
    rooms = getattr(mgr, "rooms", None)
    res["refused"], res["evicted"] = (rooms.refused, rooms.evicted) if rooms else (0, 0)
    # Decode ranks register (KVPOOL_SGLANG_MAX_PEERS from the test): p0 .. p4.
    for i in range(5):
        body = {"ip": "127.0.0.1", "port": status_port, "session": f"p{i}", "kv_ptrs": [0] * len(bufs),
                "kv_item_lens": [item] * len(bufs), "aux_ptrs": [0] * len(aux), "engine_rank": 0,
                "aux_item_lens": list(AUX_ITEMS), "attn_tp_size": 1, "page_size": PAGE}  # fmt: skip
        push.send_multipart([b"KVPOOL_REG", msgpack.packb(body)])
    peers = mgr.peers
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and (
        peers.get("p4") is None if hasattr(peers, "sessions") else "p4" not in peers
    ):
        time.sleep(0.01)
    res["peers"] = peers.sessions() if hasattr(peers, "sessions") else list(peers)
    res["peers_evicted"] = getattr(peers, "evicted", 0)
    # Registrations this prefill cannot serve: another page size; another TP size with 200,000 KV
    # buffer addresses; aux rows shorter than the prefill's. Kept: their session and why.
    good = {"ip": "127.0.0.1", "port": status_port, "kv_ptrs": [0] * len(bufs), "engine_rank": 0,
            "kv_item_lens": [item] * len(bufs), "aux_ptrs": [0] * len(aux),
            "aux_item_lens": list(AUX_ITEMS), "attn_tp_size": 1, "page_size": PAGE}  # fmt: skip
    bad = {
        "bad-page": {"page_size": PAGE * 2},
        "bad-tp": {"attn_tp_size": 2, "kv_ptrs": [1] * 200_000},
        "bad-aux": {"aux_item_lens": [AUX_ITEMS[0], AUX_ITEMS[1] - 1]},
    }
    for session, change in bad.items():
        push.send_multipart([b"KVPOOL_REG", msgpack.packb(dict(good, session=session, **change))])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and peers.get("bad-aux") is None:
        time.sleep(0.01)
    res["refused_peers"] = {
        s: [len(vars(peers.get(s))), len(getattr(peers.get(s), "kv_ptrs", ())), peers.get(s).incompatible]
        for s in bad
    }
    meta(400, "bad-page")  # a room of a refused decode rank fails with the reason
    res["refused_room"] = statuses(1)
    # The prefill's request for room 400 comes after its metadata: its sender fails at once.
    from sglang.srt.disaggregation.base import KVPoll

    late = get_kv_class(backend, T.SENDER)(mgr=mgr, bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=400)
    t0 = time.monotonic()
    while late.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    late_status, late_reason = int(late.poll()), None
    if late_status == KVPoll.Failed:
        try:
            late.failure_exception()
        except Exception as exc:  # noqa: BLE001 - KVTransferError carries the reason
            late_reason = str(exc)
    res["refused_late_sender"] = [late_status, late_reason]
    out(event="bounds", **res)
    push.close(0)
    status.close(0)
    server.close()


def bootstrap(port: int) -> None:
    """Only a bootstrap server (kvpool's, through the plugin), until killed."""
    _, backend, get_kv_class, T, *_ = setup("prefill", port)
    import urllib.request

    server = get_kv_class(backend, T.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    for _ in range(600):  # it serves from a thread of its own: ready once it answers
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                break
        except OSError:
            time.sleep(0.1)
    out(event="ready", server=type(server).__name__)
    time.sleep(600)


def decode(port: int, scenario: str, bad: bool) -> None:
    from sglang.srt.disaggregation.base import KVPoll

    np, backend, get_kv_class, T, Mode, sa, kv_args, mgr_cls, bufs, aux, item = setup("decode", port)
    mgr = mgr_cls(kv_args(), Mode.DECODE, sa, False)
    addr = f"127.0.0.1:{port}"
    t0 = time.monotonic()
    while not mgr.try_ensure_parallel_info(addr) and time.monotonic() - t0 < (3 if bad else 60):
        time.sleep(0.2)
    rooms = ROOMS if scenario == "main" else {1: ROOMS[1]}
    if bad:
        rooms = {9: 4}
    rng = np.random.default_rng(5)
    dst_pages = {r: pages(rng, n, 50) for r, n in rooms.items()}
    out(event="dst", pages={r: p.tolist() for r, p in dst_pages.items()}, rank_port=mgr.rank_port)
    receivers = {}
    for r in rooms:
        m = mgr
        if r == 3:  # a decode whose attention TP differs from the prefill's
            m = mgr_cls(kv_args(), Mode.DECODE, sa, False)
            m.attn_tp_size = 2
            m.try_ensure_parallel_info(addr)
        receivers[r] = get_kv_class(backend, T.RECEIVER)(mgr=m, bootstrap_addr=addr, bootstrap_room=r)
        receivers[r].init(0)
        if r == 2:  # aborted before its metadata: the prefill must give the room up
            receivers[r].abort()
        elif receivers[r].poll() != KVPoll.Failed:
            receivers[r].send_metadata(dst_pages[r][:-SHORT] if r == 4 else dst_pages[r], 5, None)
    pending = set(rooms)
    while pending and time.monotonic() - t0 < 90:
        for r in sorted(pending):
            s = receivers[r].poll()
            if s in (KVPoll.Success, KVPoll.Failed):
                reason = None
                if s == KVPoll.Failed:
                    try:
                        receivers[r].failure_exception()
                    except Exception as exc:  # noqa: BLE001
                        reason = str(exc)
                res = dict(event="done", room=r, status=int(s), reason=reason, t=time.monotonic() - t0,
                           dropped=dict(mgr.control_auth.dropped))  # fmt: skip
                if s == KVPoll.Success:
                    res["kv"] = digests(bufs, dst_pages[r], item)
                    res["aux"] = [bytes(a[5 * n : 6 * n]).hex() for a, n in zip(aux, AUX_ITEMS, strict=True)]
                out(**res)
                pending.discard(r)
        time.sleep(0.01)


def prefill_late(port: int, scenario: str) -> None:
    """A prefill whose KV buffers are (fake-driver, KVPOOL_CUDA_DRIVER) GPU memory WRITEs to a
    decode rank whose buffers are GPU memory of a peer process (tests/cuda_ipc_peer.py), over CUDA
    IPC; the decode's registration, metadata and ABORT come over ZMQ from here, its statuses and
    acks come back here. Room 1 moves normally; then the stream stops (no event completes until
    this process lets it, once rooms 2 to 4 were looked at): room 2's and room 3's batches
    raise TransferTimeout with their copies queued, room 3 is aborted (deferred ack), room 4 (a
    dummy destination, on room 2's worker) is sent and polled for Success meanwhile; but for
    "late-pc", room 3 has a second decode rank, B (never written: it comes second), that aborts
    it too. Prints one "late" event: what reached the "decode" (and B) while stopped, each
    status/ack afterwards with whether its room's batch had settled when it came, room 1's page
    digests on both sides and the errors the backend logged. Scenario "late-pc": SGLang's
    ``prefill_complete`` allocation policy (the decode's BOOTSTRAP registers its endpoint, the
    prefill tells it WaitingForInput when its prefill completed, Success only once the sender is
    cleared; an ABORT goes through SGLang's own handling first); "notified" lists those
    WaitingForInput notices."""
    import hashlib

    import msgpack
    import zmq
    from sglang.srt.disaggregation.base import KVPoll

    from kvpool import _native
    from kvpool.testing.fakecuda import SyncHold
    from kvpool.transfer.cuda_driver import load_driver
    from kvpool.transfer.cuda_ipc import CudaIpcTransport

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cuda_ipc_peer import Peer

    pc = scenario == "late-pc"
    np, backend, get_kv_class, T, Mode, sa, kv_args, mgr_cls, bufs, aux, item = setup(
        "prefill", port, "prefill_complete" if pc else "early"
    )
    import logging

    errors: list[str] = []  # what the backend logs as errors

    class Errors(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    logging.getLogger("kvpool.connectors.sglang").addHandler(Errors())
    # The KV buffers register as cuda:0 (the fake driver's): SGLang resolved "cpu" (no CUDA here).
    import msgspec

    msgspec.Struct.__setattr__(sa, "device", "cuda")  # past SGLang's seal on its resolved args
    drv = load_driver()
    n = PAGES * item
    src = [drv.alloc(n, 0) for _ in bufs]
    host = bytearray(n)
    for i, g in enumerate(src):
        _native.fill_pattern(_native.buffer_address(host)[0], n, 11 + i)
        drv.memcpy(g, _native.buffer_address(host)[0], n)
    a = kv_args()
    a.kv_data_ptrs = src
    server = get_kv_class(backend, T.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    mgr = mgr_cls(a, Mode.PREFILL, sa, False)
    peer = Peer(len(bufs), n)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    in_port = inbox.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{mgr.rank_port}")
    reg = {"ip": "127.0.0.1", "port": in_port, "session": peer.name, "kv_ptrs": peer.gpu, "engine_rank": 0,
           "kv_item_lens": [item] * len(bufs), "aux_ptrs": [], "aux_item_lens": [], "attn_tp_size": 1,
           "page_size": PAGE}  # fmt: skip
    push.send_multipart([b"KVPOOL_REG", msgpack.packb(reg)])
    # Not under prefill_complete (one decode rank per room): room 3 has a second decode rank, B,
    # with a control socket of its own here; it comes second, so nothing is written to it (the
    # first rank's WRITE times out first).
    b_inbox = ctx.socket(zmq.PULL)
    b_port = b_inbox.bind_to_random_port("tcp://127.0.0.1")
    if not pc:
        push.send_multipart(
            [b"KVPOOL_REG", msgpack.packb(dict(reg, port=b_port, session="rank-b", engine_rank=1))]
        )
    t0 = time.monotonic()
    while (
        mgr.peers.get(peer.name) is None or not pc and mgr.peers.get("rank-b") is None
    ) and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    src_pages = {1: [3, 4, 5, 9], 2: [10, 11, 12], 3: [20, 21]}
    dst_pages = {1: [30, 31, 32, 40], 2: [50, 51, 52], 3: [60, 61]}
    senders = {}
    for r, dst in dst_pages.items():
        senders[r] = get_kv_class(backend, T.SENDER)(
            mgr=mgr, bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=r
        )
        need = 2 if r == 3 and not pc else 1
        body = {"room": r, "ip": "127.0.0.1", "port": in_port, "session": peer.name, "dummy": False,
                "kv": np.asarray(dst, np.int32).tobytes(), "aux": None, "need": need,
                "prefix": 0}  # fmt: skip
        push.send_multipart([b"KVPOOL_META", msgpack.packb(body)])
        if need == 2:
            push.send_multipart([b"KVPOOL_META", msgpack.packb(dict(body, port=b_port, session="rank-b"))])
    # Room 4: a dummy destination (nothing to write), on room 2's worker (KVPOOL_SGLANG_WORKERS=2).
    senders[4] = get_kv_class(backend, T.SENDER)(
        mgr=mgr, bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=4
    )
    body = {"room": 4, "ip": "127.0.0.1", "port": in_port, "session": peer.name, "dummy": True, "kv": b"",
            "aux": None, "need": 1, "prefix": 0}  # fmt: skip
    push.send_multipart([b"KVPOOL_META", msgpack.packb(body)])
    notified: list = []
    if pc:  # the decode registers its endpoint; the prefill completes and tells it
        for r in senders:
            push.send_multipart([b"BOOTSTRAP", str(r).encode(), b"127.0.0.1", str(in_port).encode()])
        time.sleep(0.5)
        for s in senders.values():
            s.mark_prefill_complete()
        t0 = time.monotonic()
        while len(notified) < len(senders) and time.monotonic() - t0 < 10:
            if inbox.poll(200):
                m = inbox.recv_multipart()
                notified.append([int(m[0]), int(m[1])])
    t0 = time.monotonic()
    while any(s.poll() != KVPoll.WaitingForInput for s in senders.values()) and time.monotonic() - t0 < 10:
        time.sleep(0.01)

    def inbox_msgs(wait_ms: int = 0) -> list:
        got = []
        while inbox.poll(wait_ms):
            m = inbox.recv_multipart()
            room = int(m[1] if m[0] == b"ABORT_ACK" else m[0])
            kind = "ack" if m[0] == b"ABORT_ACK" else int(m[1])
            got.append([room, kind, bool(bid.get(room) is None or mgr.engine.batch_settled(bid[room]))])
            wait_ms = 0
        return got

    # Room 1: the setup moves bytes.
    senders[1].init(len(src_pages[1]), 0)
    senders[1].send(np.asarray(src_pages[1], np.int32))
    bid: dict[int, int] = {}
    if pc:  # Success goes to the decode once the sender is cleared
        t0 = time.monotonic()
        while senders[1].poll() != KVPoll.Success and time.monotonic() - t0 < 20:
            time.sleep(0.01)
        senders[1].clear()
    room1 = inbox_msgs(20000)
    ok1 = all(
        peer.ask(f"dump {peer.gpu[b] + d * item} {item}")
        == hashlib.sha256(_page(drv, g, s_, item)).hexdigest()
        for b, g in enumerate(src)
        for s_, d in zip(src_pages[1], dst_pages[1], strict=True)
    )
    # The stream stops; rooms 2 and 3 are sent (one worker each).
    ipc = next(t for t in mgr.engine._transports if isinstance(t, CudaIpcTransport))
    release = SyncHold(ipc.driver)  # no run completes until it is let go
    real_batch = mgr.engine.batch_transfer_sync
    timed_out: dict[int, str] = {}

    def spy(session, srcs, *rest):  # which room's batch raised what (the room from its pages)
        room = next(r for r, p in src_pages.items() if src[0] + p[0] * item in srcs)
        try:
            return real_batch(session, srcs, *rest)
        except Exception as exc:
            timed_out[room] = type(exc).__name__
            if getattr(exc, "batch_id", None) is not None:
                bid[room] = exc.batch_id
            raise

    mgr.engine.batch_transfer_sync = spy
    for r in (2, 3):
        senders[r].init(len(src_pages[r]), 0)
        senders[r].send(np.asarray(src_pages[r], np.int32))
    t0 = time.monotonic()
    while len(timed_out) < 2 and time.monotonic() - t0 < 20:
        time.sleep(0.01)
    push.send_multipart([b"ABORT", b"3", b"127.0.0.1", str(in_port).encode(), b"7"])
    if not pc:
        push.send_multipart([b"ABORT", b"3", b"127.0.0.1", str(b_port).encode(), b"8"])
    # Room 4 goes while room 2's copies are stopped: it must not wait behind room 2.
    senders[4].init(2, 0)
    senders[4].send(np.asarray([70, 71], np.int32))
    t0 = time.monotonic()
    while senders[4].poll() != KVPoll.Success and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    status4 = int(senders[4].poll())
    while_stopped = inbox_msgs(1500)

    def b_msgs(wait_ms: int) -> list:
        got = []
        while b_inbox.poll(wait_ms):
            m = b_inbox.recv_multipart()
            got.append([int(m[1]), "ack", int(m[3])] if m[0] == b"ABORT_ACK" else [int(m[0]), int(m[1])])
        return got

    b_while_stopped = b_msgs(0)
    status2 = int(senders[2].poll())
    status3 = int(senders[3].poll())  # aborted: Failed would let SGLang free pages being read
    release.set()
    after = []
    t0 = time.monotonic()
    while len(after) < 3 and time.monotonic() - t0 < 20:
        after += inbox_msgs(200)
    after += inbox_msgs(1000)  # and any message more (a second Failed of room 2)
    b_after = b_msgs(500)
    out(event="late", notified=notified, room1=room1, room1_bytes=ok1, timed_out=timed_out,
        while_stopped=while_stopped, status2_while_stopped=status2, status3_while_stopped=status3,
        status4_while_stopped=status4,
        after=after, b_while_stopped=b_while_stopped, b_after=b_after, landed=release.landed(),
        status2=int(senders[2].poll()),
        status3=int(senders[3].poll()), deferred=mgr.engine.batches.deferred(), errors=errors)  # fmt: skip
    peer.close()
    push.close(0)
    inbox.close(0)
    b_inbox.close(0)
    server.close()


def prefill_ranks(port: int) -> None:
    """A prefill (MLA, attention TP 1) whose rooms 1 and 2 each go to two decode ranks (decode
    attention TP 2): kvpool peer processes over TCP (KVPOOL_PROTOCOL and KVPOOL_TIMEOUT_S from
    the test), B written first, then A1 (room 1) or A2 (room 2), which are stopped (SIGSTOP: the
    WRITE to them times out; one each: after a timeout the engine's next batch to a stopped peer
    waits in its connect handshake); their registrations, metadata and ABORTs come over ZMQ from
    here, each rank's statuses and acks back to a socket of its own here. Both ranks abort room
    1 while its chunk is written, and room 2 once the prefill failed it (as SGLang's decode does
    on a Failed status). Prints one "ranks" event: what each rank got ([room, "ack", generation]
    or [room, status, reason]), whether B's pages of room 1 hold the prefill's bytes, and the
    batches that raised."""
    import signal

    import msgpack
    import zmq
    from sglang.srt.disaggregation.base import KVPoll

    from kvpool.transfer.peer import PeerProcess
    from kvpool.transfer.types import OpCode

    np, backend, get_kv_class, T, Mode, sa, kv_args, mgr_cls, bufs, aux, item = setup("prefill", port)
    server = get_kv_class(backend, T.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    mgr = mgr_cls(kv_args(), Mode.PREFILL, sa, True)  # MLA: each decode rank gets the whole KV
    size = len(bufs) * PAGES * item
    ranks = {r: PeerProcess(size, protocol="tcp") for r in ("B", "A1", "A2")}
    of_room = {1: ("B", "A1"), 2: ("B", "A2")}  # B first: the prefill writes B, then the other
    ctx = zmq.Context()
    inbox = {r: ctx.socket(zmq.PULL) for r in ranks}
    in_port = {r: inbox[r].bind_to_random_port("tcp://127.0.0.1") for r in ranks}
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{mgr.rank_port}")
    for i, (r, peer) in enumerate(ranks.items()):
        reg = {"ip": "127.0.0.1", "port": in_port[r], "session": peer.segment, "engine_rank": i,
               "kv_ptrs": [peer.addr + b * PAGES * item for b in range(len(bufs))],
               "kv_item_lens": [item] * len(bufs), "aux_ptrs": [], "aux_item_lens": [], "attn_tp_size": 2,
               "page_size": PAGE}  # fmt: skip
        push.send_multipart([b"KVPOOL_REG", msgpack.packb(reg)])
    t0 = time.monotonic()
    while any(mgr.peers.get(p.segment) is None for p in ranks.values()) and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    src_pages = {1: [3, 4, 5, 9], 2: [10, 11, 12]}
    dst_pages = {1: [30, 31, 32, 40], 2: [50, 51, 52]}
    senders = {}
    for room, dst in dst_pages.items():
        senders[room] = get_kv_class(backend, T.SENDER)(
            mgr=mgr, bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=room
        )
        for r in of_room[room]:
            body = {"room": room, "ip": "127.0.0.1", "port": in_port[r], "session": ranks[r].segment,
                    "dummy": False, "kv": np.asarray(dst, np.int32).tobytes(), "aux": None, "need": 2,
                    "prefix": 0}  # fmt: skip
            push.send_multipart([b"KVPOOL_META", msgpack.packb(body)])
    t0 = time.monotonic()
    while any(s.poll() != KVPoll.WaitingForInput for s in senders.values()) and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    for peer in ranks.values():  # connected before A stops (a stopped peer's connect fails, not times out)
        mgr.engine.batch_transfer_sync(peer.segment, [bufs[0].data_ptr()], [peer.addr], [item], OpCode.WRITE)
    raised: dict[int, str] = {}
    real_batch = mgr.engine.batch_transfer_sync

    def spy(session, srcs, *rest):
        try:
            return real_batch(session, srcs, *rest)
        except Exception as exc:
            raised[len(raised) + 1] = type(exc).__name__
            raise

    mgr.engine.batch_transfer_sync = spy
    got: dict[str, list] = {r: [] for r in ranks}

    def collect(wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for r, sock in inbox.items():
                while sock.poll(0):
                    m = sock.recv_multipart()
                    if m[0] == b"ABORT_ACK":
                        got[r].append([int(m[1]), "ack", int(m[3])])
                    else:
                        got[r].append([int(m[0]), int(m[1]), m[3].decode()])
            time.sleep(0.01)

    def abort(room: int) -> None:
        for gen, r in enumerate(ranks, start=7):  # B: generation 7, A1: 8, A2: 9
            if r not in of_room[room]:
                continue
            push.send_multipart([b"ABORT", str(room).encode(), b"127.0.0.1", str(in_port[r]).encode(),
                                 str(gen).encode()])  # fmt: skip

    for r in ("A1", "A2"):
        os.kill(ranks[r].pid, signal.SIGSTOP)
    try:
        # Room 1: both ranks abort it while its chunk is written.
        senders[1].init(len(src_pages[1]), 0)
        senders[1].send(np.asarray(src_pages[1], np.int32))
        t0 = time.monotonic()
        while not mgr._in_flight.get(1) and time.monotonic() - t0 < 10:
            time.sleep(0.001)
        abort(1)
        while mgr._in_flight.get(1) and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        collect(1.0)
        # Room 2: the prefill fails it (its WRITE to A times out); both ranks abort it then.
        senders[2].init(len(src_pages[2]), 0)
        senders[2].send(np.asarray(src_pages[2], np.int32))
        t0 = time.monotonic()
        while not all(any(m[0] == 2 for m in got[r]) for r in of_room[2]) and time.monotonic() - t0 < 30:
            collect(0.05)
        abort(2)
        collect(1.5)
    finally:
        for r in ("A1", "A2"):
            os.kill(ranks[r].pid, signal.SIGCONT)
    collect(1.5)  # A1 and A2 resumed: still no ack to them
    want = digests(bufs, src_pages[1], item)
    b_bytes = all(
        ranks["B"].checksum((b * PAGES + d) * item, item) == want[b][i]
        for b in range(len(bufs))
        for i, d in enumerate(dst_pages[1])
    )
    out(event="ranks", got=got, b_bytes=b_bytes, raised=raised)
    for peer in ranks.values():
        peer.close()
    push.close(0)
    for sock in inbox.values():
        sock.close(0)
    server.close()


def pp_consensus() -> None:
    """KvpoolKVManager.check_status_pp_consensus as SGLang's sender polls it with pipeline
    parallelism (``CommonKVSender.poll_pp_consensus``, on stage 0): SGLang's real
    PPConsensusStore for stage 0 (the manager's ``request_status``) and for stage 1, in this
    process, replicating over ZMQ as between stages (a stand-in for the PP group's broadcast of
    stage 0's address; no torch.distributed here). The manager and sender are SGLang's classes and
    kvpool's, with only the fields these paths read (no engine, sockets or threads). Prints one
    "pp" event: the status polled in each case."""
    setup("prefill", 0)
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.pp_consensus_store import PPConsensusStore
    from sglang.srt.observability.trace import TraceNullContext

    from kvpool.connectors.sglang.conn import KvpoolKVManager
    from kvpool.connectors.sglang.endpoints import KvpoolKVSender

    class Broadcast:  # the PP group's broadcast_object, for two stages in one process
        info = None

        def broadcast_object(self, obj: object, src: int = 0) -> object:
            if obj is not None:
                Broadcast.info = obj
            return Broadcast.info

    stages = [PPConsensusStore(2, 0, Broadcast()), PPConsensusStore(2, 1, Broadcast())]
    mgr = KvpoolKVManager.__new__(KvpoolKVManager)
    mgr.request_status, mgr._in_flight = stages[0], {}
    mgr._staging_outstanding, mgr.defer_decode_allocation = {}, False

    def poll(room: int, s0: KVPoll, s1: KVPoll, in_flight: int) -> int:
        stages[0][room], stages[1][room] = s0, s1
        t0 = time.monotonic()
        while stages[0].collect(room)[1] != s1 and time.monotonic() - t0 < 10:
            time.sleep(0.01)  # stage 1's status replicated to stage 0
        mgr._in_flight = {room: in_flight} if in_flight else {}
        sender = KvpoolKVSender.__new__(KvpoolKVSender)
        sender.kv_mgr, sender.bootstrap_room, sender.conclude_state = mgr, room, None
        sender.init_time = sender._prefill_complete_time = sender._transfer_start_time = None
        sender.trace_ctx = TraceNullContext()
        return int(sender.poll_pp_consensus())

    F, T, W = KVPoll.Failed, KVPoll.Transferring, KVPoll.WaitingForInput
    # Stage 1's manager writes a chunk of room 7 (its _write_chunk held at a gate) when the room is
    # aborted on both stages: stage 0, which writes nothing of it, polls.
    import threading

    import numpy as np

    from kvpool.connectors.sglang.plan import Chunk
    from kvpool.connectors.sglang.rooms import writing_key

    mgr1 = KvpoolKVManager.__new__(KvpoolKVManager)
    mgr1.request_status, mgr1._in_flight, mgr1._room_lock = stages[1], {}, threading.Lock()
    mgr1._late_rooms, mgr1._acks_waiting, mgr1._aborted_at = set(), {}, {}
    gate = threading.Event()
    mgr1._write_chunk = lambda chunk: gate.wait(30)
    stages[1][7] = T
    chunk = Chunk(7, np.zeros(0, np.int64), slice(0, 0), True, None)
    writer = threading.Thread(target=mgr1._send_chunk, args=(chunk, None))
    writer.start()

    def stage1_writing(expected: int | None) -> None:
        t0 = time.monotonic()
        while stages[0].collect(writing_key(7))[1] != expected and time.monotonic() - t0 < 10:
            time.sleep(0.01)

    stage1_writing(1)
    stage1_in_flight = poll(7, F, F, 0)
    gate.set()
    writer.join()
    stage1_writing(None)
    stage1_drained = poll(7, F, F, 0)
    out(
        event="pp",
        stage1_in_flight=stage1_in_flight,
        stage1_drained=stage1_drained,
        # stage 0 aborted (Failed) while its chunk of the room is written; stage 1 transfers
        aborted_in_flight=poll(1, F, T, 1),
        aborted_drained=poll(2, F, T, 0),  # the chunk ended
        stage1_failed_in_flight=poll(3, T, F, 1),  # stage 1 failed; stage 0's chunk still written
        both_transferring=poll(4, T, T, 1),
        waiting=poll(5, W, T, 0),  # the lower stage's status
        success=poll(6, KVPoll.Success, KVPoll.Success, 0),
    )


def _page(drv, base: int, page: int, item: int) -> bytes:
    """One page of (fake-driver) GPU buffer ``base``, copied to the host."""
    from kvpool import _native

    buf = bytearray(item)
    drv.memcpy(_native.buffer_address(buf)[0], base + page * item, item)
    return bytes(buf)


if __name__ == "__main__":
    role, port, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if role == "prefill":
        prefill(port, scenario)
    elif role == "prefill-bounds":
        prefill_bounds(port)
    elif role == "bootstrap":
        bootstrap(port)
    elif role == "pp-consensus":
        pp_consensus()
    elif role == "prefill-late":
        prefill_late(port, scenario)
    elif role == "prefill-ranks":
        prefill_ranks(port)
    else:
        decode(port, scenario, bad=role == "decode-badaddr")
