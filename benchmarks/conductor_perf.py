"""Conductor performance targets (issue 13): routing decision latency with 16 instances and 1M
indexed blocks, KV-event ingest rate, and the 12,031-request trace replay time.

    python benchmarks/conductor_perf.py [--trace ../shared/traces/conversation_trace.jsonl] [--json]

* **decision**: ``ConductorPolicy.route`` (prefix lookup over the index + Alg. 1 scoring of 16
  aggregated instances + SLO gate) for requests of 8k tokens (16-token blocks: 500 hashes each, so
  the lookup walks 500 blocks); the index holds 1M blocks spread over the 16 instances' GPU tiers.
  Hashing the request's tokens is timed separately (``hash_tokens``), as the proxy does it once per
  request before routing.
* **ingest**: vLLM ``KVEventBatch`` payloads (msgspec-encoded exactly as vLLM's publisher does) of
  ``BlockStored`` events with 16-token blocks; one *event* = one block stored or removed (the unit
  Dynamo's 10M events/s counts). Half the payloads store, half remove.
* **replay**: ``kvpool simulate`` of the trace with the conductor policy, 8 prefill + 8 decode.
* **clear**: one publisher stores a block and sends ``AllBlocksCleared``, over and over, while the
  index holds 1M blocks of another instance: each clear holds the index's exclusive lock (``match``
  waits), so its cost must follow the cleared location's blocks, not the table's.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import msgpack

from kvpool._smoke import pick
from kvpool.conductor import BlockIndex, Cluster, CostModel, Instance, RequestInfo, SloGate, Tier, make_policy
from kvpool.conductor.sim import SimConfig, load_requests, simulate, synthetic_requests


def bench_decision(n_instances: int = 16, n_blocks: int = 1_000_000, block: int = 16, prompt: int = 8192,
                   n: int = 5000) -> dict:  # fmt: skip
    rng = random.Random(1)
    index = BlockIndex(block, expected_blocks=n_blocks)
    insts = [Instance(f"i{k}", k, gpu=index.add_location(f"i{k}", Tier.GPU)) for k in range(n_instances)]
    per = prompt // block
    convs = []
    for k in range(n_blocks // per):
        toks = [rng.randrange(32000) for _ in range(prompt)]
        hs = index.hash_tokens(toks)
        index.add(insts[k % n_instances].gpu, hs)  # type: ignore[arg-type]
        convs.append(toks)
    cluster = Cluster(index, CostModel.paper(), insts)
    policy = make_policy("conductor", SloGate(ttft_s=5.0, tbt_s=0.1, mode="predict"))
    lat, hl = [], []
    for k in range(n):
        toks = convs[rng.randrange(len(convs))][: rng.randrange(prompt // 2, prompt)] + [7] * 64
        t0 = time.perf_counter()
        hs = index.hash_tokens(toks)
        t1 = time.perf_counter()
        d = policy.route(RequestInfo(str(k), len(toks), hs, 256), cluster, time.monotonic())
        t2 = time.perf_counter()
        hl.append(t1 - t0)
        lat.append(t2 - t1)
        assert d.prefill is not None
    lat.sort()
    hl.sort()
    return {
        "instances": n_instances,
        "indexed_blocks": len(index),
        "blocks_per_request": per,
        "decision_p50_ms": lat[len(lat) // 2] * 1e3,
        "decision_p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
        "hash_p50_ms": hl[len(hl) // 2] * 1e3,
        "hash_p99_ms": hl[int(len(hl) * 0.99)] * 1e3,
    }


def _payloads(block: int, n_batches: int, per_batch: int, seed: int = 2) -> tuple[list[bytes], int]:
    rng = random.Random(seed)
    out, events = [], 0
    h = 1
    for _ in range(n_batches):
        toks = [rng.randrange(32000) for _ in range(block * per_batch)]
        hashes = list(range(h, h + per_batch))
        h += per_batch
        stored = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": toks,
                  "block_size": block, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
        removed = {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
        # vLLM's encoding (msgspec): KVEventBatch is an array [ts, events, dp_rank]; events are maps
        # tagged by "type".
        out.append(msgpack.packb([time.time(), [stored], None]))
        out.append(msgpack.packb([time.time(), [removed], None]))
        events += 2 * per_batch
    return out, events


def bench_ingest(block: int = 16, n_batches: int = 2000, per_batch: int = 64, rounds: int = 3) -> dict:
    payloads, events = _payloads(block, n_batches, per_batch)
    best = 0.0
    for _ in range(rounds):
        index = BlockIndex(block)
        g = index.add_location("a", Tier.GPU)
        t0 = time.perf_counter()
        for p in payloads:
            index.ingest(p, g)
        dt = time.perf_counter() - t0
        assert index.counters.get("malformed", 0) == 0 and index.counters["stored"] == events // 2
        best = max(best, events / dt)
    return {"events": events, "events_per_batch": per_batch, "block_size": block, "events_per_s": best}


def bench_clear(block: int = 16, n_blocks: int = 1_000_000, clears: int = 2000) -> dict:
    index = BlockIndex(block, expected_blocks=n_blocks)
    a, b = index.add_location("a", Tier.GPU), index.add_location("b", Tier.GPU)
    per = 4096
    for p in _payloads(block, n_blocks // per, per)[0][::2]:  # the stores only
        index.ingest(p, b)
    assert len(index) == n_blocks // per * per
    one = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "medium": "GPU",
           "token_ids": list(range(block)), "block_size": block, "lora_id": None}  # fmt: skip
    payload = msgpack.packb([time.time(), [one, {"type": "AllBlocksCleared"}], None])
    t0 = time.perf_counter()
    for _ in range(clears):
        index.ingest(payload, a)
    dt = time.perf_counter() - t0
    assert index.blocks_at(a) == 0 and index.counters["cleared"] == clears
    return {"indexed_blocks": len(index), "clears": clears, "clear_us": dt / clears * 1e6}


def bench_replay(trace: str | None) -> dict:
    from kvpool.store.trace import find_shared_trace

    found = find_shared_trace()
    trace = trace or (str(found) if found else None)
    reqs = (
        load_requests(trace) if trace and Path(trace).exists() else synthetic_requests(12031, rate_per_s=3.4)
    )
    reqs = reqs[: pick(len(reqs), 500)]
    t0 = time.perf_counter()
    s = simulate(reqs, SimConfig(policy="conductor", prefill=8, decode=8))
    return {"trace": trace if trace and Path(trace).exists() else "synthetic", "requests": len(reqs),
            "replay_s": time.perf_counter() - t0, "mean_ttft_s": s["ttft_s"]["mean"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format trace (default: shared/traces/conversation_trace.jsonl found from the current "
        "directory up, else a synthetic one of 12,031 requests)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", choices=["decision", "ingest", "replay", "clear"])
    a = ap.parse_args()
    res = {}
    if a.only in (None, "ingest"):
        res["ingest"] = bench_ingest(n_batches=pick(2000, 100), rounds=pick(3, 1))
    if a.only in (None, "decision"):
        res["decision"] = bench_decision(n_blocks=pick(1_000_000, 20_000), n=pick(5000, 200))
    if a.only in (None, "clear"):
        res["clear"] = bench_clear(n_blocks=pick(1_000_000, 20_000), clears=pick(2000, 50))
    if a.only in (None, "replay"):
        res["replay"] = bench_replay(a.trace)
    if a.json:
        print(json.dumps(res, indent=2))
        return
    for k, v in res.items():
        print(k, " ".join(f"{kk}={(round(vv, 4) if isinstance(vv, float) else vv)}" for kk, vv in v.items()))


if __name__ == "__main__":
    main()
