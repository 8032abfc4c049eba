"""The conductor's store tier: the master's key change feed (``changes``) followed by
:class:`kvpool.conductor.store_feed.StoreFeed`, and the live router weighing a prefix the store
holds (real ``kvpool master`` and ``kvpool store-server`` processes, real puts and removes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from kvpool import Store
from kvpool.conductor.cost import CostModel
from kvpool.conductor.live import LiveRouter, RouterConfig
from kvpool.conductor.store_feed import StoreFeed
from kvpool.connectors.blockkeys import block_keys
from kvpool.store.changes import ChangeLog
from kvpool.store.procs import MasterProcess, StorageProcess, free_port

BS = 16
NS = f"kvpool/v2/tiny/model/bfloat16/kv-auto/h2x64/bs{BS}/tp0of1/cpu"  # a model name with a slash
TOKENS = [(7 * i + 3) % 1000 for i in range(BS * 12 + 5)]  # 12 full blocks


def _wait(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _store_blocks(st: Store, keys: list[str]) -> None:
    """What KvpoolStoreConnector writes per block: layer objects, then the block's marker."""
    for k in keys:
        st.put(f"{k}/abcd1234/layer0", b"x" * 64)
        st.put(k, b"m")


@pytest.fixture
def store() -> Iterator[tuple[MasterProcess, Store]]:
    with MasterProcess(change_log=64) as m, StorageProcess(m.address, 32 << 20):
        st = Store.connect(master=m.address, segment_size=0, buffer_size=1 << 20)
        try:
            yield m, st
        finally:
            st.close()


def test_change_log_ring() -> None:
    log = ChangeLog(3)
    assert log.since(0, 10) == []
    for k in "abcd":
        log.add("+", k)
    assert log.since(4, 10) == []
    assert [e[2] for e in log.since(2, 10)] == ["c", "d"]
    assert [e[2] for e in log.since(1, 1)] == ["b"]
    assert log.since(0, 10) is None  # entry 1 left the ring: the reader must resynchronise


def test_feed_follows_puts_and_removes(store: tuple[MasterProcess, Store]) -> None:
    m, st = store
    keys = block_keys(NS, TOKENS, BS)
    assert len(keys) == 12
    _store_blocks(st, keys[:8])
    st.put("some/other/key", b"y")  # not a block marker: ignored
    feed = StoreFeed(m.address, block_size=BS, poll_s=0.02)
    feed.start()
    try:
        _wait(feed.synced.is_set, "the first resync")
        _wait(lambda: feed.leading_blocks(TOKENS, "tiny/model") == 8, "8 stored blocks")
        assert feed.namespaces("tiny/model") == [NS]
        assert feed.leading_blocks(TOKENS, "another-model") == 8  # the only model in the store
        assert feed.leading_blocks(TOKENS[: BS * 3], "tiny/model") == 3
        other = list(TOKENS)
        other[BS * 2] += 1  # differs in block 2: the chain breaks there
        assert feed.leading_blocks(other, "tiny/model") == 2
        # changes after the sync arrive through the feed
        _store_blocks(st, keys[8:])
        _wait(lambda: feed.leading_blocks(TOKENS, "tiny/model") == 12, "12 blocks")
        st.remove(keys[5])
        _wait(lambda: feed.leading_blocks(TOKENS, "tiny/model") == 5, "the removal of block 5")
        assert feed.stats["removes"] >= 1 and feed.lag() == 0
        # a feed that falls behind the master's ring (64 entries) resynchronises and stays right
        feed.stop()
        feed.join(5)
        resyncs = feed.stats["resyncs"]
        st.put(keys[5], b"m")
        for i in range(80):
            st.put(f"filler/{i}", b"z")
        late = StoreFeed(m.address, block_size=BS, poll_s=0.02)
        late.seq, late._incarnation = feed.seq, feed._incarnation  # resume where the first one stopped
        late._view = feed._view
        assert late.poll() is True  # reset: more to read
        assert late.stats["resyncs"] == 1 and resyncs >= 1
        assert late.leading_blocks(TOKENS, "tiny/model") == 12
    finally:
        feed.stop()


def _ns(model: str, ranks: str) -> str:
    return f"kvpool/v2/{model}/bfloat16/kv-auto/h2x64/bs{BS}/{ranks}/cpu"


def test_feed_counts_a_block_only_when_every_tp_rank_and_pp_stage_stored_it(
    store: tuple[MasterProcess, Store],
) -> None:
    """KvpoolStoreConnector writes one marker per block and TP rank (and PP stage), each in its
    own namespace, and loads a block only when all are there: the feed counts a block stored
    once all its markers are seen (at a resync and through the change feed), and no more once
    one of them is removed. It counted TP rank 0's markers alone (a block another rank lacked
    was routed as stored) and no marker of an instance with pipeline stages."""
    m, st = store
    ns = [_ns("tiny/pp", f"tp{r}of2pp{s}of2") for s in (0, 1) for r in (0, 1)]  # TP 2 x PP 2
    keys = block_keys(ns[0], TOKENS, BS)

    def marker(x: str, k: str) -> str:
        return x + k[len(ns[0]) :]

    for i, k in enumerate(keys):
        for x in ns if i != 6 else ns[:3]:  # block 6 lacks stage 1's TP rank 1 marker
            st.put(f"{marker(x, k)}/abcd1234/layer{i}", b"x" * 64)  # not a marker: ignored
            st.put(marker(x, k), b"m")
    tp_only = _ns("tiny/tp", "tp0of2")  # TP 2, no PP: rank 0's markers alone
    for k in block_keys(tp_only, TOKENS, BS):
        st.put(k, b"m")
    feed = StoreFeed(m.address, block_size=BS, poll_s=0.02)
    feed.start()
    try:
        _wait(feed.synced.is_set, "the first resync")
        assert feed.leading_blocks(TOKENS, "tiny/pp") == 6 and feed.namespaces("tiny/pp") == [ns[0]]
        assert feed.size() == 11 and feed.namespaces("tiny/tp") == []  # its rank 1 stored nothing
        st.put(marker(ns[3], keys[6]), b"m")
        _wait(lambda: feed.leading_blocks(TOKENS, "tiny/pp") == 12, "block 6's last marker")
        st.remove(marker(ns[2], keys[3]))  # stage 1's TP rank 0 lost block 3
        _wait(lambda: feed.leading_blocks(TOKENS, "tiny/pp") == 3, "the removal of a marker of block 3")
        st.put(marker(ns[2], keys[3]), b"m")
        _wait(lambda: feed.leading_blocks(TOKENS, "tiny/pp") == 12, "block 3 whole again")
        st.remove(marker(ns[0], keys[9]))
        _wait(lambda: feed.leading_blocks(TOKENS, "tiny/pp") == 9, "the removal of rank 0's of block 9")
        again = StoreFeed(m.address, block_size=BS, poll_s=0.02)
        again.resync()  # the key table gives the same view
        assert again.leading_blocks(TOKENS, "tiny/pp") == 9 and again.namespaces("tiny/tp") == []
        assert feed.size() == again.size() == 11
    finally:
        feed.stop()


def test_router_lookups_during_a_resync_see_the_old_sets_or_the_new(
    store: tuple[MasterProcess, Store],
) -> None:
    """A resync cleared the namespaces' block sizes before it swapped the new blocks in: a
    router lookup in between (the feed thread resyncs while the event loop routes) took the
    "one model in the store" path over the old blocks and raised KeyError. The lookup is made
    in that window here, from inside the resync, and must see the blocks stored."""
    m, st = store
    _store_blocks(st, block_keys(NS, TOKENS, BS)[:8])
    feed = StoreFeed(m.address, block_size=BS)
    seen: list[int] = []
    try:
        feed.resync()
        assert feed.leading_blocks(TOKENS, "tiny/model") == 8
        index_namespace = feed._index_namespace

        def mid_resync(*args: object) -> None:
            seen.append(feed.leading_blocks(TOKENS, "tiny/model"))
            seen.append(feed.leading_blocks(TOKENS, "another-model"))
            index_namespace(*args)
            seen.append(feed.leading_blocks(TOKENS, "tiny/model"))

        feed._index_namespace = mid_resync  # type: ignore[method-assign]
        feed.resync()
        assert seen == [8, 8, 8] and feed.leading_blocks(TOKENS, "another-model") == 8
        assert feed.stats["resyncs"] == 2 and feed.size() == 8
    finally:
        feed._rpc.close()


def test_feed_resyncs_after_master_restart() -> None:
    port = free_port()
    keys = block_keys(NS, TOKENS, BS)
    with MasterProcess(port=port) as m, StorageProcess(m.address, 16 << 20):
        st = Store.connect(master=m.address, segment_size=0, buffer_size=1 << 20)
        _store_blocks(st, keys[:4])
        feed = StoreFeed(m.address, block_size=BS, poll_s=0.02, timeout_s=1.0)
        feed.start()
        try:
            _wait(lambda: feed.leading_blocks(TOKENS, None) == 4, "4 blocks")
        finally:
            st.close()
    try:
        # a new master on the same address knows none of them: the feed must not keep the old view
        with MasterProcess(port=port) as m2, StorageProcess(m2.address, 16 << 20):
            st2 = Store.connect(master=m2.address, segment_size=0, buffer_size=1 << 20)
            try:
                _wait(lambda: feed.size() == 0 and feed.stats["resyncs"] >= 2, "a resync with the new master")
                _store_blocks(st2, keys[:2])
                _wait(lambda: feed.leading_blocks(TOKENS, None) == 2, "2 blocks on the new master")
            finally:
                st2.close()
    finally:
        feed.stop()


def test_router_loads_a_store_prefix_instead_of_recomputing(store: tuple[MasterProcess, Store]) -> None:
    asyncio.run(_router_with_store(*store))


async def _router_with_store(m: MasterProcess, st: Store) -> None:
    long_tokens = [(11 * i + 5) % 997 for i in range(BS * 64)]
    keys = block_keys(NS, long_tokens, BS)
    cost = CostModel(prefill_per_token_s=1e-3, transfer_gbps=10.0)
    cfg = RouterConfig(policy="conductor", block_size=BS, store_master=m.address,
                       cost_model=cost, hot=False)  # fmt: skip
    router = LiveRouter(["http://a", "http://b"], ["both", "both"], cfg)
    await router.start()
    try:
        body = {"model": "tiny/model", "prompt": long_tokens}
        d, req = router.decide("r0", long_tokens, body)
        assert req.store_blocks == 0 and d.as_dict()["fetch_from"] is None
        _store_blocks(st, keys[:40])
        assert router.store_feed is not None
        _wait(lambda: router.store_feed.leading_blocks(long_tokens, "tiny/model") == 40, "40 blocks")
        d, req = router.decide("r1", long_tokens, body)
        assert req.store_blocks == 40
        got = d.as_dict()
        assert got["fetch_from"] == "store" and got["use_blocks"] == 40, got
        no_store = CostModel(prefill_per_token_s=1e-3, transfer_gbps=10.0).prefill_s(len(long_tokens))
        assert d.ttft_s < no_store / 2  # 40 of 64 blocks loaded instead of computed
        # a request to an adapter / with a cache salt is not looked up in the store
        d, req = router.decide("r2", long_tokens, {**body, "cache_salt": "s"})
        assert req.store_blocks == 0
        stats = router.stats()
        assert stats["store"]["blocks"] == 40 and stats["store"]["synced"]
        assert stats["store_fetch_decisions"] == 1
    finally:
        await router.close()
