"""The worker half of :class:`kvpool.connectors.vllm.store.KvpoolStoreConnector`: one per vLLM
worker process (TP rank), made by the connector in its worker role. It registers the KV cache
regions, and moves blocks between them and the store on two background threads (loads never wait
behind saves): whole-request loads and saves named by the scheduler's per-step metadata, or per
layer in layer-wise mode (:mod:`kvpool.connectors.vllm.layerwise`). Failed block loads are
reported to vLLM (``get_block_ids_with_load_errors``) and recomputed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from kvpool.connectors.vllm.common import Region, VllmConnectorConfig, kv_regions
from kvpool.connectors.vllm.layerwise import LayerLoads, LayerSaves
from kvpool.connectors.vllm.nonblocking import Breaker
from kvpool.connectors.vllm.stats import make_stats
from kvpool.connectors.vllm.store import (
    KvpoolStoreMetadata,
    _connect,
    check_parallel,
    layout_signature,
    namespace_for,
    pp_rank,
)
from kvpool.errors import KvpoolError, MasterUnavailable, ObjectExists, ObjectNotFound, late_batch

if TYPE_CHECKING:
    from kvpool.store.client import Store

log = logging.getLogger("kvpool.connectors.vllm")


def _miss_reason(result: Any) -> str:
    """Why a block the lookup found did not load: its miss reason in the connector stats."""
    if isinstance(result, ObjectNotFound):
        return "evicted"
    if isinstance(result, MasterUnavailable):
        return "master_unreachable"
    if isinstance(result, KvpoolError):
        return "load_error"
    return "size_mismatch"


class _StoreWorker:
    def __init__(self, cfg: VllmConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        from kvpool.connectors.vllm.pd import _tp

        check_parallel(vllm_config)
        self.cfg = cfg
        self.tp_rank, _ = _tp(vllm_config)
        self.namespace0 = namespace_for(cfg, vllm_config, 0)
        # Each TP rank, and each pipeline stage (its own layers), stores its objects and commit
        # marker under its own namespace (the scheduler's lookup needs every one's marker).
        self.pp_rank = pp_rank()
        self.namespace = namespace_for(cfg, vllm_config, self.tp_rank, self.pp_rank)
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self.store: Store | None = None
        self.regions: list[Region] = []
        self.layout = ""
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._recvd: set[str] = set()
        self._errors: set[int] = set()
        # Loads and saves whose GPU copies outlived the transfer timeout (a hung stream): (rid,
        # block ids failed once they ended -- none for a save --, batch id). Not reported to vLLM
        # (its blocks stay allocated) until the engine says their copies ended (get_finished).
        self._parked: list[tuple[str, list[int], int]] = []
        # Loads and saves on separate threads: a load never waits behind a save.
        self._loads: queue.Queue[tuple[str, list[tuple[int, str]]] | None] = queue.Queue()
        self._saves: queue.Queue[tuple[str, list[tuple[int, str]]] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self.breaker = Breaker(f"kvpool store master {cfg.master} (saves)", cfg.store_retry_s)
        self.layer_saves = LayerSaves(self._saves.put, self._put_layer, self._commit)
        self.layer_loads = LayerLoads(self._loads.put, self._get_layer)
        self._layer_rids = ""  # the requests of this step's layer-wise loads (for the log)
        self._layer_load_ids: set[int] = set()  # block ids of this step's layer-wise loads
        self.saved_blocks = 0
        self.loaded_blocks = 0
        self.stats = make_stats(cfg.stats)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.regions, tensors = kv_regions(kv_caches, self.num_blocks)
        self.layout = layout_signature(kv_caches, self.num_blocks)
        self.layer_saves.set_regions(self.regions)
        self.layer_loads.set_regions(self.regions)
        if self.store is None:
            self.store = _connect(self.cfg, self.cfg.store_segment_size, self.cfg.store_buffer_size)
        for t in tensors:
            # CPU or CUDA KV caches: GPU blocks move by DMA between the GPU and the pool (same host:
            # straight from/into the storage segment's shared memory; other hosts: staged).
            self.store.register_buffer(t)
        self._start_threads()

    def _start_threads(self) -> None:
        if not self._threads:
            for name, q in (("load", self._loads), ("save", self._saves)):
                t = threading.Thread(target=self._loop, args=(q,), name=f"kvpool-store-{name}")
                t.daemon = True
                t.start()
                self._threads.append(t)

    def unregister_kv_caches(self) -> None:
        if self.store is not None:
            for addr in {r.addr for r in self.regions}:
                try:
                    self.store.unregister_buffer(addr)
                except KvpoolError:
                    pass
        self.regions = []

    def close(self) -> None:
        self._loads.put(None)
        self._saves.put(None)
        for t in self._threads:
            t.join(timeout=10)
        if self.store is not None:
            self.store.close()

    def _key(self, key: str) -> str:
        # The scheduler names blocks in TP rank 0's (stage 0's) namespace; each rank (stage)
        # stores its own shard (layers).
        return key if self.namespace == self.namespace0 else self.namespace + key[len(self.namespace0) :]

    def _ranges(
        self, blocks: list[tuple[int, str]], regions: list[Region] | None = None
    ) -> tuple[list[str], list[int], list[int], list[int]]:
        keys, addrs, sizes, owners = [], [], [], []
        for block_id, key in blocks:
            base = self._key(key)
            for r in self.regions if regions is None else regions:
                keys.append(f"{base}/{self.layout}/{r.name}")
                addrs.append(r.addr + block_id * r.stride)
                sizes.append(r.block_bytes)
                owners.append(block_id)
        return keys, addrs, sizes, owners

    def start(self, meta: KvpoolStoreMetadata) -> None:
        """vLLM's worker, once per step (``start_load_kv``; before the forward pass when the step
        has synchronous loads, else after it): queue this step's loads, then per-request saves."""
        layer_loads: list[tuple[int, str]] = []
        for rid, blocks in meta.loads.items():
            if self.cfg.load_async:
                self._loads.put(lambda rid=rid, blocks=blocks: self._load_job(rid, blocks))
            elif self.cfg.layerwise:
                layer_loads += blocks
            else:
                self._load_or_fail(blocks, None, True, rid)
        self.layer_loads.finish()  # the last step's layer loads ended: they read _layer_rids
        self._layer_rids = ", ".join(meta.loads) if self.cfg.layerwise else ""
        self._layer_load_ids = {b for b, _ in layer_loads}
        self.layer_loads.begin(layer_loads)
        for rid, blocks in meta.saves.items():
            self._saves.put(lambda rid=rid, blocks=blocks: self._save_job(rid, blocks))

    def begin_step(self, meta: KvpoolStoreMetadata) -> None:
        """``bind_connector_metadata``, once per step before the forward pass: the blocks this
        step completes are saved layer by layer (layer-wise mode) as ``save_kv_layer`` comes."""
        lw = [b for blocks in meta.layer_saves.values() for b in blocks]
        if lw and not self.breaker.closed() and not self.breaker.want_probe():
            lw = []  # master unreachable lately: this step's blocks are not saved
        self.layer_saves.begin(lw)

    def wait_layer_load(self, layer: str) -> None:
        """``wait_for_layer_load``: this layer's blocks of this step's in-forward loads are in."""
        self.layer_loads.wait(layer)

    def save_layer(self, layer: str, kv_layer: Any = None) -> None:
        """``save_kv_layer``: queue this layer's objects of the blocks this step completes. A CUDA
        layer is saved once a CUDA event recorded here (after the attention kernel that writes
        it was enqueued) completed."""
        written = None
        if getattr(kv_layer, "is_cuda", False):
            import torch

            ev = torch.cuda.Event()
            ev.record()
            written = ev.synchronize
        self.layer_saves.layer(layer, written)

    def finish_step(self) -> None:
        """``wait_for_save``: the step's layer loads and layer writes are done when it returns.
        A step whose in-forward load failed commits none of its layer-saved blocks: they were
        computed attending to the failed blocks' stale bytes (vLLM learns of the failure only
        after this pass and recomputes them; a request sharing a loaded block may too)."""
        self.layer_loads.finish()
        load_failed = self._layer_load_failed()
        if load_failed:
            log.warning("kvpool store: an in-forward load of %s failed: this step's blocks are not committed",
                        self._layer_rids)  # fmt: skip
        self.layer_saves.finish(commit=not load_failed)
        self._layer_load_ids = set()  # (after the step's layer writes: they check it)

    def _layer_load_failed(self) -> bool:
        """Whether a block of this step's in-forward loads failed so far (its load errors are
        taken by vLLM only after ``wait_for_save``)."""
        with self._lock:
            return not self._errors.isdisjoint(self._layer_load_ids)

    @staticmethod
    def _loop(q: queue.Queue[Any]) -> None:
        while (job := q.get()) is not None:
            try:
                job()
            except Exception:  # noqa: BLE001 - one failed job must not stop the thread
                log.exception("kvpool store: background job failed")

    def _load_job(self, rid: str, blocks: list[tuple[int, str]]) -> None:
        """Load thread: one request's asynchronous load. Whatever happens, the request is reported
        finished loading (vLLM waits for it); on an unexpected error every block of it is reported
        failed (recomputed), never left as if loaded. A load whose GPU copies may still land in
        its blocks (TransferTimeout of a hung stream) is parked instead: reported finished, its
        blocks failed, only once those copies ended (:meth:`get_finished`); vLLM recomputing into
        the blocks before would have its KV overwritten by the late copy."""
        failed: list[int] = []
        late = None
        try:
            late = self._load(blocks, park=True)
        except Exception:  # noqa: BLE001 - never a request waiting forever, nor unloaded blocks used
            log.exception("kvpool store: loading %d blocks for %s failed", len(blocks), rid)
            failed = [b for b, _ in blocks]
            self.stats.record_misses("load_error", len(blocks))
        finally:
            with self._lock:
                if late is None:
                    self._errors.update(failed)
                    self._recvd.add(rid)
                else:
                    self._parked.append((rid, [b for b, _ in blocks], late))
        if late is not None:
            log.warning("kvpool store: the load of %s timed out (batch %d), GPU copies still queued (a hung "
                        "stream?); its %d blocks are reported failed once they ended",
                        rid, late, len(blocks))  # fmt: skip

    def _save_job(self, rid: str, blocks: list[tuple[int, str]]) -> None:
        """Save thread: one finished request's blocks. Reported done (vLLM frees the blocks)
        whether or not they were saved; a save whose GPU reads of them may still run (its
        TransferTimeout's batch: nothing of it is committed) only once they ended."""
        late = None
        try:
            late = self._save(blocks)
        finally:
            with self._lock:
                if late is None:
                    self._sent.add(rid)
                else:
                    self._parked.append((rid, [], late))

    def _settle_parked(self) -> None:
        """Report the parked loads and saves whose copies ended (the engine's ``batch_settled``:
        one native call each, never blocks): a load finished with its blocks failed, a save done."""
        with self._lock:
            parked, self._parked = self._parked, []
        if not parked:
            return
        assert self.store is not None
        ended, kept = [], []
        for p in parked:
            (ended if self.store.engine.batch_settled(p[2]) else kept).append(p)
        with self._lock:
            self._parked += kept
            for rid, failed, _ in ended:
                if failed:
                    self._errors.update(failed)
                    self._recvd.add(rid)
                else:
                    self._sent.add(rid)

    def _save(self, blocks: list[tuple[int, str]]) -> int | None:
        """Write every layer of each block, then the block's commit marker (the key the scheduler
        looks up) only when all its layers are stored. Returns the batch of a TransferTimeout
        whose GPU reads of the blocks may still run (nothing committed), else None."""
        assert self.store is not None
        if not self.breaker.closed() and not self.breaker.want_probe():
            return  # master unreachable lately: the blocks go back at once, unsaved
        t0 = time.perf_counter()
        try:
            # Blocks another instance committed since the scheduler's lookup are not written again
            # (this rank's, this stage's marker: its own objects are all stored).
            have = self.store.batch_exists([self._key(k) for _, k in blocks])
            blocks = [b for b, h in zip(blocks, have, strict=True) if not h]
            self.breaker.ok()
            if not blocks:
                return
            keys, addrs, sizes, owners = self._ranges(blocks)
            res = self.store.batch_put_from(keys, addrs, sizes)
        except KvpoolError as exc:
            late = late_batch(exc)
            if late is None:
                self.breaker.fail(exc)  # a hung GPU stream says nothing of the master
            log.warning("kvpool store: saving %d blocks failed: %s", len(blocks), exc)
            return late
        bad = {owners[i] for i, e in enumerate(res) if e is not None and not isinstance(e, ObjectExists)}
        done = [self._key(k) for b, k in blocks if b not in bad]
        marker = f"kvpool-block:{len(self.regions)}".encode()
        try:
            self.store.batch_put(done, [marker] * len(done))
        except KvpoolError as exc:
            log.warning("kvpool store: committing %d blocks failed: %s", len(done), exc)
            return
        self.saved_blocks += len(done)
        self.stats.record_saved(len(done))
        if bad:
            first = next(e for e in res if e is not None and not isinstance(e, ObjectExists))
            log.warning("kvpool store: %d of %d blocks not saved (%s)", len(bad), len(blocks), first)
        log.info("kvpool store: saved %d blocks (%d objects) in %.2f ms", len(done), len(keys),
                 (time.perf_counter() - t0) * 1e3)  # fmt: skip

    def _put_layer(self, blocks: list[tuple[int, str]], regions: list[Region]) -> set[int]:
        """Save thread, layer-wise: one layer's objects of ``blocks``; the ids that failed. (A write
        whose GPU reads outlived the timeout commits nothing and holds its pool space until they
        ended, :meth:`Store.batch_put_from`: vLLM reusing the blocks meanwhile is harmless.)"""
        assert self.store is not None
        if self._layer_load_failed():
            # This layer's KV was computed on failed blocks' stale bytes (through the layers
            # before it): never written, or the next save of these blocks, finding the objects
            # (ObjectExists), would commit them.
            return {b for b, _ in blocks}
        keys, addrs, sizes, owners = self._ranges(blocks, regions)
        try:
            res = self.store.batch_put_from(keys, addrs, sizes)
        except KvpoolError as exc:
            if late_batch(exc) is None:
                self.breaker.fail(exc)  # a hung GPU stream says nothing of the master
            log.warning("kvpool store: saving layer %s of %d blocks failed: %s",
                        regions[0].name, len(blocks), exc)  # fmt: skip
            return set(owners)
        self.breaker.ok()
        return {owners[i] for i, e in enumerate(res) if e is not None and not isinstance(e, ObjectExists)}

    def _commit(self, blocks: list[tuple[int, str]]) -> None:
        """Save thread, layer-wise: commit markers of blocks whose every layer is stored."""
        assert self.store is not None
        done = [self._key(k) for _, k in blocks]
        marker = f"kvpool-block:{len(self.regions)}".encode()
        try:
            res = self.store.batch_put(done, [marker] * len(done))
        except KvpoolError as exc:
            log.warning("kvpool store: committing %d blocks failed: %s", len(done), exc)
            return
        n = sum(1 for e in (res or [None] * len(done)) if e is None)
        self.saved_blocks += n
        self.stats.record_saved(n)
        log.info("kvpool store: committed %d blocks (layer-wise)", n)

    def _get_layer(self, blocks: list[tuple[int, str]], regions: list[Region], first: bool) -> None:
        """Load thread, layer-wise: one layer's objects of ``blocks`` (``wait_for_layer_load``
        waits for it)."""
        self._load_or_fail(blocks, regions, first, self._layer_rids)

    def _load_or_fail(
        self, blocks: list[tuple[int, str]], regions: list[Region] | None, first: bool, rid: str
    ) -> None:
        """In-forward loads (layer-wise, or synchronous; ``rid``: the requests, for the log): an
        unexpected error fails every block of the batch (reported to vLLM, recomputed), never
        leaves them as if loaded. A TransferTimeout whose GPU copies may still land in the blocks
        (a hung stream) waits here until they ended (``TransferEngine.wait_settled``, no upper
        bound: vLLM would recompute into blocks a late copy still writes), then fails them: the
        forward pass this runs in cannot pass that stream either."""
        try:
            late = self._load(blocks, regions, count=first, park=True)
        except Exception:  # noqa: BLE001 - the forward pass goes on: the blocks must be reported
            layer = regions[0].name if regions else "(all)"
            log.exception("kvpool store: loading layer %s of %d blocks failed", layer, len(blocks))
            if first:
                self.stats.record_misses("load_error", len(blocks))
        else:
            if late is None:
                return
            assert self.store is not None
            log.warning(
                "kvpool store: the in-forward load of %s timed out (batch %d), GPU copies still queued "
                "(a hung stream?): waiting for them before its %d blocks fail",
                rid,
                late,
                len(blocks),
            )
            self.store.engine.wait_settled(late)
        with self._lock:
            self._errors.update(b for b, _ in blocks)

    def _load(
        self,
        blocks: list[tuple[int, str]],
        regions: list[Region] | None = None,
        count: bool = True,
        park: bool = False,
    ) -> int | None:
        """Read the blocks' objects into them; failed blocks go to the load errors. ``park``: a
        TransferTimeout whose GPU copies may still land in them fails none: its batch is
        returned (the caller reports the blocks once it settled); else None."""
        assert self.store is not None
        late = None
        t0 = time.perf_counter()
        keys, addrs, sizes, owners = self._ranges(blocks, regions)
        failed: set[int] = set()
        why: dict[int, str] = {}  # failed block -> miss reason
        try:
            res = self.store.batch_get_into(keys, addrs, sizes)
            # Exact sizes: a shorter object (another layout, a truncated write) is a failed load.
            for i, r in enumerate(res):
                if isinstance(r, KvpoolError) or r != sizes[i]:
                    failed.add(owners[i])
                    why.setdefault(owners[i], _miss_reason(r))
        except KvpoolError as exc:
            failed = set(owners)
            reason = "master_unreachable" if isinstance(exc, MasterUnavailable) else "load_error"
            why = dict.fromkeys(failed, reason)
            late = late_batch(exc) if park else None
            if late is None:  # (a late batch: its caller's one warning names the requests and batch)
                log.warning("kvpool store: loading %d blocks failed: %s", len(blocks), exc)
        if late is None:
            with self._lock:
                self._errors |= failed
        ok_bytes = sum(n for n, o in zip(sizes, owners, strict=True) if o not in failed)
        # Layer-wise loads: blocks and misses are counted with the first layer only.
        nb = len(blocks) - len(failed) if count else 0
        if len(blocks) > len(failed):
            self.stats.record_transfer(time.perf_counter() - t0, ok_bytes, nb)
        if not count:
            return late
        self.loaded_blocks += nb
        for reason in set(why.values()):
            self.stats.record_misses(reason, sum(1 for r in why.values() if r == reason))
        log.info("kvpool store: loaded %d blocks (%d failed) in %.2f ms", len(blocks), len(failed),
                 (time.perf_counter() - t0) * 1e3)  # fmt: skip
        return late

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's worker, once per step: the requests whose saves (blocks freeable) and
        asynchronous loads ended since the last call, parked ones among them once settled."""
        self._settle_parked()
        with self._lock:
            sent, self._sent = self._sent, set()
            recvd, self._recvd = self._recvd, set()
        return (sent or None), (recvd or None)

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errs, self._errors = self._errors, set()
        return errs
