"""kvpool.connectors.checkpoint.checkpoint_tag: the checkpoint fingerprint in the store
connectors' key namespaces (two checkpoints served under one name must never share KV)."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import pytest

from kvpool.connectors import checkpoint
from kvpool.connectors.checkpoint import checkpoint_tag


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private digest cache, and no tag remembered from another test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    checkpoint_tag.cache_clear()


def _checkpoint(root: Path, seed: int, size: int = 3 << 20) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    rng = random.Random(seed)
    (root / "model-00001-of-00002.safetensors").write_bytes(rng.randbytes(size))
    (root / "model-00002-of-00002.safetensors").write_bytes(rng.randbytes(4096))
    return root


def _flip(f: Path, at: int) -> None:
    data = bytearray(f.read_bytes())
    data[at] ^= 1
    f.write_bytes(bytes(data))


def test_one_changed_byte_anywhere_is_another_checkpoint_and_a_copy_is_the_same(tmp_path: Path) -> None:
    """Every byte of the weights counts (a knowledge edit touches one matrix in the middle of a
    shard); the path does not (the same weights elsewhere share KV)."""
    base = _checkpoint(tmp_path / "base", seed=1)
    edited = tmp_path / "edited"
    shutil.copytree(base, edited)
    _flip(edited / "model-00001-of-00002.safetensors", (3 << 20) // 2 + 12345)
    copy = tmp_path / "mnt" / "other" / "path"
    shutil.copytree(base, copy)
    tags = {checkpoint_tag(str(p)) for p in (base, edited)}
    assert len(tags) == 2
    assert checkpoint_tag(str(copy)) == checkpoint_tag(str(base))
    assert len(checkpoint_tag(str(base))) == 16
    config = tmp_path / "config-edited"
    shutil.copytree(base, config)
    (config / "config.json").write_text('{"model_type": "llama", "hidden_size": 65}')
    assert checkpoint_tag(str(config)) != checkpoint_tag(str(base))


def test_only_what_the_loader_reads_counts(tmp_path: Path) -> None:
    """Files vLLM does not load (a README, .bin copies beside the safetensors, an ``original/``
    folder, training checkpoints in subfolders) do not change the tag, so nodes that downloaded
    more or less of a repository agree."""
    base = _checkpoint(tmp_path / "base", seed=2)
    fuller = tmp_path / "fuller"
    shutil.copytree(base, fuller)
    (fuller / "README.md").write_text("notes")
    (fuller / "pytorch_model.bin").write_bytes(b"x" * 100)
    (fuller / "original").mkdir()
    (fuller / "original" / "consolidated.00.pth").write_bytes(b"y" * 100)
    (fuller / "checkpoint-100").mkdir()
    (fuller / "checkpoint-100" / "model.safetensors").write_bytes(b"z" * 100)
    assert checkpoint_tag(str(fuller)) == checkpoint_tag(str(base))
    bins = tmp_path / "bins"  # no safetensors: the .bin files are the weights
    bins.mkdir()
    (bins / "config.json").write_text("{}")
    (bins / "pytorch_model.bin").write_bytes(b"a" * 100)
    t1 = checkpoint_tag(str(bins))
    checkpoint_tag.cache_clear()
    (bins / "pytorch_model.bin").write_bytes(b"b" * 100)
    assert checkpoint_tag(str(bins)) != t1
    gguf = tmp_path / "model.gguf"  # a single file given as the model
    gguf.write_bytes(b"GGUF" + b"c" * 100)
    assert checkpoint_tag(str(gguf)) not in (t1, checkpoint_tag(str(base)))


def _hub_repo(cache: Path, repo: str, blob: str, content: bytes, commit: str = "c0ffee") -> Path:
    """A Hugging Face cache entry as huggingface_hub lays it out: models--org--name/{refs/main,
    blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>}; returns the snapshot."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / blob).write_bytes(content)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").symlink_to(Path("..") / ".." / "blobs" / blob)
    return snap


def test_hugging_face_cache_blobs_are_named_by_their_sha256(tmp_path: Path) -> None:
    """A snapshot's weight files are symlinks to ``models--*/blobs/<sha256 of the content>``: the
    blob's name is the content's digest, so nothing is read (here: equal names with different
    bytes give one tag, equal bytes under different names two). A 64-hex name elsewhere (not an
    HF blob) is read like any file."""
    a = _hub_repo(tmp_path / "a", "org/m", "1" * 64, b"one")
    b = _hub_repo(tmp_path / "b", "org/m", "1" * 64, b"two")
    c = _hub_repo(tmp_path / "c", "org/m", "2" * 64, b"one")
    assert checkpoint_tag(str(a)) == checkpoint_tag(str(b))
    assert checkpoint_tag(str(c)) != checkpoint_tag(str(a))
    plain = tmp_path / "store"  # a content store with hex names that is not an HF cache
    (plain / "objects").mkdir(parents=True)
    for name, content in (("x", b"one"), ("y", b"two")):
        (plain / "objects" / ("3" * 64 + name)).write_bytes(content)
    tags = set()
    for name in ("x", "y"):
        d = tmp_path / f"ck-{name}"
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").symlink_to(plain / "objects" / ("3" * 64 + name))
        tags.add(checkpoint_tag(str(d)))
    assert len(tags) == 2


def test_a_hub_id_is_found_in_the_servers_download_dir(tmp_path: Path) -> None:
    """vLLM's ``--download-dir`` (``load_config.download_dir``) is where the hub id's snapshot is:
    without it the id is not found and only its name would count."""
    pytest.importorskip("huggingface_hub", reason="installed with vLLM by scripts/test.sh")
    cache = tmp_path / "models"
    _hub_repo(cache, "org/kvpool-test-model", "4" * 64, b"w1")
    name_only = checkpoint_tag("org/kvpool-test-model")
    found = checkpoint_tag("org/kvpool-test-model", None, str(cache))
    assert found != name_only
    other = tmp_path / "models2"
    _hub_repo(other, "org/kvpool-test-model", "5" * 64, b"w2")
    assert checkpoint_tag("org/kvpool-test-model", None, str(other)) not in (found, name_only)


def test_digests_are_kept_per_node_until_a_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole-file digest is read once and kept under the file's real path, size, mtime, ctime
    and inode in $XDG_CACHE_HOME/kvpool/checkpoints.json: a later start reads nothing; a file
    rewritten in place with its mtime put back, or replaced by another of the same size and
    mtime (a copy tool restoring times, an inode reused), is read again (ctime moved)."""
    base = _checkpoint(tmp_path / "base", seed=3)
    first = checkpoint_tag(str(base))
    assert (tmp_path / "xdg" / "kvpool" / "checkpoints.json").exists()
    checkpoint_tag.cache_clear()
    with monkeypatch.context() as m:
        m.setattr(checkpoint.xxhash, "xxh3_128", lambda: pytest.fail("read again"))
        assert checkpoint_tag(str(base)) == first  # from the node's cache
    w = base / "model-00001-of-00002.safetensors"
    st = w.stat()
    time.sleep(0.01)
    with w.open("r+b") as fh:  # same inode, same size, mtime put back
        fh.seek(100)
        fh.write(b"\0" * 8)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    checkpoint_tag.cache_clear()
    rewritten = checkpoint_tag(str(base))
    assert rewritten != first
    data = w.read_bytes()
    st = w.stat()
    w.unlink()
    time.sleep(0.01)
    w.write_bytes(bytes(b ^ 1 for b in data[:64]) + data[64:])  # other bytes, same size and mtime
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    checkpoint_tag.cache_clear()
    assert checkpoint_tag(str(base)) not in (first, rewritten)


def test_a_corrupt_or_foreign_cache_file_is_ignored(tmp_path: Path) -> None:
    base = _checkpoint(tmp_path / "base", seed=5)
    good = checkpoint_tag(str(base))
    cache = tmp_path / "xdg" / "kvpool" / "checkpoints.json"
    for junk in ("[" * 100_000, "not json", '{"k": 1}', "[1, 2]"):
        cache.write_text(junk)
        checkpoint_tag.cache_clear()
        assert checkpoint_tag(str(base)) == good


def test_unreadable_files_and_names_with_nothing_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _checkpoint(tmp_path / "base", seed=4)
    readable = checkpoint_tag(str(base))
    real = checkpoint._content

    def denied(f: Path, cache: dict[str, str]) -> tuple[str, bool]:
        if f.name.startswith("model-00002"):
            raise PermissionError(13, "Permission denied")
        return real(f, cache)

    monkeypatch.setattr(checkpoint, "_content", denied)
    checkpoint_tag.cache_clear()
    assert checkpoint_tag(str(base)) != readable  # named, not read; start-up goes on
    monkeypatch.setattr(checkpoint, "_content", real)
    # neither a path nor a cached hub snapshot: named by its name and revision
    a = checkpoint_tag("no-such-org/no-such-model-kvpool-test")
    assert a == checkpoint_tag("no-such-org/no-such-model-kvpool-test")
    assert a != checkpoint_tag("no-such-org/no-such-model-kvpool-test", "v2")
    assert a != checkpoint_tag("no-such-org/another-kvpool-test")
