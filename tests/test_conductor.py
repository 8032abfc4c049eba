"""kvpool.conductor: the prefix index (hashing, vLLM KV-event ingest), the policies and SLO gate,
hot-prefix detection, the simulator and ``kvpool simulate``.

Events are encoded exactly as vLLM's ZMQ publisher encodes them (msgspec: ``KVEventBatch`` as an
array ``[ts, events, dp_rank]``, each event a map tagged by ``type``); one test encodes them with
vLLM's own classes to pin that.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import msgpack
import pytest

from kvpool.conductor import (
    ApproxTracker,
    BlockIndex,
    Cluster,
    CostModel,
    HotPrefixes,
    Instance,
    RequestInfo,
    SloGate,
    Tier,
    make_policy,
)
from kvpool.conductor.sim import SimConfig, simulate, synthetic_requests
from kvpool.errors import InvalidArgument

BS = 32


def stored(hashes, tokens, parent=None, *, block_size=BS, medium="GPU", lora_name=None, extra_keys=None):
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
          "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": lora_name}  # fmt: skip
    if extra_keys is not None:
        ev["extra_keys"] = extra_keys
    return ev


def removed(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def batch(*events):
    return msgpack.packb([time.time(), list(events), None])


def tokens(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


# -- index ------------------------------------------------------------------------------------------


def test_ingest_matches_request_hashes_and_follows_removals():
    idx = BlockIndex(BS)
    a = idx.add_location("a", Tier.GPU)
    a_cpu = idx.add_location("a", Tier.CPU)
    b = idx.add_location("b", Tier.GPU)
    t = tokens(4 * BS + 5)
    # Engine hashes are opaque (bytes or ints, per-process seeds): the second event continues the
    # first through its parent's engine hash.
    st = idx.ingest(batch(stored([b"x" * 32, b"y" * 32], t[: 2 * BS])), a, a_cpu)
    assert st["stored"] == 2 and st["malformed"] == 0
    idx.ingest(batch(stored([b"z" * 32], t[2 * BS : 3 * BS], parent=b"y" * 32)), a, a_cpu)
    idx.ingest(batch(stored([7], t[:BS])), b)
    hs = idx.hash_tokens(t)
    assert len(hs) == 4  # full blocks only
    assert idx.match(hs) == [3, 0, 1]
    # A different prefix shares nothing; a divergence in block 2 keeps the first two.
    assert idx.match(idx.hash_tokens(tokens(4 * BS, seed=9))) == [0, 0, 0]
    t2 = t[: 2 * BS] + tokens(2 * BS, seed=5)
    assert idx.match(idx.hash_tokens(t2)) == [2, 0, 1]
    # Removal by engine hash; the CPU tier of the same instance is separate.
    idx.ingest(batch(removed([b"y" * 32])), a, a_cpu)
    assert idx.match(hs) == [1, 0, 1]
    idx.ingest(batch(stored([11, 12], t[: 2 * BS], medium="CPU")), a, a_cpu)
    assert idx.match(hs) == [1, 2, 1]
    idx.ingest(batch({"type": "AllBlocksCleared"}), a, a_cpu)
    assert idx.match(hs)[0] == 0 and idx.match(hs)[2] == 1
    assert idx.counters["stored"] == 6 and idx.counters["removed"] == 1 and idx.counters["cleared"] == 1


def test_clear_drops_a_location_from_every_block_however_it_was_added():
    """AllBlocksCleared reaches the blocks a location's events stored through its engine-hash map;
    blocks added directly (approximate mode, store tier), removed and re-stored ones, and blocks
    shared with another location must all come out right too."""
    idx = BlockIndex(BS)
    a = idx.add_location("a", Tier.GPU)
    b = idx.add_location("b", Tier.GPU)
    t = tokens(6 * BS)
    hs = idx.hash_tokens(t)
    idx.ingest(batch(stored([1, 2, 3, 4], t[: 4 * BS])), a)
    idx.ingest(batch(removed([2])), a)
    idx.ingest(batch(stored([5], t[BS : 2 * BS], parent=1)), a)  # block 1 again, another engine hash
    idx.ingest(batch(stored([9, 8], t[: 2 * BS])), b)
    idx.add(a, hs[4:])  # not through events
    assert idx.blocks_at(a) == 6 and idx.match(hs) == [6, 2]
    idx.ingest(batch({"type": "AllBlocksCleared"}), a)
    assert idx.blocks_at(a) == 0 and idx.match(hs) == [0, 2] and len(idx) == 2
    assert idx.hashes_at(a) == set() and idx.hashes_at(b) == set(hs[:2])
    # only event-stored blocks, many clears of a now-empty location: still exact
    idx.ingest(batch(stored([1, 2], t[: 2 * BS])), a)
    for _ in range(3):
        idx.ingest(batch({"type": "AllBlocksCleared"}), a)
    assert idx.blocks_at(a) == 0 and idx.match(hs) == [0, 2]
    idx.ingest(batch(stored([1], t[:BS])), a)  # the engine map was reset: a fresh chain works
    assert idx.match(hs) == [1, 2]


def chain_event(first_hash, t):
    return batch(stored(list(range(first_hash, first_hash + len(t) // BS)), t))


def test_index_cap_evicts_the_oldest_entries_of_the_location_holding_the_most():
    """Over ``max_blocks`` after an ingest, the index evicts the oldest entries of the location
    holding the most blocks down to 1/64 under the cap: one instance's churn keeps another's hot
    prefix (an instance pushing it over had all its entries cleared, hot prefixes included), and
    the biggest instance loses its oldest blocks first, not all of them."""
    idx = BlockIndex(BS, max_blocks=1000)
    a = idx.add_location("a", Tier.GPU)
    b = idx.add_location("b", Tier.GPU)
    insts = [Instance("a", 0, gpu=a), Instance("b", 1, gpu=b)]
    c = Cluster(idx, CostModel.paper(), insts)
    hot = tokens(20 * BS, seed=1)
    hot_hs = idx.hash_tokens(hot)
    b_chains = [tokens(200 * BS, seed=100 + k) for k in range(8)]
    for k, t in enumerate(b_chains[:5]):  # 1000 blocks: at the cap, not over
        assert idx.ingest(chain_event(1000 * (k + 1), t), b)["evicted"] == 0
    st = idx.ingest(chain_event(1, hot), a)  # a's event takes the index over the cap
    assert st["stored"] == 20 and st["evicted"] == 35 and len(idx) == 985
    assert idx.match(hot_hs) == [20, 0] and idx.blocks_at(b) == 965
    for k, t in enumerate(b_chains[5:], 5):  # b churns: 200 new blocks, 200 of its oldest go
        st = idx.ingest(chain_event(1000 * (k + 1), t), b)
        assert st["evicted"] == 200 and len(idx) == 985
    assert idx.counters["evicted"] == 35 + 3 * 200
    # b kept its newest 965: chains 4-7 whole, the last 35 blocks of chain 3 went with 0-2 (a chain
    # goes from its tail: what is left of it is its head, which still matches)
    assert [idx.match(idx.hash_tokens(t))[1] for t in b_chains] == [0, 0, 0, 165, 200, 200, 200, 200]
    assert idx.match(hot_hs) == [20, 0]
    d = make_policy("cache").route(req("r", hot_hs, prompt=len(hot)), c, 0.0)
    assert d.prefill.name == "a" and d.estimate.local_blocks == 20
    d = make_policy("cache").route(req("r2", idx.hash_tokens(b_chains[7]), prompt=200 * BS), c, 0.0)
    assert d.prefill.name == "b" and d.estimate.local_blocks == 200
    # a grows biggest: its oldest (the hot prefix first) go, its newest chain and b's stay
    a_chains = [tokens(400 * BS, seed=200 + k) for k in range(2)]
    idx.ingest(chain_event(10_000, a_chains[0]), a)  # 420 + 965: b (the biggest) loses 400
    assert idx.blocks_at(b) == 565 and idx.match(hot_hs) == [20, 0]
    st = idx.ingest(chain_event(20_000, a_chains[1]), a)  # 820 + 565: a is the biggest now
    assert st["evicted"] == 400 and len(idx) == 985
    assert idx.match(hot_hs) == [0, 0] and idx.match(idx.hash_tokens(a_chains[1])) == [400, 0]
    assert idx.match(idx.hash_tokens(b_chains[7])) == [0, 200]
    assert abs(idx.blocks_at(a) - idx.blocks_at(b)) <= 64  # evicted from the biggest in turn
    # a removal and a clear after evictions stay exact
    idx.ingest(batch(removed([20_000])), a)
    assert idx.match(idx.hash_tokens(a_chains[1])) == [0, 0]
    idx.ingest(batch({"type": "AllBlocksCleared"}), a)
    assert idx.blocks_at(a) == 0 and len(idx) == idx.blocks_at(b)


def test_index_cap_evicts_a_chain_from_its_tail_and_a_shared_prefix_last():
    """The cap evicted a location's entries in the order their events stored them: a chain's head
    (stored first, by the prefill's event, or a system prompt many chains extend) went before its
    tail (decode's events store one block each, chained to the one before), and the tail, never
    matched again (a match counts leading blocks), held the capacity. Now the oldest chain goes
    from its tail, and a prefix stays while a chain extending it does: every block the location
    keeps counts in a match."""
    idx = BlockIndex(BS, max_blocks=200)
    a = idx.add_location("a", Tier.GPU)
    shared = tokens(10 * BS, seed=400)
    idx.ingest(batch(stored(list(range(1, 11)), shared)), a)  # the shared prefix: engine hashes 1-10
    chains = []
    for k in range(12):  # 12 chains of 10 prefill blocks after the prefix, then 10 decoded ones
        t = shared + tokens(20 * BS, seed=500 + k)
        base = 1000 * (k + 1)
        idx.ingest(batch(stored(list(range(base, base + 10)), t[10 * BS : 20 * BS], parent=10)), a)
        for j in range(10, 20):
            idx.ingest(batch(stored([base + j], t[(j + 10) * BS : (j + 11) * BS], parent=base + j - 1)), a)
        chains.append(idx.hash_tokens(t))
    assert idx.counters["evicted"] == 51 and len(idx) == 199  # 250 stored, under the cap again
    held_at_a = idx.hashes_at(a)
    kept = []
    for hs in chains:
        held = sum(1 for h in hs if h in held_at_a)
        assert idx.match(hs) == [held]  # no block left that a match cannot reach
        kept.append(held)
    # the oldest chains went, from their tails; the prefix they shared with the newest stays
    assert kept == [10, 10, 19] + [30] * 9
    # A block removed by its engine while a block chained to it stays: its descendants go when
    # their turn comes, then the chain's head; the index stays exact.
    idx.ingest(batch(removed([12_005])), a)
    assert idx.match(chains[11]) == [15]
    for k in range(12, 20):
        t = tokens(20 * BS, seed=500 + k)
        idx.ingest(batch(stored(list(range(1000 * (k + 1), 1000 * (k + 1) + 20)), t)), a)
    held_at_a = idx.hashes_at(a)
    assert len(idx) == idx.blocks_at(a) == len(held_at_a) <= 200
    for hs in chains[:11]:
        assert idx.match(hs) == [sum(1 for h in hs if h in held_at_a)]
    # chains 2-9 went, then chain 10's tail; chain 11 (the newest) and the prefix stay
    assert [idx.match(hs)[0] for hs in chains] == [10] * 10 + [17, 15]
    # Blocks removed while their chains' tails stay are kept (as links) until those go: they count
    # against the cap too, or a publisher removing all but its chains' last blocks grew them unbounded.
    idx = BlockIndex(BS, max_blocks=100)
    a = idx.add_location("a", Tier.GPU)
    for k in range(10):
        base = 1000 * (k + 1)
        idx.ingest(batch(stored(list(range(base, base + 50)), tokens(50 * BS, seed=600 + k))), a)
        idx.ingest(batch(removed(list(range(base, base + 49)))), a)
        assert len(idx) <= 2
    assert idx.counters["evicted"] == 8 and idx.counters["removed"] == 490


def test_index_stays_consistent_under_random_events_adds_and_the_cap():
    """Random stores (chained to earlier blocks, engine hashes repeated within and across events),
    removals, adds, removes and clears on three locations, with and without a cap: each location's
    count is the blocks it holds, and an index with a cap ends every call under it."""
    evicted = 0
    for seed in range(60):
        rng = random.Random(seed)
        idx = BlockIndex(BS, max_blocks=rng.choice([0, 20, 50]))
        locs = [idx.add_location(f"i{k}", Tier.GPU) for k in range(3)]
        seen: list[list[int]] = [[], [], []]
        for _ in range(200):
            k = rng.randrange(3)
            loc, r = locs[k], rng.random()
            if r < 0.5:
                hs = [rng.randrange(1, 80) for _ in range(rng.randint(1, 6))]
                parent = rng.choice(seen[k]) if seen[k] and rng.random() < 0.7 else None
                t = tokens(len(hs) * BS, seed=rng.randrange(30))
                idx.ingest(batch(stored(hs, t, parent=parent)), loc)
                seen[k] += hs
            elif r < 0.8:
                idx.ingest(batch(removed([rng.randrange(1, 80) for _ in range(rng.randint(1, 4))])), loc)
            elif r < 0.95:
                idx.add(loc, [rng.randrange(1, 1 << 60) for _ in range(rng.randint(1, 8))])
                if rng.random() < 0.3:
                    idx.remove(loc, sorted(idx.hashes_at(loc))[:3])
            else:
                idx.ingest(batch({"type": "AllBlocksCleared"}), loc)
            assert [len(idx.hashes_at(x)) for x in locs] == [idx.blocks_at(x) for x in locs]
            assert len(idx) <= sum(idx.blocks_at(x) for x in locs)
            assert not idx.max_blocks or len(idx) <= idx.max_blocks
        evicted += idx.counters.get("evicted", 0)
    assert evicted > 1000  # the cap was at work


def test_index_cap_bounds_one_locations_engine_hashes():
    """One block stored under ever new engine hashes adds no block to the index but an entry to the
    location's engine-hash map: that map is bounded by the cap too. An engine hash stored again for
    another block no longer leaves the first block in the index with no entry to remove it by."""
    idx = BlockIndex(BS, max_blocks=100)
    a = idx.add_location("a", Tier.GPU)
    t = tokens(BS)
    st = idx.ingest(batch(*[stored([h], t) for h in range(1, 301)]), a)
    assert st["stored"] == 300 and st["evicted"] == 300 - 99  # down to 100 - 100 // 64
    idx.ingest(batch(stored([1000], t)), a)
    hs = idx.hash_tokens(t)
    assert idx.match(hs) == [1]
    t2 = tokens(BS, seed=7)
    idx.ingest(batch(stored([1000], t2)), a)  # engine hash 1000 now names another block
    assert idx.match(hs) == [0] and idx.match(idx.hash_tokens(t2)) == [1] and len(idx) == 1
    idx.ingest(batch(removed([1000])), a)
    assert len(idx) == 0


def test_index_cap_holds_with_concurrent_publishers_and_readers():
    """Three publishers ingest at once (big batches: an eviction lets the lock go every 1,024
    entries) while a reader matches: the index ends within the cap and every stored entry is
    accounted for as kept, removed or evicted."""
    import threading

    idx = BlockIndex(BS, max_blocks=3000)
    locs = [idx.add_location(f"i{k}", Tier.GPU) for k in range(3)]
    totals = [dict(stored=0, removed=0, evicted=0) for _ in locs]
    errors: list[BaseException] = []

    def publish(k: int) -> None:
        try:
            rng = random.Random(k)
            for j in range(40):
                n = 2500 if j == 0 else rng.randrange(1, 80)
                base = k * 10**7 + j * 10**4
                evs = [stored(list(range(base, base + n)), [rng.randrange(1000) for _ in range(n * BS)])]
                if j and rng.random() < 0.5:
                    evs.append(removed([base + rng.randrange(n)]))
                st = idx.ingest(batch(*evs), locs[k])
                for key in totals[k]:
                    totals[k][key] += st[key]
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            assert len(idx.match([1, 2, 3])) == 3

    threads = [threading.Thread(target=publish, args=(k,)) for k in range(3)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    done.set()
    reader.join(10)
    assert not errors, errors
    assert len(idx) <= 3000 and sum(t["evicted"] for t in totals) >= 2 * 2500 - 3000
    kept = sum(idx.blocks_at(loc) for loc in locs)
    assert kept == len(idx) and all(idx.blocks_at(loc) == len(idx.hashes_at(loc)) for loc in locs)
    assert sum(t["stored"] - t["removed"] - t["evicted"] for t in totals) == kept


def test_ingest_counts_bad_payloads_and_block_size_mismatch():
    idx = BlockIndex(BS)
    a = idx.add_location("a", Tier.GPU)
    assert idx.ingest(b"\xc1not msgpack", a)["malformed"] == 1
    assert idx.ingest(msgpack.packb({"not": "a batch"}), a)["malformed"] == 1
    st = idx.ingest(batch(stored([1, 2], tokens(32), block_size=16)), a)
    assert st["stored"] == 0 and st["skipped_block_size"] == 2  # counted per block
    assert idx.last_bad_block_size == 16
    # An event whose parent was never seen cannot be placed in our chain: skipped, counted.
    st = idx.ingest(batch(stored([3], tokens(BS), parent=b"unknown")), a)
    assert st["stored"] == 0 and st["skipped_orphan"] == 1
    assert len(idx) == 0


def test_extra_keys_change_hashes_like_vllm_lora():
    idx = BlockIndex(BS)
    a = idx.add_location("a", Tier.GPU)
    t = tokens(2 * BS)
    idx.ingest(batch(stored([1, 2], t, lora_name="sql", extra_keys=[["sql"], ["sql"]])), a)
    assert idx.match(idx.hash_tokens(t, lora_name="sql")) == [2]
    assert idx.match(idx.hash_tokens(t)) == [0]


def test_events_encoded_by_vllm_itself():
    kv = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    idx = BlockIndex(BS)
    a = idx.add_location("a", Tier.GPU)
    t = tokens(3 * BS)
    ev = kv.BlockStored(block_hashes=[b"p" * 32, b"q" * 32, b"r" * 32], parent_block_hash=None, token_ids=t,
                        block_size=BS, lora_id=None, medium="GPU", lora_name=None)  # fmt: skip
    st = idx.ingest(msgspec.msgpack.encode(kv.KVEventBatch(ts=time.time(), events=[ev])), a)
    assert st["stored"] == 3
    assert idx.match(idx.hash_tokens(t)) == [3]


def test_approx_tracker_forgets_after_ttl():
    idx = BlockIndex(BS)
    a = idx.add_location("a", Tier.GPU)
    tr = ApproxTracker(idx, ttl_s=10)
    hs = idx.hash_tokens(tokens(3 * BS))
    tr.routed(a, hs, now=100.0)
    assert idx.match(hs) == [3]
    tr.routed(a, hs[:1], now=105.0)  # refreshed: block 0 lives until 115
    assert tr.sweep(now=111.0) == 2
    assert idx.match(hs) == [1]
    assert tr.sweep(now=116.0) == 1
    assert len(idx) == 0
    with pytest.raises(InvalidArgument):
        ApproxTracker(idx, ttl_s=0)


def test_index_cap_evicts_added_entries_too_a_chains_tail_first():
    """Entries made by add() (the simulator's, the approximate mode's) had no order to evict them
    by: the cap skipped their locations, so they alone could hold the index over ``max_blocks``
    unbounded, and an ingest over it evicted a small event-fed location's entries instead of the
    biggest one's. Now the oldest added go first, a chain's tail before its head."""
    idx = BlockIndex(BS, max_blocks=100)
    a = idx.add_location("a", Tier.GPU)
    b = idx.add_location("b", Tier.GPU)
    c = idx.add_location("c", Tier.GPU)
    chains = [idx.hash_tokens(tokens(40 * BS, seed=700 + k)) for k in range(4)]
    idx.add(a, chains[0] + chains[1][:30])  # 70: under the cap
    t = tokens(40 * BS, seed=710)
    st = idx.ingest(batch(stored(list(range(1, 41)), t)), b)  # 110: a, the biggest, loses 11
    assert st["evicted"] == 11 and idx.blocks_at(a) == 59 and idx.blocks_at(b) == 40
    # one add() is one chain: its tail went first
    assert idx.match(chains[0]) == [40, 0, 0] and idx.match(chains[1]) == [19, 0, 0]
    idx.add(a, chains[1][:10])  # added again: the newest
    assert idx.add(c, chains[2], evict=False) == 0 and len(idx) == 139  # left to its caller
    assert idx.add(c, chains[3]) == 179 - 99 and len(idx) == 99  # an add over the cap evicts
    # c (80) lost chain 2 (added first) and chain 3's tail, then a (59) its oldest: chain 0's tail
    # (chain 1's refreshed head stays)
    assert [max(idx.match(hs)) for hs in chains] == [33, 10, 0, 16]
    assert idx.match(idx.hash_tokens(t)) == [0, 40, 0] and idx.counters["evicted"] == 11 + 80
    assert len(idx) == sum(idx.blocks_at(x) for x in (a, b, c))
    idx.remove(a, chains[0])
    idx.clear(c)
    assert len(idx) == 50 and idx.add(a, chains[0]) == 0 and idx.match(chains[0]) == [40, 0, 0]
    assert idx.add(c, chains[2]) == 130 - 99 and len(idx) == 99
    # a (50), the biggest, lost its oldest: chain 1's head (added before chain 0), chain 0's tail
    assert [max(idx.match(hs)) for hs in chains] == [19, 0, 40, 0]
    assert len(idx) == sum(idx.blocks_at(x) for x in (a, b, c))


def test_an_engine_removal_also_drops_the_locations_added_entry_of_the_block():
    """A location fed both by add() and by KV events kept the add() entry of a block its engine
    then removed (the location's bit went, the entry stayed in the cap's list): entries of blocks no
    longer in the index, not bounded by ``max_blocks`` (they hold nothing over it), counted as
    evicted when the cap dropped them, and when the engine stored the block again the cap evicted
    that fresh block through the old entry, before older ones. Now the removal drops both."""
    idx = BlockIndex(BS, max_blocks=100)
    a = idx.add_location("a", Tier.GPU)
    eng = 1
    for k in range(10):  # routed there, stored, then removed by the engine: 400 blocks come and go
        t = tokens(40 * BS, seed=800 + k)
        idx.add(a, idx.hash_tokens(t))
        idx.ingest(batch(stored(list(range(eng, eng + 40)), t)), a)
        idx.ingest(batch(removed(list(range(eng, eng + 40)))), a)
        eng += 40
    assert len(idx) == 0
    x = idx.hash_tokens(t)
    idx.ingest(batch(stored(list(range(eng, eng + 40)), t)), a)  # the last one stored again
    y = idx.hash_tokens(tokens(70 * BS, seed=820))
    assert idx.add(a, y) == 11  # 110 blocks, down to 99: the oldest added entries, y's tail
    assert idx.match(x) == [40] and idx.match(y) == [59] and len(idx) == 99


def test_approx_entries_are_held_under_the_index_cap_and_lose_a_chains_tail_first():
    """Approximate mode (an engine that publishes no KV events): the router's own entries (made
    by the index's add(), which its native eviction never touches) were bounded only by the
    tracker's max_entries (1M), whatever the index's max_blocks; and the oldest went first in the
    order routed, a chain's head before its tail -- the tail then never matched (a match counts
    leading blocks) but held its place until it expired."""
    idx = BlockIndex(BS, max_blocks=100)
    a = idx.add_location("a", Tier.GPU)
    b = idx.add_location("b", Tier.GPU)
    tr = ApproxTracker(idx, ttl_s=1000)
    chains = [idx.hash_tokens(tokens(40 * BS, seed=300 + k)) for k in range(3)]
    tr.routed(a, chains[0], now=0.0)
    tr.routed(a, chains[1], now=1.0)
    assert len(idx) == 80 and idx.match(chains[0]) == [40, 0]  # under the cap: nothing dropped
    tr.routed(b, chains[2], now=2.0)  # 120: over 100, trimmed to 99 (1/64 under), from the oldest
    assert len(idx) == 99 and len(tr) == 99
    assert idx.match(chains[0]) == [19, 0] and idx.match(chains[2]) == [0, 40]  # chain 0's tail went
    for k in range(3, 10):  # more routing keeps the index under its cap
        tr.routed(a if k % 2 else b, idx.hash_tokens(tokens(40 * BS, seed=300 + k)), now=float(k))
        assert len(idx) == 99 and len(tr) == 99
    # What is left of each chain is its head: every entry still tracked counts in a match.
    kept = []
    for k in range(10):
        hs = idx.hash_tokens(tokens(40 * BS, seed=300 + k))
        held = sum(1 for h in hs if idx.match([h]) != [0, 0])
        assert max(idx.match(hs)) == held, k
        kept.append(held)
    assert kept == [0] * 7 + [19, 40, 40]  # the oldest first
    # A request routed again refreshes its head: the oldest tails go first, heads last.
    tr2 = ApproxTracker(BlockIndex(BS), ttl_s=1000, max_entries=60)
    c = tr2.index.add_location("c", Tier.GPU)
    tr2.routed(c, chains[0], now=0.0)
    tr2.routed(c, chains[1], now=1.0)  # 80 > 60: 20 of chain 0's go, from its tail
    assert tr2.index.match(chains[0]) == [20] and tr2.index.match(chains[1]) == [40]
    assert tr2.sweep(now=1000.5) == 20 and tr2.index.match(chains[0]) == [0]


def test_index_refuses_more_than_64_locations():
    idx = BlockIndex(BS)
    for i in range(64):
        idx.add_location(f"i{i}", Tier.GPU)
    with pytest.raises(InvalidArgument, match="at most 64"):
        idx.add_location("one-more", Tier.GPU)


# -- policies ---------------------------------------------------------------------------------------


def cluster_of(n=3, *, aggregated=True, block_tokens=512):
    idx = BlockIndex(block_tokens)
    insts = [Instance(f"i{k}", k, gpu=idx.add_location(f"i{k}", Tier.GPU)) for k in range(n)]
    if not aggregated:
        insts += [Instance(f"d{k}", n + k, prefill=False, decode=True) for k in range(n)]
        for i in insts[:n]:
            i.decode = False
    return Cluster(idx, CostModel.paper(), insts)


def req(rid, hashes, prompt=6000, out=100):
    return RequestInfo(rid, prompt, hashes, out)


def test_round_robin_and_load():
    c = cluster_of(3)
    rr = make_policy("round-robin")
    assert [rr.route(req(str(k), []), c, 0.0).prefill.name for k in range(4)] == ["i0", "i1", "i2", "i0"]
    c.instances[0].busy_until = 5.0
    c.instances[1].busy_until = 1.0
    c.instances[2].busy_until = 3.0
    d = make_policy("load").route(req("x", []), c, 0.0)
    assert d.prefill.name == "i1" and d.decode is d.prefill  # aggregated: decode where prefill ran


def test_cache_prefers_holder_and_conductor_fetches_when_cheaper():
    c = cluster_of(2)
    hs = list(range(100, 112))  # 12 blocks of 512 tokens
    c.index.add(c.instances[0].gpu, hs[:10])
    c.instances[0].busy_until = 0.5  # the holder is busy for 0.5 s
    r = req("r", hs, prompt=6000)
    d_cache = make_policy("cache").route(r, c, 0.0)
    assert d_cache.prefill.name == "i0" and d_cache.estimate.local_blocks == 10
    d_cond = make_policy("conductor").route(r, c, 0.0)
    # Fetching 10 blocks from i0 to the idle i1 (ms) beats waiting 0.5 s for i0.
    assert d_cond.prefill.name == "i1"
    assert d_cond.estimate.fetch_from is c.instances[0].gpu and d_cond.estimate.use_blocks == 10
    assert d_cond.ttft_s < d_cache.ttft_s
    assert d_cond.best_blocks == 10
    # A holder that is down is not fetched from.
    c.instances[0].healthy = False
    d = make_policy("conductor").route(r, c, 0.0)
    assert d.prefill.name == "i1" and d.estimate.fetch_from is None


def test_balancing_threshold_fetches_only_for_a_much_longer_prefix():
    """With ``balancing_threshold`` X the conductor fetches a prefix only when it is more than X
    times what the best choice without fetching reuses: not to move a request off a busy holder of
    the same prefix, but still to extend a short local prefix a lot."""
    c = cluster_of(2)
    hs = list(range(100, 112))  # 12 blocks of 512 tokens
    c.index.add(c.instances[0].gpu, hs[:10])
    c.instances[0].busy_until = 0.5
    r = req("r", hs, prompt=6000)
    assert make_policy("conductor").route(r, c, 0.0).prefill.name == "i1"  # 1: fetch when faster
    d = make_policy("conductor", balancing_threshold=2).route(r, c, 0.0)
    assert d.prefill.name == "i0" and d.estimate.fetch_from is None and d.estimate.use_blocks == 10
    c2 = cluster_of(2)
    c2.index.add(c2.instances[0].gpu, hs[:2])
    c2.index.add(c2.instances[1].gpu, hs[:10])
    c2.instances[1].busy_until = 30.0  # the long prefix's holder is far too busy to wait for
    d = make_policy("conductor", balancing_threshold=2).route(r, c2, 0.0)
    assert d.prefill.name == "i0" and d.estimate.fetch_from is c2.instances[1].gpu
    assert d.estimate.use_blocks == 10 and d.estimate.local_blocks == 2
    with pytest.raises(InvalidArgument):
        make_policy("conductor", balancing_threshold=0.5)


def test_balancing_threshold_avoids_the_small_cache_collapse():
    """Small caches (300 blocks) under heavy load: fetching for every small gain duplicates prefixes
    and evicts others, and the conductor ended far behind local cache-aware; with threshold 2 it
    does not (the simulator is deterministic: these are fixed numbers, not timings)."""
    reqs = synthetic_requests(1500, rate_per_s=5.0, seed=1)
    cfg = dict(prefill=4, decode=4, cache_blocks=300)
    cache = simulate(reqs, SimConfig(policy="cache", **cfg))["ttft_s"]["mean"]
    greedy = simulate(reqs, SimConfig(policy="conductor", **cfg))["ttft_s"]["mean"]
    balanced = simulate(reqs, SimConfig(policy="conductor", balancing_threshold=2, **cfg))["ttft_s"]["mean"]
    assert greedy > 1.5 * cache and balanced < cache, (cache, greedy, balanced)


def test_decode_pick_counts_requests_still_in_prefill():
    c = cluster_of(2, aggregated=False)
    pol = make_policy("conductor")
    picks = []
    for k in range(4):
        d = pol.route(req(str(k), [], prompt=2000), c, 0.0)
        d.prefill.start_prefill(str(k), d.estimate.prefill_s, 0.0)
        d.decode.reserve_decode(str(k), 2100, d.ttft_s, 100 * d.tbt_s)
        picks.append(d.decode.name)
    assert sorted(picks) == ["d0", "d0", "d1", "d1"]  # no herding onto the instance idle now


def test_slo_gate_ttft_rejection_has_reason():
    c = cluster_of(1)
    c.instances[0].busy_until = 10.0
    d = make_policy("round-robin", SloGate(ttft_s=2.0, mode="early")).route(req("r", []), c, 0.0)
    assert d.reject == "ttft_slo" and "exceeds the SLO of 2 s" in d.reject_reason
    assert (
        make_policy("round-robin", SloGate(ttft_s=2.0, mode="none")).route(req("r", []), c, 0.0).reject
        is None
    )
    with pytest.raises(InvalidArgument):
        SloGate(mode="sometimes")  # type: ignore[arg-type]


def test_early_vs_prediction_based_rejection():
    cost = CostModel.paper()
    c = cluster_of(1, aggregated=False)
    dec = c.instances[1]
    # The decode instance is full now, but its sequences are predicted to end within 1 s.
    for k in range(40):
        dec.start_decode(f"old{k}", 25_000, 1.0, now=0.0)
    assert not cost.decode_fits(41, 40 * 25_000 + 6100)
    r = req("new", [], prompt=6000)
    c.instances[0].busy_until = 2.0  # this request's prefill ends after ~2.8 s
    early = make_policy("load", SloGate(ttft_s=30, mode="early")).route(r, c, 0.0)
    assert early.reject == "decode_overload" and "now" in early.reject_reason
    pred = make_policy("load", SloGate(ttft_s=30, mode="predict")).route(r, c, 0.0)
    assert pred.reject is None
    # Baseline admits on arrival and refuses only after the prefill (when it is still full).
    base = SloGate(ttft_s=30, mode="baseline")
    assert make_policy("load", base).route(r, c, 0.0).reject is None
    assert "full" in base.admit_decode(dec, r, c)
    # A request routed earlier and arriving at the same time counts in the prediction.
    for k in range(40):
        dec.end_decode(f"old{k}")
    for k in range(60):
        dec.reserve_decode(f"p{k}", 20_000, 2.5, 30.0)
    pred = make_policy("load", SloGate(ttft_s=30, mode="predict")).route(r, c, 0.0)
    assert pred.reject == "decode_overload" and "when its prefill is done" in pred.reject_reason


def test_hot_prefixes_and_power_of_two_among_replicas():
    hot = HotPrefixes(window_s=10, share=0.2, min_count=3)
    assert [hot.observe(1, t) for t in (0.0, 0.1)] == [False, False]
    assert hot.observe(1, 0.2) is True
    for t in range(20):
        hot.observe(1000 + t, 0.3)  # many cold keys dilute the share
    assert hot.observe(1, 0.4) is False
    hot2 = HotPrefixes(window_s=1, share=0.2, min_count=2)
    hot2.observe(5, 0.0)
    assert hot2.observe(5, 5.0) is False  # the window forgot the first use

    c = cluster_of(4)
    hs = list(range(10))
    for inst in c.instances[:3]:
        c.index.add(inst.gpu, hs)
    pol = make_policy("conductor", hot=HotPrefixes(window_s=100, share=0.1, min_count=1))
    chosen = {pol.route(req(f"r{k}", hs, prompt=5200), c, 0.0).prefill.name for k in range(30)}
    assert chosen <= {"i0", "i1", "i2"} and len(chosen) >= 2  # spread over the replicas
    # Deterministic per request id (several conductors agree).
    pol2 = make_policy("conductor", hot=HotPrefixes(window_s=100, share=0.1, min_count=1))
    a = [pol.route(req(f"s{k}", hs, prompt=5200), c, 0.0).prefill.name for k in range(10)]
    b = [pol2.route(req(f"s{k}", hs, prompt=5200), c, 0.0).prefill.name for k in range(10)]
    assert a == b
    # With fewer replicas than wanted, a hot prefix names one more instance to copy it to.
    c2 = cluster_of(3)
    c2.index.add(c2.instances[0].gpu, hs)
    pol3 = make_policy("conductor", hot=HotPrefixes(window_s=100, share=0.1, min_count=1, replicas=2))
    d = pol3.route(req("h", hs, prompt=5200), c2, 0.0)
    assert d.hot and [i.name for i in d.replicate_to] == ["i1"]


# -- simulator --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_trace():
    return synthetic_requests(1500, rate_per_s=3.0, seed=3)


def test_simulator_orders_policies_like_the_paper(small_trace):
    res = {}
    for p in ("random", "load", "cache", "conductor"):
        res[p] = simulate(small_trace, SimConfig(policy=p, prefill=4, decode=4, cache_blocks=300))
    ttft = {p: r["ttft_s"]["mean"] for p, r in res.items()}
    assert ttft["random"] > ttft["load"] > ttft["cache"] > ttft["conductor"], ttft
    for r in res.values():
        assert r["completed"] == len(small_trace) and r["rejected"]["total"] == 0
        assert r["hit_rate"]["global"] >= r["hit_rate"]["local"]
    # The conductor uses blocks held elsewhere; the local-aware policy cannot.
    assert res["conductor"]["hit_rate"]["used"] > res["conductor"]["hit_rate"]["local"]
    assert res["conductor"]["transfers"]["count"] > 0 and res["cache"]["transfers"]["count"] == 0


def test_simulator_rejections_and_pd_report(small_trace):
    cfg = dict(policy="conductor", prefill=4, decode=1, cache_blocks=300, ttft_slo_s=5.0, tbt_slo_s=0.03)
    res = {m: simulate(small_trace, SimConfig(reject_mode=m, **cfg)) for m in ("none", "baseline", "predict")}
    assert res["none"]["rejected"]["total"] == 0
    assert res["baseline"]["rejected"].get("decode_overload_after_prefill", 0) > 0
    assert res["predict"]["rejected"].get("decode_overload", 0) > 0
    for r in res.values():
        assert r["completed"] + r["rejected"]["total"] == len(small_trace)
    pd = res["none"]["pd_ratio"]
    assert 0 < pd["prefill_util"] <= 1 and pd["suggested_prefill"] + pd["suggested_decode"] == 5


def test_simulate_cli_json_and_plots(tmp_path):
    trace = tmp_path / "t.jsonl"
    with trace.open("w") as f:
        for r in synthetic_requests(300, rate_per_s=3.0, seed=1):
            f.write(json.dumps({"timestamp": int(r.arrival_s * 1000), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}))  # fmt: skip
            f.write("\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "simulate", "--trace", str(trace),
         "--policy", "round-robin,conductor",
         "--prefill", "2", "--decode", "2", "--json", "--plot", str(tmp_path / "img")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["policy"] for r in rows] == ["round-robin", "conductor"]
    assert all(r["requests"] == 300 and r["ttft_s"]["mean"] > 0 for r in rows)
    assert (tmp_path / "img" / "ttft_cdf.png").stat().st_size > 1000
    bad = subprocess.run([sys.executable, "-m", "kvpool.cli", "simulate", "--policy", "fastest"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "unknown policy 'fastest'" in bad.stderr and "Traceback" not in bad.stderr


def test_approx_tracker_memory_is_bounded_when_one_prompt_repeats():
    """The same long prompt routed again and again refreshes its entries in place: what the tracker
    holds stays within ``max_entries`` (each refresh queued another copy of all its hashes, so one
    32k-token prompt at 200 req/s grew the queue to 2 GiB), and it still expires and evicts."""
    import tracemalloc

    idx = BlockIndex(BS)
    a = idx.add_location("a", Tier.GPU)
    b = idx.add_location("b", Tier.GPU)
    tr = ApproxTracker(idx, ttl_s=1000, max_entries=150)
    hs = idx.hash_tokens(tokens(100 * BS))
    tr.routed(a, hs, now=0.0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(5000):
            tr.routed(a, hs, now=float(i) / 100)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 200_000, grown
    assert len(tr) == 100 and idx.match(hs) == [100, 0]
    tr.routed(b, hs, now=60.0)  # 200 entries > 150: a's 50 least recently refreshed go, its tail
    assert len(tr) == 150 and idx.blocks_at(a) == 50 and idx.match(hs) == [50, 100]
    assert tr.sweep(now=1055.0) == 50 and idx.blocks_at(a) == 0
    assert tr.sweep(now=1061.0) == 100 and len(idx) == 0 and len(tr) == 0


def test_event_subscriber_bounds_message_size_and_index_size():
    """A KV-event publisher cannot grow the router's memory without bound: a message larger than
    ``max_msg_bytes`` is refused by ZMQ (MAXMSGSIZE; it was taken whole), and events that take the
    index past its ``max_blocks`` evict the oldest entries of the instance holding the most, not
    all of the publishing instance's (they were cleared)."""
    import zmq

    from kvpool.conductor.live import EventSubscriber

    def stored(first: int, n: int) -> bytes:
        ev = {"type": "BlockStored", "block_hashes": list(range(first, first + n)), "parent_block_hash": None,
              "token_ids": list(range(first * BS, (first + n) * BS)), "block_size": BS, "lora_id": None,
              "medium": "GPU", "lora_name": None}  # fmt: skip
        return msgpack.packb([time.time(), [ev], None])

    def publish_until(pub, payload, done, tries=40):
        for seq in range(tries):  # the subscriber connects asynchronously: publish until seen
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            time.sleep(0.05)
            if done():
                return

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    idx = BlockIndex(BS, max_blocks=1000)
    a = idx.add_location("a", Tier.GPU)
    b = idx.add_location("b", Tier.GPU)
    sub = EventSubscriber(idx, f"tcp://127.0.0.1:{port}", a, None, max_msg_bytes=128 * 1024)
    sub.start()
    try:
        big = stored(1, 3000)
        assert len(big) > 128 * 1024
        publish_until(pub, big, lambda: sub.batches > 0)
        assert sub.batches == 0 and len(idx) == 0 and sub.disconnects >= 1
        publish_until(pub, stored(1, 300), lambda: len(idx) == 300)
        assert len(idx) == 300 and sub.evicted == 0
        idx.ingest(stored(2001, 600), b)  # b: 600 blocks, a's 300 kept under the cap of 1000
        publish_until(pub, stored(301, 200), lambda: sub.evicted > 0, tries=1)
        for _ in range(40):
            if sub.evicted:
                break
            time.sleep(0.05)
        # 1100 blocks: b (the biggest) loses its oldest 115; all of a's stay
        assert sub.evicted == 115 and len(idx) == 985 and idx.blocks_at(a) == 500
        assert idx.blocks_at(b) == 485 and idx.counters["evicted"] == 115
        own = list(range(301 * BS, 501 * BS))
        assert idx.match(idx.hash_tokens(own)) == [200, 0]
    finally:
        sub.stop()
        sub.join(2.0)
        pub.close(0)
