"""The SSD tier's object files: ``ssd_dir/xx/<sha1 of key>-<generation>-<token>.kvp`` (magic, size,
xxh3-64, key, value); the master names each spill's file, with a random token of its own, so no
two copies ever share a path (files named before, without the token, are still swept).

Written to a temporary file, fsynced and renamed, so a reader sees a whole file or none (a failed
write removes its temporary file; one of a process killed mid-write stays, never read); a reader
checks the key, size and checksum, and treats any mismatch as a miss.

Files no copy has (a spill whose report was lost, copies of a client that came back under another
id or never) are removed by the directory's client: :func:`sweep_ssd_dir`, run on its task thread.
"""

from __future__ import annotations

import errno
import os
import re
import struct
import time
import uuid
from collections.abc import Callable

import xxhash

_SSD_MAGIC = b"KVPSSD01"
_SSD_HDR = struct.Struct("<8sQQI")  # magic, size, xxh3_64, key length


def write_ssd_file(path: str, key: str, data: memoryview | bytes) -> str:
    """Write an object file atomically; returns its xxh3-64 hex checksum."""
    digest = xxhash.xxh3_64_intdigest(data)
    kb = key.encode()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(_SSD_HDR.pack(_SSD_MAGIC, len(data), digest, len(kb)))
            f.write(kb)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # A failed write (disk full, EIO, file size limit) leaves no partial file behind: on a
        # full disk every failed spill would otherwise keep its bytes, and the disk stays full.
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return f"{digest:016x}"


def read_ssd_file(
    path: str, key: str, size: int, checksum: str, why: list[str] | None = None
) -> bytes | None:
    """Read and verify an SSD-tier file; None when missing, truncated or corrupt. ``why`` (when
    given) gets ``"corrupt"`` for a file that is there but is not this object's (truncated,
    another size or key, a checksum mismatch) or that the disk failed to read (EIO), else
    ``"missing"`` when it is not there (ENOENT, ENOTDIR), ``"unreadable"`` for another error
    (EMFILE, EACCES, ESTALE...: the file may be fine)."""
    try:
        with open(path, "rb") as f:
            hdr = f.read(_SSD_HDR.size)
            magic, n, digest, klen = _SSD_HDR.unpack(hdr)
            if magic != _SSD_MAGIC or n != size or f.read(klen) != key.encode():
                return _bad(why, "corrupt")
            data = f.read(n + 1)
    except struct.error:
        return _bad(why, "corrupt")
    except OSError as exc:
        if exc.errno == errno.EIO:
            return _bad(why, "corrupt")
        return _bad(why, "missing" if exc.errno in (errno.ENOENT, errno.ENOTDIR) else "unreadable")
    if len(data) != size or xxhash.xxh3_64_intdigest(data) != digest or f"{digest:016x}" != checksum:
        return _bad(why, "corrupt")
    return data


def _bad(why: list[str] | None, reason: str) -> None:
    if why is not None:
        why.append(reason)
    return None


_SUBDIR = re.compile(r"[0-9a-f]{2}")
# What the master's spills name (see upkeep: Upkeep._spill); the token is optional, as the files
# of earlier versions (named without it) are this tier's too.
_NAME = r"[0-9a-f]{40}-[0-9]+(?:-[0-9a-f]{16})?\.kvp"
_FILE = re.compile(_NAME)
_TMP = re.compile(_NAME + r"\.[0-9a-f]{32}\.tmp")  # a write killed midway
SWEEP_MAX_FILES = 65536  # files one sweep looks at (the next sweep sees the others)
SWEEP_BATCH = 512  # names per question to the master
# ssd_dir -> the subdirectory the next sweep starts at (where the last one reached its cap)
_resume: dict[str, str] = {}


def sweep_ssd_dir(
    ssd_dir: str,
    unknown: Callable[[list[str]], tuple[list[str], float]],
    batch: int = SWEEP_BATCH,
    budget_s: float | None = None,
) -> int:
    """Remove the SSD-tier files of ``ssd_dir`` that no SSD copy has; returns how many.

    ``unknown(names)`` asks the master which file names (at most ``batch``) none of its
    SSD copies has, and the grace period: only files older than it are removed (a spill's file
    is that old only once its report was taken or refused). Only names this tier writes, in its
    two-hex-digit subdirectories, are touched; other files stay. A file replaced since it was
    looked at (another inode or time) stays. Called on the store client's task thread, which
    also runs its spills (none writes meanwhile), at most :data:`SWEEP_MAX_FILES` files and
    about ``budget_s`` seconds a call: the spills and copies queued behind it must start before
    the master gives up on them (its ``task_timeout_s``; by default the budget is min(2 s, a
    tenth of it), the grace being twice it and a second). Its first subdirectory is seen to
    whole (a sweep stopped in it is taken up past it, the rest of it left for a full round).
    A sweep stopped by either limit is taken up where it stopped by the next one."""
    t0 = time.monotonic()
    _, grace = unknown([])
    deadline = t0 + (min(2.0, grace / 20) if budget_s is None else budget_s)
    cutoff = time.time() - grace
    # (index in subs, path, stat, temporary?) of files older than the grace, in sweep order
    found: list[tuple[int, str, os.stat_result, bool]] = []
    seen = 0
    stop: int | None = None  # index in subs of the subdirectory the sweep stopped in
    try:
        with os.scandir(ssd_dir) as it:
            subs = sorted(e.name for e in it if _SUBDIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
    except OSError:
        return 0
    # From where the last sweep stopped, around: else, in a directory of more files than the
    # cap (or than a sweep gets through in its budget), each sweep looked at the same first ones
    after = _resume.pop(ssd_dir, "")
    start = next((i for i, n in enumerate(subs) if n >= after), 0)
    subs = subs[start:] + subs[:start]
    for i, name in enumerate(subs):
        if seen >= SWEEP_MAX_FILES:
            stop = i - 1  # the one that reached the cap
            break
        sub = os.path.join(ssd_dir, name)
        try:
            with os.scandir(sub) as it:
                for e in it:
                    if seen >= SWEEP_MAX_FILES:
                        break
                    if i and time.monotonic() >= deadline:
                        stop = i
                        break
                    is_file, is_tmp = _FILE.fullmatch(e.name), _TMP.fullmatch(e.name)
                    if not (is_file or is_tmp):
                        continue
                    seen += 1
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue  # removed since it was listed (the rest of the directory is looked at)
                    if st.st_mtime < cutoff:
                        found.append((i, e.path, st, not is_file))
        except OSError:
            continue  # the next sweep looks again
        if stop is not None:
            break
    removed, pos = 0, 0
    while pos < len(found) and not (found[pos][0] and time.monotonic() >= deadline):
        chunk = found[pos : pos + batch]
        ask = [os.path.basename(p) for _, p, _, tmp in chunk if not tmp]
        names = set(unknown(ask)[0]) if ask else set()
        for j, (i, path, st, tmp) in enumerate(chunk):
            if i and j and time.monotonic() >= deadline:
                break  # (at least one file of each answer is seen to)
            pos += 1
            # a temporary file that old is a write that never finished
            if tmp or os.path.basename(path) in names:
                removed += _remove_unchanged(path, st)
    if pos < len(found):
        stop = found[pos][0]  # its files (and those after it) not seen to: the next sweep's
    if stop is not None:
        # the next sweep starts at the one it stopped in (past it when it was the first: one of
        # more files than the cap, or than a sweep gets through in its budget)
        _resume[ssd_dir] = subs[max(stop, 1) % len(subs)]
    return removed


def _remove_unchanged(path: str, st: os.stat_result) -> int:
    """Unlink ``path`` unless it was written again since ``st`` was taken; 1 if it did."""
    try:
        now = os.stat(path, follow_symlinks=False)
        if (now.st_ino, now.st_mtime_ns) != (st.st_ino, st.st_mtime_ns):
            return 0  # written again since
        os.unlink(path)
        return 1
    except OSError:
        return 0
