"""KvpoolStoreConnector on vLLM's real Scheduler: blocks saved by one instance, loaded by another
through a real master and storage process (the forward pass is a test double)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.store import Store
from kvpool.store.procs import MasterProcess, StorageProcess
from tests.vllm_support import tiny_llama  # noqa: F401  (fixture)

pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")  # never skipped in CI

from kvpool.connectors.vllm.store import block_keys  # noqa: E402
from tests.vllm_sched import Instance, expected_rows  # noqa: E402

PROMPT = [(i * 53) % 600 + 5 for i in range(80)]  # 2 full blocks + 16 tokens


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    with MasterProcess() as m, StorageProcess(m.address, 64 << 20):
        yield m.address


def run_to_end(inst: Instance, rid: str) -> None:
    inst.run_until(lambda o: rid in o and o[rid].finish_reason is not None)


def test_second_instance_loads_the_prefix_the_first_saved(tiny_llama: Path, master: str) -> None:  # noqa: F811
    a = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "t1"})
    b = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "t1"})
    try:
        a.add("a1", PROMPT, 1, None)
        run_to_end(a, "a1")
        # The finished request's blocks are held until its 2 full blocks are saved, then freed.
        a.run_until(lambda o: a.free_blocks() == a.idle_free)
        assert a.worker._worker.saved_blocks == 2
        keys = block_keys(a.connector._scheduler.namespace, PROMPT, 32)
        assert len(keys) == 2 and all(a.connector._scheduler.store.batch_exists(keys))

        prompt_b = PROMPT + [9, 9, 9]
        b.add("b1", prompt_b, 3, None)
        out, _ = b.step()
        loads = out.kv_connector_metadata.loads["b1"]
        assert [k for _, k in loads] == keys
        b.run_until(lambda o: "b1" in o and o["b1"].new_token_ids)
        assert b.worker._worker.loaded_blocks == 2
        stats = b.scheduler.connector_prefix_cache_stats
        assert b.connector._scheduler.hit_blocks == 2 and stats is not None
        for got, want in zip(b.block_values("b1", 64), expected_rows(prompt_b, 64), strict=True):
            assert torch.equal(got, want)
        run_to_end(b, "b1")
    finally:
        a.close()
        b.close()


def test_diverging_prompt_hits_only_the_common_blocks(tiny_llama: Path, master: str) -> None:  # noqa: F811
    a = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "t2"})
    try:
        a.add("x1", PROMPT, 1, None)
        run_to_end(a, "x1")
        a.run_until(lambda o: a.free_blocks() == a.idle_free)
        other = PROMPT[:40] + [1] * 60  # same first block, different second
        ns = a.connector._scheduler.namespace
        assert block_keys(ns, other, 32)[0] == block_keys(ns, PROMPT, 32)[0]
        assert block_keys(ns, other, 32)[1] != block_keys(ns, PROMPT, 32)[1]
        n, is_async = a.connector.get_num_new_matched_tokens(a.add("x2", other, 1, None), 0)
        assert (n, is_async) == (32, True)
        # Another model tag shares nothing.
        c = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "other"})
        try:
            assert c.connector.get_num_new_matched_tokens(c.add("y", PROMPT, 1, None), 0) == (0, False)
        finally:
            c.close()
    finally:
        a.close()


def test_block_evicted_between_lookup_and_load_is_recomputed(tiny_llama: Path, master: str) -> None:  # noqa: F811
    a = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "t3"})
    b = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "t3"})
    b.scheduler.recompute_kv_load_failures = True
    try:
        a.add("e1", PROMPT, 1, None)
        run_to_end(a, "e1")
        a.run_until(lambda o: a.free_blocks() == a.idle_free)
        b.add("e2", PROMPT, 2, None)
        n, _ = b.connector.get_num_new_matched_tokens(b.scheduler.requests["e2"], 0)
        assert n == 64
        with Store.connect(master, segment_size=0) as s:  # the objects vanish before the load
            assert s.remove_all() >= 2
        outputs = b.run_until(lambda o: "e2" in o and o["e2"].new_token_ids, timeout=20)
        assert outputs["e2"].finish_reason is None
        for got, want in zip(b.block_values("e2", 79), expected_rows(PROMPT, 79), strict=True):
            assert torch.equal(got, want)
    finally:
        a.close()
        b.close()


def test_store_connector_needs_a_master(tiny_llama: Path) -> None:  # noqa: F811
    from kvpool.errors import ConfigError

    with pytest.raises(ConfigError, match="master"):
        Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {})
    with pytest.raises(ConfigError, match="kv_connector_extra_config"):
        Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": "x:1", "no_such_key": 1})


def test_combined_pd_and_store_through_multiconnector(tiny_llama: Path, master: str) -> None:  # noqa: F811
    from kvpool.child import free_port

    both = {
        "connectors": [
            {"kv_connector": "KvpoolConnector", "kv_role": "kv_producer",
             "kv_connector_module_path": "kvpool.connectors.vllm",
             "kv_connector_extra_config": {"side_channel_port": free_port()}},
            {"kv_connector": "KvpoolStoreConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "kvpool.connectors.vllm",
             "kv_connector_extra_config": {"master": master, "model_tag": "t4"}},
        ]
    }  # fmt: skip
    p = Instance(tiny_llama, "MultiConnector", "kv_both", both)
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()})
    s = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "t4"})
    try:
        p.add("c1", PROMPT, 1, {"do_remote_decode": True})
        _, outputs = p.step()
        params = outputs["c1"].kv_transfer_params
        assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 3
        # The store save finishes on its own; the blocks stay until the decode has read them too.
        for _ in range(5):
            p.step()
            time.sleep(0.02)
        assert p.free_blocks() == p.idle_free - 3
        d.add("c2", PROMPT, 2, params)
        d.run_until(lambda o: "c2" in o and o["c2"].new_token_ids)
        for got, want in zip(d.block_values("c2", 79), expected_rows(PROMPT, 79), strict=True):
            assert torch.equal(got, want)
        p.run_until(lambda o: p.free_blocks() == p.idle_free)
        # ... and the prefix is in the pool for any other instance.
        assert s.connector.get_num_new_matched_tokens(s.add("c3", PROMPT, 1, None), 0) == (64, True)
    finally:
        for inst in (s, d, p):
            inst.close()
