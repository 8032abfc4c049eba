"""A fingerprint of the checkpoint an engine serves, for the store connectors' key namespaces.

Store keys name the model by what the server is called (vLLM's ``served_model_name``, an alias
that two different checkpoints can share) or by its path (which a redeploy can fill with other
weights). KV computed by one checkpoint and read by another makes the model answer wrongly with
HTTP 200, so the namespace also carries :func:`checkpoint_tag`, a digest of the files the loader
reads: ``config.json`` and the weight files at the top of the checkpoint directory (its
``*.safetensors`` where there are any, else its ``*.bin`` / ``*.pt`` / ``*.pth`` / ``*.gguf``; a
single file given as the model is that file), each by name, size and **whole content**:

- a file of the Hugging Face cache (a snapshot's symlink to ``blobs/<sha256>``) by the blob's
  name, which is its content's SHA-256 (nothing read);
- any other by its xxh3-128, read once per node and kept in ``~/.cache/kvpool/checkpoints.json``
  (``$XDG_CACHE_HOME``) under its real path, size, mtime, inode and device: a later start reads
  nothing; a file replaced or rewritten in place is read again.

Other weights under the same name or path never share a namespace, the same checkpoint at another
path does. A hub id is resolved through the local Hugging Face cache (never the network); a model
with nothing readable here is tagged by its name and revision, a file that cannot be read by its
name, size and error. Computed once per process and model (``functools.lru_cache``), by the
connector's scheduler and worker halves alike, at start-up, never on an engine's hot path.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

import xxhash

__all__ = ["checkpoint_tag"]

log = logging.getLogger("kvpool.connectors")

_PREFERRED = (".safetensors",)
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf", ".ckpt")
_BLOB = re.compile(r"^[0-9a-f]{64}$")  # a Hugging Face cache blob of an LFS file: its SHA-256
_READ = 8 << 20


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
    """What the loader reads: config.json and the top-level weights (see the module docstring)."""
    if root.is_file():
        return [root]
    try:
        top = sorted(f for f in root.iterdir() if f.is_file())
    except OSError:
        return []
    weights = [f for f in top if f.suffix in _PREFERRED] or [f for f in top if f.suffix in _OTHER_WEIGHTS]
    return [f for f in top if f.name == "config.json"] + weights


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvpool" / "checkpoints.json"


def _load_cache() -> dict[str, str]:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict[str, str]) -> None:
    """Best effort, atomically (a concurrent start writes the same digests)."""
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("kvpool: checkpoint digest cache not written (%s)", exc)


def _content(f: Path, cache: dict[str, str]) -> tuple[str, bool]:
    """(digest of ``f``'s content, whether ``cache`` gained an entry)."""
    real = f.resolve()
    if f.is_symlink() and _BLOB.match(real.name):
        return "sha256:" + real.name, False
    st = real.stat()
    key = json.dumps([str(real), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev])
    hit = cache.get(key)
    if hit is not None:
        return hit, False
    h = xxhash.xxh3_128()
    t0 = time.monotonic()
    with real.open("rb") as fh:
        while chunk := fh.read(_READ):
            h.update(chunk)
    if st.st_size > 1 << 30:
        log.info("kvpool: fingerprinted %s (%d bytes) in %.1f s", real, st.st_size, time.monotonic() - t0)
    cache[key] = "xxh3:" + h.hexdigest()
    return cache[key], True


@functools.lru_cache(maxsize=16)
def checkpoint_tag(model: str, revision: str | None = None) -> str:
    """16 hex digits naming the checkpoint's content (see the module docstring)."""
    h = hashlib.blake2b(digest_size=8)
    root = _local(model, revision)
    files = _files(root) if root is not None else []
    if root is None or not [f for f in files if f.name != "config.json"]:
        h.update(json.dumps(["name", model, revision]).encode())  # nothing (else) local to read
    cache, dirty = _load_cache(), False
    for f in files:
        try:
            digest, added = _content(f, cache)
            entry = [f.name, f.stat().st_size, digest]
            dirty = dirty or added
        except OSError as exc:  # unreadable or gone: named, not read (the loader will say more)
            entry = [f.name, "unreadable", type(exc).__name__]
        h.update(json.dumps(entry).encode())
    if dirty:
        _save_cache(cache)
    return h.hexdigest()
