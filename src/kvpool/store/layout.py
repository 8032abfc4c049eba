"""How an object sits in a storage segment: a 64-byte header, then the value.

The writer puts the header and the value in place in the same put; a reader checks the header
(and, where there is one, the checksum) after the bytes have landed. A location that now holds
another object, another version, a half-written object or nothing at all therefore never passes
as the object the reader asked for (FaRM/Pilaf-style self-validating objects)::

    u32 magic "KVP1" | u32 flags | u64 epoch | u64 generation | u64 key hash | u64 length |
    u64 checksum | 16 bytes reserved                                  (little endian, 64 bytes)

``epoch`` is the master's incarnation and ``generation`` the allocation's id under it (unique per
master life); ``key hash`` is xxh3-64 of the UTF-8 key; ``checksum`` is xxh3-64 of the value when
flag bit 0 is set. Values up to :data:`CHECKSUM_ALWAYS_MAX` always carry a checksum (it costs
under 3 µs and lets a client read them through a cached location without asking the master).
"""

from __future__ import annotations

import struct

import xxhash

HEADER = struct.Struct("<IIQQQQQ16x")
HEADER_SIZE = HEADER.size  # 64
MAGIC = 0x3150564B  # b"KVP1" little endian
FLAG_CHECKSUM = 1
CHECKSUM_ALWAYS_MAX = 64 << 10
assert HEADER_SIZE == 64


def key_hash(key: str) -> int:
    """xxh3-64 of the UTF-8 key (as stored in the header)."""
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


def checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of a value."""
    return xxhash.xxh3_64_intdigest(data)


def pack_header(epoch: int, gen: int, khash: int, length: int, csum: int | None) -> bytes:
    """The 64 header bytes of an object."""
    flags = FLAG_CHECKSUM if csum is not None else 0
    return HEADER.pack(MAGIC, flags, epoch, gen, khash, length, csum or 0)


def pack_header_into(buf: bytearray | memoryview, epoch: int, gen: int, khash: int, length: int,
                     csum: int | None, offset: int = 0) -> None:  # fmt: skip
    """:func:`pack_header` written straight into the 64 bytes of ``buf`` at ``offset``."""
    flags = FLAG_CHECKSUM if csum is not None else 0
    HEADER.pack_into(buf, offset, MAGIC, flags, epoch, gen, khash, length, csum or 0)


def header_mismatch(
    buf: bytes | bytearray | memoryview, epoch: int, gen: int, khash: int, length: int, csum: int | None
) -> str | None:
    """Why ``buf`` (at least 64 bytes) is not the header of this object; None when it is."""
    magic, flags, e, g, h, n, c = HEADER.unpack_from(buf)
    if magic != MAGIC:
        return "no object header at that location (freed or overwritten)"
    if (e, g) != (epoch, gen):
        return f"the location holds object {e:x}/{g}, not {epoch:x}/{gen} (replaced)"
    if h != khash or n != length:
        return "the header names another key or length (replaced)"
    if csum is not None and (not flags & FLAG_CHECKSUM or c != csum):
        return "the header's checksum differs from the one committed"
    return None


def header_checksum(buf: bytes | bytearray | memoryview) -> int | None:
    """The checksum a header carries (None when it has none)."""
    _, flags, _, _, _, _, c = HEADER.unpack_from(buf)
    return c if flags & FLAG_CHECKSUM else None
