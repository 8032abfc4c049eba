"""Trace-driven discrete-event simulator of a P/D cluster, driving the same policies as the live
router (``kvpool simulate``).

Model (one event heap, simulated seconds):

* **Requests** come from a Mooncake-format trace (``timestamp`` in ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token blocks); ``speedup`` compresses time.
* **Prefill instances** run one prefill at a time, first come first served. A prefill's true
  duration comes from the cost model and the instance's cache *when it starts*: leading blocks it
  holds are reused, blocks the decision fetches (from another instance or the store, if they are
  still there) cost a transfer, the rest is computed. When it ends, the request's blocks enter the
  instance's LRU cache (``cache_blocks`` each) and, with a store tier, the store's LRU
  (``store_blocks``); evictions leave the prefix index, as vLLM's ``BlockRemoved`` events would.
* **Decode instances** batch continuously: all running sequences advance one token per step, a
  step lasts ``CostModel.tbt_s(batch, kv)``; a request leaves after its true ``output_length``.
* **The policy** sees only what a live conductor sees: the prefix index, its own bookkeeping of
  what it dispatched (predicted prefill times, decode slots with an *estimated* output length, the
  trace's mean unless given) -- never the true durations or lengths.
* **SLO gate** (:class:`~kvpool.conductor.policy.SloGate`): arrival rejections, and the decode
  admission check once a prefill is done (a rejection there wastes the prefill).

Results: TTFT / TBT distributions, SLO attainment, goodput, rejections by reason, hit rates (the
chosen instance's own cache vs the best anywhere), transfers, and a PD-ratio report (§5.1): prefill
and decode utilisation per window and the split of instances they suggest.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.conductor.cost import CostModel
from kvpool.conductor.index import BlockIndex, Location, Tier
from kvpool.conductor.policy import DEFAULT_BALANCING_THRESHOLD, Decision, HotPrefixes, SloGate, make_policy
from kvpool.conductor.state import Cluster, Instance, RequestInfo
from kvpool.errors import InvalidArgument

__all__ = ["SimConfig", "TraceRequest", "load_requests", "simulate", "synthetic_requests"]

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_requests(path: str | Path) -> list[TraceRequest]:
    """Requests of a Mooncake-format JSONL trace, sorted by arrival (``timestamp`` is in ms)."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                req = TraceRequest(
                    float(row["timestamp"]) / 1000.0,
                    int(row["input_length"]),
                    int(row["output_length"]),
                    tuple(int(h) for h in row["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidArgument(
                    f"{path}:{lineno}: expected an object with timestamp, input_length, output_length and "
                    f"hash_ids ({type(exc).__name__}: {exc})"
                ) from None
            if req.input_length <= 0 or req.output_length < 0:
                raise InvalidArgument(f"{path}:{lineno}: input_length must be > 0 and output_length >= 0")
            out.append(req)
    out.sort(key=lambda r: r.arrival_s)
    return out


def synthetic_requests(
    n: int = 1000, rate_per_s: float = 4.0, seed: int = 0, **kw: Any
) -> list[TraceRequest]:
    """A Mooncake-shaped trace (multi-turn conversations sharing a system prompt, Poisson arrivals;
    see :func:`kvpool.store.trace.synthetic_trace`) for tests and demos without the real one."""
    import random

    from kvpool.store.trace import synthetic_trace

    rng = random.Random(seed)
    t = 0.0
    out = []
    for ids in synthetic_trace(n, seed=seed, **kw):
        t += rng.expovariate(rate_per_s)
        tokens = (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + rng.randint(1, MOONCAKE_BLOCK_TOKENS)
        out.append(TraceRequest(t, tokens, rng.randint(16, 800), tuple(ids)))
    return out


@dataclass
class SimConfig:
    """Parameters of one simulation (``kvpool simulate`` flags)."""

    policy: str = "conductor"
    prefill: int = 8
    decode: int = 8
    cache_blocks: int = 10_000
    """Blocks each prefill instance's local cache holds (its DRAM share of the pool)."""
    store_blocks: int = 0
    """Blocks of a separate store tier every instance can fetch from (0: none)."""
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    reject_mode: str = "none"
    speedup: float = 1.0
    output_estimate: int | None = None
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    hot: bool = True
    balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD
    """Conductor: fetch a prefix only when it is more than this many times what the best choice
    without fetching reuses (1: whenever fetching is predicted faster)."""
    seed: int = 0
    pd_window_s: float = 60.0


class _Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[int, None] = OrderedDict()

    def prefix(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.d:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            if h in self.d:
                self.d.move_to_end(h)

    def insert(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Insert/refresh; returns (added, evicted)."""
        added: list[int] = []
        for h in hashes:
            if h in self.d:
                self.d.move_to_end(h)
            else:
                self.d[h] = None
                added.append(h)
        evicted: list[int] = []
        while len(self.d) > self.capacity:
            evicted.append(self.d.popitem(last=False)[0])
        return added, evicted


class _Decoder:
    """True decode state of one instance: processor sharing over steps."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.steps = 0.0
        self.t = 0.0
        self.heap: list[tuple[float, int]] = []
        self.kv: dict[int, int] = {}
        self.kv_total = 0
        self.version = 0
        self.busy_time = 0.0  # integral of tbt/slo-normalised load (for the PD report)

    def tbt(self) -> float:
        return self.cost.tbt_s(len(self.kv), self.kv_total) if self.kv else 0.0

    def advance(self, now: float) -> None:
        if self.kv and now > self.t:
            self.steps += (now - self.t) / self.tbt()
        self.t = now

    def join(self, rid: int, out_tokens: int, kv_tokens: int, now: float) -> None:
        self.advance(now)
        heapq.heappush(self.heap, (self.steps + max(1, out_tokens), rid))
        self.kv[rid] = kv_tokens
        self.kv_total += kv_tokens

    def next_finish(self) -> float | None:
        if not self.heap:
            return None
        return self.t + max(0.0, self.heap[0][0] - self.steps) * self.tbt()

    def pop_finished(self, now: float) -> list[int]:
        self.advance(now)
        done = []
        while self.heap and self.heap[0][0] <= self.steps + 1e-9:
            _, rid = heapq.heappop(self.heap)
            self.kv_total -= self.kv.pop(rid)
            done.append(rid)
        return done


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(math.ceil(q * len(s))) - 1))
    return s[k]


def _dist(xs: list[float]) -> dict[str, float]:
    return {
        "mean": sum(xs) / len(xs) if xs else float("nan"),
        "p50": _pct(xs, 0.5),
        "p90": _pct(xs, 0.9),
        "p99": _pct(xs, 0.99),
    }


def simulate(
    trace: Sequence[TraceRequest],
    config: SimConfig | None = None,
    cost: CostModel | None = None,
    *,
    keep_samples: bool = False,
    progress: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` through a simulated cluster under ``config``; returns the summary dict
    (``ttft_s``, ``tbt_s``, ``rejected``, ``hit_rate``, ``slo_attainment``, ``pd_ratio`` ...; with
    ``keep_samples`` also the per-request ``samples``)."""
    cfg = config or SimConfig()
    cost = cost or CostModel.paper()
    if cfg.prefill < 1 or cfg.decode < 1:
        raise InvalidArgument("the simulator needs at least one prefill and one decode instance")
    if cfg.prefill + cfg.decode + (1 if cfg.store_blocks else 0) > 64:
        raise InvalidArgument("at most 64 instances (plus the store) in one simulation")
    if cfg.speedup <= 0 or cfg.cache_blocks < 0 or cfg.store_blocks < 0:
        raise InvalidArgument("speedup must be > 0 and cache sizes >= 0")
    wall0 = time.perf_counter()
    n_total = len(trace)
    out_est = cfg.output_estimate or (
        max(1, round(sum(r.output_length for r in trace) / n_total)) if n_total else 1
    )

    index = BlockIndex(cfg.block_tokens, expected_blocks=min(4_000_000, cfg.cache_blocks * cfg.prefill * 2))
    instances: list[Instance] = []
    caches: list[_Lru] = []
    for i in range(cfg.prefill):
        name = f"p{i}"
        instances.append(
            Instance(name, i, prefill=True, decode=False, gpu=index.add_location(name, Tier.GPU))
        )
        caches.append(_Lru(cfg.cache_blocks))
    for j in range(cfg.decode):
        instances.append(Instance(f"d{j}", cfg.prefill + j, prefill=False, decode=True))
    store_loc: Location | None = index.add_location(None, Tier.STORE) if cfg.store_blocks else None
    store = _Lru(cfg.store_blocks) if cfg.store_blocks else None
    cluster = Cluster(index, cost, instances, store=store_loc, block_tokens=cfg.block_tokens)
    gate = SloGate(cfg.ttft_slo_s, cfg.tbt_slo_s, cfg.reject_mode)  # type: ignore[arg-type]
    hot = HotPrefixes() if cfg.hot else None
    policy = make_policy(
        cfg.policy, gate, seed=cfg.seed, hot=hot, balancing_threshold=cfg.balancing_threshold
    )
    loc_cache: dict[int, _Lru] = {inst.gpu.id: caches[k] for k, inst in enumerate(instances[: cfg.prefill])}
    if store_loc is not None and store is not None:
        loc_cache[store_loc.id] = store
    decoders = {inst.index: _Decoder(cost) for inst in instances[cfg.prefill :]}

    # per-request state
    reqs = [
        RequestInfo(str(k), r.input_length, r.hash_ids, out_est) for k, r in enumerate(trace)
    ]  # fmt: skip
    decisions: dict[int, Decision] = {}
    queues: list[list[int]] = [[] for _ in range(cfg.prefill)]
    running: list[int | None] = [None] * cfg.prefill
    prefill_start: dict[int, float] = {}
    ttft: dict[int, float] = {}
    decode_start: dict[int, float] = {}
    done_tbt: dict[int, float] = {}
    rejected: dict[str, int] = {}
    stats = dict(blocks=0, local_hit=0, global_hit=0, used=0, transfers=0, fetched=0, replicated=0,
                 fetch_misses=0, hot=0)  # fmt: skip
    prefill_busy = [0.0] * cfg.prefill
    pd_windows: list[dict[str, float]] = []
    win = {"t0": 0.0, "prefill_busy": 0.0, "decode_load": 0.0, "samples": 0}

    heap: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, a, b)
    seq = 0
    ARRIVE, PDONE, DCHECK, SAMPLE = 0, 1, 2, 3

    def push(t: float, kind: int, a: int = 0, b: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, a, b))

    t0 = trace[0].arrival_s if n_total else 0.0
    for k, r in enumerate(trace):
        push((r.arrival_s - t0) / cfg.speedup, ARRIVE, k)
    sample_dt = cfg.pd_window_s / 10
    if n_total:
        push(sample_dt, SAMPLE)

    def reject(kind: str) -> None:
        rejected[kind] = rejected.get(kind, 0) + 1

    def cache_insert(lru: _Lru, loc: Location, hashes: Sequence[int]) -> None:
        added, evicted = lru.insert(hashes)
        if added:
            index.add(loc, added)
        if evicted:
            index.remove(loc, evicted)

    def start_prefill(p: int, k: int, now: float) -> None:
        running[p] = k
        req, d, r = reqs[k], decisions[k], trace[k]
        lru = caches[p]
        local = lru.prefix(r.hash_ids)
        lru.touch(r.hash_ids[:local])
        use = local
        xfer = 0.0
        e = d.estimate
        if e is not None and e.fetch_from is not None and e.use_blocks > local:
            src = loc_cache[e.fetch_from.id]
            have = src.prefix(r.hash_ids[: e.use_blocks])
            if have > local:
                src.touch(r.hash_ids[:have])
                xfer = cost.transfer_s(cluster.cached_tokens(req, have) - cluster.cached_tokens(req, local))
                stats["transfers"] += 1
                stats["fetched"] += have - local
                use = have
            if have < e.use_blocks:
                stats["fetch_misses"] += 1
        cached = cluster.cached_tokens(req, use)
        dur = xfer + cost.prefill_s(req.prompt_tokens - cached, cached)
        stats["used"] += use
        prefill_start[k] = now
        prefill_busy[p] += dur
        win["prefill_busy"] += dur
        push(now + dur, PDONE, p, k)

    def schedule_decode(j: int) -> None:
        dec = decoders[j]
        dec.version += 1
        t = dec.next_finish()
        if t is not None:
            push(t, DCHECK, j, dec.version)

    now = 0.0
    processed = 0
    step = max(1, n_total // 100)
    while heap:
        now, _, kind, a, b = heapq.heappop(heap)
        if kind == ARRIVE:
            k = a
            req, r = reqs[k], trace[k]
            processed += 1
            if progress is not None and processed % step == 0:
                progress(processed / n_total)
            d = policy.route(req, cluster, now)
            stats["blocks"] += len(r.hash_ids)
            stats["global_hit"] += d.best_blocks
            if d.reject:
                reject(d.reject)
                continue
            assert d.prefill is not None and d.decode is not None and d.estimate is not None
            stats["local_hit"] += d.estimate.local_blocks
            stats["hot"] += d.hot
            decisions[k] = d
            p = d.prefill.index
            d.prefill.start_prefill(req.rid, d.estimate.prefill_s + d.estimate.transfer_s, now)
            d.decode.reserve_decode(
                req.rid, req.prompt_tokens + req.output_tokens, now + d.ttft_s, req.output_tokens * d.tbt_s
            )
            for tgt in d.replicate_to:  # hot prefix: copy its blocks to one more instance (background)
                src_loc = d.best_location
                if src_loc is not None and tgt.gpu is not None:
                    n = loc_cache[src_loc.id].prefix(r.hash_ids)
                    cache_insert(caches[tgt.index], tgt.gpu, r.hash_ids[:n])
                    stats["replicated"] += n
            queues[p].append(k)
            if running[p] is None:
                start_prefill(p, queues[p].pop(0), now)
        elif kind == PDONE:
            p, k = a, b
            req, r, d = reqs[k], trace[k], decisions[k]
            inst = instances[p]
            inst.end_prefill(req.rid, now)
            assert inst.gpu is not None
            cache_insert(caches[p], inst.gpu, r.hash_ids)
            if store is not None and store_loc is not None:
                cache_insert(store, store_loc, r.hash_ids)
            running[p] = None
            if queues[p]:
                start_prefill(p, queues[p].pop(0), now)
            assert d.decode is not None
            why = gate.admit_decode(d.decode, req, cluster)
            if why is not None:
                d.decode.end_decode(req.rid)  # drops the reservation
                reject("decode_overload_after_prefill")
                continue
            ttft[k] = now - (trace[k].arrival_s - t0) / cfg.speedup
            j = d.decode.index
            dec = decoders[j]
            kv = r.input_length + r.output_length
            dec.join(k, r.output_length, kv, now)
            est_tbt = cost.tbt_s(len(dec.kv), dec.kv_total)
            d.decode.start_decode(req.rid, req.prompt_tokens + req.output_tokens, out_est * est_tbt, now)
            decode_start[k] = now
            schedule_decode(j)
        elif kind == DCHECK:
            j, version = a, b
            dec = decoders[j]
            if version != dec.version:
                continue
            for k in dec.pop_finished(now):
                done_tbt[k] = (now - decode_start[k]) / max(1, trace[k].output_length)
                instances[j].end_decode(reqs[k].rid)
            schedule_decode(j)
        else:  # SAMPLE: decode load for the PD-ratio report
            load = 0.0
            for dec in decoders.values():
                dec.advance(now)
                if cfg.tbt_slo_s:
                    load += min(1.0, dec.tbt() / cfg.tbt_slo_s) if dec.kv else 0.0
                else:
                    load += min(1.0, dec.kv_total / cost.decode_max_kv_tokens)
            win["decode_load"] += load / len(decoders)
            win["samples"] += 1
            if now - win["t0"] >= cfg.pd_window_s - 1e-9:
                span = now - win["t0"]
                pd_windows.append({
                    "t_s": round(win["t0"], 3),
                    "prefill_util": min(1.0, win["prefill_busy"] / (span * cfg.prefill)),
                    "decode_util": win["decode_load"] / max(1, win["samples"]),
                })  # fmt: skip
                win = {"t0": now, "prefill_busy": 0.0, "decode_load": 0.0, "samples": 0}
            if len(done_tbt) + sum(rejected.values()) < n_total:
                push(now + sample_dt, SAMPLE)

    return _summary(cfg, trace, t0, ttft, done_tbt, rejected, stats, prefill_busy, pd_windows, now,
                    time.perf_counter() - wall0, keep_samples, policy.name, cost)  # fmt: skip


def _summary(cfg: SimConfig, trace: Sequence[TraceRequest], t0: float, ttft: dict[int, float],
             tbt: dict[int, float], rejected: dict[str, int], stats: dict[str, int],
             prefill_busy: list[float], pd_windows: list[dict[str, float]], end: float, wall: float,
             keep_samples: bool, policy: str, cost: CostModel) -> dict[str, Any]:  # fmt: skip
    n = len(trace)
    done = sorted(tbt)
    ttfts = [ttft[k] for k in done]
    tbts = [tbt[k] for k in done]
    ok = sum(
        1 for k in done
        if (cfg.ttft_slo_s is None or ttft[k] <= cfg.ttft_slo_s)
        and (cfg.tbt_slo_s is None or tbt[k] <= cfg.tbt_slo_s)
    )  # fmt: skip
    span = max(end, 1e-9)
    blocks = max(1, stats["blocks"])
    pu = sum(prefill_busy) / (span * cfg.prefill)
    du = sum(w["decode_util"] for w in pd_windows) / len(pd_windows) if pd_windows else 0.0
    total = cfg.prefill + cfg.decode
    demand_p, demand_d = pu * cfg.prefill, du * cfg.decode
    suggest_p = round(total * demand_p / (demand_p + demand_d)) if demand_p + demand_d > 0 else cfg.prefill
    suggest_p = min(total - 1, max(1, suggest_p))
    out: dict[str, Any] = {
        "policy": policy,
        "reject_mode": cfg.reject_mode,
        "prefill": cfg.prefill,
        "decode": cfg.decode,
        "requests": n,
        "completed": len(done),
        "rejected": {"total": sum(rejected.values()), **dict(sorted(rejected.items()))},
        "ttft_s": _dist(ttfts),
        "tbt_s": _dist(tbts),
        "slo": {"ttft_s": cfg.ttft_slo_s, "tbt_s": cfg.tbt_slo_s},
        "slo_attainment": ok / n if n else float("nan"),
        "goodput_rps": ok / span,
        "hit_rate": {
            "local": stats["local_hit"] / blocks,
            "global": stats["global_hit"] / blocks,
            "used": stats["used"] / blocks,
        },
        "transfers": {
            "count": stats["transfers"],
            "blocks": stats["fetched"],
            "misses": stats["fetch_misses"],
        },
        "hot": {"requests": stats["hot"], "replicated_blocks": stats["replicated"]},
        "pd_ratio": {
            "prefill_util": pu,
            "decode_util": du,
            "imbalance": (pu / du) if du > 0 else None,
            "suggested_prefill": suggest_p,
            "suggested_decode": total - suggest_p,
            "windows": pd_windows,
        },
        "config": {k: v for k, v in vars(cfg).items()},
        "cost_model": cost.name,
        "sim_seconds": end,
        "wall_seconds": wall,
    }
    if keep_samples:
        out["samples"] = {"ttft_s": ttfts, "tbt_s": tbts}
    return out
