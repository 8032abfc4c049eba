"""Store keys of vLLM prompt blocks, without importing vLLM.

Used by :mod:`kvpool.connectors.vllm.store` (which names every stored block this way) and by the
conductor's store index (:mod:`kvpool.conductor.store_feed`), which must compute the same keys
from a request's token ids to know how much of its prefix the store holds.

A block's key is ``<namespace>/<hex>``: BLAKE2b-128 over the parent block's digest (the
namespace's digest for the first block), the block's token ids as int64 and its encoded vLLM
extra keys. The namespace (``kvpool/v2/<model>/<dtype>/kv-<cache_dtype>/h<heads>x<head>/bs<N>/
tp<r>of<n>/<device>``) is built by ``namespace_for`` in the vLLM connector.
"""

from __future__ import annotations

import array
import hashlib
import re
from collections.abc import Callable
from typing import Any

import msgpack

__all__ = ["MARKER_RE", "NAMESPACE_RE", "block_keys", "digest", "encode_extra_keys", "leading_blocks"]

#: A block marker key of TP rank 0 (and PP stage 0), the namespace keys are chained from:
#: (namespace, model, block size, hex digest).
NAMESPACE_RE = re.compile(
    r"^(?P<ns>kvpool/v2/(?P<model>.+)/[^/]+/kv-[^/]+/[^/]+/bs(?P<bs>\d+)/tp0of\d+(?:pp0of\d+)?/[^/]+)"
    r"/(?P<hex>[0-9a-f]{32})$"
)

#: A block marker key of any TP rank and PP stage (each writes its own, see
#: :mod:`kvpool.connectors.vllm.store`): the namespace before and after the ranks (``pre``,
#: ``dev``), model, block size, TP rank and size, PP stage and count (None without PP), digest.
MARKER_RE = re.compile(
    r"^(?P<pre>kvpool/v2/(?P<model>.+)/[^/]+/kv-[^/]+/[^/]+/bs(?P<bs>\d+))/tp(?P<tp>\d{1,4})of(?P<tps>\d{1,4})"
    r"(?:pp(?P<pp>\d{1,4})of(?P<pps>\d{1,4}))?(?P<dev>/[^/]+)/(?P<hex>[0-9a-f]{32})$"
)


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def block_keys(
    namespace: str,
    token_ids: Any,
    block_size: int,
    n_blocks: int | None = None,
    extra: list[bytes] | None = None,
) -> list[str]:
    """Prefix-chained keys of the full blocks of ``token_ids`` (at most ``n_blocks``).

    ``extra[i]``: the encoded extra keys of block ``i`` (:func:`encode_extra_keys`; ``b""`` for
    none). Token bytes have a fixed length per block, so token ids and extra keys never run into
    each other.
    """
    full = len(token_ids) // block_size
    if n_blocks is not None:
        full = min(full, n_blocks)
    parent = digest(namespace.encode())
    keys = []
    for i in range(full):
        toks = array.array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        parent = digest(parent + toks + (extra[i] if extra else b""))
        keys.append(f"{namespace}/{parent.hex()}")
    return keys


def leading_blocks(namespace: str, token_ids: Any, block_size: int, present: Callable[[bytes], bool]) -> int:
    """How many leading full blocks of ``token_ids`` (no extra keys) ``present(digest)`` says are
    stored: the chain of :func:`block_keys`, computed only up to the first block missing."""
    parent = digest(namespace.encode())
    toks = array.array("q", token_ids).tobytes()
    step = 8 * block_size
    n = 0
    for i in range(len(token_ids) // block_size):
        parent = digest(parent + toks[i * step : (i + 1) * step])
        if not present(parent):
            break
        n += 1
    return n


def encode_extra_keys(keys: tuple[Any, ...] | None) -> bytes:
    """Deterministic bytes of one block's vLLM extra keys (msgpack; raises TypeError for a value
    msgpack cannot encode, so nothing falls back to ``repr`` or Python's salted ``hash``)."""
    if not keys:
        return b""
    return b"\x01" + msgpack.packb(keys, use_bin_type=True, strict_types=False)
