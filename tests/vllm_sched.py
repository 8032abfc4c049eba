"""Drive vLLM's real ``Scheduler`` and the connectors' worker halves in one process (no model).

The "forward pass" is a test double: it writes a known pattern into the KV blocks vLLM assigned
and returns one sampled token per request. Everything else is vLLM's own scheduler, KV cache
manager and request objects, and kvpool's real transfer engine / store.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BS = 32
HEADS = 2
HEAD = 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def vllm_config(
    model: Path,
    connector: str,
    role: str,
    extra: dict[str, Any],
    blocks: int,
    dtype: str = "float32",
    engine_id: str | None = None,
) -> VllmConfig:
    """A VllmConfig for the tiny model with a kvpool connector."""
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype=dtype, max_model_len=4096, seed=0),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=4096, is_encoder_decoder=False
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=None if connector == "MultiConnector" else "kvpool.connectors.vllm",
            kv_role=role,
            kv_connector_extra_config=extra,
            engine_id=engine_id,
        ),
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = blocks
    return vc


def kv_cache_config(blocks: int, sliding_window: int | None = None) -> KVCacheConfig:
    """One full-attention group over the two layers (``sliding_window``: one sliding-window group,
    whose blocks that fall out of the window vLLM replaces by its null block)."""
    spec: Any = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    if sliding_window is not None:
        sw = sliding_window
        spec = SlidingWindowSpec(
            block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32, sliding_window=sw
        )
    return KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)]
    )


class Instance:
    """A scheduler plus the worker-side connector over real CPU KV tensors (CPU backend layout)."""

    def __init__(
        self, model: Path, connector: str, role: str, extra: dict[str, Any], blocks: int = 64,
        dtype: str = "float32", sliding_window: int | None = None, engine_id: str | None = None,
    ) -> None:  # fmt: skip
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        self.vc = vllm_config(model, connector, role, extra, blocks, dtype, engine_id)
        kcc = kv_cache_config(blocks, sliding_window)
        self.scheduler = Scheduler(
            self.vc, kcc, StructuredOutputManager(self.vc), block_size=BS, log_stats=True
        )
        self.worker = KVConnectorFactory.create_connector(self.vc, KVConnectorRole.WORKER, kcc)
        dt = getattr(torch, dtype)
        self.kv = {name: torch.zeros(blocks, HEADS, BS, 2 * HEAD, dtype=dt) for name in LAYERS}
        self.worker.register_kv_caches(self.kv)
        self.idle_free = self.free_blocks()
        self.pending = KVConnectorOutput()

    @property
    def connector(self) -> Any:
        """The scheduler-side connector."""
        return self.scheduler.connector

    def free_blocks(self) -> int:
        """Free blocks in vLLM's block pool."""
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(
        self, rid: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, **kw: Any
    ) -> Request:
        """Queue a request (greedy); ``kw`` go to vLLM's ``Request`` (e.g. ``cache_salt``)."""
        req = make_request(rid, prompt, max_tokens, params, **kw)
        self.scheduler.add_request(req)
        return req

    def step_until(self, cond: Any, timeout: float = 10.0) -> Any:
        """Step until ``cond(scheduler_output)`` is true; returns that scheduler output."""
        deadline = time.monotonic() + timeout
        while True:
            out, _ = self.step()
            if cond(out):
                return out
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached")
            time.sleep(0.005)

    def lookup(self, req: Request, computed: int = 0, timeout: float = 10.0) -> tuple[int, bool]:
        """``get_num_new_matched_tokens`` asked again, as the scheduler does, while it answers
        None (lookup pending)."""
        deadline = time.monotonic() + timeout
        while True:
            n, is_async = self.connector.get_num_new_matched_tokens(req, computed)
            if n is not None:
                return n, is_async
            if time.monotonic() > deadline:
                raise AssertionError("lookup still pending")
            time.sleep(0.005)

    def step(self, token: int = 7) -> tuple[Any, dict[str, Any]]:
        """One engine step: schedule, run the worker connector, 'compute' the scheduled tokens."""
        out = self.scheduler.schedule()
        # as vLLM's model runner: handle_preemptions first (before it writes into freed blocks), then bind
        self.worker.handle_preemptions(out.kv_connector_metadata)
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        # as vLLM's model runner (kv_connector_model_runner_mixin): loads start before the
        # forward pass only when the step has synchronous ones, else after it
        after = not getattr(out, "has_sync_kv_loads", True)
        if not after:
            self.worker.start_load_kv(None)
        work: list[tuple[str, int, int]] = []
        for new in out.scheduled_new_reqs:
            work.append((new.req_id, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id]))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            work.append((rid, cached.num_computed_tokens[i], out.num_scheduled_tokens[rid]))
        self._forward(work)
        if after:
            self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        kco = KVConnectorOutput(
            finished_sending=sending, finished_recving=recving, invalid_block_ids=set(errors)
        )
        ids = [w[0] for w in work]
        reqs = self.scheduler.requests
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            # a prefill chunk that does not reach the end of the prompt samples nothing (as vLLM's runner)
            sampled_token_ids=[  # (none for a request aborted while its step ran)
                [token] if start + n >= getattr(reqs.get(rid), "num_tokens", 1 << 62) else []
                for rid, start, n in work
            ],
            kv_connector_output=kco,
        )
        eco = self.scheduler.update_from_output(out, mro)
        return out, {o.request_id: o for e in eco.values() for o in e.outputs}

    def _forward(self, work: list[tuple[str, int, int]]) -> None:
        """The forward pass double over ``(request id, first token, tokens)`` of the step."""
        for rid, start, n in work:
            self._compute(rid, start, n)

    def _compute(self, rid: str, start: int, n: int) -> None:
        """The forward pass double: token t of request rid gets the value pattern(rid, t)."""
        req = self.scheduler.requests[rid]
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        for t in range(start, start + n):
            b, off = divmod(t, BS)
            for li, name in enumerate(LAYERS):
                self.kv[name][block_ids[b], :, off, :] = pattern(req.all_token_ids[: t + 1], li)

    def holds_prompt_kv(self, rid: str, prompt: list[int]) -> bool:
        """Whether the request's blocks hold the KV of every prompt token but the last (what a
        decode loads; it computes the last one itself), as :meth:`_compute` writes it."""
        n = len(prompt) - 1
        return all(
            torch.equal(g, w)
            for g, w in zip(self.block_values(rid, n), expected_rows(prompt, n), strict=True)
        )

    def block_values(self, rid: str, upto_tokens: int) -> list[torch.Tensor]:
        """The KV rows of the first ``upto_tokens`` tokens of a request, per layer."""
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        out = []
        for name in LAYERS:
            rows = [self.kv[name][block_ids[t // BS], :, t % BS, :] for t in range(upto_tokens)]
            out.append(torch.stack(rows))
        return out

    def run_until(self, cond: Any, timeout: float = 10.0) -> dict[str, Any]:
        """Step until ``cond(outputs)`` is true; returns the last outputs."""
        deadline = time.monotonic() + timeout
        while True:
            _, outputs = self.step()
            if cond(outputs):
                return outputs
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached")
            time.sleep(0.01)

    def close(self) -> None:
        """Shut the worker connector down."""
        self.worker.shutdown()
        self.connector.shutdown()


class LayerInstance(Instance):
    """:class:`Instance` whose forward pass runs layer by layer: ``wait_for_layer_load`` before a
    layer computes, ``save_kv_layer`` after, ``wait_for_save`` at the end -- as vLLM's attention
    layers and model runner call them. ``stop_after``: the forward pass is cut short after that
    many layers (an abort between layers); ``after_save(layer index)`` runs between layers."""

    stop_after: int | None = None
    after_save: Any = None  # called with the layer index after each save_kv_layer
    seen: list[tuple[str, str]]

    def step(self, token: int = 7) -> tuple[Any, dict[str, Any]]:
        self.seen = []
        return super().step(token)

    def _forward(self, work: list[tuple[str, int, int]]) -> None:
        for li, name in enumerate(LAYERS):
            if self.stop_after is not None and li >= self.stop_after:
                break
            self.worker.wait_for_layer_load(name)
            self.seen.append(("load", name))
            for rid, start, n in work:
                self._compute_layer(rid, start, n, li)
            self.worker.save_kv_layer(name, self.kv[name], None)
            self.seen.append(("save", name))
            if self.after_save is not None:
                self.after_save(li)

    def _compute_layer(self, rid: str, start: int, n: int, li: int) -> None:
        req = self.scheduler.requests[rid]
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        for t in range(start, start + n):
            b, off = divmod(t, BS)
            self.kv[LAYERS[li]][block_ids[b], :, off, :] = pattern(req.all_token_ids[: t + 1], li)


def make_request(
    rid: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None, **kw: Any
) -> Request:
    """A vLLM ``Request`` (greedy) not yet queued; ``kw`` go to ``Request`` (``cache_salt``,
    ``lora_request``, ``mm_features``)."""
    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
    return Request(rid, list(prompt), sp, None, block_hasher=HASHER, **kw)


def pattern(tokens: list[int], layer: int) -> float:
    """A value that depends on the token prefix (like real KV) and the layer."""
    return float((sum((i + 1) * t for i, t in enumerate(tokens)) % 9973) + 10000 * layer)


def expected_rows(tokens: list[int], n: int) -> list[torch.Tensor]:
    """What :meth:`Instance._compute` writes for the first ``n`` tokens, per layer."""
    out = []
    for li in range(len(LAYERS)):
        vals = torch.tensor([pattern(tokens[: t + 1], li) for t in range(n)])
        out.append(vals.view(n, 1, 1).expand(n, HEADS, 2 * HEAD))
    return out
