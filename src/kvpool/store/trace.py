"""Replay prefix-caching traces through the store and measure KV-block hit rates.

A trace is a list of requests; each request is the list of its prefix-block ids (``hash_ids`` in
the Mooncake FAST'25 conversation trace, one id per 512-token block). Two requests that share an
id share that KV block, and since ids are prefix hashes, a block is only reusable when every block
before it is reusable too. :func:`replay` plays a trace against a :class:`~kvpool.store.Store` the
way a serving engine with a pooled prefix cache would: look up the request's blocks, read the
leading run that is present (refreshing its LRU recency and checking its bytes), and store the
rest. :func:`run_hit_rate_study` does that for several pool sizes, each against a fresh master
and storage process, next to the hit rate of an infinite pool.

The team's trace lives outside the repository (``shared/traces/conversation_trace.jsonl`` beside
the repository root, see :func:`find_shared_trace`); nothing here requires it, and
:func:`synthetic_trace` makes a multi-turn trace of the same shape.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

from kvpool.errors import InvalidArgument, ObjectExists, StoreError, StoreFull

__all__ = [
    "SHARED_TRACE",
    "block_key",
    "block_value",
    "find_shared_trace",
    "ideal_hit_rate",
    "load_trace",
    "replay",
    "run_hit_rate_study",
    "synthetic_trace",
]

SHARED_TRACE = Path("shared") / "traces" / "conversation_trace.jsonl"
"""Where the team's trace lives, relative to a parent of the repository root (or of the cwd)."""


def load_trace(path: str | Path) -> list[list[int]]:
    """The ``hash_ids`` of every request of a JSON-lines trace, in file order.

    Blank lines are skipped. A line that is not a JSON object with a ``hash_ids`` list of
    non-negative integers raises :class:`~kvpool.errors.InvalidArgument` naming its line number.
    """
    out: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise InvalidArgument(f"{path}:{lineno}: not valid JSON: {exc}") from None
            ids = row.get("hash_ids") if isinstance(row, dict) else None
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
            ):
                raise InvalidArgument(
                    f"{path}:{lineno}: expected an object with a 'hash_ids' list of non-negative integers"
                )
            out.append(ids)
    return out


def find_shared_trace() -> Path | None:
    """The team's conversation trace when it exists, else None.

    Looks for ``shared/traces/conversation_trace.jsonl`` in the current working directory, this
    file's directory and all their parents (so ``../shared`` beside the repository root is found).
    """
    seen: set[Path] = set()
    for start in (Path.cwd().resolve(), Path(__file__).resolve().parent):
        for d in (start, *start.parents):
            if d in seen:
                continue
            seen.add(d)
            candidate = d / SHARED_TRACE
            if candidate.is_file():
                return candidate
    return None


def synthetic_trace(
    n_requests: int = 2000,
    n_conversations: int = 200,
    seed: int = 0,
    *,
    zipf_s: float = 1.0,
    max_blocks: int = 64,
) -> list[list[int]]:
    """A deterministic multi-turn conversation trace shaped like the Mooncake one.

    Every request starts with the shared system-prompt block ``0``. There are ``n_conversations``
    conversation slots with Zipf(``zipf_s``) popularity; each request picks a slot, and its
    conversation's next turn extends the previous turn's blocks with 1-4 new ones (the previous
    answer and the new question). A conversation's first turn has 2-12 blocks of its own; one that
    would pass ``max_blocks`` ends, and a new conversation (fresh ids) takes over its slot. Block
    ids are unique across conversations, so only block 0 and a conversation's own earlier turns
    are reusable.
    """
    if n_requests < 0 or n_conversations < 1 or max_blocks < 2:
        raise InvalidArgument("n_requests must be >= 0, n_conversations >= 1 and max_blocks >= 2")
    rng = random.Random(seed)
    cum = list(accumulate(1.0 / (rank + 1) ** zipf_s for rank in range(n_conversations)))
    next_id = 1
    convs: list[list[int] | None] = [None] * n_conversations
    out: list[list[int]] = []
    for _ in range(n_requests):
        slot = rng.choices(range(n_conversations), cum_weights=cum)[0]
        prev = convs[slot]
        grow = rng.randint(1, 4)
        if prev is None or len(prev) + grow > max_blocks:
            grow = min(rng.randint(2, 12), max_blocks - 1)
            prev = [0]
        blocks = prev + list(range(next_id, next_id + grow))
        next_id += grow
        convs[slot] = blocks
        out.append(blocks)
    return out


def ideal_hit_rate(trace: Iterable[Sequence[int]]) -> float:
    """Hit rate of an infinite pool: the leading run of already-seen blocks of each request."""
    seen: set[int] = set()
    hits = total = 0
    for ids in trace:
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hits += n
        total += len(ids)
        seen.update(ids)
    return hits / total if total else 0.0


def block_key(block_id: int, key_prefix: str = "blk") -> str:
    """Store key of a block."""
    return f"{key_prefix}:{block_id}"


def block_value(block_id: int, block_bytes: int = 4096) -> bytes:
    """Deterministic bytes of a block: its id as 8-byte little-endian, repeated to ``block_bytes``."""
    word = block_id.to_bytes(8, "little")
    return (word * (block_bytes // 8 + 1))[:block_bytes]


def replay(
    store: Any,
    trace: Sequence[Sequence[int]],
    block_bytes: int = 4096,
    key_prefix: str = "blk",
    progress: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """Play ``trace`` against ``store`` in order, as a prefix-caching serving engine would.

    For each request: ``batch_exists`` of its block keys; the leading run of present keys is the
    reusable prefix, read with ``batch_get`` (which refreshes LRU recency) and checked against
    :func:`block_value`; the remaining blocks are stored with ``batch_put``. A present block that
    cannot be read ends the prefix there (counted in ``lost_blocks``) and is stored again.

    Returns ``requests``, ``blocks``, ``hit_blocks``, ``hit_rate`` (hit_blocks / blocks),
    ``prefix_hit_requests`` (requests that reused at least one block), ``failed_puts`` (puts
    refused with StoreFull), ``lost_blocks``, ``evictions`` (the master's counter after the run)
    and ``seconds``.

    Raises:
        StoreError: a block read back other bytes than were put, or a put failed other than
            with ObjectExists (already stored) or StoreFull (counted).
        InvalidArgument: ``block_bytes`` is not positive.
    """
    if block_bytes <= 0:
        raise InvalidArgument("block_bytes must be positive")
    n_req = len(trace)
    step = max(1, n_req // 100)
    blocks = hit_blocks = prefix_hits = failed = lost = 0
    t0 = time.perf_counter()
    for i, ids in enumerate(trace):
        blocks += len(ids)
        if not ids:
            continue
        keys = [block_key(h, key_prefix) for h in ids]
        present = store.batch_exists(keys)
        n = 0
        while n < len(ids) and present[n]:
            n += 1
        if n:
            values = store.batch_get(keys[:n])
            for j, got in enumerate(values):
                if got is None:  # evicted or unreadable between exists and get: a miss from here on
                    lost += n - j
                    n = j
                    break
                if got != block_value(ids[j], block_bytes):
                    raise StoreError(
                        f"request {i}: block {ids[j]} ({keys[j]!r}) read back {len(got)} bytes that differ "
                        f"from the {block_bytes} bytes put"
                    )
        hit_blocks += n
        prefix_hits += n > 0
        todo: dict[str, int] = {}
        for key, h in zip(keys[n:], ids[n:], strict=True):
            todo.setdefault(key, h)  # a request naming a block twice stores it once
        if todo:
            errs = store.batch_put(list(todo), [block_value(h, block_bytes) for h in todo.values()])
            for key, err in zip(todo, errs, strict=True):
                if err is None or isinstance(err, ObjectExists):
                    continue
                if isinstance(err, StoreFull):
                    failed += 1
                    continue
                raise StoreError(f"request {i}: put of {key!r} failed: {err!r}") from err
        if progress is not None and ((i + 1) % step == 0 or i + 1 == n_req):
            progress((i + 1) / n_req)
    seconds = time.perf_counter() - t0
    counters = store.stats().get("counters", {})
    return {
        "requests": n_req,
        "blocks": blocks,
        "hit_blocks": hit_blocks,
        "hit_rate": hit_blocks / blocks if blocks else 0.0,
        "prefix_hit_requests": prefix_hits,
        "failed_puts": failed,
        "lost_blocks": lost,
        "evictions": int(counters.get("evictions", 0)),
        "seconds": seconds,
    }


def run_hit_rate_study(
    trace: Sequence[Sequence[int]],
    pool_blocks: Sequence[int] = (1024, 4096, 16384, 65536),
    block_bytes: int = 4096,
    max_requests: int | None = None,
    *,
    master_options: dict[str, Any] | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> list[dict[str, Any]]:
    """Hit rate of ``trace`` for pools of each size in ``pool_blocks`` (in blocks of ``block_bytes``).

    Each size gets a fresh ``kvpool master`` child process (``eviction_high_watermark=0.9,
    eviction_ratio=0.1`` unless ``master_options`` says otherwise), one storage child process
    contributing ``pool_blocks * block_bytes`` bytes, and a pool-only client in this process that
    runs :func:`replay`. ``block_bytes`` should be a multiple of the master's 64-byte allocation
    alignment so that the pool holds exactly ``pool_blocks`` blocks. ``progress(pool_blocks,
    fraction)`` is called as each replay advances.

    Returns one row per size: ``pool_blocks``, ``pool_bytes``, the :func:`replay` result and
    ``ideal_hit_rate`` (an infinite pool's hit rate on the same requests).
    """
    from kvpool.store.client import Store
    from kvpool.store.procs import MasterProcess, StorageProcess

    if max_requests is not None:
        trace = trace[:max_requests]
    ideal = ideal_hit_rate(trace)
    opts: dict[str, Any] = {"eviction_high_watermark": 0.9, "eviction_ratio": 0.1}
    opts.update(master_options or {})
    rows: list[dict[str, Any]] = []
    for n in pool_blocks:
        if n <= 0:
            raise InvalidArgument("pool sizes must be positive")
        pool_bytes = n * block_bytes
        cb = None if progress is None else (lambda f, n=n: progress(n, f))
        with MasterProcess(**opts) as master, StorageProcess(master.address, pool_bytes):
            with Store.connect(master=master.address, segment_size=0) as store:
                res = replay(store, trace, block_bytes=block_bytes, progress=cb)
        rows.append({"pool_blocks": n, "pool_bytes": pool_bytes, **res, "ideal_hit_rate": ideal})
    return rows
