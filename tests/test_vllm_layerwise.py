"""KvpoolStoreConnector in layer-wise mode on vLLM's real Scheduler: each step's completed prompt
blocks saved per layer during the forward pass (``save_kv_layer``), committed only once every
layer is stored; in-forward loads waited for per layer (``wait_for_layer_load``); a real master
and storage process (the forward pass is a test double that calls the per-layer hooks as vLLM's
attention layers do, in the order vLLM 0.32's model runner calls them)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.store.procs import MasterProcess, StorageProcess
from tests.vllm_support import tiny_llama  # noqa: F401  (fixture)

pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")  # never skipped in CI


from kvpool.connectors.vllm.store import block_keys  # noqa: E402
from tests.vllm_sched import BS, LAYERS, Instance, LayerInstance, expected_rows  # noqa: E402

PROMPT = [(i * 37) % 500 + 3 for i in range(80)]  # 2 full blocks + 16 tokens


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    with MasterProcess() as m, StorageProcess(m.address, 64 << 20):
        yield m.address


def _wait_exists(inst: Instance, keys: list[str], want: bool, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while list(inst.connector._scheduler.store.batch_exists(keys)) != [want] * len(keys):
        assert time.monotonic() < deadline, f"commit markers not {'all there' if want else 'absent'}"
        time.sleep(0.02)


def test_layerwise_saves_during_prefill_and_loads_per_layer_byte_exact(tiny_llama: Path, master: str) -> None:  # noqa: F811
    extra = {"master": master, "model_tag": "lw1", "layerwise": True, "load_async": False}
    a = LayerInstance(tiny_llama, "KvpoolStoreConnector", "kv_both", extra)
    b = LayerInstance(tiny_llama, "KvpoolStoreConnector", "kv_both", extra)
    try:
        a.add("a1", PROMPT, 50, None)
        a.step_until(lambda out: "a1" in out.kv_connector_metadata.layer_saves)
        out = a.step_until(lambda out: "a1" in out.num_scheduled_tokens)  # decoding now
        keys = block_keys(a.connector._scheduler.namespace, PROMPT, BS)
        assert len(keys) == 2
        # Saved and committed while the request still runs (per-request mode saves at its end).
        _wait_exists(a, keys, True)
        assert a.scheduler.requests["a1"].status.name == "RUNNING"
        # The save thread counts a block once its marker's put has returned, a moment after the
        # marker became visible to the lookup above.
        deadline = time.monotonic() + 10
        while a.worker._worker.saved_blocks < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.worker._worker.saved_blocks == 2
        # Decode steps complete no prompt block: nothing more is saved.
        for _ in range(3):
            out, _ = a.step()
            assert not out.kv_connector_metadata.layer_saves

        prompt_b = PROMPT + [9, 9, 9]
        b.add("b1", prompt_b, 3, None)
        out = b.step_until(lambda out: "b1" in out.kv_connector_metadata.loads)
        assert [k for _, k in out.kv_connector_metadata.loads["b1"]] == keys
        # The in-forward load was waited for layer by layer, before each layer computed.
        assert [s for s in b.seen if s[0] == "load"] == [("load", n) for n in LAYERS]
        assert b.worker._worker.loaded_blocks == 2
        assert not b.worker._worker.take_load_errors()
        for got, want in zip(b.block_values("b1", 64), expected_rows(prompt_b, 64), strict=True):
            assert torch.equal(got, want)
        b.run_until(lambda o: "b1" in o and o["b1"].finish_reason is not None)
        a.run_until(lambda o: "a1" in o and o["a1"].finish_reason is not None)
        # Layer-wise saves are done when their step ends: a finished request's blocks go back at once.
        a.run_until(lambda o: a.free_blocks() == a.idle_free)
    finally:
        a.close()
        b.close()


def test_a_forward_pass_cut_between_layers_commits_nothing(tiny_llama: Path, master: str) -> None:  # noqa: F811
    extra = {"master": master, "model_tag": "lw2", "layerwise": True, "load_async": False}
    a = LayerInstance(tiny_llama, "KvpoolStoreConnector", "kv_both", extra)
    b = LayerInstance(tiny_llama, "KvpoolStoreConnector", "kv_both", extra)
    try:
        a.stop_after = 1  # layer 0 computed and saved, layer 1 never reached
        a.add("a1", PROMPT, 1, None)
        out = a.step_until(lambda out: "a1" in out.kv_connector_metadata.layer_saves)
        assert len(out.kv_connector_metadata.layer_saves["a1"]) == 2
        keys = block_keys(a.connector._scheduler.namespace, PROMPT, BS)
        store = a.connector._scheduler.store
        w = a.worker._worker
        # Layer 0's objects were written, yet no block is visible as a hit.
        layer0 = [f"{k}/{w.layout}/{LAYERS[0]}" for k in keys]
        assert all(store.batch_exists(layer0))
        time.sleep(0.3)  # a late commit would land within this
        assert not any(store.batch_exists(keys))
        assert w.saved_blocks == 0
        # Another instance computes the prompt itself (no hit, no load).
        b.add("b1", PROMPT, 1, None)
        assert b.lookup(b.scheduler.requests["b1"]) == (0, False)
    finally:
        a.close()
        b.close()


def test_per_request_mode_stays_the_default(tiny_llama: Path, master: str) -> None:  # noqa: F811
    a = LayerInstance(tiny_llama, "KvpoolStoreConnector", "kv_both", {"master": master, "model_tag": "lw3"})
    try:
        a.add("a1", PROMPT, 1, None)
        out = a.step_until(lambda out: "a1" in out.num_scheduled_tokens)
        assert not out.kv_connector_metadata.layer_saves
        a.run_until(lambda o: a.free_blocks() == a.idle_free)
        assert a.worker._worker.saved_blocks == 2  # saved after the request finished
    finally:
        a.close()


def test_a_layer_is_saved_only_once_its_kv_is_written() -> None:
    """LayerSaves runs a layer's ``written`` wait (a CUDA event recorded in ``save_kv_layer``:
    the attention kernel is only enqueued then) on the save thread before reading the layer;
    a wait that fails keeps the step's blocks out of the store (no commit marker)."""
    import threading

    from kvpool.connectors.vllm.common import Region
    from kvpool.connectors.vllm.layerwise import LayerSaves

    order: list[str] = []
    gate = threading.Event()

    def run(job):  # noqa: ANN001, ANN202 - the save thread, which logs a failed job and goes on
        def quiet() -> None:
            try:
                job()
            except RuntimeError:
                pass

        threading.Thread(target=quiet).start()

    saves = LayerSaves(
        run, lambda blocks, regions: order.append("put") or set(), lambda b: order.append("commit")
    )
    saves.set_regions([Region("model.layers.0.self_attn.attn", 4096, 64, 64, 4)])
    saves.begin([(1, "k1")])

    def kernel_done() -> None:
        gate.wait(5)
        order.append("written")

    saves.layer("model.layers.0.self_attn.attn", kernel_done)
    threading.Timer(0.2, gate.set).start()
    saves.finish()
    deadline = time.monotonic() + 5
    while "commit" not in order and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == ["written", "put", "commit"]

    def lost() -> None:
        raise RuntimeError("device lost")

    order.clear()
    saves.begin([(2, "k2")])
    saves.layer("model.layers.0.self_attn.attn", lost)
    saves.finish()
    time.sleep(0.2)
    assert order == []  # neither read nor committed


def test_an_unexpected_error_in_a_layer_load_fails_its_blocks(
    tiny_llama: Path,  # noqa: F811
    master: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An in-forward layer load that raises something other than a kvpool error: its blocks are
    reported to vLLM as failed (recomputed), never taken as loaded with whatever bytes they held."""
    extra = {"master": master, "model_tag": "lw-err", "layerwise": True, "load_async": False}
    b = LayerInstance(tiny_llama, "KvpoolStoreConnector", "kv_both", extra)
    try:
        w = b.worker._worker
        calls = []

        def second_layer_breaks(keys: list[str], addrs: list[int], sizes: list[int]) -> list[int]:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected")
            return list(sizes)  # the first layer's objects all read in full

        monkeypatch.setattr(w.store, "batch_get_into", second_layer_breaks)
        keys = block_keys(w.namespace, PROMPT, BS)
        w.layer_loads.begin([(3, keys[0]), (4, keys[1])])
        for name in LAYERS:
            w.wait_layer_load(name)
        w.finish_step()
        assert len(calls) == len(LAYERS) == 2
        assert w.take_load_errors() == {3, 4}
    finally:
        b.close()


def test_blocks_computed_on_a_failed_in_forward_load_are_not_committed(
    tiny_llama: Path,  # noqa: F811
    master: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step whose in-forward load failed computes its later blocks on top of whatever the
    failed blocks held (vLLM learns of the failure only after the forward pass, then recomputes
    them): those later blocks, saved layer by layer in the same step, must get no commit marker,
    or every instance would load KV computed from a garbage prefix under the right keys."""
    extra = {"master": master, "model_tag": "lw-poison", "layerwise": True, "load_async": False}
    a = LayerInstance(tiny_llama, "KvpoolStoreConnector", "kv_both", extra)
    b = LayerInstance(tiny_llama, "KvpoolStoreConnector", "kv_both", extra)
    try:
        a.add("a1", PROMPT, 1, None)
        a.run_until(lambda o: "a1" in o and o["a1"].finish_reason is not None)
        _wait_exists(a, block_keys(a.connector._scheduler.namespace, PROMPT, BS), True)
        w = b.worker._worker
        # Every object b reads comes back one byte short: a failed load of both hit blocks.
        monkeypatch.setattr(w.store, "batch_get_into", lambda keys, addrs, sizes: [n - 1 for n in sizes])
        prompt_b = PROMPT[:64] + [(i * 11) % 500 + 3 for i in range(80)]  # 4 full blocks + 16
        b.add("b1", prompt_b, 1, None)
        out = b.step_until(lambda out: "b1" in out.kv_connector_metadata.loads)
        meta = out.kv_connector_metadata
        assert len(meta.loads["b1"]) == 2
        later = [k for _, k in meta.layer_saves["b1"]]
        assert later == block_keys(b.connector._scheduler.namespace, prompt_b, BS)[2:4]
        store = b.connector._scheduler.store
        time.sleep(0.3)  # a commit queued at the step's end would land within this
        assert not any(store.batch_exists(later))  # none became a hit
        assert w.saved_blocks == 0
        # Nor were their layer objects written: an uncommitted object is taken as stored by the
        # next save of the same block (ObjectExists), whose marker would then make it a hit.
        layer_objs = [f"{w._key(k)}/{w.layout}/{n}" for k in later for n in LAYERS]
        assert not any(store.batch_exists(layer_objs))
    finally:
        a.close()
        b.close()
