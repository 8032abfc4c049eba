"""A fingerprint of the checkpoint an engine serves, for the store connectors' key namespaces.

Store keys name the model by what the server is called (vLLM's ``served_model_name``, an alias
that two different checkpoints can share) or by its path (which a redeploy can fill with other
weights). KV computed by one checkpoint and read by another makes the model answer wrongly with
HTTP 200, so the namespace also carries :func:`checkpoint_tag`, a digest of the files the loader
reads: ``config.json`` and the weight files at the top of the checkpoint directory (its
``*.safetensors`` where there are any, else its ``*.bin`` / ``*.pt`` / ``*.pth`` / ``*.gguf``; a
single file given as the model is that file), each by name, size and **whole content**:

- a file of the Hugging Face cache (a snapshot's symlink to ``models--*/blobs/<sha256>``) by the
  blob's name, which is its content's SHA-256 (nothing read);
- any other by its xxh3-128, read once per node and kept in ``~/.cache/kvpool/checkpoints.json``
  (``$XDG_CACHE_HOME``) under its real path, size, mtime, ctime, inode and device (ctime cannot
  be set back by a copy tool, so a file replaced by another of the same size and mtime on a
  reused inode is read again); the digest is kept only if the file did not change while it was
  read. Processes starting together on a node take turns (a lock beside the cache file), so one
  reads and the others find its digests.

Other weights under the same name or path never share a namespace; the same checkpoint at another
path does (two plain copies, or two Hugging Face caches). A hub id is resolved through the local
Hugging Face cache, ``download_dir`` when the server was given one (never the network); a model
with nothing readable here is tagged by its name and revision (logged: then only the name tells
checkpoints apart), a file that cannot be read by its name and error. Computed once per process
and model (``functools.lru_cache``), by the connector's scheduler and worker halves alike, at
start-up, never on an engine's hot path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import xxhash

__all__ = ["checkpoint_tag"]

log = logging.getLogger("kvpool.connectors")

_PREFERRED = (".safetensors",)
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf", ".ckpt")
_BLOB = re.compile(r"^[0-9a-f]{64}$")  # a Hugging Face cache blob of an LFS file: its SHA-256
_READ = 8 << 20
_CACHE_MAX = 16 << 20  # a digest cache file bigger than this is not ours: ignored


def _local(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The checkpoint's local directory or file: ``model`` itself, or a hub id's snapshot in the
    local Hugging Face cache (``download_dir`` when given; no download); None when neither exists."""
    p = Path(model).expanduser()
    if p.exists():
        return p
    try:
        from huggingface_hub import snapshot_download

        got = snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
        return Path(got)
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
    """The node's digests; empty when missing, unreadable, too big or not what we wrote."""
    path = _cache_path()
    try:
        if path.stat().st_size > _CACHE_MAX:
            return {}
        data = json.loads(path.read_text())
    except Exception:  # noqa: BLE001 - missing, unreadable, corrupt (deeply nested: RecursionError)
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _save_cache(cache: dict[str, str]) -> None:
    """Best effort, atomically, without the entries of files that are gone."""
    path = _cache_path()
    kept = {}
    for k, v in cache.items():
        try:
            if os.path.exists(json.loads(k)[0]):
                kept[k] = v
        except (ValueError, TypeError, IndexError, KeyError):
            continue
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".checkpoints.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(kept, fh)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.debug("kvpool: checkpoint digest cache not written (%s)", exc)


@contextlib.contextmanager
def _node_lock() -> Iterator[None]:
    """One process of the node at a time reads and writes the cache (and hashes what it lacks):
    the scheduler and the TP workers starting together read a checkpoint once, not each."""
    try:
        _cache_path().parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(_cache_path().with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield  # no cache directory: every process reads for itself
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _is_hf_blob(f: Path, real: Path) -> bool:
    """``f`` is a Hugging Face cache snapshot entry pointing at ``models--*/blobs/<sha256>``."""
    return (
        f.is_symlink() and bool(_BLOB.match(real.name)) and real.parent.name == "blobs"
        and real.parent.parent.name.startswith("models--")
    )  # fmt: skip


def _content(f: Path, cache: dict[str, str]) -> tuple[str, int, bool]:
    """(digest of ``f``'s content, its size, whether ``cache`` gained an entry)."""
    real = f.resolve()
    st = real.stat()
    if _is_hf_blob(f, real):
        return "sha256:" + real.name, st.st_size, False

    def stamp(s: os.stat_result) -> list[int]:
        return [s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino, s.st_dev]

    key = json.dumps([str(real), *stamp(st)])
    hit = cache.get(key)
    if hit is not None:
        return hit, st.st_size, False
    h = xxhash.xxh3_128()
    t0 = time.monotonic()
    with real.open("rb") as fh:
        while chunk := fh.read(_READ):
            h.update(chunk)
    if st.st_size > 1 << 30:
        log.info("kvpool: fingerprinted %s (%d bytes) in %.1f s", real, st.st_size, time.monotonic() - t0)
    digest = "xxh3:" + h.hexdigest()
    if stamp(real.stat()) != stamp(st):  # written while read: this digest is of no one version
        return "changing:" + digest, st.st_size, False
    cache[key] = digest
    return digest, st.st_size, True


@functools.lru_cache(maxsize=16)
def checkpoint_tag(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """16 hex digits naming the checkpoint's content (see the module docstring)."""
    h = hashlib.blake2b(digest_size=8)
    root = _local(model, revision, download_dir)
    files = _files(root) if root is not None else []
    if root is None or not [f for f in files if f.name != "config.json"]:
        log.warning(
            "kvpool: no local weights found for %r: store keys tell checkpoints apart by that name "
            "(and revision) only", model,
        )  # fmt: skip
        h.update(json.dumps(["name", model, revision]).encode())
    with _node_lock():
        cache, dirty = _load_cache(), False
        for f in files:
            try:
                digest, size, added = _content(f, cache)
                entry: list[object] = [f.name, size, digest]
                dirty = dirty or added
            except OSError as exc:  # unreadable or gone: named, not read (the loader will say more)
                entry = [f.name, "unreadable", type(exc).__name__]
            h.update(json.dumps(entry).encode())
        if dirty:
            _save_cache(cache)
    return h.hexdigest()
