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
request ids whose blocks were read (or given up on), each with the digest of the (id, block ids)
its params named, and answers which of them it had freed unread or never handed out those blocks
for (:meth:`~kvpool.connectors.vllm.pd_notices.DoneNotices._done`).
The scheduler half lives in :mod:`kvpool.connectors.vllm.pd_scheduler`, the decode's loads in
:mod:`kvpool.connectors.vllm.pd_load`, the prefill's ``done`` fence in
:mod:`kvpool.connectors.vllm.pd_notices`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from kvpool._rpc import RpcClient
from kvpool._rpc_server import RpcServer
from kvpool.connectors.vllm.base import KvpoolConnectorBase
from kvpool.connectors.vllm.common import (
    Region,
    VllmConnectorConfig,
    kv_regions,
)
from kvpool.connectors.vllm.pd_load import DecodeLoads, _PeerLane, _Remote
from kvpool.connectors.vllm.pd_notices import DoneNotices, _Notice
from kvpool.connectors.vllm.pd_scheduler import (
    KvpoolConnectorMetadata,
    _PdScheduler,
    _tp,
    refuse_context_parallel,
    refuse_pipeline_parallel,
)
from kvpool.connectors.vllm.pd_stream import (
    LONG_POLL_S,
    MAX_PROGRESS_IDS,
    StreamLoad,
    StreamTable,
)
from kvpool.connectors.vllm.reshard import (
    KvLayout,
    layout_from_vllm,
)
from kvpool.connectors.vllm.stats import make_stats
from kvpool.errors import KvpoolError, ProtocolUnavailable, TransferError
from kvpool.transfer.engine import TransferEngine

log = logging.getLogger("kvpool.connectors.vllm")

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

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """vLLM's model runner, first thing in every step, before it zeroes or copies into any
        block freed by a preemption or abort: a prefill applies the step's stream changes now
        (generations moved, streams ended), so no ``done`` notice is confirmed for a block
        written afterwards (:meth:`bind_connector_metadata` applies them where this is not called)."""
        if self._worker is not None and isinstance(kv_connector_metadata, KvpoolConnectorMetadata):
            self._worker.begin_step(kv_connector_metadata)

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
class _PdWorker(DecodeLoads, DoneNotices):
    """The connector's worker half, one per TP rank: registers the KV cache, serves the prefill's
    side channel (``layout``, ``progress``, ``done``), tracks per-step streaming, and reports what
    finished (``get_finished``); the decode's loads are :class:`DecodeLoads`."""

    def __init__(
        self, cfg: VllmConnectorConfig, vllm_config: Any, engine_id: str, kv_cache_config: Any
    ) -> None:
        refuse_context_parallel(vllm_config)
        refuse_pipeline_parallel(vllm_config)
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_layout: KvLayout | None = None  # for heterogeneous TP (reshard plans)
        self._layout_why = "KV cache layout not described yet"
        self._notice_counts: dict[str, set[int]] = {}  # req id -> decode ranks whose "done" came
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
        self._digests: dict[str, str] = {}  # req id -> blocks_digest of the blocks held for it
        self._stream_blocks: dict[str, list[int]] = {}  # streamed req id -> its prompt's blocks held
        # "done" notices waiting for requests this worker does not know yet (bounded)
        self._parked_done: list[_Notice] = []
        self._parked_ids = 0
        # "done" confirmed -> when (held requests; a stale streamed read's may precede them)
        self._notified: OrderedDict[str, float] = OrderedDict()
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
        # sleep mode: the last step (scheduler's count) whose KV the cache held when it was released
        self._slept_after: int | None = None
        self._asleep = False  # between unregister_kv_caches and the next register_kv_caches
        self._last_step = 0
        self._begun = 0  # the step whose metadata begin_step applied (handle_preemptions, else bind)
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
            # same-host peers through CUDA IPC, by other hosts over TCP (the C++ server stages them;
            # both need the CUDA driver) or RDMA (GPUDirect); as local READ destinations they are
            # staged on TCP.
            try:
                self.engine.register_local_memory(t, remote_accessible=self.serves)
            except ProtocolUnavailable as exc:
                raise TransferError(
                    f"KV cache on {t.device}: {exc}. A prefill (kv_producer/kv_both) instance with a GPU KV "
                    "cache needs the CUDA driver (CUDA IPC on one host, TCP server staging) or "
                    "protocol='rdma'; see docs/gpu.md"
                ) from None
        self.regions = regions
        self._asleep = False
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
        """vLLM 0.33 sleep mode (the connector's ``unregister_kv_caches``): the KV cache memory is
        released, and with it the KV of the requests held for decodes. They are freed at the next
        ``get_finished`` and answered "expired" from now on: a decode that reads their block ids
        after the wake-up reads whatever the restored cache holds there. So are the requests
        computed before now whose ``send`` metadata comes later (:meth:`start`)."""
        now = time.monotonic()
        with self._lock:
            self._asleep = True
            self._slept_after = self._last_step
            for rid in self._pending_send:
                self._pending_send[rid] = now - 1.0
                self._expired[rid] = now
                self._expired.move_to_end(rid)
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
            asked = req.get("ids")
            ids = [str(t) for t in asked[:MAX_PROGRESS_IDS]] if isinstance(asked, list) else []
            wait = min(float(req.get("wait_s") or 0.0), LONG_POLL_S)
            seen = req.get("seen")
            if wait > 0 and conn is not None and isinstance(seen, int):
                if self.streams.park(conn, rid, ids, seen, time.monotonic() + wait):
                    return None  # answered by _answer_parked: news, or the wait is over
            return {"id": rid, **self._progress(ids)}
        if op == "done":
            return self._done(req, conn)
        return {"id": rid, "ok": False, "err": "INVALID", "msg": f"unknown op {op!r}"}

    def _progress(self, ids: list[str]) -> dict[str, Any]:
        """The answer to a progress question (side-channel thread)."""
        assert self.streams is not None
        streams, version = self.streams.progress(ids)
        return {"ok": True, "streams": streams, "version": version, "engine_id": self.engine_id}

    # ------------------------------------------------------------------ per step
    def begin_step(self, meta: KvpoolConnectorMetadata) -> None:
        """Model thread, before the forward pass: this step's streaming requests (prefill), and
        the engine id of this incarnation (the scheduler's; until the first step, the configured
        one, which matches no params: nothing was prefilled yet). Once per step: from
        ``handle_preemptions``, or else from ``bind_connector_metadata``."""
        if meta.step and meta.step == self._begun:
            return
        self._begun = meta.step
        if meta.engine_id:
            self.engine_id = meta.engine_id
        if self.streams is not None:
            self.streams.begin_step(meta, _EXPIRED_KEEP_S)
        if meta.stream_end:
            now = time.monotonic()
            with self._lock:
                for rid in meta.stream_end:  # aborted while streaming: its blocks are freed now
                    self._expired[rid] = now
                    if rid not in self._pending_send:  # a read confirmed early has no hold to free
                        self._notified.pop(rid, None)
                        self._notice_counts.pop(rid, None)
            self._wake_parked_done()

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
        """vLLM's model runner, once per step before the forward pass (``start_load_kv``): hold
        the blocks of the requests the scheduler hands out, start this step's loads."""
        now = time.monotonic()
        if meta.send:
            # Computed by step meta.step - 1 at the latest: if the KV cache was released after
            # that step (sleep mode), their blocks hold the restored cache, not their KV; they are
            # freed at once and answered "expired", as the ones held at the sleep were.
            gone = self._asleep or (self._slept_after is not None and meta.step - 1 <= self._slept_after)
            with self._lock:
                for rid, ttl in meta.send.items():
                    if gone:
                        self._pending_send[rid] = now - 1.0
                        self._expired[rid] = now
                        self._expired.move_to_end(rid)
                        continue
                    self._pending_send[rid] = now + ttl
                    streamed = rid in meta.send_blocks
                    table = self.streams
                    if rid in meta.send_hold and (
                        not streamed or (table is not None and table.numbered(rid))
                    ):
                        # Every hold has a number of its own in its params and digest: reads of
                        # an earlier hold's params of the id (a client reused it) never match the
                        # digest held now, and streamed reads of an earlier stream of the id carry
                        # a generation older than this stream's first (the scheduler's count): both
                        # refused, freeing nothing, so an "expired" mark of the id is taken back.
                        self._expired.pop(rid, None)
                    digest = meta.send_digest.get(rid)
                    if digest is not None:
                        self._digests[rid] = digest
                    if streamed:
                        self._stream_blocks[rid] = meta.send_blocks[rid]
                        if table is not None and table.given_up(rid):
                            self._notified[rid] = now  # a load of its stream gave up: freed now
            if gone:
                log.warning("kvpool connector: %d request(s) computed before the KV cache was released "
                            "(sleep mode) are not held for decodes (they recompute): %s",
                            len(meta.send), ", ".join(list(meta.send)[:8]))  # fmt: skip
            self._wake_parked_done()
        self._last_step = max(self._last_step, meta.step)
        if meta.cancel:
            with self._lock:
                for rid in meta.cancel:
                    ld = self._stream_loads.get(rid)
                    if ld is not None:
                        ld.cancelled = True
        for job in meta.recv.values():
            lane = self._lane(job)
            if job.transfer_id is not None:
                if job.refused is not None:  # blocks that do not match: vLLM recomputes them
                    self.stats.record_failure("BlocksMismatch")
                    self._load_done(job, False)
                    # the stream only waits for the prefill request, to tell it to free its blocks
                    job = replace(job, local_block_ids=[], block_index=[], refused=None, waited=False)
                ld = StreamLoad(job, now + self.cfg.abort_timeout_s)
                with self._lock:
                    self._stream_loads[job.req_id] = ld
                    if job.waited and not job.local_block_ids:  # only vLLM's null block: loaded
                        self._recv_done.add(job.req_id)  # (the stream only tells the prefill)
                lane.stream(ld)
            elif not job.local_block_ids:
                if job.waited:  # only vLLM's null block: nothing to read, the load is done
                    with self._lock:
                        self._recv_done.add(job.req_id)
                lane.notice(job)  # else aborted before allocation: only free the prefill's blocks
            elif job.refused is not None:  # blocks that do not match: vLLM recomputes them
                self.stats.record_failure("BlocksMismatch")
                self._load_done(job, False)
                lane.notice(job)
            elif self._inline(job):
                # Small same-host reads finish faster here than after a hand-off to the load
                # thread (no wake-up, no GIL ping-pong with this busy thread).
                self._load(job)
                lane.notice(job)
            else:
                lane.load(job)

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
                self._digests.pop(rid, None)
                self._stream_blocks.pop(rid, None)
                # Freed now: a later "done" for it (a second read of the same params: a decode
                # request with n > 1, a retried one) is answered "expired", never "held".
                self._expired[rid] = now
            if sending and self.streams is not None:
                self.streams.forget(sending)
            # "done" notices for requests this worker never held (aborted, restarted) expire,
            # oldest first (the ones for requests it holds were just taken out above).
            while self._notified:
                rid, t = next(iter(self._notified.items()))
                if now - t <= self.cfg.abort_timeout_s or rid in self._pending_send:
                    break
                del self._notified[rid]
        return (sending or None), (recving or None)

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errs, self._load_errors = self._load_errors, set()
        return errs
