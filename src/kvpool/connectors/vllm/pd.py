"""KvpoolConnector: prefill/decode disaggregation for vLLM over the kvpool transfer engine.

Decode pulls. A prefill instance computes the prompt, keeps the request's blocks alive
(``request_finished`` returns ``delay_free=True``) and hands the proxy ``kv_transfer_params``
naming its blocks and side channel. The decode instance allocates its own blocks, READs the
prefill blocks into them with one transfer batch (contiguous block runs merged, every layer in
the same batch), then tells the prefill side channel "done" so the blocks are freed there; the
load is reported finished only after that notice is answered "still held" (the fence against a
read of blocks the prefill already freed: :meth:`_PdWorker._notify`).

Why pull: only the decode side knows which of its blocks receive the KV and when they exist
(blocks are allocated when the decode scheduler admits the request). With pull the prefill never
waits for a destination and needs no per-request state beyond a deadline; a decode that never
comes costs blocks for ``abort_timeout_s`` only. The same choice as vLLM's NixlConnector.

Side channel (one per prefill TP rank, msgpack over TCP, ``side_channel_port + rank``):
``layout`` returns the engine's segment name and the KV block regions; ``done`` carries the
request ids whose blocks were read (or given up on) and answers which of them it had freed unread.
The scheduler half lives in :mod:`kvpool.connectors.vllm.pd_scheduler`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from kvpool._rpc import RpcClient
from kvpool._rpc_server import RpcServer
from kvpool.connectors.vllm.base import KvpoolConnectorBase
from kvpool.connectors.vllm.common import (
    Region,
    VllmConnectorConfig,
    kv_regions,
)
from kvpool.connectors.vllm.pd_scheduler import KvpoolConnectorMetadata, RecvJob, _PdScheduler, _tp
from kvpool.connectors.vllm.pd_stream import (
    LONG_POLL_S,
    MAX_PROGRESS_IDS,
    POLL_MAX_S,
    POLL_MIN_S,
    StreamLoad,
    StreamTable,
    region_columns,
    stream_round,
)
from kvpool.connectors.vllm.reshard import (
    KvLayout,
    RegionAddr,
    RegionPairs,
    ReshardError,
    layout_from_vllm,
    plan_columns,
    plan_sources,
    region_pairs,
)
from kvpool.connectors.vllm.stats import make_stats
from kvpool.errors import KvpoolError, ProtocolUnavailable, TransferError
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.types import OpCode

log = logging.getLogger("kvpool.connectors.vllm")

# Load threads per decode worker: one per prefill peer up to this many, then peers share them.
MAX_PEER_THREADS = 32
# A lane sends its pending "done" notices after at most this many loads in a row.
_LOADS_BEFORE_NOTICES = 8
# A prefill remembers the requests it freed unread (abort_timeout_s) this long / this many, to
# answer a late decode's "done" notice with "expired".
_EXPIRED_KEEP_S = 3600.0
_EXPIRED_MAX = 1 << 16


class KvpoolConnector(KvpoolConnectorBase):
    """vLLM KV connector (v1) for P/D disaggregation over the kvpool transfer engine.

    ``--kv-transfer-config '{"kv_connector":"KvpoolConnector",
    "kv_connector_module_path":"kvpool.connectors.vllm","kv_role":"kv_producer"|"kv_consumer"|"kv_both",
    "kv_connector_extra_config":{...}}'`` (keys: :class:`VllmConnectorConfig`).
    """

    def _make_scheduler(self, vllm_config: Any) -> _PdScheduler:
        return _PdScheduler(self.cfg, vllm_config, str(vllm_config.kv_transfer_config.engine_id))

    def _make_worker(self, vllm_config: Any, kv_cache_config: Any) -> _PdWorker:
        return _PdWorker(
            self.cfg, vllm_config, str(vllm_config.kv_transfer_config.engine_id), kv_cache_config
        )

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """vLLM's model runner, once per step before the forward pass: a prefill learns the step's
        streaming requests (their layers become final during this forward pass)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvpoolConnectorMetadata):
            self._worker.begin_step(connector_metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """vLLM's attention layer, after writing its KV, every layer of every step: a prefill marks
        the layer final for the step's streaming requests (nothing else moves per layer)."""
        self._worker.layer_saved(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """vLLM's model runner, once per step after the forward pass: every layer is final."""
        self._worker.step_done()


# ====================================================================== worker side
@dataclass
class _Remote:
    segment: str
    handle: Any
    regions: dict[str, Region]
    block_size: int
    kv_layout: dict[str, Any] | None = None
    layout: KvLayout | None = None
    """``kv_layout`` parsed (once, on the first resharded load)."""
    pairs: RegionPairs | None = None
    """This decode rank's regions paired with this prefill rank's (once, on the first resharded load)."""


def _addr(r: Region) -> RegionAddr:
    return RegionAddr(r.addr, r.stride, r.num_blocks)


class _PeerLane:
    """Load thread of one prefill peer (past :data:`MAX_PEER_THREADS` peers, of a few): its loads
    first, then its "done" notices, one RPC per peer. A dead or stalled peer holds up only the
    requests whose KV is on it."""

    def __init__(self, worker: _PdWorker, name: str) -> None:
        self.worker = worker
        self._cv = threading.Condition()
        self._loads: deque[RecvJob] = deque()
        self._notices: deque[RecvJob] = deque()
        self._new: list[StreamLoad] = []
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def load(self, job: RecvJob) -> None:
        with self._cv:
            self._loads.append(job)
            self._cv.notify()

    def notice(self, job: RecvJob) -> None:
        with self._cv:
            self._notices.append(job)
            self._cv.notify()

    def stream(self, ld: StreamLoad) -> None:
        with self._cv:
            self._new.append(ld)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _loop(self) -> None:
        in_a_row = 0
        active: list[StreamLoad] = []  # streaming loads: one progress question per round
        seen: dict[tuple[str, int], int] = {}  # per prefill peer: the progress version last seen
        wait_s = POLL_MIN_S
        while True:
            with self._cv:
                if active:
                    if not (self._loads or self._notices or self._new or self._stop):
                        self._cv.wait(wait_s)
                else:
                    while not (self._loads or self._notices or self._new or self._stop):
                        self._cv.wait()
                if self._stop:
                    return
                active.extend(self._new)
                self._new.clear()
                job = None
                notices: list[RecvJob] = []
                if self._loads and (in_a_row < _LOADS_BEFORE_NOTICES or not self._notices):
                    job = self._loads.popleft()
                    in_a_row += 1
                elif self._notices:
                    notices, self._notices = list(self._notices), deque()
                    in_a_row = 0
            if job is not None:
                self.worker._load(job)
                with self._cv:
                    self._notices.append(job)
            elif notices:
                self.worker._notify(notices)
            if active:
                with self._cv:  # wait at the prefill only when nothing else is queued here
                    idle = not (self._loads or self._notices or self._new)
                ended, moved, waited = stream_round(self.worker, active, seen, LONG_POLL_S if idle else 0.0)
                for ld, why in ended:
                    active.remove(ld)
                    if self.worker._stream_ended(ld, why):
                        with self._cv:
                            self._notices.append(ld.job)
                wait_s = (
                    0.0 if waited else POLL_MIN_S if moved else min(max(wait_s, POLL_MIN_S) * 2, POLL_MAX_S)
                )


class _PdWorker:
    def __init__(
        self, cfg: VllmConnectorConfig, vllm_config: Any, engine_id: str, kv_cache_config: Any
    ) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_layout: KvLayout | None = None  # for heterogeneous TP (reshard plans)
        self._layout_why = "KV cache layout not described yet"
        self._notice_counts: dict[str, int] = {}  # req id -> "done" notices from decode ranks
        self.engine_id = engine_id
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_rank, self.tp_size = _tp(vllm_config)
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        ktc = vllm_config.kv_transfer_config
        self.serves = ktc.kv_role in ("kv_producer", "kv_both")
        self.engine: TransferEngine | None = None
        self.regions: list[Region] = []
        self._lock = threading.Lock()
        self._pending_send: dict[str, float] = {}  # req id -> deadline (monotonic)
        self._notified: dict[str, float] = {}  # "done" seen -> when (may precede the metadata)
        # Freed by abort_timeout_s unread -> when (bounded). Ordered: get_finished drops the oldest
        # from the front each step, O(1) each (a plain dict's first item is found by skipping the
        # slots of earlier deletions: a burst of expiries cost O(n^2) in one step).
        self._expired: OrderedDict[str, float] = OrderedDict()
        self._confirming: set[str] = set()  # read, waiting for the prefill to confirm it held them
        self._recv_done: set[str] = set()
        self._load_errors: set[int] = set()
        self._remotes: dict[tuple[str, int], _Remote] = {}
        self._rpcs: dict[tuple[str, int, str], RpcClient] = {}
        self._lanes: dict[tuple[str, int], _PeerLane] = {}
        self._lane_list: list[_PeerLane] = []
        self._server: RpcServer | None = None
        self.streams: StreamTable | None = None  # prefill: progress of streaming requests
        self._on_gpu = False
        self._stream_loads: dict[str, StreamLoad] = {}  # decode: req id -> streaming load
        self._threads: list[threading.Thread] = []
        self.loaded_blocks = 0
        self.loaded_bytes = 0
        self.stats = make_stats(cfg.stats)

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        regions, tensors = kv_regions(kv_caches, self.num_blocks)
        if self.engine is None:
            self.engine = TransferEngine(**self.cfg.engine_kwargs())
        for t in tensors:
            # The prefill side's blocks are read by decode instances (remote-accessible); a decode's
            # own blocks are only written locally. CUDA tensors register as cuda:N: read by
            # same-host peers through CUDA IPC (when the CUDA driver loads), by other hosts over RDMA
            # (GPUDirect); as local READ destinations they are staged on TCP.
            try:
                self.engine.register_local_memory(t, remote_accessible=self.serves)
            except ProtocolUnavailable as exc:
                raise TransferError(
                    f"KV cache on {t.device}: {exc}. A prefill (kv_producer/kv_both) instance with a GPU KV "
                    "cache needs the CUDA driver (same-host decodes: CUDA IPC) or protocol='rdma'; "
                    "see docs/gpu.md"
                ) from None
        self.regions = regions
        self._on_gpu = any(getattr(t, "is_cuda", False) for t in tensors)
        if self.serves:
            self.streams = StreamTable(regions)
        self.kv_layout = self._describe_layout(tensors)
        total = sum(r.stride * r.num_blocks for r in regions)
        log.info("kvpool connector: registered %d KV regions (%.1f MiB) with engine %s",
                 len(regions), total / 2**20, self.engine.segment_name)  # fmt: skip
        if self.serves and self._server is None:
            port = self.cfg.side_channel_port + self.tp_rank
            self._server = RpcServer(
                self.cfg.hostname, port, self._handle, self._answer_parked, tick_s=LONG_POLL_S / 2,
                secret=self.cfg.secret, with_connection=True,
            )  # fmt: skip
            if self.streams is not None:
                server = self._server
                self.streams.on_change = lambda: server.call_soon(self._answer_parked)
            t = threading.Thread(target=self._server.serve_forever, name="kvpool-pd-side", daemon=True)
            t.start()
            self._threads.append(t)
            log.info("kvpool connector: side channel on %s:%d", self.cfg.hostname, port)

    def _describe_layout(self, tensors: list[Any]) -> KvLayout | None:
        """This rank's :class:`KvLayout` for reshard plans, None when the KV cache shape is not
        one reshard understands (then only equal TP sizes can transfer)."""
        try:
            t = tensors[0]
            shape, es = tuple(t.shape), t.element_size()
            if len(shape) == 4 and shape[0] == (self.num_blocks or shape[0]):
                order, htb = "HND", shape[3] * es  # CPU: [blocks, kv heads, block size, 2 * head size]
            elif len(shape) == 5 and shape[0] == 2:
                order, htb = "NHD", shape[4] * es  # FlashAttention: [2, blocks, block size, heads, head size]
            elif len(shape) == 3:
                order, htb = "HND", shape[2] * es  # MLA: [blocks, block size, latent + rope]
            else:
                self._layout_why = f"KV tensor shape {shape} is not a layout kvpool can reshard"
                return None
            lay = layout_from_vllm(self.vllm_config, self.tp_rank, self.tp_size, htb)
            lay = KvLayout(**{**lay.wire(), "order": order})
            lay.validate()
            if lay.block_bytes() != self.regions[0].block_bytes:
                self._layout_why = f"KV tensor shape {shape} does not match the model config"
                return None
            return lay
        except Exception as exc:  # noqa: BLE001 - describe what we can; equal TP still works
            self._layout_why = str(exc)
            log.info("kvpool connector: KV layout not described for reshard (%s); equal TP sizes only", exc)
            return None

    def unregister_kv_caches(self) -> None:
        if self.engine is not None:
            for r in {r.addr for r in self.regions}:
                try:
                    self.engine.unregister_local_memory(r)
                except KvpoolError:
                    pass
        self.regions = []

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
        for lane in self._lane_list:
            lane.stop()
        for rpc in self._rpcs.values():
            rpc.close()
        if self.engine is not None:
            self.engine.close()

    # ------------------------------------------------------------------ side channel (prefill)
    def _handle(self, req: dict[str, Any], conn: Any = None) -> dict[str, Any] | None:
        rid = req.get("id")  # the connection proved the secret (kvpool._rpc handshake)
        op = req.get("op")
        if op == "layout":
            assert self.engine is not None
            return {
                "id": rid, "ok": True, "engine_id": self.engine_id, "segment": self.engine.segment_name,
                "block_size": self.block_size, "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "regions": [r.wire() for r in self.regions],
                "kv_layout": self.kv_layout.wire() if self.kv_layout is not None else None,
            }  # fmt: skip
        if op == "progress":
            if self.streams is None:
                return {"id": rid, "ok": True, "streams": {}, "version": 0, "engine_id": self.engine_id}
            ids = [str(t) for t in (req.get("ids") or ())][:MAX_PROGRESS_IDS]
            wait = min(float(req.get("wait_s") or 0.0), LONG_POLL_S)
            seen = req.get("seen")
            if wait > 0 and conn is not None and isinstance(seen, int):
                if self.streams.park(conn, rid, ids, seen, time.monotonic() + wait):
                    return None  # answered by _answer_parked: news, or the wait is over
            return {"id": rid, **self._progress(ids)}
        if op == "done":
            # The answer fences late reads: "expired" names the requests freed unread after
            # abort_timeout_s (their blocks may hold another request's KV now); "engine_id" tells a
            # restarted instance (that never held the blocks) from the one that did.
            now = time.monotonic()
            of = max(1, min(int(req.get("of") or 1), 64))  # decode ranks that each send one notice
            gens = req.get("gens") or {}  # streamed reads: the generation they were made under
            expired: list[str] = []
            with self._lock:
                for r in req.get("req_ids") or ():
                    r = str(r)
                    if r in self._expired:
                        expired.append(r)
                        continue
                    g = gens.get(r) if isinstance(gens, dict) else None
                    if g is not None and self.streams is not None and not self.streams.gen_ok(r, int(g)):
                        expired.append(r)  # preempted or aborted since that read: the bytes may be stale
                    if of > 1:
                        n = self._notice_counts.get(r, 0) + 1
                        if n < of and len(self._notice_counts) < 1 << 16:
                            self._notice_counts[r] = n
                            continue
                        self._notice_counts.pop(r, None)
                    self._notified[r] = now
            return {"id": rid, "ok": True, "expired": expired, "engine_id": self.engine_id}
        return {"id": rid, "ok": False, "err": "INVALID", "msg": f"unknown op {op!r}"}

    def _answer_parked(self) -> None:
        """Side-channel thread (its tick, or woken by a change): answer the parked progress
        questions that have news or waited long enough."""
        table, server = self.streams, self._server
        if table is None or server is None:
            return
        for conn, rid, ids in table.due(time.monotonic()):
            server.reply(conn, rid, self._progress(ids))

    def _progress(self, ids: list[str]) -> dict[str, Any]:
        """The answer to a progress question (side-channel thread)."""
        assert self.streams is not None
        streams, version = self.streams.progress(ids)
        return {"ok": True, "streams": streams, "version": version, "engine_id": self.engine_id}

    # ------------------------------------------------------------------ per step
    def begin_step(self, meta: KvpoolConnectorMetadata) -> None:
        """Model thread, before the forward pass: this step's streaming requests (prefill)."""
        if self.streams is not None:
            self.streams.begin_step(meta, _EXPIRED_KEEP_S)
        if meta.stream_end:
            now = time.monotonic()
            with self._lock:
                for rid in meta.stream_end:  # aborted while streaming: its blocks are freed now
                    self._expired[rid] = now

    def layer_saved(self, layer_name: str, kv_layer: Any) -> None:
        """Model thread, after each attention layer: the layer is final for this step's streams."""
        table = self.streams
        if table is None or not table.busy():
            return
        ready = None
        if getattr(kv_layer, "is_cuda", False):  # final once the compute stream passed this point
            import torch

            ev = torch.cuda.Event()
            ev.record()
            ready = ev.query
        table.layer_saved(layer_name, ready)

    def step_done(self) -> None:
        """Model thread, after the forward pass."""
        table = self.streams
        if table is None or not table.busy():
            return
        ready = None
        if self._on_gpu:
            import torch

            ev = torch.cuda.Event()
            ev.record()
            ready = ev.query
        table.step_done(ready)

    def start(self, meta: KvpoolConnectorMetadata) -> None:
        now = time.monotonic()
        if meta.send:
            with self._lock:
                for rid, ttl in meta.send.items():
                    self._pending_send[rid] = now + ttl
        if meta.cancel:
            with self._lock:
                for rid in meta.cancel:
                    ld = self._stream_loads.get(rid)
                    if ld is not None:
                        ld.cancelled = True
        for job in meta.recv.values():
            lane = self._lane(job)
            if job.transfer_id is not None:
                ld = StreamLoad(job, now + self.cfg.abort_timeout_s)
                with self._lock:
                    self._stream_loads[job.req_id] = ld
                lane.stream(ld)
            elif not job.local_block_ids:
                lane.notice(job)  # aborted before allocation: only free the prefill's blocks
            elif self._inline(job):
                # Small same-host reads finish faster here than after a hand-off to the load
                # thread (no wake-up, no GIL ping-pong with this busy thread).
                self._load(job)
                lane.notice(job)
            else:
                lane.load(job)

    def _lane(self, job: RecvJob) -> _PeerLane:
        """The load thread of the job's prefill peer (made on first use; bounded)."""
        key = (job.remote_host, job.remote_port + self.tp_rank)
        lane = self._lanes.get(key)
        if lane is None:
            if len(self._lane_list) < MAX_PEER_THREADS:
                lane = _PeerLane(self, f"kvpool-pd-load-{len(self._lane_list)}")
                self._lane_list.append(lane)
            else:
                lane = self._lane_list[hash(key) % MAX_PEER_THREADS]
            self._lanes[key] = lane
        return lane

    def _inline(self, job: RecvJob) -> bool:
        rem = self._remotes.get((job.remote_host, job.remote_port + self.tp_rank))
        if rem is None or self.engine is None or not self.cfg.inline_load_bytes:
            return False
        nbytes = len(job.local_block_ids) * sum(r.block_bytes for r in self.regions)
        return nbytes <= self.cfg.inline_load_bytes and self.engine.uses_same_host_path(rem.handle)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        now = time.monotonic()
        sending: set[str] = set()
        with self._lock:
            recving, self._recv_done = self._recv_done, set()
            for rid, deadline in list(self._pending_send.items()):
                if rid in self._notified:
                    sending.add(rid)
                elif now > deadline:
                    log.warning("kvpool connector: request %s was not read by a decode instance within "
                                "%.0fs; freeing its blocks", rid, self.cfg.abort_timeout_s)  # fmt: skip
                    sending.add(rid)
                    # Fence: a decode that read these blocks late is told so by its "done" notice
                    # and fails its load instead of using blocks vLLM may already have reused.
                    self._expired[rid] = now
            while self._expired:  # oldest first; once per step, so no copy of the whole dict
                rid, t = next(iter(self._expired.items()))
                if now - t <= _EXPIRED_KEEP_S and len(self._expired) <= _EXPIRED_MAX:
                    break
                self._expired.popitem(last=False)
            for rid in sending:
                del self._pending_send[rid]
                self._notified.pop(rid, None)
                self._notice_counts.pop(rid, None)
            if sending and self.streams is not None:
                self.streams.forget(sending)
            # "done" notices for requests this worker never held (aborted, restarted) expire.
            for rid, t in list(self._notified.items()):
                if now - t > self.cfg.abort_timeout_s and rid not in self._pending_send:
                    del self._notified[rid]
        return (sending or None), (recving or None)

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errs, self._load_errors = self._load_errors, set()
        return errs

    # ------------------------------------------------------------------ loads (decode)
    def _rpc(self, host: str, port: int, use: str = "") -> RpcClient:
        """The side-channel client of a prefill rank (``use``: a separate connection)."""
        key = (host, port, use)
        rpc = self._rpcs.get(key)
        if rpc is None:
            rpc = self._rpcs[key] = RpcClient(f"{host}:{port}", self.cfg.transfer_timeout_s, self.cfg.secret)
        return rpc

    def _remote(self, host: str, port: int) -> _Remote:
        key = (host, port)
        rem = self._remotes.get(key)
        if rem is None:
            assert self.engine is not None
            reply = self._rpc(host, port).call("layout")
            regions = {r.name: r for r in map(Region.from_wire, reply["regions"])}
            rem = _Remote(reply["segment"], self.engine.open_segment(reply["segment"]), regions,
                          int(reply["block_size"]), reply.get("kv_layout"))  # fmt: skip
            self._remotes[key] = rem
        return rem

    def _columns(self, rem: _Remote, job: RecvJob) -> tuple[list[int], list[int], list[int]]:
        """(local addresses, remote addresses, lengths) of the READs of one load."""
        if rem.block_size != self.block_size:
            raise TransferError(f"block size differs: prefill {rem.block_size}, decode {self.block_size}")
        if set(rem.regions) != {r.name for r in self.regions}:
            raise TransferError("prefill and decode KV cache layers differ (same model and layout needed)")
        cols: tuple[list[int], list[int], list[int]] = ([], [], [])
        for loc in self.regions:
            region_columns(loc, rem.regions[loc.name], job.local_block_ids, job.remote_block_ids, cols)
        return cols

    def _load_resharded(self, job: RecvJob) -> int:
        """Decode rank, prefill TP != decode TP: READ this rank's head slices from every prefill
        rank the reshard plan names. Runs on the load thread.

        Every source's plan is built and checked before any byte moves; the load succeeds only when
        every source's ranges completed (one ``batch_transfer_sync_multi``): a failed source fails the
        whole load and every block of it is reported to vLLM (never a partial load marked ready).
        """
        ptp = job.remote_tp_size
        if self.kv_layout is None:
            raise ReshardError(
                f"prefill TP {ptp} and decode TP {self.tp_size} differ and this decode's KV cache cannot be "
                f"resharded ({self._layout_why}); use equal TP sizes"
            )
        first = self._remote(job.remote_host, job.remote_port)
        if first.kv_layout is None:
            raise ReshardError(
                f"prefill TP {ptp} != decode TP {self.tp_size} and the prefill sent no KV layout"
            )
        if first.layout is None:
            first.layout = KvLayout.from_wire(first.kv_layout)
        sources = plan_sources(ptp, self.kv_layout, first.layout)
        lb, rb = job.local_block_ids, job.remote_block_ids
        parts = []  # (segment, locals, remotes, lengths) per source rank, numpy columns
        for p in sources:
            rem = self._remote(job.remote_host, job.remote_port + p)
            pl = rem.layout
            if pl is None:
                pl = rem.layout = KvLayout.from_wire(rem.kv_layout or {})
            if pl.tp_size != ptp or pl.tp_rank != p:
                raise ReshardError(
                    f"prefill rank {p} reports TP rank {pl.tp_rank} of {pl.tp_size}, not {p} of {ptp}"
                )
            if rem.pairs is None:  # once per handshake: the regions and layouts do not change
                if set(rem.regions) != {r.name for r in self.regions}:
                    raise ReshardError(
                        "prefill and decode KV cache layers differ (same model and layout needed)"
                    )
                rem.pairs = region_pairs(
                    pl, self.kv_layout, [(_addr(r), _addr(rem.regions[r.name])) for r in self.regions]
                )
            parts.append((rem.segment, *plan_columns(pl, self.kv_layout, rem.pairs, lb, rb)))
        engine = self.engine
        assert engine is not None

        # Every source in one call (short loads: one native call in this thread; longer ones: one
        # batch in flight on the engine's threads, one wait): the load is done only when all
        # completed; a failed range fails the whole load (never a partial load marked ready).
        return engine.batch_transfer_sync_multi(parts, OpCode.READ)

    def _notify(self, jobs: list[RecvJob]) -> None:
        """Tell prefill side channels their blocks may go (read or given up on), one RPC per
        peer, and complete the loads among ``jobs``. Runs on the peer's lane only.

        The notice is also the fence of a read: a load is reported finished only when every
        prefill rank it read from answers that it still held the blocks when the notice came
        (after the read). Blocks freed unread after ``abort_timeout_s``, an undeliverable notice,
        or an answer from another instance (the prefill restarted on that port) fail the load:
        those blocks may hold another request's KV by now.
        """
        by_peer: dict[tuple[str, int, int], list[RecvJob]] = {}
        for job in jobs:
            if job.remote_tp_size == self.tp_size:
                peers = [(job.remote_host, job.remote_port + self.tp_rank, 1)]
            else:  # every prefill rank frees its blocks after a notice from every decode rank
                peers = [
                    (job.remote_host, job.remote_port + p, self.tp_size) for p in range(job.remote_tp_size)
                ]
            for peer in peers:
                by_peer.setdefault(peer, []).append(job)
        bad: dict[str, str] = {}  # remote request id -> why its load fails
        for (host, port, of), pjobs in by_peer.items():
            ids = [j.remote_request_id for j in pjobs]
            gens = {j.remote_request_id: j.gen for j in pjobs if j.gen is not None}
            try:
                reply = self._rpc(host, port).call("done", req_ids=ids, of=of, gens=gens)
            except KvpoolError as exc:
                log.debug("done notice for %s not delivered: %s", ids, exc)
                for j in pjobs:
                    bad[j.remote_request_id] = f"the read could not be confirmed by {host}:{port} ({exc})"
                continue
            for r in reply.get("expired") or ():
                bad[r] = f"{host}:{port} freed the blocks unread after its abort_timeout_s"
            engine = reply.get("engine_id")
            for j in pjobs:
                if engine and j.remote_engine_id and engine != j.remote_engine_id:
                    bad[j.remote_request_id] = f"{host}:{port} is another instance now ({engine}, restarted?)"
        for job in jobs:
            with self._lock:
                if job.req_id not in self._confirming:
                    continue  # only a notice (aborted, failed): nothing waits on it
                self._confirming.discard(job.req_id)
                why = bad.get(job.remote_request_id)
                if why is not None:
                    self._load_errors.update(job.local_block_ids)
                self._recv_done.add(job.req_id)
            if why is not None:
                self.stats.record_failure("PrefillFreed" if "abort_timeout_s" in why else "Unconfirmed")
                log.warning("kvpool connector: KV of %s read but not confirmed: %s; blocks reported to vLLM "
                            "(kv_load_failure_policy: recompute or fail)", job.req_id, why)  # fmt: skip

    def _stream_ended(self, ld: StreamLoad, why: str | None) -> bool:
        """A streaming load ended on its lane (``why``: None, or why it failed). Returns whether
        the prefill must be sent a "done" notice (it knows the request: its blocks wait for it)."""
        job = ld.job
        with self._lock:
            self._stream_loads.pop(job.req_id, None)
        if why is None:
            job.gen = ld.gen
            if job.local_block_ids:
                wait_ms = (time.perf_counter() - ld.t0) * 1e3
                log.info("kvpool connector: streamed %d blocks (%d bytes) for %s in %.2f ms of reads "
                         "(%d rounds, %.1f ms after the decode asked)", len(job.local_block_ids), ld.nbytes,
                         job.req_id, ld.read_s * 1e3, ld.rounds, wait_ms)  # fmt: skip
            self._load_done(job, True, ld.nbytes, ld.read_s)
            return True
        self.stats.record_failure("StreamFailed")
        log.warning("kvpool connector: streaming the KV of %s from %s:%d failed (%s); blocks reported to "
                    "vLLM (kv_load_failure_policy: recompute or fail)",
                    job.req_id, job.remote_host, job.remote_port, why)  # fmt: skip
        self._load_done(job, False)
        return bool(job.remote_request_id)

    def _load_done(self, job: RecvJob, ok: bool, nbytes: int = 0, seconds: float = 0.0) -> None:
        """Record a load's outcome (per-request or streamed; a job without local blocks is only a
        notice): read -> counted, finished once the prefill confirms it (``_notify``); failed ->
        its blocks reported to vLLM and the request finished."""
        if not job.local_block_ids:
            return  # only a notice for the prefill: vLLM is not waiting for this request
        if ok:
            self.loaded_blocks += len(job.local_block_ids)
            self.loaded_bytes += nbytes
            self.stats.record_transfer(seconds, nbytes, len(job.local_block_ids))
        with self._lock:
            if ok:
                self._confirming.add(job.req_id)
            else:
                self._load_errors.update(job.local_block_ids)
                self._recv_done.add(job.req_id)

    def _forget_remotes(self, job: RecvJob) -> None:
        """After a typed failure: drop the cached layouts of every prefill rank the job reads from
        (a restarted peer is asked again on the next load)."""
        ranks = range(job.remote_tp_size) if job.remote_tp_size != self.tp_size else ()
        for p in {self.tp_rank, *ranks}:
            self._remotes.pop((job.remote_host, job.remote_port + p), None)

    def _load(self, job: RecvJob) -> None:
        t0 = time.perf_counter()
        ok = True
        why = ""
        nbytes = 0
        try:
            if job.local_block_ids:
                if job.remote_tp_size != self.tp_size:
                    nbytes = self._load_resharded(job)
                else:
                    port = job.remote_port + self.tp_rank
                    rem = self._remote(job.remote_host, port)
                    locs, rems, lens = self._columns(rem, job)
                    nbytes = sum(lens)
                    assert self.engine is not None
                    # One batch, submitted as columns; raises a typed error naming what failed.
                    self.engine.batch_transfer_sync(rem.segment, locs, rems, lens, OpCode.READ)
        except KvpoolError as exc:
            ok, why = False, str(exc)
            self.stats.record_failure(type(exc).__name__)
            self._forget_remotes(job)
        except Exception as exc:  # noqa: BLE001 - never leave a request waiting forever
            ok, why = False, f"{type(exc).__name__}: {exc}"
            self.stats.record_failure(type(exc).__name__)
        seconds = time.perf_counter() - t0
        if ok and job.local_block_ids:
            log.info("kvpool connector: loaded %d blocks (%d bytes) for %s in %.2f ms",
                     len(job.local_block_ids), nbytes, job.req_id, seconds * 1e3)  # fmt: skip
        elif not ok:
            log.warning("kvpool connector: loading KV of %s from %s:%d failed (%s); blocks reported to vLLM "
                        "(kv_load_failure_policy: recompute or fail)",
                        job.req_id, job.remote_host, job.remote_port, why)  # fmt: skip
        self._load_done(job, ok, nbytes, seconds)
