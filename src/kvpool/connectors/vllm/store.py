"""KvpoolStoreConnector: cross-instance prefix reuse for vLLM through the kvpool store.

Every full prompt block is stored under a prefix-chained key covering everything vLLM's own
prefix-cache block hash covers: BLAKE2b-128 over the parent block's digest, the block's token
ids and vLLM's extra keys for that block (``generate_block_hash_extra_keys``: LoRA name and path,
multimodal hashes and offsets, ``cache_salt`` on the first block, prompt-embeds digests). The
chain starts from the namespace, which names the model, model dtype, KV cache dtype
(``cache_dtype``, fp8 variants included), KV heads x head size (with decode context parallel:
its size and interleave), the tokens of one block id (block size x DCP size), TP rank and size
(with pipeline parallelism: the stage and stage count too) and device
(``kvpool/v2/<model>/<dtype>/kv-<cache_dtype>/h<heads>x<head>/bs<N>/tp<r>of<n>[pp<s>of<m>]/<device>``).
vLLM's own ``request.block_hashes`` are not reused: their seed (``NONE_HASH``) is random per
process for non-cryptographic hash settings; this chain is deterministic across processes and
hosts by construction, whatever vLLM's hash setting. Extra keys that cannot be encoded
deterministically make the request bypass the store (logged once), never share keys.

One object per block and layer, named with the worker's KV layout signature (tensor dtype,
per-block shape and strides), plus a small commit marker under the block's key, written after all
its layers. Every TP rank and PP stage stores its own objects and marker under its own namespace
(the key's digest chain is TP rank 0's, stage 0's); a block is a hit only when every rank's and
stage's marker exists. Any instance pointed at the same master finds the longest stored prefix of a new
prompt and loads it into its own blocks; a load checks every object's exact size (a shorter or
longer object is a failed load, recomputed by vLLM).

Saves: when a request finishes, its full prompt blocks that the store lacks are written from the
KV cache straight into the pool (``batch_put_from``, no staging copy) by a background thread;
the blocks stay allocated (``delay_free``) until the save is done. Loads: asynchronous by default
(between scheduler steps, ``load_async``), or inside the forward pass. A block that cannot be
read (evicted between lookup and load, master gone, wrong size) is reported through
``get_block_ids_with_load_errors`` and recomputed by vLLM.

This module holds the keys, the connector and its scheduler half; the worker half (one per TP
rank and PP stage) is :mod:`kvpool.connectors.vllm.store_worker`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpool.connectors.blockkeys import block_keys, digest, encode_extra_keys
from kvpool.connectors.checkpoint import checkpoint_tag
from kvpool.connectors.vllm.base import KvpoolConnectorBase
from kvpool.connectors.vllm.common import VllmConnectorConfig
from kvpool.connectors.vllm.layerwise import LayerwiseSaveScheduler
from kvpool.connectors.vllm.nonblocking import AsyncLookups, Breaker, Lookup
from kvpool.connectors.vllm.stats import StoreEvents, make_stats
from kvpool.errors import ConfigError, KvpoolError

if TYPE_CHECKING:
    from kvpool.connectors.vllm.store_worker import _StoreWorker
    from kvpool.store.client import Store

log = logging.getLogger("kvpool.connectors.vllm")

# vLLM's BlockPool.null_block (the first block it takes, id 0): where a request's block list
# holds it, that block was freed (out of a sliding window) and its KV is not there.
_NULL_BLOCK = 0
# Store loads one request may make: a second covers a preemption or one failed load; after that
# vLLM recomputes (with kv_load_failure_policy=recompute a load failing every time — a corrupt or
# wrong-size object — was offered and failed again every step, forever).
_MAX_LOADS = 2


def request_block_keys(namespace: str, request: Any, block_size: int) -> list[str]:
    """Keys of every full prompt block of a vLLM ``Request``, covering what vLLM's own prefix
    cache hash covers (tokens, parent, LoRA, multimodal, ``cache_salt``, prompt embeds).

    Raises ``TypeError`` when an extra key has no deterministic encoding."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    tokens = request.prompt_token_ids
    if tokens is None:  # prompt embeds: the embeddings' digests are in the extra keys
        tokens = [0] * int(request.num_prompt_tokens)
    full = len(tokens) // block_size
    need_extra = bool(
        request.lora_request or request.mm_features or request.cache_salt
        or getattr(request, "prompt_embeds", None) is not None
    )  # fmt: skip
    extra: list[bytes] | None = None
    if need_extra:
        extra, mm_idx = [], 0
        for i in range(full):
            start = i * block_size
            keys, mm_idx = generate_block_hash_extra_keys(request, start, start + block_size, mm_idx)
            extra.append(encode_extra_keys(keys))
    return block_keys(namespace, tokens, block_size, full, extra)


def namespace_for(cfg: VllmConnectorConfig, vllm_config: Any, tp_rank: int, pp_rank: int = 0) -> str:
    """Key namespace: model, model dtype (with the checkpoint's quantization and revision when
    set, and a digest of its files' content unless ``model_tag`` is set
    (:func:`~kvpool.connectors.checkpoint.checkpoint_tag`): one served name for two of them must
    not share KV; and a digest of the RoPE settings
    when the model scales RoPE or the server overrides its config: K differs with them; and of the
    speculative decoding draft model, whose layers' KV is stored too), KV cache
    dtype, KV heads x head size (and the DCP size and interleave when DCP > 1), the tokens of one
    block id (:func:`key_block_size`), TP rank and size (and, with pipeline parallelism, the
    stage ``pp_rank`` and the stage count: each stage commits its own layers), device."""
    mc = vllm_config.model_config
    model = cfg.model_tag or str(getattr(mc, "served_model_name", None) or mc.model)
    dtype = str(mc.dtype).replace("torch.", "")
    # the checkpoint's content, unless the operator vouches for it (model_tag): a served name or
    # path alone lets two checkpoints share KV (kvpool.connectors.checkpoint)
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    revision = getattr(mc, "revision", None)
    ckpt = None if cfg.model_tag else checkpoint_tag(str(mc.model), revision, download_dir)
    for tag, value in (
        ("q", getattr(mc, "quantization", None)),
        ("rev", revision),
        ("ckpt", ckpt),
        ("rope", _rope_tag(mc)),
        ("draft", _draft_tag(vllm_config)),
    ):
        if value:
            dtype += f"+{tag}-" + str(value).replace("/", "_")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    try:
        heads = f"h{mc.get_num_kv_heads(vllm_config.parallel_config)}x{mc.get_head_size()}"
    except Exception:  # noqa: BLE001 - a model config without attention geometry
        heads = "h?"
    device = str(getattr(vllm_config.device_config, "device_type", "cpu"))
    bs = key_block_size(vllm_config)
    dcp = _dcp_size(vllm_config)
    if dcp > 1:  # which tokens of a block a rank holds: DCP size and interleave
        pc = vllm_config.parallel_config
        heads += f"+dcp{dcp}i{int(getattr(pc, 'cp_kv_cache_interleave_size', 1) or 1)}"
    ranks = f"tp{tp_rank}of{tp}"
    pp = pp_size(vllm_config)
    if pp > 1:
        ranks += f"pp{pp_rank}of{pp}"
    return f"kvpool/v2/{model}/{dtype}/kv-{cache_dtype}/{heads}/bs{bs}/{ranks}/{device}"


def pp_size(vllm_config: Any) -> int:
    """The instance's pipeline stage count."""
    return int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)


def pp_rank() -> int:
    """This worker's pipeline stage (vLLM's PP group rank), called once by the worker half at
    start; 0 where vLLM's parallel state is not set up (the scheduler process, tests)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - not initialised
        return 0


def _dcp_size(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)


def key_block_size(vllm_config: Any) -> int:
    """Tokens one vLLM block id covers, the unit of store keys: ``cache_config.block_size`` times
    the decode context parallel size (vLLM's scheduler block size: with DCP each rank holds a
    slice of every block's tokens in its ``block_size`` slots, so a block id covers
    ``block_size * dcp`` prompt tokens)."""
    return int(vllm_config.cache_config.block_size) * _dcp_size(vllm_config)


def _draft_tag(vllm_config: Any) -> str | None:
    """A digest of the speculative decoding draft model (method, model, revision, quantization),
    or None without one: its layers' KV caches are stored with the target model's, under layer
    names another draft model of the same shapes has too."""
    sc = getattr(vllm_config, "speculative_config", None)
    dmc = getattr(sc, "draft_model_config", None)
    if sc is None or dmc is None:
        return None  # no speculative decoding, or a method without a draft model (n-gram): no KV
    fields = [str(getattr(sc, "method", None))]
    fields += [str(getattr(dmc, k, None)) for k in ("model", "revision", "quantization", "dtype")]
    return digest(json.dumps(fields).encode()).hex()[:8]


def _rope_tag(mc: Any) -> str | None:
    """A digest of what changes K beyond the checkpoint's name (RoPE scaling and base, and the
    server's ``hf_overrides``), or None for a model with default RoPE and no overrides (its
    namespace stays as it was)."""
    hf = getattr(mc, "hf_config", None)
    overrides = getattr(mc, "hf_overrides", None)
    scaling = getattr(hf, "rope_scaling", None) or getattr(hf, "rope_parameters", None)
    kind = (scaling.get("rope_type") or scaling.get("type")) if isinstance(scaling, dict) else scaling
    if kind in (None, "default") and not overrides:
        return None
    names = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings")
    fields = {k: getattr(hf, k, None) for k in names}
    extra = overrides if isinstance(overrides, dict) else repr(overrides)  # a callable: its name
    text = json.dumps([fields, extra], sort_keys=True, default=repr)
    return digest(text.encode()).hex()[:8]


def layout_signature(kv_caches: dict[str, Any], num_blocks: int | None) -> str:
    """Short digest of the KV cache layout a worker stores: per distinct tensor its dtype and
    shape without the block dimension (tensors are contiguous, :func:`kv_regions` checks). Two
    instances with different layouts (NHD/HND, fp8, head split) never read each other's layer
    objects."""
    parts = []
    seen: set[int] = set()
    for name in sorted(kv_caches):
        t = kv_caches[name]
        if isinstance(t, (list, tuple)) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        shape = tuple(t.shape)
        n = num_blocks if num_blocks is not None else shape[0]
        inner = shape[1:] if shape[0] == n else (shape[0], "B", *shape[2:])
        parts.append((str(t.dtype), inner))
    return digest(repr(parts).encode()).hex()[:16]


@dataclass
class KvpoolStoreMetadata(KVConnectorMetadata):
    """Scheduler -> worker per step: loads (block id, key) and saves (block id, key) per request."""

    loads: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    saves: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    #: layer-wise mode: blocks this step completes, saved per layer during the forward pass.
    layer_saves: dict[str, list[tuple[int, str]]] = field(default_factory=dict)


def _check_master(cfg: VllmConnectorConfig) -> None:
    if not cfg.master:
        raise ConfigError(
            "KvpoolStoreConnector needs kv_connector_extra_config.master (host:port of `kvpool master`) "
            "so that instances share one pool"
        )


def check_parallel(vllm_config: Any) -> None:
    """Refuse prefill context parallel (PCP > 1): its ranks of one TP rank hold other token
    slices (DCP across PCP) or only the requests they own (PCP alone), and the key names the TP
    rank only, so they would write different bytes under one key."""
    pcp = int(getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) or 1)
    if pcp > 1:
        raise ConfigError(
            f"KvpoolStoreConnector does not support prefill_context_parallel_size > 1 (got {pcp})"
        )


def _connect(cfg: VllmConnectorConfig, segment_size: int, buffer_size: int) -> Store:
    from kvpool.store.client import Store

    _check_master(cfg)
    kw: dict[str, Any] = dict(
        master=cfg.master, hostname=cfg.hostname, segment_size=segment_size, buffer_size=buffer_size,
        protocol=cfg.protocol, metadata=cfg.metadata, transfer_timeout_s=cfg.transfer_timeout_s,
    )  # fmt: skip
    if cfg.secret:
        kw["secret"] = cfg.secret
    if cfg.store_rpc_timeout_s is not None:
        kw["rpc_timeout_s"] = cfg.store_rpc_timeout_s
    return Store.connect(**kw)


class KvpoolStoreConnector(KvpoolConnectorBase):
    """vLLM KV connector (v1) that saves full prompt blocks into the kvpool store and loads the
    longest stored prefix on any instance.

    ``--kv-transfer-config '{"kv_connector":"KvpoolStoreConnector",
    "kv_connector_module_path":"kvpool.connectors.vllm","kv_role":"kv_both",
    "kv_connector_extra_config":{"master":"host:port"}}'``.
    """

    def _make_scheduler(self, vllm_config: Any) -> _StoreScheduler:
        return _StoreScheduler(self.cfg, vllm_config)

    def _make_worker(self, vllm_config: Any, kv_cache_config: Any) -> _StoreWorker:
        from kvpool.connectors.vllm.store_worker import _StoreWorker

        return _StoreWorker(self.cfg, vllm_config, kv_cache_config)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM's model runner, once per step before the forward pass: layer-wise mode begins the
        step's per-layer saves here -- vLLM 0.32 calls ``start_load_kv`` only after the forward
        pass unless the step has synchronous loads, i.e. after every ``save_kv_layer``."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvpoolStoreMetadata):
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """vLLM's model runner, once per step (before the forward pass when the step has
        synchronous loads, ``load_async: false``; else after it): queues this step's loads and
        saves; synchronous per-request loads run here. A synchronous load whose GPU copies
        outlive the transfer timeout (a hung stream) waits here, with no upper bound, until they
        ended, then its blocks are reported failed (recomputed): a bounded wait would hand vLLM
        blocks a late copy may still write, and the forward pass cannot pass that stream either."""
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """vLLM's attention layer, before it reads its KV (layer-wise loads only wait here). A
        layer's load whose GPU copies outlive the transfer timeout (a hung stream) is waited for
        here until they ended, with no upper bound, then its blocks are reported failed: as for
        :meth:`start_load_kv`'s synchronous loads."""
        self._worker.wait_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """vLLM's attention layer, after it wrote its KV: queue that layer's save (layer-wise)."""
        self._worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """vLLM's model runner, once per step after the forward pass (layer-wise: waits for the
        layer writes still running, then queues the commit markers)."""
        self._worker.finish_step()


class _StoreScheduler:
    """Scheduler half. No hook waits on the master: lookups run on a background thread
    (:class:`AsyncLookups`; ``get_num_new_matched_tokens`` answers ``None`` = "ask again" while
    one is pending), ``request_finished`` only hands blocks to the worker (which checks what the
    store already has), and a :class:`Breaker` turns the store off while the master is
    unreachable (requests are computed locally meanwhile)."""

    def __init__(self, cfg: VllmConnectorConfig, vllm_config: Any) -> None:
        check_parallel(vllm_config)
        self.cfg = cfg
        self.block_size = key_block_size(vllm_config)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        # Keys are named in TP rank 0's (stage 0's) namespace (every rank saves the same blocks).
        self.namespace = namespace_for(cfg, vllm_config, 0)
        _check_master(cfg)
        self.breaker = Breaker(f"kvpool store master {cfg.master}", cfg.store_retry_s)
        # Every TP rank of every PP stage writes its own marker once its own objects are stored
        # (a stage's objects are its own layers): a hit needs all.
        pp = pp_size(vllm_config)
        self._rank_ns = [namespace_for(cfg, vllm_config, r, s)
                         for s in range(pp) for r in range(self.tp_size) if r or s]  # fmt: skip
        self._lookups = AsyncLookups(lambda: _connect(cfg, 0, 1 << 16), self._committed)
        self._pending: dict[str, Lookup] = {}  # req -> its lookup (until allocated or finished)
        self._probe: Lookup | None = None
        self._hits: dict[str, tuple[int, list[str]]] = {}  # req -> (local computed tokens, hit keys)
        self._keys: dict[str, list[str] | None] = {}  # req -> keys of its full prompt blocks
        self._stored: dict[str, int] = {}  # req -> leading blocks known to be in the store
        self._loads_made: dict[str, int] = {}  # req -> store loads issued for it (until finished)
        self._unkeyable_logged = False
        self._loads: dict[str, list[tuple[int, str]]] = {}
        self._saves: dict[str, list[tuple[int, str]]] = {}
        self.loading: set[str] = set()  # asynchronous loads not yet reported finished
        self.lookups = 0
        self.hit_blocks = 0
        self.stats = make_stats(cfg.stats)
        self._lw = LayerwiseSaveScheduler(self.block_size) if cfg.layerwise else None
        self._reqs: dict[str, Any] = {}  # layer-wise: req -> its Request (keys of its blocks)
        self.events = StoreEvents(vllm_config)

    def _committed(self, store: Store, keys: list[str]) -> list[bool]:
        """The lookup thread, per batch of lookups: whether every TP rank of every PP stage
        committed each block (its marker in each rank's namespace). Rank 0's marker alone made a
        hit whose load failed on a rank (or stage) that had not stored its shard (its layers):
        recomputed, but a wasted load each time."""
        if not self._rank_ns:
            return store.batch_exists(keys)
        n, m = len(self.namespace), len(keys)
        found = store.batch_exists(keys + [ns + k[n:] for ns in self._rank_ns for k in keys])
        return [all(found[i + r * m] for r in range(len(self._rank_ns) + 1)) for i in range(m)]

    @property
    def store(self) -> Store | None:
        """The scheduler's store client (made by the lookup thread on first use)."""
        return self._lookups.client

    def close(self) -> None:
        self._lookups.close()
        if self._lookups.client is not None:
            self._lookups.client.close()

    def _store_usable(self) -> bool:
        """Closed breaker; while open, one probe per ``store_retry_s`` (never waited for)."""
        if self._probe is not None and self._probe.done:
            probe, self._probe = self._probe, None
            if probe.error is None:
                self.breaker.ok()
            else:
                self.breaker.fail(probe.error)
        if self.breaker.closed():
            return True
        if self._probe is None and self.breaker.want_probe():
            self._probe = self._lookups.submit([f"{self.namespace}/probe"])
        return False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's scheduler, for each waiting request it considers, each step: external hit tokens
        and whether they load asynchronously; ``(None, False)`` while the lookup is pending."""
        rid = request.request_id
        if self._lw is not None:
            self._reqs[rid] = request
        n_prompt = len(request.prompt_token_ids or ())
        # At least the last prompt token is computed here, so a full hit stops one block short.
        limit = (n_prompt - 1) // self.block_size
        if limit * self.block_size <= num_computed_tokens or limit < self.cfg.min_hit_blocks:
            return 0, False
        if self._loads_made.get(rid, 0) >= _MAX_LOADS:  # its loads failed (vLLM asks again after
            return 0, False  # a failed load): recomputed, never a store hit failing every step
        if not self._store_usable():
            if self._pending.pop(rid, None) is None:
                self.stats.record_misses("master_unreachable", limit)
            return 0, False
        lk = self._pending.get(rid)
        if lk is None:
            keys = self._request_keys(request)
            if keys is None:
                self.stats.record_misses("unkeyable", limit)
                return 0, False
            self._pending[rid] = self._lookups.submit(keys[:limit])
            return None, False
        if not lk.done:
            if time.monotonic() - lk.started > self.cfg.lookup_timeout_s:
                self._pending.pop(rid, None)
                self.breaker.fail(f"lookup took over {self.cfg.lookup_timeout_s} s")
                return 0, False
            return None, False
        if lk.error is not None:
            self._pending.pop(rid, None)
            self.stats.record_misses("master_unreachable", len(lk.keys))
            if isinstance(lk.error, KvpoolError):
                self.breaker.fail(lk.error)
            else:
                log.warning("kvpool store lookup for %s failed: %r", rid, lk.error)
            return 0, False
        self.breaker.ok()
        found = lk.found or []
        n = 0
        while n < len(found) and found[n]:
            n += 1
        self.lookups += 1
        self.stats.record_hits(n)
        self.stats.record_misses("not_stored", len(found) - n)
        self._stored[rid] = n
        hit = n * self.block_size - num_computed_tokens
        if n < self.cfg.min_hit_blocks or hit <= 0:
            return 0, False
        self._hits[rid] = (num_computed_tokens, lk.keys[:n])
        return hit, self.cfg.load_async

    def _request_keys(self, request: Any) -> list[str] | None:
        """Keys of the request's full prompt blocks (computed once per request); None when its
        extra keys have no deterministic encoding (the request bypasses the store)."""
        rid = request.request_id
        if rid not in self._keys:
            try:
                self._keys[rid] = request_block_keys(self.namespace, request, self.block_size)
            except (TypeError, ValueError) as exc:
                if not self._unkeyable_logged:
                    self._unkeyable_logged = True
                    log.warning("kvpool store: request %s has block-hash extra keys without a deterministic "
                                "encoding (%s); such requests bypass the store", rid, exc)  # fmt: skip
                self._keys[rid] = None
        return self._keys[rid]

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM's scheduler, once blocks are allocated for a request it schedules."""
        self._pending.pop(request.request_id, None)
        entry = self._hits.pop(request.request_id, None)
        if entry is None or num_external_tokens <= 0:
            return
        computed, keys = entry
        ids = blocks.get_block_ids()[0]
        first = computed // self.block_size
        last = (computed + num_external_tokens) // self.block_size
        if self.cfg.load_async:
            self.loading.add(request.request_id)
        self._loads_made[request.request_id] = self._loads_made.get(request.request_id, 0) + 1
        # A sliding-window model: blocks out of the window are vLLM's null block (shared by every
        # request, never read): nothing is loaded into them. An empty load is still a job: the
        # worker reports the request finished loading.
        self._loads[request.request_id] = [
            (ids[i], keys[i]) for i in range(first, min(last, len(keys), len(ids))) if ids[i] != _NULL_BLOCK
        ]
        self.hit_blocks += last - first

    def build_meta(self, scheduler_output: Any = None) -> KvpoolStoreMetadata:
        meta = KvpoolStoreMetadata(loads=self._loads, saves=self._saves)
        self._loads, self._saves = {}, {}
        if self._lw is not None and scheduler_output is not None:
            usable = self._store_usable()
            meta.layer_saves = self._lw.step_layer_saves(
                scheduler_output,
                lambda rid: self._request_keys(self._reqs[rid]) if usable and rid in self._reqs else None,
                lambda rid: self._stored.get(rid, 0),
                lambda rid: len(getattr(self._reqs.get(rid), "prompt_token_ids", None) or ()),
            )
        return meta

    def loads_done(self, req_ids: Any) -> None:
        self.loading.difference_update(req_ids)

    def sends_done(self, req_ids: Any) -> None:
        """vLLM's scheduler, each step: requests whose saves every worker finished."""
        self.events.sent(req_ids)

    def take_events(self) -> list[Any]:
        return self.events.take()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        """vLLM's scheduler, once per finished request: hand its full prompt blocks to the worker
        for saving (no master RPC here); True keeps the blocks until the worker is done."""
        return self._finished(request, block_ids), None

    def _finished(self, request: Any, block_ids: list[int]) -> bool:
        rid = request.request_id
        self._pending.pop(rid, None)
        self._hits.pop(rid, None)
        stored = self._stored.pop(rid, 0)
        self._loads_made.pop(rid, None)
        all_keys = self._keys.pop(rid, None)
        if self._lw is not None:
            self._lw.forget(rid)
            self._reqs.pop(rid, None)
        if rid in self.loading:
            return True  # a load still writes into its blocks: freed once it is reported done
        if self._lw is not None:
            return False  # layer-wise: its blocks were saved while they were computed
        tokens = request.prompt_token_ids or ()
        n = min(len(tokens), int(request.num_computed_tokens)) // self.block_size
        n = min(n, len(block_ids))
        if n <= stored or not self._store_usable():
            return False
        if all_keys is None:
            all_keys = self._request_keys(request)
            self._keys.pop(rid, None)
        if all_keys is None:
            return False
        # Blocks the lookup found are in the store already; the worker checks the rest. A
        # sliding-window model's blocks that fell out of the window are vLLM's null block by now
        # (freed, their KV gone): never saved, or another request would load its bytes.
        saves = [(block_ids[i], all_keys[i]) for i in range(stored, n) if block_ids[i] != _NULL_BLOCK]
        if not saves:
            return False
        self._saves[rid] = saves
        if len(saves) == n - stored:  # a gap: no event rather than one claiming the whole prefix
            self.events.saving(request, stored, n, self.block_size)
        return True
