"""What the conductor knows about its instances: load bookkeeping and the prefix view.

Both drivers of the policies -- the live router (:mod:`kvpool.conductor.live`) and the simulator
(:mod:`kvpool.conductor.sim`) -- keep an :class:`Instance` per serving instance and tell it what
they dispatched and what finished; the policies only read it. All times are seconds on the
driver's clock (``time.monotonic()`` live, simulated time in the simulator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.conductor.cost import CostModel
from kvpool.conductor.index import BlockIndex, Location

__all__ = ["Cluster", "DecodeSlot", "Instance", "PrefixView", "RequestInfo"]


@dataclass
class RequestInfo:
    """One request as the policies see it."""

    rid: str
    prompt_tokens: int
    hashes: Sequence[int]
    """Our hashes of its full prompt blocks (or, in traces, the trace's block ids)."""
    output_tokens: int = 256
    """Expected output length (live: ``max_tokens`` capped by a default; the simulator gives a
    trace-wide estimate, not the request's true length)."""
    store_blocks: int = 0
    """Live: leading blocks the kvpool store holds (from :class:`~kvpool.conductor.store_feed.StoreFeed`;
    the simulator keeps the store tier in the index instead)."""


@dataclass
class DecodeSlot:
    kv_tokens: int
    est_end: float
    dur_s: float = float("inf")
    """Reserved slots: the predicted decode time once it arrives (``est_end`` is the arrival)."""


@dataclass
class Instance:
    """One serving instance: its roles, index locations and load as the conductor tracks it.

    ``busy_until`` is when its prefill queue is predicted to drain; :meth:`start_prefill` pushes it
    by the request's predicted prefill time and :meth:`end_prefill` pulls it back to *now* once
    nothing is left (so prediction errors do not accumulate).
    """

    name: str
    index: int
    prefill: bool = True
    decode: bool = True
    gpu: Location | None = None
    cpu: Location | None = None
    url: str | None = None
    healthy: bool = True
    busy_until: float = 0.0
    prefilling: dict[str, float] = field(default_factory=dict)
    decoding: dict[str, DecodeSlot] = field(default_factory=dict)
    kv_tokens: int = 0
    reserved: dict[str, DecodeSlot] = field(default_factory=dict)
    """Requests routed to decode here that are still in prefill: KV tokens and when they should
    arrive (``est_end`` holds the predicted prefill end)."""
    observed_waiting: int = 0
    """Requests the engine reports waiting (live metrics; 0 in the simulator)."""
    observed_running: int = 0

    def queue_s(self, now: float) -> float:
        """Predicted wait before a new prefill starts here."""
        return max(0.0, self.busy_until - now)

    def start_prefill(self, rid: str, seconds: float, now: float) -> None:
        self.busy_until = max(now, self.busy_until) + seconds
        self.prefilling[rid] = seconds

    def end_prefill(self, rid: str, now: float) -> None:
        if self.prefilling.pop(rid, None) is not None and not self.prefilling:
            self.busy_until = min(self.busy_until, now)

    def reserve_decode(
        self, rid: str, kv_tokens: int, ready_at: float, decode_s: float = float("inf")
    ) -> None:
        """A request routed here for decode is in prefill until about ``ready_at``, then decodes for
        about ``decode_s``."""
        self.reserved[rid] = DecodeSlot(int(kv_tokens), ready_at, decode_s)

    def start_decode(self, rid: str, kv_tokens: int, est_s: float, now: float) -> None:
        self.reserved.pop(rid, None)
        self.end_decode(rid)
        self.decoding[rid] = DecodeSlot(int(kv_tokens), now + est_s)
        self.kv_tokens += int(kv_tokens)

    def end_decode(self, rid: str) -> None:
        self.reserved.pop(rid, None)
        slot = self.decoding.pop(rid, None)
        if slot is not None:
            self.kv_tokens -= slot.kv_tokens

    def decode_load(self, at: float | None = None, *, committed: bool = False) -> tuple[int, int]:
        """(sequences, KV tokens) decoding here.

        * default: now.
        * ``committed``: now plus every request already routed here and still in prefill (the load
          if nothing finished meanwhile).
        * ``at``: predicted at time ``at`` (prediction-based early rejection, §4.3): requests
          predicted to have finished by then are left out, those in prefill that should have
          arrived by then and not yet finished are counted."""
        batch = max(len(self.decoding), self.observed_running if self.decode else 0)
        extra = max(0, batch - len(self.decoding))  # seen in the engine's metrics, not routed by us
        if at is None and not committed:
            return batch, self.kv_tokens
        if at is None:
            return batch + len(self.reserved), self.kv_tokens + sum(
                s.kv_tokens for s in self.reserved.values()
            )
        n = kv = 0
        for slot in self.decoding.values():
            if slot.est_end > at:
                n += 1
                kv += slot.kv_tokens
        for slot in self.reserved.values():
            if slot.est_end <= at < slot.est_end + slot.dur_s:
                n += 1
                kv += slot.kv_tokens
        return n + extra, kv


@dataclass
class PrefixView:
    """Where a request's prefix is: per instance (its best local tier) and overall."""

    local: list[int]
    """Per instance (by ``Instance.index``): leading blocks in its GPU or CPU tier."""
    local_tier_cpu: list[bool]
    """Per instance: the local prefix is only in its CPU tier."""
    best_blocks: int
    best_location: Location | None
    store_blocks: int


class Cluster:
    """Instances + index + cost model: the view a policy decides on."""

    def __init__(
        self,
        index: BlockIndex,
        cost: CostModel,
        instances: Sequence[Instance],
        *,
        store: Location | None = None,
        block_tokens: int | None = None,
        fetch_between_instances: bool = True,
    ) -> None:
        self.index = index
        self.fetch_between_instances = fetch_between_instances
        """False: an instance can load a prefix from the store only, not from another instance
        (live vLLM with the kvpool store connector)."""
        self.cost = cost
        self.instances = list(instances)
        self.store = store
        self.block_tokens = int(block_tokens or index.block_size)
        """Tokens per block in cost terms (the index block size, or 512 for Mooncake traces)."""
        for i, inst in enumerate(self.instances):
            inst.index = i
        self.by_name = {inst.name: inst for inst in self.instances}

    @property
    def aggregated(self) -> bool:
        """Every instance does both phases (no P/D split): decode stays where prefill ran."""
        return all(i.prefill and i.decode for i in self.instances)

    def prefill_instances(self) -> list[Instance]:
        return [i for i in self.instances if i.prefill and i.healthy]

    def decode_instances(self) -> list[Instance]:
        return [i for i in self.instances if i.decode and i.healthy]

    def prefix(self, hashes: Sequence[int], store_blocks: int = 0) -> PrefixView:
        """Where the prefix of ``hashes`` is; ``store_blocks``: what the store holds of it when the
        store tier is looked up outside the index (live)."""
        per_loc = self.index.match(hashes) if hashes else [0] * len(self.index.locations)
        if store_blocks and self.store is not None:
            per_loc[self.store.id] = max(per_loc[self.store.id], min(store_blocks, len(hashes)))
        local = [0] * len(self.instances)
        cpu_only = [False] * len(self.instances)
        for inst in self.instances:
            g = per_loc[inst.gpu.id] if inst.gpu is not None else 0
            c = per_loc[inst.cpu.id] if inst.cpu is not None else 0
            local[inst.index] = max(g, c)
            cpu_only[inst.index] = c > g
        best, best_loc = 0, None
        for loc in self.index.locations:
            owner = self.by_name.get(loc.instance) if loc.instance is not None else None
            if owner is not None and not owner.healthy:
                continue  # cannot fetch from an instance that is down
            if per_loc[loc.id] > best:
                best, best_loc = per_loc[loc.id], loc
        store_blocks = per_loc[self.store.id] if self.store is not None else 0
        return PrefixView(local, cpu_only, best, best_loc, store_blocks)

    def cached_tokens(self, req: RequestInfo, blocks: int) -> int:
        return min(blocks * self.block_tokens, req.prompt_tokens)
