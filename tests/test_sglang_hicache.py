"""KvpoolHiCacheStorage with SGLang's real host pool and backend factory, against a kvpool master
and storage server in other processes; writer and reader are different processes."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.store.procs import MasterProcess, StorageProcess
from tests.sglang_support import ROOT, SGLANG_ENV, sglang_python

PROC = str(ROOT / "tests" / "sglang_hicache_proc.py")


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    with MasterProcess() as m, StorageProcess(m.address, 64 << 20):
        yield m.address


def run(role: str, master: str, n: int, *more: object) -> dict:
    env = dict(os.environ, **SGLANG_ENV)
    out = subprocess.run(
        [sglang_python(), PROC, role, master, str(n), *map(str, more)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_hicache_pages_written_by_one_process_are_read_by_another(master: str) -> None:
    w = run("write", master, 12)
    assert w["backend"] == "KvpoolHiCacheStorage"
    assert w["before"] == 0
    assert w["set"] == [True] * 12 and w["set_again"] == [True] * 12
    assert w["exists"] == 12 and w["exists_with_gap"] == 3  # leading-run semantics
    assert w["legacy_set"] is True and w["legacy_get"] is True
    r = run("read", master, 12)
    assert r["exists"] == 12 and r["get"] == [True] * 12
    assert r["digests"] == w["digests"]  # every byte of K and V of every page
    assert r["missing"] == [False]
    assert r["other_layout_exists"] == 0  # fp16 pool vs bf16 objects: the layout is in the key
    assert r["short"] == [False, True]  # a shorter object fails its page only


def test_two_checkpoints_at_one_path_or_name_never_share_keys(master: str, tmp_path: Path) -> None:
    """SGLang names the model by its path (``model_path``, or ``model_path-<format tag>``): the
    key prefix adds a fingerprint of the checkpoint's files, so other weights under the same
    name - a redeploy into the same path, another fine-tune - are other keys, and the same
    checkpoint copied elsewhere fingerprints the same."""
    import shutil

    base, tuned = tmp_path / "base", tmp_path / "tuned"
    for d, fill in ((base, b"a"), (tuned, b"b")):
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "model.safetensors").write_bytes(fill * 4096)
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    names = [str(base), str(tuned), str(copy), f"{base}-page_first", "not-a-path/model"]
    p = run("prefixes", master, 0, *names)["prefixes"]
    assert len(p) == 5 and all("+ckpt-" in x for x in p)
    ckpt = [x.split("+ckpt-")[1] for x in p]
    assert ckpt[0] != ckpt[1]  # other weights: other keys
    assert ckpt[0] == ckpt[2] == ckpt[3]  # a copy, and the name with SGLang's format tag
    assert p[0] != p[2]  # the path itself stays in the key (as before)
    (base / "model.safetensors").write_bytes(b"c" * 4096)  # redeployed in place: a new process sees it
    again = run("prefixes", master, 0, str(base))["prefixes"][0]
    assert again != p[0]


def test_mla_pages_are_stored_once_for_all_tp_ranks(master: str) -> None:
    """SGLang's MLA host pool (one latent row per token, the same on every TP rank): rank 0 of 2
    writes each page as one object; rank 1, in another process, finds every page already stored
    (nothing to write: the cache is moved and stored once, not per rank) and reads back the very
    bytes rank 0 wrote into other host slots."""
    w = run("pages-write", master, 6, "mla", "page_first", 0, 2)
    assert w["parts"] == ["_k"] and w["objects"] == 6  # one object per page
    assert w["before"] == 0 and w["set"] == [True] * 6 and w["exists"] == 6
    r = run("pages-read", master, 6, "mla", "page_first", 1, 2)
    assert r["before"] == 6  # rank 1 sees rank 0's pages
    assert r["get"] == [True] * 6 and r["digests"] == w["digests"]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_layer_first_host_pools_store_every_buffer_of_a_page(master: str, kind: str) -> None:
    """A layer-first host pool gives one buffer per layer (and K/V half) for each page: every
    one is its own object, so all of a page's bytes go to the store and come back (before, only
    two per page were named and such pools failed every page)."""
    n = 4
    w = run("pages-write", master, n, kind, "layer_first", 0, 1)
    per = 4 * (1 if kind == "mla" else 2)  # 4 layers in the test pools
    assert w["parts"] == [f"_p{i}" for i in range(per)] and w["objects"] == n * per
    assert w["set"] == [True] * n and w["exists"] == n
    r = run("pages-read", master, n, kind, "layer_first", 0, 1)
    assert r["get"] == [True] * n and r["digests"] == w["digests"]  # every layer of every page


def _kept_apart(master: str, writer: tuple, other: tuple, same: tuple, n: int = 3) -> None:
    """A ``pages-write`` process with ``writer``'s arguments stores ``n`` pages; a ``pages-read``
    one with ``other``'s finds none of them, one with ``same``'s reads them back byte for byte."""
    w = run("pages-write", master, n, *writer)
    assert w["set"] == [True] * n and w["exists"] == n
    out = run("pages-read", master, n, *other)
    assert out["before"] == 0 and out["get"] == [False] * n
    back = run("pages-read", master, n, *same)
    assert back["before"] == n and back["get"] == [True] * n and back["digests"] == w["digests"]


def test_pipeline_stages_with_other_layers_share_no_pages(master: str) -> None:
    """Pipeline stage 1 of a 12-layer model split 8 + 4 (layers 8-11) stores its pages; stage 1
    of the same model split 4 + 4 + 4 (layers 4-7: the same stage rank, TP rank and layer count)
    finds none of them (the old key named the stage rank only: it read layers 8-11's KV as its
    own layers 4-7); a stage with the writer's layers reads them back byte for byte."""
    layers = ("mha", "page_first", 0, 1)  # then: first layer, stage rank, stages, CP rank, CP size
    _kept_apart(master, (*layers, 8, 1, 2, 0, 1), (*layers, 4, 1, 3, 0, 1), (*layers, 8, 1, 2, 0, 1))


def test_attention_cp_ranks_keep_their_own_slices_of_mla_pages(master: str) -> None:
    """Under attention context parallelism (NSA's CP) each CP rank holds a disjoint slice of every
    page: MLA pages, otherwise shared by all TP ranks, are stored per CP rank. CP rank 1 of 2
    finds none of CP rank 0's pages (the old key named no CP rank: it read rank 0's slice as its
    own); another TP rank of CP rank 0 reads them back byte for byte."""
    tp = ("mla", "page_first")  # then: TP rank, TP size, first layer, stage rank, stages, CP rank, CP size
    _kept_apart(master, (*tp, 0, 2, 0, 0, 1, 0, 2), (*tp, 0, 2, 0, 0, 1, 1, 2), (*tp, 1, 2, 0, 0, 1, 0, 2))


def test_decode_context_parallel_ranks_keep_their_own_slices_of_mla_pages(master: str) -> None:
    """Under decode context parallelism each DCP rank holds its own interleaved slice of every
    logical page's tokens: MLA pages, otherwise shared by all TP ranks, are stored per DCP rank.
    DCP rank 1 of 2 (TP rank 1) finds none of DCP rank 0's pages (the old key named no DCP rank:
    it read rank 0's tokens as its own); TP rank 2, DCP rank 0 of the next DCP group, reads
    them back byte for byte."""
    tp = ("mla", "page_first")  # then: TP rank, TP size, first layer, stage, stages, CP rank, CP size, DCP
    _kept_apart(
        master,
        (*tp, 0, 4, 0, 0, 1, 0, 1, 0, 2),
        (*tp, 1, 4, 0, 0, 1, 0, 1, 1, 2),
        (*tp, 2, 4, 0, 0, 1, 0, 1, 0, 2),
    )


def test_hicache_backend_needs_a_master() -> None:
    code = (
        "from kvpool.connectors.sglang.hicache import KvpoolHiCacheStorage\n"
        "from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig\n"
        "cfg = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, True, 'm', extra_config={})\n"
        "try:\n    KvpoolHiCacheStorage(cfg, {})\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    env = {k: v for k, v in dict(os.environ, **SGLANG_ENV).items() if k != "KVPOOL_MASTER"}
    out = subprocess.run([sglang_python(), "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert out.stdout.startswith("ConfigError") and "master" in out.stdout, out.stderr[-2000:]


def test_a_master_outage_is_a_miss_for_every_interface() -> None:
    """The master is SIGKILLed under a running backend: legacy get/set/exists and the v1
    batch_exists/get/set answer a miss or a failure, never an exception into SGLang (the legacy
    get and set raised); a get still served through a cached location has the right bytes."""
    with MasterProcess() as m, StorageProcess(m.address, 64 << 20):
        env = dict(os.environ, **SGLANG_ENV)
        p = subprocess.Popen([sglang_python(), PROC, "outage", m.address, "2"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        try:
            assert p.stdout is not None and p.stdin is not None
            line = p.stdout.readline()
            assert json.loads(line) == {"ready": True}, p.stderr.read() if p.stderr else ""
            m.kill()
            p.stdin.write("go\n")
            p.stdin.flush()
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            r = json.loads(out.strip().splitlines()[-1])
        finally:
            if p.poll() is None:
                p.kill()
    assert r["set_before"] == [True, True] and r["legacy_set_before"] is True
    assert r["legacy_get"] in ("miss", "right bytes") and r["legacy_set"] is False
    assert r["set"] == [False] and r["exists"] in (0, 2) and len(r["get"]) == 2
