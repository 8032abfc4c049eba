"""The SSD tier's object files: ``ssd_dir/xx/<sha1 of key>-<generation>.kvp`` (magic, size, xxh3-64,
key, value).

Written to a temporary file, fsynced and renamed, so a reader sees a whole file or none (a failed
write removes its temporary file; one of a process killed mid-write stays, never read); a reader
checks the key, size and checksum, and treats any mismatch as a miss.
"""

from __future__ import annotations

import errno
import os
import struct
import uuid

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
    ``"missing"``."""
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
        return _bad(why, "corrupt" if exc.errno == errno.EIO else "missing")
    if len(data) != size or xxhash.xxh3_64_intdigest(data) != digest or f"{digest:016x}" != checksum:
        return _bad(why, "corrupt")
    return data


def _bad(why: list[str] | None, reason: str) -> None:
    if why is not None:
        why.append(reason)
    return None
