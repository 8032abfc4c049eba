"""kvpool.connectors.checkpoint.checkpoint_tag: the checkpoint fingerprint in the store
connectors' key namespaces (two checkpoints served under one name must never share KV)."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvpool.connectors.checkpoint import CHUNK, SAMPLES, checkpoint_tag


def _checkpoint(root: Path, seed: int, big: int = 3 * SAMPLES * CHUNK) -> Path:
    """A checkpoint directory: config.json, one weight file bigger than the sampled bytes (so it
    is sampled, not read whole) and one small one, contents from ``seed``."""
    import random

    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    rng = random.Random(seed)
    (root / "model-00001-of-00002.safetensors").write_bytes(rng.randbytes(big))
    (root / "model-00002-of-00002.safetensors").write_bytes(rng.randbytes(4096))
    (root / "README.md").write_text("not part of the fingerprint")
    return root


def test_two_checkpoints_differ_and_a_copy_elsewhere_is_the_same(tmp_path: Path) -> None:
    base = _checkpoint(tmp_path / "base", seed=1)
    tuned = _checkpoint(tmp_path / "tuned", seed=2)  # same names, sizes and config: other weights
    copy = tmp_path / "mnt" / "other" / "path"
    shutil.copytree(base, copy)
    (copy / "README.md").write_text("edited: not a weight file")
    assert checkpoint_tag(str(base)) != checkpoint_tag(str(tuned))
    assert checkpoint_tag(str(copy)) == checkpoint_tag(str(base))
    assert len(checkpoint_tag(str(base))) == 16


def test_sampled_content_config_and_file_set_count(tmp_path: Path) -> None:
    """A change in a sampled chunk of a big weight file, anywhere in a small one, in
    config.json, a weight file added or renamed: another tag each."""
    big = 3 * SAMPLES * CHUNK
    tags = set()
    for i, edit in enumerate(("none", "big", "small", "config", "added", "renamed")):
        root = _checkpoint(tmp_path / f"c{i}", seed=7, big=big)
        w1, w2 = root / "model-00001-of-00002.safetensors", root / "model-00002-of-00002.safetensors"
        if edit == "big":  # the last sample ends at the file's end
            data = bytearray(w1.read_bytes())
            data[-1] ^= 0xFF
            w1.write_bytes(bytes(data))
        elif edit == "small":
            data = bytearray(w2.read_bytes())
            data[2000] ^= 1
            w2.write_bytes(bytes(data))
        elif edit == "config":
            (root / "config.json").write_text('{"model_type": "llama", "hidden_size": 65}')
        elif edit == "added":
            (root / "extra.bin").write_bytes(b"\0" * 10)
        elif edit == "renamed":
            w2.rename(root / "model-00002-of-00002.renamed.safetensors")
        tags.add(checkpoint_tag(str(root)))
    assert len(tags) == 6


def test_a_single_file_and_a_name_that_is_not_local(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    g = tmp_path / "other.gguf"
    g.write_bytes(b"GGUF" + bytes(range(256)) * 11)
    assert checkpoint_tag(str(f)) != checkpoint_tag(str(g))
    # neither a path nor a cached hub snapshot: named by its name and revision
    a = checkpoint_tag("no-such-org/no-such-model-kvpool-test")
    assert a == checkpoint_tag("no-such-org/no-such-model-kvpool-test")
    assert a != checkpoint_tag("no-such-org/no-such-model-kvpool-test", "v2")
    assert a != checkpoint_tag("no-such-org/another-kvpool-test")
