"""The live router behind ``kvpool proxy --policy ...``: the policies of
:mod:`kvpool.conductor.policy` driven by real requests, real vLLM KV events and real timings.

Who calls what:

* the proxy calls :meth:`LiveRouter.prompt_tokens` (async: the request's token ids, from the body,
  a local tokenizer, or a backend's ``POST /tokenize``), then :meth:`LiveRouter.decide` (sync,
  microseconds: prefix lookup + policy + SLO gate) once per request on its event loop;
* then :meth:`LiveRouter.dispatched`, :meth:`LiveRouter.first_token` and :meth:`LiveRouter.finished`
  as the request moves on, so the per-instance load the policies read stays true;
* one :class:`~kvpool.conductor.events.EventSubscriber` thread per instance with ``--kv-events``
  feeds the index (the native ingest releases the GIL); instances without events are tracked approximately
  (:class:`~kvpool.conductor.index.ApproxTracker`, what was routed there, forgotten after a TTL);
* hot prefixes (conductor policy): when a prefix is hot and fewer instances than
  ``HotPrefixes.replicas`` hold it, :meth:`LiveRouter.plan_copy` (right after ``dispatched``)
  names a spare instance and the prefix's token ids; the proxy sends that instance a background
  ``max_tokens=1`` request of the prefix (it computes it, or loads it from the kvpool store when
  its ``KvpoolStoreConnector`` finds it there) and reports the end with
  :meth:`LiveRouter.copy_done`; the index learns the new holder from that instance's KV events;
* with ``--store-master``, a :class:`~kvpool.conductor.store_feed.StoreFeed` thread follows the
  kvpool store's key feed: a prefix the store holds can be loaded by every instance running
  ``KvpoolStoreConnector``, so the conductor weighs loading it (transfer) against recomputing.

Block hashes: ours, recomputed from token ids (events carry them), so engines need no shared hash
seed. A block-size mismatch shows in the ingest counters at the first event and is logged and
exported; a hashing mismatch (tokenization differing from the engine's) is detected after each
completed request on an event-fed instance: its full prompt blocks must then be in the index.

Stateless: everything here is rebuilt from events (vLLM's replay buffer when the publisher has a
``replay_endpoint``), the routed requests and the instances; several routers with the same
configuration make the same decisions from the same view (power-of-two choices are seeded by the
request id).
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.conductor.cost import CostModel
from kvpool.conductor.events import EventSubscriber
from kvpool.conductor.index import ApproxTracker, BlockIndex, Location, Tier
from kvpool.conductor.policy import DEFAULT_BALANCING_THRESHOLD, Decision, HotPrefixes, SloGate, make_policy
from kvpool.conductor.state import Cluster, Instance, RequestInfo
from kvpool.conductor.store_feed import StoreFeed
from kvpool.errors import InvalidArgument

__all__ = ["EventSubscriber", "LiveRouter", "RouterConfig", "request_text"]

_log = logging.getLogger(__name__)

DEFAULT_OUTPUT_TOKENS = 256
MAX_HOT_COPIES = 2
"""Hot-prefix copies in flight at once (each is one background prefill on a spare instance)."""
HOT_COPY_COOLDOWN_S = 30.0
"""A prefix is copied to the same instance at most once per this many seconds."""
LONG_PROMPT_TOKENS = 1 << 16
"""Prompts longer than this are checked and hashed in a thread, and their blocks recorded by the
approximate tracker in one (a 33 MiB prompt of 4.3M token ids took the event loop 0.2 s to check,
0.05-0.18 s to hash and 0.5 s to record); shorter ones take it under ~5 ms for all."""


@dataclass
class RouterConfig:
    """Settings of the live router (``kvpool proxy`` flags)."""

    policy: str = "conductor"
    block_size: int = 16
    """Tokens per block: must equal the engines' ``--block-size``."""
    kv_events: Sequence[str | None] = ()
    """Per instance (same order as the URLs): its ZMQ publisher address, or None (approximate mode)."""
    kv_events_topic: str = ""
    max_event_bytes: int = 16 * 1024 * 1024
    """Largest KV-event message taken from a publisher (ZMQ ``MAXMSGSIZE``: larger drops its connection)."""
    max_index_blocks: int = 8_000_000
    """Most blocks the index holds, so a busy or hostile publisher cannot grow it unbounded: KV events
    that take it past this evict the oldest entries (in the order they were stored) of the location
    holding the most blocks until it is ~1/64 under (``/health`` ``event_evictions``); another
    instance's hot prefixes stay, and an evicted block comes back with its next ``BlockStored``."""
    approx_ttl_s: float = 120.0
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    reject_mode: str = "predict"
    cost_model: CostModel | None = None
    tokenizer: str | None = None
    """A local tokenizer (path or name, offline) instead of the backends' ``/tokenize``."""
    hot: bool = True
    balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD
    """Conductor: fetch a prefix from another instance only when it is more than this many times
    what the best choice without fetching reuses (1: whenever predicted faster)."""
    seed: int = 0
    store_master: str | None = None
    """``host:port`` of the kvpool store master the instances' ``KvpoolStoreConnector`` use: its
    key feed becomes the index's store tier (None: no store tier)."""
    store_secret: str | None = field(default=None, repr=False)  # never in logs or tracebacks


@dataclass
class _Pending:
    req: RequestInfo
    decision: Decision
    t0: float
    first: float | None = None
    instances: list[Instance] = field(default_factory=list)


def request_text(body: dict[str, Any], chat: bool) -> tuple[str | None, Sequence[int] | None]:
    """(prompt text, token ids) of an OpenAI request body as given; raises ValueError with a
    one-line reason when the fields the router reads have the wrong shape. The ids are the
    body's: a list, or the ``array('I')`` the proxy parses a long one into."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ValueError("'messages' must be a non-empty list of objects")
        return None, None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, array) and prompt.typecode == "I" and prompt:  # in [0, 2**32) already
        return None, prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < 1 << 32 for t in prompt):
            raise ValueError("'prompt' token ids must be in [0, 2**32)")
        return None, prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0], None
    raise ValueError("'prompt' must be a string or a list of token ids (batched prompts are not routed)")


def _ids(tokens: Sequence[int]) -> Sequence[int]:
    """A local tokenizer's ids: an ``array('I')`` when long (a list when one is out of range)."""
    if len(tokens) <= LONG_PROMPT_TOKENS:
        return list(tokens)
    try:
        return array("I", tokens)
    except (OverflowError, TypeError):
        return list(tokens)


def _log_failure(fut: asyncio.Future[Any]) -> None:
    """Done callback of a background job: log its failure (nobody awaits it)."""
    if not fut.cancelled() and fut.exception() is not None:
        _log.error("router background job failed", exc_info=fut.exception())


def _token_ids(tokens: Sequence[Any]) -> Sequence[int] | None:
    """A ``/tokenize`` answer's token ids as ints, or None when one is out of [0, 2**32); an
    ``array('I')`` (a long answer, as the proxy parses it) as it is."""
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens
    ids = [int(t) for t in tokens]
    return ids if all(0 <= t < 1 << 32 for t in ids) else None


class LiveRouter:
    """Policy + index + load bookkeeping for the proxy. ``urls``: the instances; ``roles``: per
    instance ``"both"`` (aggregated), ``"prefill"`` or ``"decode"``."""

    def __init__(self, urls: Sequence[str], roles: Sequence[str], config: RouterConfig) -> None:
        if len(urls) != len(roles):
            raise InvalidArgument("one role per instance URL")
        ev = list(config.kv_events) or [None] * len(urls)
        prefills = [k for k, role in enumerate(roles) if role in ("both", "prefill")]
        if len(ev) == len(prefills) != len(urls):  # P/D: one per prefill (decodes publish no index)
            by_prefill = dict(zip(prefills, ev, strict=True))
            ev = [by_prefill.get(k) for k in range(len(urls))]
        if len(ev) != len(urls):
            raise InvalidArgument(
                f"--kv-events names {len(ev)} endpoints for {len(prefills)} prefill instances; give one "
                "per prefill instance in the same order (or 'none' for an instance without events)"
            )
        self.config = config
        self.index = BlockIndex(config.block_size, max_blocks=config.max_index_blocks)
        self.cost = config.cost_model or CostModel.paper()
        insts = []
        for k, (url, role) in enumerate(zip(urls, roles, strict=True)):
            name = url
            inst = Instance(
                name, k, prefill=role in ("both", "prefill"), decode=role in ("both", "decode"), url=url
            )
            if inst.prefill:
                inst.gpu = self.index.add_location(name, Tier.GPU)
                inst.cpu = self.index.add_location(name, Tier.CPU)
            insts.append(inst)
        store_loc = self.index.add_location(None, Tier.STORE) if config.store_master else None
        # Live, an engine loads a prefix from the store (KvpoolStoreConnector), never from another
        # instance's GPU.
        self.cluster = Cluster(self.index, self.cost, insts, store=store_loc, fetch_between_instances=False)
        gate = SloGate(config.ttft_slo_s, config.tbt_slo_s, config.reject_mode)  # type: ignore[arg-type]
        if config.ttft_slo_s is None and config.tbt_slo_s is None:
            gate = None
        hot = HotPrefixes() if config.hot else None
        self.policy = make_policy(
            config.policy, gate, seed=config.seed, hot=hot, balancing_threshold=config.balancing_threshold
        )
        # Without a store the conductor scores local prefixes only.
        self.policy.fetch = store_loc is not None
        self.store_feed = (
            StoreFeed(config.store_master, secret=config.store_secret, block_size=config.block_size)
            if config.store_master else None
        )  # fmt: skip
        self.approx = ApproxTracker(self.index, ttl_s=config.approx_ttl_s)
        self.subscribers: list[EventSubscriber] = []
        self.has_events = [e is not None for e in ev]
        for inst, endpoint in zip(insts, ev, strict=True):
            if endpoint is not None and inst.gpu is not None:
                self.subscribers.append(
                    EventSubscriber(
                        self.index,
                        endpoint,
                        inst.gpu,
                        inst.cpu,
                        config.kv_events_topic,
                        inst.name,
                        max_msg_bytes=config.max_event_bytes,
                    )  # fmt: skip
                )
        self._tokenizer: Any = None
        self._pending: dict[str, _Pending] = {}
        self.counts: dict[str, int] = {}
        self.rejections: dict[str, int] = {}
        self.ttft_err: list[float] = []  # predicted - actual, seconds (last 1000)
        self.hash_mismatch = 0
        self._sweep_task: asyncio.Task[None] | None = None
        self._copies: set[str] = set()  # hot-prefix copies in flight (request ids)
        self._copied: dict[tuple[int, int], float] = {}  # (prefix hash, instance) -> cooldown end

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.config.tokenizer:
            self._tokenizer = await asyncio.to_thread(_load_tokenizer, self.config.tokenizer)
        for s in self.subscribers:
            s.start()
        if self.store_feed is not None:
            self.store_feed.start()
        self._sweep_task = asyncio.create_task(self._sweep_loop(), name="kvpool-router-sweep")

    async def close(self) -> None:
        if self._sweep_task is not None:
            self._sweep_task.cancel()
            try:
                await self._sweep_task
            except asyncio.CancelledError:
                pass
        for s in self.subscribers:
            s.stop()
        if self.store_feed is not None:
            self.store_feed.stop()
            await asyncio.to_thread(self.store_feed.join, 7.0)
        for s in self.subscribers:
            await asyncio.to_thread(s.join, 2.0)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.approx.sweep()

    def set_health(self, url: str, healthy: bool) -> None:
        inst = self.cluster.by_name.get(url)
        if inst is not None:
            inst.healthy = healthy

    # -- tokens ---------------------------------------------------------------------------------------

    async def prompt_tokens(
        self, body: dict[str, Any], chat: bool, tokenize_remote: Any
    ) -> Sequence[int] | None:
        """The request's prompt token ids, or None when they cannot be had (routing then ignores
        caches). ``tokenize_remote(payload)`` posts to a backend's ``/tokenize``. Millions of ids
        are held as an ``array('I')`` (a long prompt of ids in the body, a long ``/tokenize``
        answer, a local tokenizer's): a list of them took tens of ms to free on the event loop
        and young-generation GCs walked it."""
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and len(prompt) > LONG_PROMPT_TOKENS:
            text, ids = await asyncio.to_thread(request_text, body, chat)
        else:
            text, ids = request_text(body, chat)
        if ids is not None:
            return ids
        tok = self._tokenizer
        try:
            if tok is not None:
                if chat:
                    return await asyncio.to_thread(lambda: _ids(tok.apply_chat_template(
                        body["messages"], add_generation_prompt=True, tokenize=True
                    )))  # fmt: skip
                return await asyncio.to_thread(lambda: _ids(tok(text)["input_ids"]))
            payload: dict[str, Any] = {"messages": body["messages"]} if chat else {"prompt": text}
            if isinstance(body.get("model"), str):
                payload["model"] = body["model"]
            got = await tokenize_remote(payload)
            if isinstance(got, dict) and isinstance(got.get("tokens"), (list, array)):
                toks = got["tokens"]  # millions of ids take the loop 0.1 s per pass: in a thread
                ids = await asyncio.to_thread(_token_ids, toks) if len(toks) > 1 << 16 else _token_ids(toks)
                if ids is not None:
                    return ids
        except Exception as exc:  # a tokenizer failure must not fail the request
            _log.debug("tokenization failed: %s", exc)
        self._count("tokenize_failed")
        return None

    # -- decisions ------------------------------------------------------------------------------------

    async def prompt_hashes(self, tokens: Sequence[int] | None, body: dict[str, Any]) -> list[int]:
        """The block hashes :meth:`decide` takes as ``hashes``: of a prompt longer than
        :data:`LONG_PROMPT_TOKENS`, hashed in a thread a piece at a time (the event loop runs
        meanwhile); of a shorter one, at once. Called by the proxy before :meth:`decide`."""
        if not tokens:
            return []
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        if len(tokens) <= LONG_PROMPT_TOKENS:
            return self.index.hash_tokens(tokens, cache_salt=salt)
        return await asyncio.to_thread(self.index.hash_tokens_in_pieces, tokens, cache_salt=salt)

    def decide(
        self, rid: str, tokens: Sequence[int] | None, body: dict[str, Any], hashes: list[int] | None = None
    ) -> tuple[Decision, RequestInfo]:
        """Route one request (sync, on the proxy's event loop): prefix lookup, policy, SLO gate.
        ``hashes``: the prompt's block hashes from :meth:`prompt_hashes` (None: hashed here)."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        if hashes is None:
            # LoRA adapters are not mapped (the engine's adapter names are not known here): requests
            # to an adapter match no prefix and are routed by load.
            hashes = self.index.hash_tokens(tokens, cache_salt=salt) if tokens else []
        out = body.get("max_tokens", body.get("max_completion_tokens"))
        out_tokens = min(int(out), 4096) if isinstance(out, int) and out > 0 else DEFAULT_OUTPUT_TOKENS
        req = RequestInfo(rid, len(tokens) if tokens else 1, hashes, out_tokens)
        if self.store_feed is not None and tokens and salt is None:
            model = body.get("model") if isinstance(body.get("model"), str) else None
            req.store_blocks = self.store_feed.leading_blocks(tokens, model)
        d = self.policy.route(req, self.cluster, time.monotonic())
        self._count(f"decision_{self.policy.name}")
        src = d.estimate.fetch_from if d.estimate is not None else None
        if src is not None and src is self.cluster.store:
            self._count("fetch_store")  # routed to load its prefix from the store
        if d.reject:
            self.rejections[d.reject] = self.rejections.get(d.reject, 0) + 1
        return d, req

    def dispatched(self, d: Decision, req: RequestInfo) -> None:
        """The request was sent (to ``d.prefill``; aggregated: the same instance decodes)."""
        now = time.monotonic()
        assert d.prefill is not None
        est = d.estimate
        d.prefill.start_prefill(req.rid, (est.prefill_s + est.transfer_s) if est else 0.0, now)
        if d.decode is not None:
            d.decode.reserve_decode(req.rid, req.prompt_tokens + req.output_tokens, now + d.ttft_s,
                                    req.output_tokens * d.tbt_s)  # fmt: skip
        k = d.prefill.index
        if not self.has_events[k] and d.prefill.gpu is not None and req.hashes:
            self._record_routed(d.prefill.gpu, req.hashes, now)
        self._pending[req.rid] = _Pending(req, d, now)

    def _record_routed(self, loc: Location, hashes: list[int], now: float) -> None:
        """``approx.routed``: at once, or in a thread for more than ``LONG_PROMPT_TOKENS`` tokens'
        blocks (the tracker is thread-safe; the entries appear milliseconds later)."""
        if len(hashes) * self.index.block_size <= LONG_PROMPT_TOKENS:
            self.approx.routed(loc, hashes, now)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a direct caller): nothing to keep free
            self.approx.routed(loc, hashes, now)
            return
        fut = loop.run_in_executor(None, self.approx.routed, loc, hashes, now)
        fut.add_done_callback(_log_failure)

    def plan_copy(
        self, d: Decision, req: RequestInfo, tokens: Sequence[int] | None
    ) -> tuple[Instance, Sequence[int], int, str] | None:
        """The hot-prefix copy this decision asks for, as (instance, ``tokens``, ``n``, copy request
        id) -- the prefix is ``tokens[:n]``, not copied here (millions of ids take the loop tens
        of ms) -- or None. Called by the proxy on its event loop right after :meth:`dispatched`, once
        per request; microseconds. Only aggregated instances (prefill and decode roles) get copies
        (a P/D prefill instance would hold the blocks for a decode that never comes); at most
        :data:`MAX_HOT_COPIES` in flight and one per prefix and instance per
        :data:`HOT_COPY_COOLDOWN_S`. The copy counts as a prefill on that instance until
        :meth:`copy_done`."""
        if not d.replicate_to or not tokens or d.best_blocks < 1 or len(req.hashes) < d.best_blocks:
            return None
        inst = d.replicate_to[0]
        n = d.best_blocks * self.index.block_size
        if not (inst.prefill and inst.decode and inst.healthy and inst.url) or n > len(tokens):
            return None
        now = time.monotonic()
        key = (req.hashes[d.best_blocks - 1], inst.index)
        if len(self._copies) >= MAX_HOT_COPIES or self._copied.get(key, 0.0) > now:
            self._count("hot_copy_skipped")
            return None
        if len(self._copied) > 4096:
            self._copied = {k: t for k, t in self._copied.items() if t > now}
        self._copied[key] = now + HOT_COPY_COOLDOWN_S
        rid = f"hot-copy-{req.rid}"
        copy = RequestInfo(rid, n, req.hashes[: d.best_blocks], 1)
        inst.start_prefill(rid, self.cost.prefill_s(n), now)
        if not self.has_events[inst.index] and inst.gpu is not None:
            self._record_routed(inst.gpu, copy.hashes, now)
        self._pending[rid] = _Pending(copy, Decision("hot-copy", inst, None), now)
        self._copies.add(rid)
        self._count("hot_copies")
        return inst, tokens, n, rid

    def copy_done(self, rid: str, ok: bool) -> None:
        """A hot-prefix copy from :meth:`plan_copy` is over (the proxy's background request)."""
        self._copies.discard(rid)
        if not ok:
            self._count("hot_copy_failed")
        self.finished(rid, ok)

    def first_token(self, rid: str) -> None:
        """The prefill is over (first token streamed, or the prefill backend answered)."""
        p = self._pending.get(rid)
        if p is None or p.first is not None:
            return
        now = time.monotonic()
        p.first = now
        d = p.decision
        assert d.prefill is not None
        d.prefill.end_prefill(rid, now)
        if d.decode is not None:
            d.decode.start_decode(rid, p.req.prompt_tokens + p.req.output_tokens,
                                  p.req.output_tokens * max(d.tbt_s, 1e-3), now)  # fmt: skip
        err = d.ttft_s - (now - p.t0)
        self.ttft_err.append(err)
        if len(self.ttft_err) > 1000:
            del self.ttft_err[:500]

    def finished(self, rid: str, ok: bool) -> None:
        """The request is over (answered, failed or the client left)."""
        p = self._pending.pop(rid, None)
        if p is None:
            return
        d = p.decision
        now = time.monotonic()
        if d.prefill is not None:
            d.prefill.end_prefill(rid, now)
        if d.decode is not None:
            d.decode.end_decode(rid)
        if ok and d.prefill is not None and self.has_events[d.prefill.index] and p.req.hashes:
            asyncio.get_running_loop().call_later(1.0, self._check_hashes, d.prefill, p.req.hashes)

    def _check_hashes(self, inst: Instance, hashes: Sequence[int]) -> None:
        # After a request completes, vLLM has stored (and published) every full prompt block; if
        # our hashes of the same tokens find none of them, tokenization or hashing differs.
        per = self.index.match(hashes)
        got = max(per[inst.gpu.id] if inst.gpu else 0, per[inst.cpu.id] if inst.cpu else 0)
        if got == 0 and len(hashes) >= 2:
            self.hash_mismatch += 1
            if self.hash_mismatch in (1, 10, 100):
                _log.warning(
                    "instance %s finished a request of %d full blocks but the index holds none of them "
                    "(%d times): the router's tokens/block size differ from the engine's (check --block-size "
                    "and --tokenizer) or its KV events are not arriving",
                    inst.name, len(hashes), self.hash_mismatch,
                )  # fmt: skip

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    # -- introspection --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        now = time.time()
        lag = [now - s.last_event_ts for s in self.subscribers if s.last_event_ts]
        errs = sorted(abs(e) for e in self.ttft_err)
        return {
            "policy": self.policy.name,
            "block_size": self.index.block_size,
            "index_blocks": len(self.index),
            "per_instance_blocks": {
                i.name: self.index.blocks_at(i.gpu) + (self.index.blocks_at(i.cpu) if i.cpu else 0)
                for i in self.cluster.instances
                if i.gpu is not None
            },  # fmt: skip
            "events": dict(self.index.counters),
            "event_gaps": sum(s.gaps for s in self.subscribers),
            "event_evictions": sum(s.evicted for s in self.subscribers),
            "event_lag_s": max(lag) if lag else None,
            "block_size_mismatch": [
                s.first_block_size_error for s in self.subscribers if s.first_block_size_error
            ],
            "hash_mismatch": self.hash_mismatch,
            "decisions": {k[9:]: v for k, v in self.counts.items() if k.startswith("decision_")},
            "rejections": dict(self.rejections),
            "tokenize_failed": self.counts.get("tokenize_failed", 0),
            "ttft_abs_error_p50_s": errs[len(errs) // 2] if errs else None,
            "in_flight": len(self._pending),
            "store": self.store_feed.snapshot() if self.store_feed is not None else None,
            "store_fetch_decisions": self.counts.get("fetch_store", 0),
            "hot_copies": self.counts.get("hot_copies", 0),
            "hot_copies_failed": self.counts.get("hot_copy_failed", 0),
            "hot_copies_in_flight": len(self._copies),
        }

    def metrics(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.stats()
        out = []
        m = CounterMetricFamily(
            "kvpool_conductor_decisions", "Routing decisions by policy", labels=["policy"]
        )
        for k, v in st["decisions"].items():
            m.add_metric([k], v)
        out.append(m)
        m = CounterMetricFamily(
            "kvpool_conductor_rejections", "Requests refused (429) by reason", labels=["reason"]
        )
        for k, v in st["rejections"].items():
            m.add_metric([k], v)
        out.append(m)
        m = GaugeMetricFamily(
            "kvpool_conductor_index_blocks", "Blocks in the prefix index", labels=["instance"]
        )
        for k, v in st["per_instance_blocks"].items():
            m.add_metric([k], v)
        out.append(m)
        m = CounterMetricFamily(
            "kvpool_conductor_events", "KV-event blocks ingested by kind", labels=["kind"]
        )
        for k, v in st["events"].items():
            m.add_metric([k], v)
        out.append(m)
        out.append(GaugeMetricFamily("kvpool_conductor_event_lag_seconds",
                                     "Age of the newest KV event applied",
                                     value=st["event_lag_s"] or 0.0))  # fmt: skip
        out.append(GaugeMetricFamily("kvpool_conductor_ttft_error_seconds",
                                     "Median |predicted - actual| TTFT over recent requests",
                                     value=st["ttft_abs_error_p50_s"] or 0.0))  # fmt: skip
        if st["store"] is not None:
            out.append(GaugeMetricFamily("kvpool_conductor_store_blocks",
                                         "Blocks the kvpool store holds (its key feed)",
                                         value=st["store"]["blocks"]))  # fmt: skip
            out.append(GaugeMetricFamily("kvpool_conductor_store_feed_lag",
                                         "Store key changes not applied yet",
                                         value=st["store"]["lag"]))  # fmt: skip
        m = CounterMetricFamily(
            "kvpool_conductor_hot_copies", "Hot-prefix copies to spare instances", labels=["outcome"]
        )
        m.add_metric(["started"], st["hot_copies"])
        m.add_metric(["failed"], st["hot_copies_failed"])
        out.append(m)
        out.append(CounterMetricFamily("kvpool_conductor_hash_mismatch",
                                       "Completed requests whose blocks never showed in the index",
                                       value=st["hash_mismatch"]))  # fmt: skip
        return out


def _load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)
