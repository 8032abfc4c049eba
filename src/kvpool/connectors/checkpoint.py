"""A fingerprint of the checkpoint an engine serves, for the store connectors' key namespaces.

Store keys name the model by what the server is called (vLLM's ``served_model_name``, an alias
that two different checkpoints can share) or by its path (which a redeploy can fill with other
weights). KV computed by one checkpoint and read by another makes the model answer wrongly with
HTTP 200, so the namespace also carries :func:`checkpoint_tag`: a digest of the checkpoint's
local files — each weight file's name, size and content sampled at evenly spaced offsets
(``SAMPLES`` chunks of ``CHUNK`` bytes; a file no bigger is read whole), and ``config.json``
whole. Two fine-tunes of one base model differ in every tensor, so the samples differ; the same
checkpoint copied to another path gives the same tag (the path is not in it). A hub id is
resolved through the local Hugging Face cache (never the network); a model that cannot be read
locally is tagged by its name and revision. Computed once per process and model (a few MiB
read at start-up: ``SAMPLES`` x ``CHUNK`` per weight file), by the connector's scheduler and
worker halves alike, before any key is made.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

__all__ = ["CHUNK", "SAMPLES", "checkpoint_tag"]

SAMPLES = 16
CHUNK = 64 << 10
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
_WHOLE = ("config.json",)


def _local(model: str, revision: str | None) -> Path | None:
    """The checkpoint's local directory or file: ``model`` itself, or a hub id's snapshot in the
    local Hugging Face cache (no download); None when neither exists."""
    p = Path(model).expanduser()
    if p.exists():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub id, not cached, or no huggingface_hub
        return None


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    found = [f for f in root.rglob("*") if f.is_file() and (f.suffix in _WEIGHTS or f.name in _WHOLE)]
    return sorted(found, key=lambda f: f.relative_to(root).as_posix())


@functools.lru_cache(maxsize=16)
def checkpoint_tag(model: str, revision: str | None = None) -> str:
    """16 hex digits naming the checkpoint's content (see the module docstring)."""
    h = hashlib.blake2b(digest_size=8)
    root = _local(model, revision)
    files = _files(root) if root is not None else []
    if not files:  # nothing local to read: the name the server was started with
        h.update(json.dumps(["name", model, revision]).encode())
        return h.hexdigest()
    for f in files:
        size = f.stat().st_size
        name = f.name if root is None or root.is_file() else f.relative_to(root).as_posix()
        h.update(json.dumps([name, size]).encode())
        with f.open("rb") as fh:
            if size <= SAMPLES * CHUNK or f.name in _WHOLE:
                h.update(fh.read())
                continue
            for i in range(SAMPLES):
                fh.seek((size - CHUNK) * i // (SAMPLES - 1))
                h.update(fh.read(CHUNK))
    return h.hexdigest()
