"""Layer-wise mode of :class:`KvpoolStoreConnector` (``kv_connector_extra_config.layerwise``).

Per-request mode (the default) saves a request's full prompt blocks after it finished and loads
hits before their request runs. Layer-wise mode moves the KV of each attention layer while the
next one is computed:

* **Saves.** The scheduler half names, in every step's metadata, the full prompt blocks the step
  completes (:func:`step_layer_saves`). vLLM calls ``save_kv_layer`` after each attention layer;
  the worker queues that layer's objects of those blocks as one batch on its save thread
  (:class:`LayerSaves`), so layer *i* is written while layer *i+1* is computed. ``wait_for_save``
  (once per step, after the forward pass) waits for the writes still running -- vLLM's contract:
  the KV blocks may be reused after it returns -- and queues the blocks' commit markers. A marker
  is written only for a block whose every layer was stored: a step cut short between layers, a
  failed layer write, a failed in-forward load in the step (its later blocks were computed on
  the failed blocks' stale bytes) or an open breaker leaves no marker, so a partial block is
  never a hit.
* **Loads** inside the forward pass (``load_async: false``): ``start_load_kv`` queues one batch per
  layer on the load thread; ``wait_for_layer_load(layer)`` waits for that layer's batch only, so
  layer *i+1* is read while layer *i* is computed (:class:`LayerLoads`). Asynchronous loads
  (``load_async: true``) complete before their request runs and are unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpool.connectors.vllm.common import Region


def layer_of(region: Region) -> str:
    """The attention layer a region belongs to (K/V planes are ``<layer>#<plane>``)."""
    return region.name.split("#", 1)[0]


def regions_by_layer(regions: list[Region]) -> dict[str, list[Region]]:
    """Regions grouped by layer name, in layer order."""
    out: dict[str, list[Region]] = {}
    for r in regions:
        out.setdefault(layer_of(r), []).append(r)
    return out


@dataclass
class _Progress:
    """Scheduler-side state of one request's layer-wise saves."""

    blocks: list[int]
    next_block: int  # first full prompt block not yet handed to a step's saves


class LayerwiseSaveScheduler:
    """Scheduler half: which full prompt blocks each step computes (so the worker saves them per
    layer during that step). Called from ``build_connector_meta``, once per step; no I/O."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._progress: dict[str, _Progress] = {}

    def forget(self, rid: str) -> None:
        self._progress.pop(rid, None)

    def step_layer_saves(
        self, so: Any, keys_of: Any, stored_of: Any, n_prompt_of: Any
    ) -> dict[str, list[tuple[int, str]]]:
        """(block id, key) per request for the full prompt blocks this step completes.

        ``keys_of(rid)`` gives the request's block keys (None: it bypasses the store),
        ``stored_of(rid)`` how many leading blocks the store is known to hold, ``n_prompt_of(rid)``
        its prompt length."""
        saves: dict[str, list[tuple[int, str]]] = {}
        bs = self.block_size
        ends: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            rid = new.req_id
            self._progress[rid] = _Progress(list(new.block_ids[0]), stored_of(rid))
            ends[rid] = new.num_computed_tokens + so.num_scheduled_tokens.get(rid, 0)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            p = self._progress.get(rid)
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                # Preempted and resumed: new blocks, and what it had saved may be partial again.
                p = self._progress[rid] = _Progress(list(new_ids[0]) if new_ids else [], stored_of(rid))
            elif p is None:
                continue
            elif new_ids:
                p.blocks.extend(new_ids[0])
            ends[rid] = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)
        for rid, end in ends.items():
            p = self._progress[rid]
            last = min(end, n_prompt_of(rid)) // bs
            if last <= p.next_block:
                continue
            keys = keys_of(rid)
            if not keys:
                p.next_block = last
                continue
            last = min(last, len(keys), len(p.blocks))
            if last > p.next_block:
                saves[rid] = [(p.blocks[b], keys[b]) for b in range(p.next_block, last)]
                p.next_block = last
        return saves


@dataclass
class _StepSaves:
    blocks: list[tuple[int, str]]
    pending: list[threading.Event] = field(default_factory=list)
    layers_done: set[str] = field(default_factory=set)
    bad: set[int] = field(default_factory=set)  # block ids with a failed layer write


class LayerSaves:
    """Worker half of layer-wise saves for the current step (one forward pass).

    ``begin`` (``start_load_kv``), ``layer`` (``save_kv_layer``, once per attention layer),
    ``finish`` (``wait_for_save``). ``put_layer(blocks, regions) -> set of failed block ids`` runs on
    the save thread (``submit``); ``commit(blocks)`` writes the markers, also on the save thread.
    """

    def __init__(self, submit: Any, put_layer: Any, commit: Any) -> None:
        self._submit = submit
        self._put_layer = put_layer
        self._commit = commit
        self._layers: dict[str, list[Region]] = {}
        self._step: _StepSaves | None = None

    def set_regions(self, regions: list[Region]) -> None:
        self._layers = regions_by_layer(regions)

    def begin(self, blocks: list[tuple[int, str]]) -> None:
        self._step = _StepSaves(blocks) if blocks else None

    def layer(self, name: str, written: Callable[[], None] | None = None) -> None:
        """Queue the save of layer ``name``; ``written`` (on the save thread, first) waits until
        the layer's KV is in memory: a GPU attention kernel is only enqueued when vLLM calls
        ``save_kv_layer`` (a CUDA event recorded there), host memory is written already (None)."""
        step = self._step
        regions = self._layers.get(name)
        if step is None or not regions or name in step.layers_done:
            return  # nothing to save, or a layer sharing another layer's tensor
        step.layers_done.add(name)
        done = threading.Event()
        step.pending.append(done)

        def job() -> None:
            try:
                if written is not None:
                    written()
                step.bad |= self._put_layer(step.blocks, regions)
            except BaseException:
                step.bad |= {b for b, _ in step.blocks}
                raise
            finally:
                done.set()

        self._submit(job)

    def finish(self, commit: bool = True) -> None:
        """Wait for this step's layer writes (the blocks may be reused afterwards), then queue
        the commit markers of the blocks whose every layer was stored (none when ``commit`` is
        false: the worker found the step's KV computed on a failed load)."""
        step, self._step = self._step, None
        if step is None:
            return
        for ev in step.pending:
            ev.wait()
        if not commit or step.layers_done != set(self._layers):
            return  # the forward pass did not reach every layer: nothing becomes visible
        good = [(b, k) for b, k in step.blocks if b not in step.bad]
        if good:
            self._submit(lambda: self._commit(good))


class LayerLoads:
    """Worker half of layer-wise loads inside the forward pass: one batch per layer queued at
    ``begin`` (``start_load_kv``; ``get_layer(blocks, regions, first)`` on the load thread),
    ``wait(layer)`` in ``wait_for_layer_load``, ``finish`` at
    ``wait_for_save`` (a layer vLLM never waited for is still complete before the step ends)."""

    def __init__(self, submit: Any, get_layer: Any) -> None:
        self._submit = submit
        self._get_layer = get_layer
        self._layers: dict[str, list[Region]] = {}
        self._events: dict[str, threading.Event] = {}

    def set_regions(self, regions: list[Region]) -> None:
        self._layers = regions_by_layer(regions)

    def begin(self, blocks: list[tuple[int, str]]) -> None:
        self.finish()
        if not blocks:
            return
        for i, (name, regions) in enumerate(self._layers.items()):
            ev = threading.Event()
            self._events[name] = ev

            def job(regions: list[Region] = regions, ev: threading.Event = ev, first: bool = i == 0) -> None:
                try:
                    self._get_layer(blocks, regions, first)
                finally:
                    ev.set()

            self._submit(job)

    def wait(self, name: str) -> None:
        ev = self._events.get(name)
        if ev is not None:
            ev.wait()
        elif name not in self._layers:
            self.finish()  # a layer we do not know (shares another's tensor): wait for all

    def finish(self) -> None:
        for ev in self._events.values():
            ev.wait()
        self._events = {}
