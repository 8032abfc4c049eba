"""Routing policies: one interface, driven by the live router and by the simulator alike.

A :class:`Policy` looks at a :class:`~kvpool.conductor.state.Cluster` (instances, their load, the
prefix index, the cost model) and returns a :class:`Decision` for one request: a prefill instance, a
decode instance, or a rejection with its reason. Policies never change the cluster; the driver
applies the decision (dispatches, then reports completions to the instances).

Policies (``make_policy(name)``):

* ``random`` -- uniform over healthy instances.
* ``round-robin`` -- in turn.
* ``load`` -- the prefill instance with the shortest predicted queue, the decode instance with the
  lowest predicted time between tokens (TBT); caches ignored.
* ``cache`` -- the paper's *local cache-aware* policy: the prefill instance with the lowest predicted
  TTFT = queue + prefill of the tokens it does not hold itself.
* ``conductor`` -- Mooncake's Algorithm 1 (*global cache-aware*): as ``cache``, but an instance may
  fetch the best prefix held anywhere (another instance, the store) when fetching plus prefilling the
  rest beats recomputing, and (``balancing_threshold`` > 1) the fetched prefix is more than that
  many times what the best choice without fetching reuses (after Alg. 1's
  ``kvcache_balancing_threshold``: a small gain may not be worth a second copy of the prefix, which
  evicts others from the target's cache); hot prefixes
  (heavy hitters over a sliding window, TokenLake §4) choose among their replicas by power-of-two
  choices and name a new replica when there are too few.

Every policy can carry an :class:`SloGate` (TTFT/TBT SLOs, §4.3 early rejection).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

import xxhash

from kvpool.conductor.index import Location
from kvpool.conductor.state import Cluster, Instance, PrefixView, RequestInfo
from kvpool.errors import InvalidArgument

__all__ = [
    "POLICIES",
    "CachePolicy",
    "ConductorPolicy",
    "Decision",
    "Estimate",
    "HotPrefixes",
    "LoadPolicy",
    "Policy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "SloGate",
    "estimate",
    "make_policy",
]

RejectMode = Literal["none", "baseline", "early", "predict"]


@dataclass
class Estimate:
    """Predicted TTFT of a request on one prefill instance, and how its prefix is obtained."""

    ttft_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    local_blocks: int
    """Leading blocks the instance holds itself."""
    use_blocks: int
    """Leading blocks it will not compute (local, or local + fetched)."""
    fetch_from: Location | None = None


@dataclass
class Decision:
    """What to do with one request. ``reject`` set means: answer 429 with that reason, run nothing."""

    policy: str
    prefill: Instance | None
    decode: Instance | None
    estimate: Estimate | None = None
    tbt_s: float = 0.0
    reject: str | None = None
    reject_reason: str = ""
    hot: bool = False
    replicate_to: list[Instance] = field(default_factory=list)
    best_blocks: int = 0
    """Leading blocks of the request held anywhere (the global-pool hit)."""
    best_location: Location | None = None

    @property
    def ttft_s(self) -> float:
        return self.estimate.ttft_s if self.estimate is not None else 0.0

    def as_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "policy": self.policy,
            "prefill": self.prefill.name if self.prefill else None,
            "decode": self.decode.name if self.decode else None,
            "predicted_ttft_s": round(self.ttft_s, 6),
            "predicted_tbt_s": round(self.tbt_s, 6),
            "local_blocks": e.local_blocks if e else 0,
            "use_blocks": e.use_blocks if e else 0,
            "fetch_from": (e.fetch_from.instance or "store") if e and e.fetch_from else None,
            "reject": self.reject,
            "reason": self.reject_reason or None,
            "hot": self.hot,
        }


def estimate(cluster: Cluster, inst: Instance, req: RequestInfo, view: PrefixView, now: float,
             fetch: bool) -> Estimate:  # fmt: skip
    """Alg. 1's TTFT estimate for ``req`` on prefill instance ``inst``: queue time, plus prefill of
    what it does not hold, plus (``fetch``) the transfer of the best prefix held elsewhere when
    fetching and prefilling the rest beats recomputing."""
    cost = cluster.cost
    q = inst.queue_s(now)
    local = view.local[inst.index]
    cached = cluster.cached_tokens(req, local)
    load = cost.transfer_s(cached) if view.local_tier_cpu[inst.index] else 0.0
    p_local = cost.prefill_s(req.prompt_tokens - cached, cached)
    best = Estimate(q + load + p_local, q, p_local, load, local, local)
    loc, blocks = view.best_location, view.best_blocks
    if not cluster.fetch_between_instances:  # only the store serves prefixes to other instances
        loc, blocks = (cluster.store, view.store_blocks) if view.store_blocks else (None, 0)
    if fetch and loc is not None and blocks > local and loc.instance != inst.name:
        got = cluster.cached_tokens(req, blocks)
        t_x = load + cost.transfer_s(got - cached)
        p_f = cost.prefill_s(req.prompt_tokens - got, got)
        if t_x + p_f < load + p_local:
            best = Estimate(q + t_x + p_f, q, p_f, t_x, local, blocks, loc)
    return best


def _decode_kv(req: RequestInfo) -> int:
    return req.prompt_tokens + req.output_tokens


def predicted_tbt(cluster: Cluster, inst: Instance, req: RequestInfo, at: float | None = None,
                  committed: bool = False) -> float:  # fmt: skip
    batch, kv = inst.decode_load(at, committed=committed)
    return cluster.cost.tbt_s(batch + 1, kv + _decode_kv(req))


class SloGate:
    """TTFT/TBT SLOs and when to reject (Mooncake §4.3).

    Modes: ``none`` never rejects. The others reject on arrival a request whose predicted TTFT
    exceeds the TTFT SLO (Alg. 1), and differ on decode load: ``baseline`` finds out only once the
    prefill is done (the decode instance cannot take the request: rejected, the prefill wasted);
    ``early`` also rejects on arrival when the decode instance is overloaded *now* (its current
    load; the paper's early rejection, which lags the load by a prefill time); ``predict`` judges the
    load expected when this prefill will have finished: running requests predicted to be done by
    then are left out, routed requests predicted to have arrived by then are counted.
    """

    def __init__(self, ttft_s: float | None = None, tbt_s: float | None = None, mode: RejectMode = "predict"):
        if mode not in ("none", "baseline", "early", "predict"):
            raise InvalidArgument(f"reject mode must be none, baseline, early or predict, not {mode!r}")
        self.ttft_s = ttft_s
        self.tbt_s = tbt_s
        self.mode: RejectMode = mode

    def check(self, d: Decision, req: RequestInfo, cluster: Cluster, now: float) -> None:
        """On arrival: set ``d.reject`` when the request should be refused before prefill."""
        if self.mode == "none" or d.reject or d.prefill is None or d.decode is None:
            return
        if self.ttft_s is not None and d.ttft_s > self.ttft_s:
            e = d.estimate
            assert e is not None
            d.reject = "ttft_slo"
            d.reject_reason = (
                f"predicted TTFT {d.ttft_s:.3f} s exceeds the SLO of {self.ttft_s:g} s on the best instance "
                f"{d.prefill.name} (queue {e.queue_s:.3f} s, prefill {e.prefill_s:.3f} s, transfer "
                f"{e.transfer_s:.3f} s); retry later"
            )
            return
        if self.mode == "baseline":
            return
        at = now + d.ttft_s if self.mode == "predict" else None
        reason = self._decode_overload(d.decode, req, cluster, at, committed=False)
        if reason:
            d.reject = "decode_overload"
            d.reject_reason = reason

    def admit_decode(self, inst: Instance, req: RequestInfo, cluster: Cluster) -> str | None:
        """After prefill: None when ``inst`` can take the request now, else the reason (every mode
        but ``none`` applies it; in ``baseline`` it is the only check)."""
        if self.mode == "none":
            return None
        return self._decode_overload(inst, req, cluster, None)

    def _decode_overload(self, inst: Instance, req: RequestInfo, cluster: Cluster, at: float | None,
                         committed: bool = False) -> str | None:  # fmt: skip
        batch, kv = inst.decode_load(at, committed=committed)
        kv_new = kv + _decode_kv(req)
        when = (
            "when its prefill is done"
            if at is not None
            else "with the requests routed to it"
            if committed
            else "now"
        )
        if not cluster.cost.decode_fits(batch + 1, kv_new):
            return (f"decode instance {inst.name} is full {when} ({batch} sequences, {kv} KV tokens); "
                    "retry later")  # fmt: skip
        if self.tbt_s is not None:
            tbt = cluster.cost.tbt_s(batch + 1, kv_new)
            if tbt > self.tbt_s:
                return (f"predicted TBT {tbt * 1000:.1f} ms on decode instance {inst.name} {when} "
                        "exceeds the "
                        f"SLO of {self.tbt_s * 1000:g} ms; retry later")  # fmt: skip
        return None


class HotPrefixes:
    """Heavy hitters among prefixes over a sliding window (two half-window buckets).

    :meth:`observe` counts one use of ``key`` (the hash of a request's deepest known prefix block)
    and says whether it is hot: used at least ``min_count`` times and by at least ``share`` of the
    requests in the last ``window_s``. Memory is bounded by ``max_keys`` per bucket (the least used
    keys are dropped, as in Space-Saving)."""

    def __init__(self, window_s: float = 60.0, share: float = 0.02, min_count: int = 8,
                 max_keys: int = 4096, replicas: int = 2) -> None:  # fmt: skip
        if window_s <= 0 or not 0 < share <= 1 or min_count < 1 or max_keys < 2 or replicas < 1:
            raise InvalidArgument("bad HotPrefixes parameters")
        self.window_s = window_s
        self.share = share
        self.min_count = min_count
        self.max_keys = max_keys
        self.replicas = replicas
        self._cur: dict[int, int] = {}
        self._prev: dict[int, int] = {}
        self._n_cur = self._n_prev = 0
        self._t0: float | None = None

    def observe(self, key: int, now: float) -> bool:
        if self._t0 is None:
            self._t0 = now
        half = self.window_s / 2
        if now - self._t0 >= half:
            if now - self._t0 >= self.window_s:
                self._prev, self._n_prev = {}, 0
            else:
                self._prev, self._n_prev = self._cur, self._n_cur
            self._cur, self._n_cur, self._t0 = {}, 0, now
        self._cur[key] = self._cur.get(key, 0) + 1
        self._n_cur += 1
        if len(self._cur) > self.max_keys:
            keep = sorted(self._cur.items(), key=lambda kv: kv[1], reverse=True)[: self.max_keys // 2]
            self._cur = dict(keep)
        count = self._cur.get(key, 0) + self._prev.get(key, 0)
        return count >= self.min_count and count >= self.share * (self._n_cur + self._n_prev)

    def hot_keys(self) -> int:
        total = self._n_cur + self._n_prev
        keys = set(self._cur) | set(self._prev)
        return sum(
            1 for k in keys
            if (c := self._cur.get(k, 0) + self._prev.get(k, 0)) >= self.min_count and c >= self.share * total
        )  # fmt: skip


class Policy(ABC):
    """A routing policy. :meth:`route` is called once per request by the driver (the live router
    on its event loop, or the simulator), must not block, and must not change the cluster."""

    name = "policy"
    fetch = False

    def __init__(self, gate: SloGate | None = None, seed: int = 0) -> None:
        self.gate = gate
        self.rng = random.Random(seed)

    def route(self, req: RequestInfo, cluster: Cluster, now: float) -> Decision:
        prefills = cluster.prefill_instances()
        decodes = cluster.decode_instances()
        if not prefills or (not decodes and not cluster.aggregated):
            role = "prefill" if not prefills else "decode"
            return Decision(self.name, None, None, reject="no_instance",
                            reject_reason=f"no healthy {role} instance")  # fmt: skip
        view = cluster.prefix(req.hashes, req.store_blocks)
        d = self.choose(req, cluster, view, prefills, now)
        d.best_blocks, d.best_location = view.best_blocks, view.best_location
        if d.estimate is None and d.prefill is not None:
            d.estimate = estimate(cluster, d.prefill, req, view, now, self.fetch)
        if d.decode is None:
            d.decode = d.prefill if cluster.aggregated else self.pick_decode(req, cluster, decodes)
        d.tbt_s = predicted_tbt(cluster, d.decode, req) if d.decode is not None else 0.0
        if self.gate is not None:
            self.gate.check(d, req, cluster, now)
        return d

    @abstractmethod
    def choose(self, req: RequestInfo, cluster: Cluster, view: PrefixView, prefills: list[Instance],
               now: float) -> Decision:  # fmt: skip
        """Pick the prefill instance (and optionally the decode instance)."""

    def pick_decode(self, req: RequestInfo, cluster: Cluster, decodes: list[Instance]) -> Instance:
        """Alg. 1's SelectDecodingInstance: the lowest predicted TBT with this request added, counting
        the requests already routed there and still in prefill (else a burst herds onto the
        instance that is idle now)."""
        return min(decodes, key=lambda i: (predicted_tbt(cluster, i, req, committed=True), i.index))


class RandomPolicy(Policy):
    name = "random"

    def choose(self, req, cluster, view, prefills, now):  # type: ignore[no-untyped-def]
        d = Decision(self.name, self.rng.choice(prefills), None)
        if not cluster.aggregated:
            d.decode = self.rng.choice(cluster.decode_instances())
        return d


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self, gate: SloGate | None = None, seed: int = 0) -> None:
        super().__init__(gate, seed)
        self._p = self._d = 0

    def choose(self, req, cluster, view, prefills, now):  # type: ignore[no-untyped-def]
        p = prefills[self._p % len(prefills)]
        self._p += 1
        d = Decision(self.name, p, None)
        if not cluster.aggregated:
            decodes = cluster.decode_instances()
            d.decode = decodes[self._d % len(decodes)]
            self._d += 1
        return d


class LoadPolicy(Policy):
    name = "load"

    def choose(self, req, cluster, view, prefills, now):  # type: ignore[no-untyped-def]
        p = min(prefills, key=lambda i: (i.queue_s(now), len(i.prefilling) + i.observed_waiting, i.index))
        return Decision(self.name, p, None)


class CachePolicy(Policy):
    """Local cache-aware: lowest queue + prefill of what the instance does not hold."""

    name = "cache"

    def choose(self, req, cluster, view, prefills, now):  # type: ignore[no-untyped-def]
        ests = [(estimate(cluster, i, req, view, now, self.fetch), i) for i in prefills]
        e, p = min(ests, key=lambda ei: (ei[0].ttft_s, ei[1].index))
        return Decision(self.name, p, None, estimate=e)


#: ``ConductorPolicy``'s default: fetch whenever fetching is predicted faster (1). With small caches
#: under heavy load, 2 avoids a collapse (docs/conductor.md, "Balancing threshold").
DEFAULT_BALANCING_THRESHOLD = 1.0


class ConductorPolicy(CachePolicy):
    """Mooncake Alg. 1 (global cache-aware), with hot-prefix replicas chosen by power of two."""

    name = "conductor"
    fetch = True

    def __init__(
        self,
        gate: SloGate | None = None,
        seed: int = 0,
        hot: HotPrefixes | None = None,
        balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD,
    ) -> None:
        super().__init__(gate, seed)
        if not balancing_threshold >= 1:
            raise InvalidArgument(f"balancing_threshold must be >= 1, got {balancing_threshold!r}")
        self.hot = hot
        self.balancing_threshold = balancing_threshold

    def choose(self, req, cluster, view, prefills, now):  # type: ignore[no-untyped-def]
        hot = False
        cands = prefills
        holders: list[Instance] = []
        if self.hot is not None and view.best_blocks >= 2:
            hot = self.hot.observe(req.hashes[view.best_blocks - 1], now)
            if hot:
                holders = [i for i in prefills if view.local[i.index] >= view.best_blocks]
                if len(holders) > 2:
                    # Power of two choices among the replicas, seeded by the request id so that every
                    # conductor of a deployment makes the same choice.
                    r = random.Random(xxhash.xxh64_intdigest(req.rid.encode()))
                    two = r.sample(holders, 2)
                    cands = [i for i in prefills if i not in holders or i in two]
        ests = [(estimate(cluster, i, req, view, now, self.fetch), i) for i in cands]
        e, p = min(ests, key=lambda ei: (ei[0].ttft_s, ei[1].index))
        if e.fetch_from is not None and self.balancing_threshold > 1:
            # Fetch only for a prefix well beyond what the best choice without fetching reuses: a
            # copy duplicates the prefix in the target's cache, evicting others (with small caches
            # under load, fetching for every small gain ended worse than not fetching at all).
            e0, p0 = min(
                ((estimate(cluster, i, req, view, now, False), i) for i in cands),
                key=lambda ei: (ei[0].ttft_s, ei[1].index),
            )
            if e0.use_blocks > 0 and e.use_blocks <= self.balancing_threshold * e0.use_blocks:
                e, p = e0, p0
        d = Decision(self.name, p, None, estimate=e, hot=hot)
        if hot and self.hot is not None and len(holders) < min(self.hot.replicas, len(prefills)):
            spare = [i for i in prefills if i not in holders and i is not p]
            if spare:
                d.replicate_to = [min(spare, key=lambda i: (i.queue_s(now), i.index))]
        return d


POLICIES: dict[str, type[Policy]] = {
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
    "load": LoadPolicy,
    "cache": CachePolicy,
    "conductor": ConductorPolicy,
}


def make_policy(
    name: str,
    gate: SloGate | None = None,
    seed: int = 0,
    hot: HotPrefixes | None = None,
    balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD,
) -> Policy:
    """A policy by name (``random``, ``round-robin``, ``load``, ``cache``, ``conductor``)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidArgument(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if cls is ConductorPolicy:
        return ConductorPolicy(gate, seed, hot, balancing_threshold)
    return cls(gate, seed)
