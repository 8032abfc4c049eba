"""LoRA isolation of the store connector on real vLLM CPU servers (issue 12).

Two servers share one kvpool store and serve the tiny random Llama with two random LoRA adapters
made offline (:func:`tests.vllm_support.build_tiny_lora`).  Equal prompts under another adapter
(or none) must get no external hit from each other's blocks, the same (prompt, adapter) on the
other server must hit every full block, and every output equals a single ordinary server's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.store.procs import MasterProcess, StorageProcess
from tests.test_vllm_e2e import KV_BYTES, completion, kv_config
from tests.vllm_support import VllmServer, build_tiny_lora, tiny_llama  # noqa: F401  (fixture)

pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")  # never skipped in CI

BLOCK = 32
PROMPT = [(i * 31 + 7) % 700 + 4 for i in range(200)]  # 6 full blocks
FULL = (len(PROMPT) - 1) // BLOCK * BLOCK  # tokens an external hit covers (not the last token)
MODELS = ("tiny", "lora-1", "lora-2")  # the base model and the two adapters


def lora_args(adapters: dict[str, Path]) -> list[str]:
    mods = [f"{name}={path}" for name, path in adapters.items()]
    return ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules", *mods]


@pytest.fixture(scope="module")
def servers(
    tiny_llama: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[VllmServer, VllmServer, VllmServer]]:
    """(single, a, b): an ordinary server and two store-connector servers, all with both adapters,
    started together."""
    base = tmp_path_factory.mktemp("vllm-lora")
    adapters = {f"lora-{i}": build_tiny_lora(base / f"lora-{i}", tiny_llama, seed=i) for i in (1, 2)}
    with MasterProcess() as m, StorageProcess(m.address, 128 << 20):
        extra = kv_config("KvpoolStoreConnector", "kv_both", short_name=True, master=m.address)
        common = {"kv_cache_bytes": KV_BYTES, "max_num_seqs": 4}
        lora = lora_args(adapters)
        single = VllmServer(tiny_llama, base, name="lora-single", extra_args=lora, **common)
        a = VllmServer(tiny_llama, base, name="lora-a", cpu=0, extra_args=extra + lora, **common)
        b = VllmServer(tiny_llama, base, name="lora-b", cpu=1, extra_args=extra + lora, **common)
        procs = (single, a, b)
        for s in procs:
            s.start()
        try:
            for s in procs:
                s.wait_ready()
            yield single, a, b
        finally:
            for s in procs:
                s.stop()


def _text(server: VllmServer, model: str) -> str:
    return completion(server.url, PROMPT, model=model)["choices"][0]["text"]


def _wait_saves(server: VllmServer, count: int) -> None:
    deadline = time.monotonic() + 30
    while server.log_path.read_text().count("kvpool store: saved") < count and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.log_path.read_text().count("kvpool store: saved") >= count


def test_lora_adapters_get_no_hit_from_each_others_blocks(
    servers: tuple[VllmServer, VllmServer, VllmServer],
) -> None:
    single, a, b = servers
    reference = {model: _text(single, model) for model in MODELS}
    # The adapters change the output (else this test could not tell the KV apart).
    assert len(set(reference.values())) == 3, reference

    # Server A computes and saves the prompt under adapter 1 only.
    assert _text(a, "lora-1") == reference["lora-1"]
    _wait_saves(a, 1)
    hits0 = b.metric("vllm:external_prefix_cache_hits")
    # The base model and the other adapter on B: nothing from lora-1's blocks, outputs unchanged.
    for model in ("tiny", "lora-2"):
        assert _text(b, model) == reference[model], model
        assert b.metric("vllm:external_prefix_cache_hits") == hits0, f"{model} hit lora-1's blocks"
    # The same (prompt, adapter) on B: every full block comes from the store.
    assert _text(b, "lora-1") == reference["lora-1"]
    assert b.metric("vllm:external_prefix_cache_hits") - hits0 == FULL

    # And the other way round: base blocks saved by B (above) serve the base model on A only.
    _wait_saves(b, 2)  # B saved the base and lora-2 prompts
    hits_a = a.metric("vllm:external_prefix_cache_hits")
    assert _text(a, "tiny") == reference["tiny"]
    assert a.metric("vllm:external_prefix_cache_hits") - hits_a == FULL
    assert _text(a, "lora-2") == reference["lora-2"]
    assert a.metric("vllm:external_prefix_cache_hits") - hits_a == 2 * FULL
