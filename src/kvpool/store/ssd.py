"""The SSD tier's object files: ``ssd_dir/xx/<sha1 of key>-<generation>-<token>.kvp`` (magic, size,
xxh3-64, key, value); the master names each spill's file, with a random token of its own, so no
two copies ever share a path (files named before, without the token, are still swept).

Written to a temporary file, fsynced and renamed, so a reader sees a whole file or none (a failed
write removes its temporary file; one of a process killed mid-write stays, never read, until
swept); a reader checks the key, size and checksum, and treats any mismatch as a miss.

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
from collections.abc import Callable, Iterator

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
    path: str,
    key: str,
    size: int,
    checksum: str,
    why: list[str] | None = None,
    err: list[int] | None = None,
) -> bytes | None:
    """Read and verify an SSD-tier file; None when missing, truncated or corrupt. ``why`` (when
    given) gets ``"corrupt"`` for a file that is there but is not this object's (truncated,
    another size or key, a checksum mismatch) or that the disk failed to read (EIO), else
    ``"missing"`` when it is not there (ENOENT, ENOTDIR), ``"unreadable"`` for another error
    (EMFILE, EACCES, ESTALE...: the file may be fine; its errno goes to ``err``, when given:
    see :class:`UnreadableFiles`)."""
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
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return _bad(why, "missing")
        if err is not None:
            err.append(exc.errno or 0)
        return _bad(why, "unreadable")
    if len(data) != size or xxhash.xxh3_64_intdigest(data) != digest or f"{digest:016x}" != checksum:
        return _bad(why, "corrupt")
    return data


def _bad(why: list[str] | None, reason: str) -> None:
    if why is not None:
        why.append(reason)
    return None


#: errnos of a process or system out of a resource: a file opened in vain with one may be fine
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN, errno.EINTR})
UNREADABLE_CHECKS = 3  # checks, UNREADABLE_GAP_S apart at least, a file is unreadable on to be lost
UNREADABLE_GAP_S = 30.0
UNREADABLE_MAX = 4096  # files an UnreadableFiles keeps count of (the oldest forgotten first)


class UnreadableFiles:
    """When an SSD file its own client cannot open is lost (its copy to be let go of): the
    store client's task thread asks (:meth:`lost`) on each check of a file it could not open
    (``ssd_check``, handed out when a reader missed, at most once per copy per the master's
    ``client_ttl_s``), and says which it read or found missing or bad (:meth:`done`).

    Out of a resource (EMFILE, ENFILE, ENOMEM...), the file may be fine: never lost. Another
    error (EACCES, EPERM: a mode, owner, ACL or security label changed; ESTALE...) with the
    file there and its directory searchable (a stat of it works: else the directory's trouble,
    every copy in it alike, maybe a mount coming back) counts once per :data:`UNREADABLE_GAP_S`
    at most, and the file is lost on the :data:`UNREADABLE_CHECKS`-th count with no read in
    between: a file unreadable that long (a minute at least, by default) is not coming back by
    itself, and every read of it misses meanwhile. (A copy whose file could not be opened was
    kept for good: an SSD-only object that nobody could read, its key refused to every put.)"""

    def __init__(self) -> None:
        self._counts: dict[str, tuple[int, float]] = {}  # path -> (counts, when last counted)

    def lost(self, path: str, err: int, now: float | None = None) -> bool:
        """``path`` could not be opened (errno ``err``) on a check: True when it is lost."""
        if err in _TRANSIENT:
            return False
        try:
            os.stat(path)
        except OSError:
            return False  # not the file's trouble (or it went meanwhile: the next check says)
        now = time.monotonic() if now is None else now
        n, at = self._counts.pop(path, (0, float("-inf")))
        if now - at >= UNREADABLE_GAP_S:
            n, at = n + 1, now
        if n >= UNREADABLE_CHECKS:
            return True
        while len(self._counts) >= UNREADABLE_MAX:
            del self._counts[next(iter(self._counts))]
        self._counts[path] = (n, at)
        return False

    def done(self, path: str) -> None:
        """``path`` was read, or found missing or bad, on a check: its count starts again."""
        self._counts.pop(path, None)


_SUBDIR = re.compile(r"[0-9a-f]{2}")
# What the master's spills name (see upkeep: Upkeep._spill); the token is optional, as the files
# of earlier versions (named without it) are this tier's too.
_NAME = r"[0-9a-f]{40}-[0-9]+(?:-[0-9a-f]{16})?\.kvp"
_FILE = re.compile(_NAME)
_TMP = re.compile(f"({_NAME})" + r"\.[0-9a-f]{32}\.tmp")  # a write (of group 1's file) killed midway
SWEEP_MAX_FILES = 65536  # files one sweep looks at (the next sweep sees the others)
SWEEP_BATCH = 512  # names per question to the master
# ssd_dir -> (subdirectory, file name) of the last file a sweep saw to: the next one starts past it
_resume: dict[str, tuple[str, str]] = {}
# a file's path, its stat and the name the master is asked about (a temporary file's: its file's)
_Found = tuple[str, os.stat_result, str]


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
    looked at (another inode or time) stays.

    A temporary file (``<file>.<random>.tmp``: a spill writing, or one killed midway) is
    removed on the same terms as the file it is to become, whose name the master is asked
    about: the master knows the file of every spill in flight, and names each spill's file once
    (a token of its own in it), so once that name is unknown no spill the master runs writes it
    any more, and the temporary file is abandoned. By its age alone (as it went before), on a
    directory several clients share, with clocks apart, a running spill of another client could
    lose its temporary file. (A spill the master gave up on may still be writing: its temporary
    file may go, and the write fail; its report would have been refused anyway.)

    Called on the store client's task thread, which also runs its spills (none writes
    meanwhile): the spills and copies queued behind it must start before the master gives up on
    them (its ``task_timeout_s``). So a call looks at :data:`SWEEP_MAX_FILES` files at most and
    stops about ``budget_s`` seconds in (by default min(2 s, a tenth of ``task_timeout_s``, the
    grace being twice it and a second)) wherever it is, in a subdirectory too: past the budget
    it asks one more question at most, about the files it looked at, and removes those of the
    answer (no more files than it looked at within the budget, or ``batch``). Each call sees to one
    file at least, and the next call starts past the last file it saw to (subdirectories, and
    the files of each, in sorted order, around), so every file is looked at in turn. A call
    lists the subdirectories it goes through (names only; a file is stat'ed when its turn
    comes)."""
    t0 = time.monotonic()
    _, grace = unknown([])
    deadline = t0 + (min(2.0, grace / 20) if budget_s is None else budget_s)
    cutoff = time.time() - grace
    try:
        with os.scandir(ssd_dir) as it:
            subs = sorted(e.name for e in it if _SUBDIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
    except OSError:
        return 0
    after = _resume.pop(ssd_dir, None)
    done = after  # every file up to this one (in this sweep's order) seen to
    last = after  # the last file looked at
    found: list[_Found] = []  # looked at, older than the grace, not asked about yet
    removed = seen = 0
    complete = False
    try:
        for key, path in _in_order(ssd_dir, subs, after):
            if seen >= SWEEP_MAX_FILES or (seen and time.monotonic() >= deadline):
                break
            tmp = _TMP.fullmatch(key[1])
            if not (tmp or _FILE.fullmatch(key[1])):
                continue
            seen += 1
            last = key
            try:
                st = os.lstat(path)
            except OSError:
                st = None  # removed since it was listed (the rest of the directory is looked at)
            if st is not None and st.st_mtime < cutoff:
                found.append((path, st, tmp.group(1) if tmp else key[1]))
            if len(found) >= batch:
                removed += _settle(found, unknown)
                found = []
            if not found:
                done = key
        else:
            complete = True
        if found:  # the files looked at but not asked about yet: one more question
            removed += _settle(found, unknown)
            done = last
    finally:
        if not complete and done is not None:
            _resume[ssd_dir] = done
    return removed


def _in_order(
    ssd_dir: str, subs: list[str], after: tuple[str, str] | None
) -> Iterator[tuple[tuple[str, str], str]]:
    """(subdirectory, name) and path of the files of ``subs``, in order, around, from past
    ``after`` (the subdirectory of it that is listed is listed once: its files past ``after``
    first, those up to it last). A subdirectory that cannot be listed is skipped."""
    start = 0 if after is None else next((i for i, n in enumerate(subs) if n >= after[0]), 0)
    head: list[str] = []
    for k in range(len(subs)):
        sub = subs[(start + k) % len(subs)]
        try:
            with os.scandir(os.path.join(ssd_dir, sub)) as it:
                names = sorted(e.name for e in it)
        except OSError:
            continue  # the next sweep looks again
        if k == 0 and after is not None and sub == after[0]:
            head = [n for n in names if n <= after[1]]
            names = [n for n in names if n > after[1]]
        for name in names:
            yield (sub, name), os.path.join(ssd_dir, sub, name)
    for name in head:
        yield (subs[start], name), os.path.join(ssd_dir, subs[start], name)


def _settle(found: list[_Found], unknown: Callable[[list[str]], tuple[list[str], float]]) -> int:
    """Ask the master about ``found`` and remove those no copy has; returns how many."""
    names = set(unknown(sorted({name for *_, name in found}))[0])
    return sum(_remove_unchanged(path, st) for path, st, name in found if name in names)


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
