"""KvpoolStoreConnector on vLLM's real Scheduler: blocks saved by one instance, loaded by another
through a real master and storage process (the forward pass is a test double)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def _found(sched: Any, keys: list[str]) -> list[bool]:
    """Which of ``keys`` the scheduler's non-blocking lookup finds in the store (waits for it)."""
    lookup = sched._lookups.submit(keys)
    deadline = time.monotonic() + 10
    while not lookup.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lookup.error is None, lookup.error
    return lookup.found


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
        out = b.step_until(lambda out: "b1" in out.kv_connector_metadata.loads)  # lookup, then load
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
        n, is_async = a.lookup(a.add("x2", other, 1, None))
        assert (n, is_async) == (32, True)
        # Another model tag shares nothing.
        c = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "other"})
        try:
            assert c.lookup(c.add("y", PROMPT, 1, None)) == (0, False)
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
        n, _ = b.lookup(b.scheduler.requests["e2"])
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


def test_blocks_out_of_the_sliding_window_are_not_saved(tiny_llama: Path, master: str) -> None:  # noqa: F811
    """A sliding-window model: vLLM replaces a request's blocks that fell out of the window by its
    null block (id 0) before ``request_finished``; saving those would store the null block's bytes
    under the prompt's keys, loaded by any later request sharing that prefix."""
    a = Instance(
        tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "swa"},
        sliding_window=64,
    )  # fmt: skip
    try:
        prompt = [(i * 31) % 600 + 7 for i in range(128)]  # 4 full blocks
        a.add("w1", prompt, 40, None)  # finishes at ~167 tokens: blocks 0-2 are out of the window
        saves: dict[str, list[tuple[int, str]]] = {}
        a.step_until(lambda out: bool(saves.update(out.kv_connector_metadata.saves) or "w1" in saves))
        a.run_until(lambda o: a.free_blocks() == a.idle_free)
        assert saves["w1"] and all(b != 0 for b, _ in saves["w1"])
        keys = block_keys(a.connector._scheduler.namespace, prompt, 32)
        assert a.connector._scheduler.store.batch_exists(keys) == [False, False, False, True]
    finally:
        a.close()


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
        outputs = p.run_until(lambda o: "c1" in o)  # after the store lookup
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
        assert s.lookup(s.add("c3", PROMPT, 1, None)) == (64, True)
    finally:
        for inst in (s, d, p):
            inst.close()


# ---------------------------------------------------------------- keys that cannot collide (issue 12)
def test_cache_salt_lora_and_multimodal_requests_never_share_blocks(tiny_llama: Path, master: str) -> None:  # noqa: F811
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from kvpool.connectors.vllm.store import request_block_keys
    from tests.vllm_sched import make_request

    a = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "t5"})
    b = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "t5"})
    try:
        a.add("s1", PROMPT, 1, None, cache_salt="tenant-1")
        run_to_end(a, "s1")
        a.run_until(lambda o: a.free_blocks() == a.idle_free)
        assert a.worker._worker.saved_blocks == 2
        # Same tokens, another salt or none: no external hit. Same salt: both blocks.
        assert b.lookup(make_request("q1", PROMPT, 1, cache_salt="tenant-2")) == (0, False)
        assert b.lookup(make_request("q2", PROMPT, 1)) == (0, False)
        assert b.lookup(make_request("q3", PROMPT, 1, cache_salt="tenant-1")) == (64, True)

        # LoRA (name and path) and multimodal inputs are in every block's key, as in vLLM's hash.
        ns = b.connector._scheduler.namespace

        def keys(**kw: object) -> list[str]:
            return request_block_keys(ns, make_request("k", PROMPT, 1, **kw), 32)

        def mm(ident: str, offset: int) -> list[MultiModalFeatureSpec]:
            return [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                          mm_position=PlaceholderRange(offset=offset, length=8))]  # fmt: skip

        plain = keys()
        variants = [
            keys(cache_salt="tenant-1"),
            keys(lora_request=LoRARequest("ad-a", 1, "/adapters/a")),
            keys(lora_request=LoRARequest("ad-b", 2, "/adapters/a")),
            keys(lora_request=LoRARequest("ad-a", 1, "/adapters/a2")),
            keys(mm_features=mm("img-1", 40)),
            keys(mm_features=mm("img-2", 40)),
            keys(mm_features=mm("img-1", 36)),
        ]
        assert all(len(v) == 2 for v in variants)
        firsts = [plain[0]] + [v[0] for v in variants[:4]]
        assert len(set(firsts)) == len(firsts)  # salt and LoRA change the first block already
        seconds = [plain[1]] + [v[1] for v in variants]
        assert len(set(seconds)) == len(seconds)  # the image sits in block 1: every chain differs
        assert variants[4][0] == plain[0]  # ... and block 0, before the image, is shared
        # Deterministic: the same request hashes the same (no per-process seed).
        assert keys(cache_salt="tenant-1") == variants[0]
        lora = make_request("l", PROMPT, 1, lora_request=LoRARequest("ad-a", 1, "/adapters/a"))
        assert b.lookup(lora) == (0, False)
    finally:
        a.close()
        b.close()


def test_kv_cache_dtype_and_layout_are_in_the_namespace(tiny_llama: Path) -> None:  # noqa: F811
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.store import layout_signature, namespace_for
    from tests.vllm_sched import vllm_config

    cfg = VllmConnectorConfig(master="x:1", model_tag="m")
    names = set()
    for cache_dtype in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        vc = vllm_config(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": "x:1"}, 8)
        vc.cache_config.cache_dtype = cache_dtype
        names.add(namespace_for(cfg, vc, 0))
    assert len(names) == 4
    assert namespace_for(cfg, vc, 0) != namespace_for(cfg, vc, 1)
    # Two checkpoints served under one name (another revision, another quantization) never share.
    vc.model_config.revision = "refs/pr/7"
    with_rev = namespace_for(cfg, vc, 0)
    vc.model_config.quantization = "awq"
    assert len({namespace_for(cfg, vc, 0), with_rev, *names}) == 6
    assert with_rev.split("/")[3] == "float32+rev-refs_pr_7"  # one path segment: the router parses it
    # RoPE settings change K: another scaling or an override of the config is another namespace.
    plain = namespace_for(cfg, vc, 0)
    hf = vc.model_config.hf_config
    hf.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    linear2 = namespace_for(cfg, vc, 0)
    hf.rope_scaling = {"rope_type": "linear", "factor": 4.0}
    linear4 = namespace_for(cfg, vc, 0)
    assert len({plain, linear2, linear4}) == 3 and "+rope-" in linear4
    hf.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    assert namespace_for(cfg, vc, 0) == linear2  # the same settings: the same namespace
    hf.rope_scaling = {"rope_type": "default", "rope_theta": 10000.0}
    assert namespace_for(cfg, vc, 0) == plain
    vc.model_config.hf_overrides = {"rope_theta": 1e6}
    assert namespace_for(cfg, vc, 0) not in (plain, linear2)
    vc.model_config.hf_overrides = {}
    from kvpool.connectors.blockkeys import NAMESPACE_RE

    assert NAMESPACE_RE.match(namespace_for(cfg, vc, 0) + "/" + "0" * 32)["model"] == "m"
    assert NAMESPACE_RE.match(linear4 + "/" + "0" * 32)["model"] == "m"
    base = {"l0": torch.zeros(8, 2, 32, 128)}
    sigs = {
        layout_signature(base, 8),
        layout_signature({"l0": torch.zeros(8, 32, 2, 128)}, 8),  # NHD vs HND
        layout_signature({"l0": torch.zeros(8, 2, 32, 128, dtype=torch.uint8)}, 8),  # fp8 bytes
        layout_signature({"l0": torch.zeros(2, 8, 2, 32, 64)}, 8),  # K/V planes first
    }
    assert len(sigs) == 4
    assert layout_signature({"l0": torch.zeros(16, 2, 32, 128)}, 16) == layout_signature(base, 8)


def test_two_checkpoints_under_one_served_name_never_share_a_namespace(
    tiny_llama: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The same served name (an alias) for another checkpoint - weights that differ in one byte
    - is another namespace; the same checkpoint copied to another path is the same one; with
    ``model_tag`` the operator vouches for the weights and no fingerprint is added."""
    import shutil

    from kvpool.connectors.blockkeys import NAMESPACE_RE
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.store import namespace_for
    from tests.vllm_sched import vllm_config

    tuned, copy = tmp_path / "tuned", tmp_path / "elsewhere" / "copy"
    shutil.copytree(tiny_llama, tuned)
    shutil.copytree(tiny_llama, copy)
    weights = sorted(tuned.glob("*.safetensors"))
    assert weights
    data = bytearray(weights[-1].read_bytes())
    data[-1] ^= 0xFF
    weights[-1].write_bytes(bytes(data))

    def ns(model: Path, cfg: VllmConnectorConfig) -> str:
        vc = vllm_config(model, "KvpoolStoreConnector", "kv_both", {"master": "x:1"}, 8)
        vc.model_config.served_model_name = "llama"
        return namespace_for(cfg, vc, 0)

    plain = VllmConnectorConfig(master="x:1")
    base = ns(tiny_llama, plain)
    assert ns(tuned, plain) != base
    assert ns(copy, plain) == base
    assert "+ckpt-" in base.split("/")[3]
    assert NAMESPACE_RE.match(base + "/" + "0" * 32)["model"] == "llama"  # the router still parses it
    tagged = VllmConnectorConfig(master="x:1", model_tag="m")
    assert ns(tuned, tagged) == ns(tiny_llama, tagged)
    assert "+ckpt-" not in ns(tiny_llama, tagged)


def test_a_stored_object_of_the_wrong_size_is_a_failed_load(tiny_llama: Path, master: str) -> None:  # noqa: F811
    a = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "t6"})
    b = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "t6"})
    b.scheduler.recompute_kv_load_failures = True
    try:
        a.add("w1", PROMPT, 1, None)
        run_to_end(a, "w1")
        a.run_until(lambda o: a.free_blocks() == a.idle_free)
        w = a.worker._worker
        stored = block_keys(a.connector._scheduler.namespace, PROMPT, 32)
        keys, _, sizes, _ = w._ranges([(0, k) for k in stored])
        # Replace block 1's layer-0 object with a shorter one (as a truncated or foreign write would).
        with Store.connect(master, segment_size=0) as s:
            s.remove(keys[2], force=True)
            s.put(keys[2], b"\x01" * (sizes[2] // 2))
        b.add("w2", PROMPT, 2, None)
        outputs = b.run_until(lambda o: "w2" in o and o["w2"].new_token_ids, timeout=20)
        assert outputs["w2"].finish_reason is None
        assert b.worker._worker.loaded_blocks == 1  # block 0 loaded, block 1 refused and recomputed
        for got, want in zip(b.block_values("w2", 79), expected_rows(PROMPT, 79), strict=True):
            assert torch.equal(got, want)
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- hooks never block (issue 12)
def test_hooks_return_at_once_while_the_master_is_stopped(tiny_llama: Path) -> None:  # noqa: F811
    """SIGSTOP the master: a scheduler hook that waited on it would block for the store's RPC
    timeout (60 s here); each step must instead return at once, requests are computed locally,
    and once the master runs again the store is used again."""
    import os
    import signal

    from tests.vllm_sched import make_request

    with MasterProcess() as m, StorageProcess(m.address, 64 << 20):
        extra = {"master": m.address, "model_tag": "t7", "store_rpc_timeout_s": 60.0,
                 "lookup_timeout_s": 0.5, "store_retry_s": 0.5}  # fmt: skip
        a = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", extra)
        try:
            a.add("m1", PROMPT, 1, None)
            run_to_end(a, "m1")
            a.run_until(lambda o: a.free_blocks() == a.idle_free)
            assert a.worker._worker.saved_blocks == 2
            # m0 is running (its lookup answered) when the master stops: it finishes meanwhile.
            other = [(i * 41) % 500 + 7 for i in range(100)]
            a.add("m0", other, 3, None)
            a.step_until(lambda out: any(r.req_id == "m0" for r in out.scheduled_new_reqs))
            os.kill(m.proc.pid, signal.SIGSTOP)
            try:
                slowest = 0.0
                done: set[str] = set()

                def step() -> None:
                    nonlocal slowest
                    s0 = time.perf_counter()
                    _, outputs = a.step()
                    slowest = max(slowest, time.perf_counter() - s0)
                    done.update(r for r, o in outputs.items() if o.finish_reason)

                while "m0" not in done:  # request_finished hands the save to the worker, no RPC
                    step()
                answers = []
                req = make_request("m2", PROMPT, 1)
                while not answers or answers[-1][0] is None:
                    t0 = time.perf_counter()
                    answers.append(a.connector.get_num_new_matched_tokens(req, 0))
                    slowest = max(slowest, time.perf_counter() - t0)
                    assert len(answers) < 10_000
                    time.sleep(0.01)
                assert answers[0] == (None, False)  # pending: vLLM asks again next step
                assert answers[-1] == (0, False)  # given up after lookup_timeout_s: computed locally
                assert not a.connector._scheduler.breaker.closed()
                # Whole requests through vLLM's scheduler, with the store switched off.
                a.add("m3", other[:50] + PROMPT, 2, None)
                a.add("m4", PROMPT, 2, None)
                t0 = time.perf_counter()
                while not {"m3", "m4"} <= done:
                    step()
                    assert time.perf_counter() - t0 < 30, "requests not served while the master is stopped"
                assert slowest < 5.0, f"a step waited {slowest:.1f} s on the stopped master"
                assert a.connector._scheduler.hit_blocks == 0
            finally:
                os.kill(m.proc.pid, signal.SIGCONT)
            # m0's save (stuck on the master in the worker's save thread) ends; its blocks come back.
            a.run_until(lambda o: a.free_blocks() == a.idle_free, timeout=90)
            # The master is back: a probe closes the breaker and the saved prefix is found again.
            deadline = time.monotonic() + 90
            i = 0
            while a.lookup(make_request(f"m5-{i}", PROMPT, 1), timeout=90) != (64, True):
                assert time.monotonic() < deadline, "store not used again after the master came back"
                i += 1
                time.sleep(0.1)
            assert a.connector._scheduler.breaker.closed() and a.connector._scheduler.breaker.outages == 1
        finally:
            a.close()


def test_a_load_on_a_sliding_window_model_skips_the_null_block(tiny_llama: Path, master: str) -> None:  # noqa: F811
    """A sliding-window model loading a stored prefix: the blocks out of its window are vLLM's
    null block (id 0, shared by every request); nothing is loaded into them, the window's blocks
    are the stored ones."""
    opts = {"master": master, "model_tag": "swa-load"}
    a = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", opts, sliding_window=64)
    b = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", opts, sliding_window=64)
    try:
        prompt = [(i * 29) % 600 + 11 for i in range(128)]  # 4 full blocks
        # Blocks out of a's window when a request finishes are not saved: its first 2 blocks come
        # from a shorter request (inside the window), the last 2 from the whole prompt.
        for rid, p in (("a1", prompt[:64] + [5]), ("a2", prompt)):
            a.add(rid, p, 1, None)
            run_to_end(a, rid)
            a.run_until(lambda o: a.free_blocks() == a.idle_free)
        keys = block_keys(a.connector._scheduler.namespace, prompt, 32)
        assert all(a.connector._scheduler.store.batch_exists(keys))

        prompt_b = prompt + [(i * 7) % 600 + 3 for i in range(40)]
        b.add("b1", prompt_b, 2, None)
        out = b.step_until(lambda out: "b1" in out.kv_connector_metadata.loads)
        loads = out.kv_connector_metadata.loads["b1"]
        assert b.scheduler.kv_cache_manager.get_block_ids("b1")[0][0] == 0  # out of the window
        assert loads and all(blk != 0 for blk, _ in loads)
        b.run_until(lambda o: "b1" in o and o["b1"].new_token_ids)
        assert all(not b.kv[name][0].any() for name in b.kv)  # the null block untouched
        n = len(prompt_b) - 1
        lo = (n - 64) // 32 * 32
        for got, want in zip(b.block_values("b1", n), expected_rows(prompt_b, n), strict=True):
            assert torch.equal(got[lo:], want[lo:])
        run_to_end(b, "b1")
    finally:
        a.close()
        b.close()


@pytest.fixture
def loader(tiny_llama: Path, master: str, request: pytest.FixtureRequest) -> Iterator[Instance]:  # noqa: F811
    """An instance that stored PROMPT's blocks (and finished) and the one yielded, of the same
    model, about to load them, with kv_load_failure_policy=recompute (vLLM recomputes the blocks of
    a failed load). A model tag of the test's own: no other test's keys."""
    opts = {
        "master": master,
        "model_tag": "fail-" + hashlib.sha1(request.node.name.encode()).hexdigest()[:12],
    }
    a = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", opts)
    b = Instance(tiny_llama, "KvpoolStoreConnector", "kv_both", opts)
    b.scheduler.recompute_kv_load_failures = True
    try:
        a.add("saved", PROMPT, 1, None)
        run_to_end(a, "saved")
        a.run_until(lambda o: a.free_blocks() == a.idle_free)
        yield b
    finally:
        a.close()
        b.close()


def test_an_unexpected_error_in_a_load_fails_its_blocks_and_finishes_it(
    loader: Instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An asynchronous load that raises something other than a kvpool error: every block of it is
    reported failed to vLLM (recomputed) and the request finishes loading (never waits forever)."""
    b = loader
    store = b.worker._worker.store
    real = store.batch_get_into

    def broken(*args: object, **kw: object) -> object:
        monkeypatch.setattr(store, "batch_get_into", real)  # the first load only
        raise RuntimeError("injected")

    monkeypatch.setattr(store, "batch_get_into", broken)
    reported: set[int] = set()
    take = b.worker.get_block_ids_with_load_errors
    monkeypatch.setattr(b.worker, "get_block_ids_with_load_errors", lambda: reported.update(e := take()) or e)
    b.add("f2", PROMPT, 2, None)
    out = b.step_until(lambda out: "f2" in out.kv_connector_metadata.loads)
    loaded = {blk for blk, _ in out.kv_connector_metadata.loads["f2"]}
    assert len(loaded) == 2
    outputs = b.run_until(lambda o: "f2" in o and o["f2"].new_token_ids, timeout=20)
    assert reported == loaded
    assert outputs["f2"].finish_reason is None  # still running: vLLM looked it up and loaded again
    assert b.worker._worker.loaded_blocks == 2
    for got, want in zip(b.block_values("f2", 79), expected_rows(PROMPT, 79), strict=True):
        assert torch.equal(got, want)


def test_a_load_that_fails_every_time_is_recomputed_not_retried_forever(
    loader: Instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With kv_load_failure_policy=recompute vLLM asks the connector again after a failed load; a
    load failing every time (a corrupt object) was offered and failed again every step, forever.
    At most two store loads per request: then vLLM recomputes, with the right rows."""
    b = loader
    calls = []

    def broken(*args: object, **kw: object) -> object:
        calls.append(1)
        raise RuntimeError("injected: every load fails")

    monkeypatch.setattr(b.worker._worker.store, "batch_get_into", broken)
    b.add("g2", PROMPT, 2, None)
    outputs = b.run_until(lambda o: "g2" in o and o["g2"].new_token_ids, timeout=30)
    assert outputs["g2"].new_token_ids and len(calls) == 2
    for got, want in zip(b.block_values("g2", 79), expected_rows(PROMPT, 79), strict=True):
        assert torch.equal(got, want)


def test_a_pipeline_stage_saves_its_layers_when_another_stage_committed_the_block(
    tiny_llama: Path,  # noqa: F811
    master: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pipeline stages write their own commit marker per block (in their own namespace) over
    their own layers' objects: the stage that saves second stores its layers too, instead of
    taking the first stage's marker for its own layers and leaving the block without them (a
    hit whose load fails on every instance, forever)."""
    from kvpool.connectors.vllm import store_worker
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.store_worker import _StoreWorker
    from tests.vllm_sched import vllm_config

    cfg = VllmConnectorConfig(master=master, model_tag="pp-" + hashlib.sha1(b"pp").hexdigest()[:8])
    vc = vllm_config(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master}, 4)
    vc.parallel_config.pipeline_parallel_size = 2
    stages = []
    for layer in (0, 1):  # stage 0 holds layer 0, stage 1 layer 1 (vLLM's names: whole-model index)
        monkeypatch.setattr(store_worker, "pp_rank", lambda layer=layer: layer)  # no vLLM PP group here
        w = _StoreWorker(cfg, vc, None)
        t = torch.full((4, 2, 32, 8), float(layer + 1))
        w.register_kv_caches({f"model.layers.{layer}.self_attn.attn": t})
        stages.append((w, t))
    try:
        assert stages[0][0].namespace == stages[1][0].namespace0 != stages[1][0].namespace
        assert "/tp0of1pp1of2/" in stages[1][0].namespace
        key = block_keys(stages[0][0].namespace, PROMPT, 32)[0]
        for w, _ in stages:
            w._save([(2, key)])
        for w, t in stages:
            keys, _, sizes, _ = w._ranges([(2, key)])
            assert all(w.store.batch_exists(keys)), "a stage's layer was never saved"
            assert w.store.exists(w._key(key))  # its own marker
            out = torch.zeros_like(t)
            w.store.register_buffer(out)
            assert w.store.batch_get_into(keys, [out.data_ptr() + 2 * out.stride(0) * 4], sizes) == sizes
            assert torch.equal(out[2], t[2])
        assert [w.saved_blocks for w, _ in stages] == [1, 1]
    finally:
        for w, _ in stages:
            w.close()


def test_a_block_is_a_hit_only_when_every_pipeline_stage_and_tp_rank_committed_it(
    tiny_llama: Path,  # noqa: F811
    master: str,
) -> None:
    """With pipeline parallelism each stage (and each TP rank of it) writes its own commit marker
    in its own namespace once its own layers are stored; the scheduler's lookup needs all of
    them. The stages shared one marker: stage 0's alone made a hit whose load failed on stage 1,
    which had not stored its layers (recomputed after a wasted load, every time)."""
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.store import _StoreScheduler, namespace_for
    from tests.vllm_sched import vllm_config

    cfg = VllmConnectorConfig(master=master, model_tag="pp-" + hashlib.sha1(b"pp2tp2").hexdigest()[:8])
    vc = vllm_config(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master}, 4)
    vc.parallel_config.tensor_parallel_size = 2
    vc.parallel_config.pipeline_parallel_size = 2
    sched = _StoreScheduler(cfg, vc)
    try:
        ns = [namespace_for(cfg, vc, r, s) for s in (0, 1) for r in (0, 1)]
        assert ns[0] == sched.namespace and len(set(ns)) == 4
        keys = block_keys(ns[0], PROMPT, 32)
        n = len(ns[0])
        markers = [x + keys[1][n:] for x in ns]  # block 1: every rank of every stage
        markers += [x + keys[0][n:] for x in ns[:3]]  # block 0: stage 1's TP rank 1 lacks it
        with Store.connect(master=master, segment_size=0) as st:
            st.batch_put(markers, [b"m"] * len(markers))
        assert _found(sched, keys + [ns[0] + "/missing"]) == [False, True, False]
    finally:
        sched.close()


def test_with_decode_context_parallel_a_key_covers_the_tokens_of_one_block_id(tiny_llama: Path) -> None:  # noqa: F811
    """With DCP each rank holds a slice of every block's tokens: one block id covers
    ``block_size * dcp`` tokens (vLLM's scheduler block size). Keys are made over that many tokens
    and the namespace names the DCP split: a block is never saved under the key of a shorter
    prefix (another prompt sharing only that prefix would load the block's other tokens' KV)."""
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.store import _StoreScheduler, namespace_for
    from tests.vllm_sched import make_request, vllm_config

    cfg = VllmConnectorConfig(master="127.0.0.1:1", model_tag="dcp")
    vc = vllm_config(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": "x:1"}, 8)
    plain = namespace_for(cfg, vc, 0)
    vc.parallel_config.decode_context_parallel_size = 2
    sched = _StoreScheduler(cfg, vc)
    try:
        assert sched.block_size == 64
        assert sched.namespace != plain and "/bs64/" in sched.namespace and "+dcp2i1/" in sched.namespace
        vc.parallel_config.cp_kv_cache_interleave_size = 16
        assert namespace_for(cfg, vc, 0) != sched.namespace  # another interleave: other slices
        req = make_request("d1", PROMPT, 1)
        req.num_computed_tokens = len(PROMPT)
        # 80 prompt tokens: block 5 holds tokens 0-63 (this rank's slice), block 6 tokens 64-79.
        assert sched.request_finished(req, [5, 6]) == (True, None)
        assert sched.build_meta().saves == {"d1": [(5, block_keys(sched.namespace, PROMPT, 64)[0])]}
    finally:
        sched.close()


def test_the_speculative_draft_model_is_in_the_namespace(tiny_llama: Path) -> None:  # noqa: F811
    """A draft model's layers' KV caches are registered and stored with the target model's, under
    layer names another draft model of the same shapes has too: two instances of one target model
    with different draft models (or none) never share keys; an n-gram drafter has no KV."""
    from types import SimpleNamespace

    from kvpool.connectors.blockkeys import NAMESPACE_RE
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.store import namespace_for
    from tests.vllm_sched import vllm_config

    cfg = VllmConnectorConfig(master="x:1", model_tag="m")
    vc = vllm_config(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": "x:1"}, 8)
    plain = namespace_for(cfg, vc, 0)

    def with_draft(method: str, draft: str | None) -> str:
        dmc = (
            None
            if draft is None
            else SimpleNamespace(model=draft, revision=None, quantization=None, dtype="bf16")
        )
        object.__setattr__(vc, "speculative_config", SimpleNamespace(method=method, draft_model_config=dmc))
        return namespace_for(cfg, vc, 0)

    eagle_a, eagle_b = with_draft("eagle", "org/eagle-a"), with_draft("eagle", "org/eagle-b")
    assert len({plain, eagle_a, eagle_b}) == 3
    assert with_draft("eagle", "org/eagle-a") == eagle_a
    assert with_draft("ngram", None) == plain
    assert NAMESPACE_RE.match(eagle_a + "/" + "0" * 32)["model"] == "m"


def test_prefill_context_parallel_is_refused(tiny_llama: Path) -> None:  # noqa: F811
    """PCP ranks of one TP rank hold other token slices or only the requests they own, and the key
    names the TP rank only: both halves refuse PCP > 1 at start rather than share keys."""
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.store import _StoreScheduler
    from kvpool.connectors.vllm.store_worker import _StoreWorker
    from kvpool.errors import ConfigError
    from tests.vllm_sched import vllm_config

    cfg = VllmConnectorConfig(master="127.0.0.1:1", model_tag="pcp")
    vc = vllm_config(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": "x:1"}, 8)
    vc.parallel_config.prefill_context_parallel_size = 2
    for half in (_StoreScheduler, _StoreWorker):
        with pytest.raises(ConfigError, match="prefill_context_parallel_size"):
            half(cfg, vc, None) if half is _StoreWorker else half(cfg, vc)


def test_a_block_is_a_hit_only_when_every_tp_rank_committed_it(tiny_llama: Path, master: str) -> None:  # noqa: F811
    """Each TP rank writes its own commit marker once its own shard is stored; the scheduler's
    lookup needs every rank's: rank 0's alone (another rank's save failed) made a hit whose load
    failed on that rank, recomputed after a wasted load, every time the prefix came back."""
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.store import _StoreScheduler, namespace_for
    from tests.vllm_sched import vllm_config

    cfg = VllmConnectorConfig(master=master, model_tag="tp-" + hashlib.sha1(b"tp2").hexdigest()[:8])
    vc = vllm_config(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master}, 4)
    vc.parallel_config.tensor_parallel_size = 2
    sched = _StoreScheduler(cfg, vc)
    try:
        ns0, ns1 = sched.namespace, namespace_for(cfg, vc, 1)
        assert ns0 != ns1
        keys = block_keys(ns0, PROMPT, 32)
        with Store.connect(master=master, segment_size=0) as st:
            st.batch_put([keys[0], keys[1], ns1 + keys[1][len(ns0) :]], [b"m"] * 3)  # rank 1 lacks block 0
        assert _found(sched, keys + [ns0 + "/missing"]) == [False, True, False]
    finally:
        sched.close()
