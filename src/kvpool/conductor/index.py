"""The conductor's prefix index: which locations (instance GPU cache, instance CPU cache, the kvpool
store) hold which KV blocks.

Blocks are named by *our* chained hash (``kvpool._conductor``, XXH64 over the block's token ids and
the extra keys vLLM publishes, seeded with the parent's hash), computed the same way from a request's
tokens (:meth:`BlockIndex.hash_tokens`) and from an engine's ``BlockStored`` events
(:meth:`BlockIndex.ingest`). The engine's own block hashes only map ``BlockRemoved`` events and
parent links back to ours, per location, so instances need not share a hash seed.

The index is fed three ways: live vLLM KV events (:mod:`kvpool.conductor.events`), direct updates
(:meth:`BlockIndex.add` / :meth:`BlockIndex.remove`: the simulator's caches, the store tier), and an
approximate mode for engines that publish no events (:class:`ApproxTracker`: what the conductor
routed there, forgotten after a TTL).

Thread safety: the native index has its own reader/writer lock and releases the GIL for ingest and
lookups; location registration happens before any concurrent use.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

from kvpool._conductor import MAX_LOCATIONS, PrefixIndex
from kvpool.errors import InvalidArgument

__all__ = ["ApproxTracker", "BlockIndex", "Location", "Tier", "extra_keys"]


class Tier(str, Enum):
    """Where a copy of a block lives, fastest first."""

    GPU = "gpu"
    """The engine's own KV cache (vLLM ``medium`` GPU, or unset on CPU-only engines)."""
    CPU = "cpu"
    """The engine's host-memory offload tier (vLLM ``medium`` CPU)."""
    STORE = "store"
    """The kvpool store (a pool every instance can load from)."""


@dataclass(frozen=True)
class Location:
    """One place blocks can be: ``id`` is its bit in the index (0..63)."""

    id: int
    tier: Tier
    instance: str | None
    """The instance's name for GPU/CPU tiers; None for the shared store."""


def extra_keys(
    n_blocks: int, *, lora_name: str | None = None, cache_salt: str | None = None
) -> list[bytes | None]:
    """Per-block extra keys of a text request as vLLM publishes them in ``BlockStored.extra_keys``
    (LoRA name on every block, ``cache_salt`` on the first), msgpack-encoded for
    :meth:`BlockIndex.hash_tokens`. Multimodal inputs are not covered: route those with
    ``cache_salt`` or expect no prefix match."""
    out: list[bytes | None] = []
    for i in range(n_blocks):
        keys: list[Any] = []
        if lora_name:
            keys.append(lora_name)
        if i == 0 and cache_salt:
            keys.append(cache_salt)
        out.append(msgpack.packb(keys) if keys else None)
    return out


class BlockIndex:
    """Block hash → locations, with named locations and event counters.

    Args:
        block_size: tokens per block; must equal the engines' ``--block-size`` (checked at start by
            the live router, and per event: events of another size are counted and skipped).
        root_seed: seed of the first block's hash (one per model/deployment; all conductors of a
            deployment must use the same).
        expected_blocks: pre-size the table (avoids rehash pauses while it fills).
        max_blocks: most blocks the index holds (0: no cap). After an :meth:`ingest` that leaves
            more, the oldest entries of the location holding the most blocks are evicted, as if its
            engine had removed them, until the index is ~1/64 under the cap; so is a location whose
            own engine-hash map is over it. A chain goes from its tail (the chain whose last block
            was stored first goes first), and a prefix stays while a chain extending it does.
            Entries made by :meth:`add` are evicted too, the oldest added first, and so is the index
            after an :meth:`add` that leaves it over the cap (unless ``evict=False``:
            :class:`ApproxTracker` trims its own entries). Counted in ``counters["evicted"]``.
    """

    def __init__(
        self, block_size: int, *, root_seed: int = 0, expected_blocks: int = 0, max_blocks: int = 0
    ) -> None:
        if block_size <= 0:
            raise InvalidArgument("block_size must be > 0")
        if max_blocks < 0:
            raise InvalidArgument("max_blocks must be >= 0")
        self.block_size = int(block_size)
        self.max_blocks = int(max_blocks)
        self.native = PrefixIndex(self.block_size, root_seed, expected_blocks, self.max_blocks)
        self.locations: list[Location] = []
        self._by_key: dict[tuple[str | None, Tier], Location] = {}
        self.counters: dict[str, int] = {}
        self.last_bad_block_size: int | None = None
        self._lock = threading.Lock()  # counters only

    # -- locations -----------------------------------------------------------------------------------

    def add_location(self, instance: str | None, tier: Tier) -> Location:
        """Register a location (idempotent); at most 64."""
        key = (instance, tier)
        if key in self._by_key:
            return self._by_key[key]
        if len(self.locations) >= MAX_LOCATIONS:
            raise InvalidArgument(
                f"the index tracks at most {MAX_LOCATIONS} locations (instance x tier); use fewer "
                "instances per conductor or run one conductor per group of instances"
            )
        loc = Location(len(self.locations), tier, instance)
        self.locations.append(loc)
        self._by_key[key] = loc
        return loc

    def location(self, instance: str | None, tier: Tier) -> Location | None:
        return self._by_key.get((instance, tier))

    # -- hashing and lookups -------------------------------------------------------------------------

    def hash_tokens(
        self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> list[int]:
        """Our hashes of the full blocks of ``tokens`` (a list of ints or a uint32 ``array``)."""
        extras = None
        if lora_name or cache_salt:
            extras = extra_keys(len(tokens) // self.block_size, lora_name=lora_name, cache_salt=cache_salt)
        return self.native.hash_tokens(tokens, extras)

    def hash_tokens_in_pieces(
        self, tokens: Sequence[int], *, cache_salt: str | None = None, piece_blocks: int = 4096
    ) -> list[int]:
        """:meth:`hash_tokens` (no LoRA name), ``piece_blocks`` blocks per native call, each
        chained to the last hash of the one before: a thread hashing millions of token ids holds
        the GIL only to convert one piece of the list at a time (the hashing itself releases it),
        so the event loop runs between pieces. Called by the live router in a thread."""
        step = piece_blocks * self.block_size
        full = len(tokens) // self.block_size * self.block_size
        out: list[int] = []
        for a in range(0, full, step):
            extras = extra_keys(1, cache_salt=cache_salt) if a == 0 and cache_salt else None
            parent = out[-1] if out else None
            out += self.native.hash_tokens(tokens[a : min(a + step, full)], extras, parent)
        return out

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Per registered location (by id), how many leading blocks of ``hashes`` it holds."""
        return self.native.match(hashes, len(self.locations))

    def add(self, loc: Location, hashes: Sequence[int], *, evict: bool = True) -> int:
        """``loc`` holds ``hashes`` (a chain's, head first, or part of one: the cap evicts its tail
        first), the newest of its added entries. With ``evict``, an index left over ``max_blocks``
        evicts as after an :meth:`ingest`; returns the entries evicted (also counted in
        ``counters["evicted"]``). Called by the simulator and by :class:`ApproxTracker`."""
        n = int(self.native.add(loc.id, hashes, evict))
        if n:
            with self._lock:
                self.counters["evicted"] = self.counters.get("evicted", 0) + n
        return n

    def remove(self, loc: Location, hashes: Sequence[int]) -> None:
        self.native.remove(loc.id, hashes)

    def clear(self, loc: Location) -> None:
        self.native.clear(loc.id)

    def blocks_at(self, loc: Location) -> int:
        return self.native.location_size(loc.id)

    def hashes_at(self, loc: Location) -> set[int]:
        return set(self.native.hashes_at(loc.id))

    def __len__(self) -> int:
        return len(self.native)

    # -- events ----------------------------------------------------------------------------------------

    def ingest(self, payload: bytes, gpu: Location, cpu: Location | None = None) -> dict[str, Any]:
        """Apply one vLLM ``KVEventBatch`` msgpack payload from the instance owning ``gpu``.

        Returns the native counters of this payload (``stored``, ``removed``, ``cleared``,
        ``evicted`` (entries of any location evicted under ``max_blocks`` after it), ``skipped_*``,
        ``malformed``, ``last_ts``) and adds them to :attr:`counters`."""
        st = self.native.ingest(payload, gpu.id, cpu.id if cpu is not None else -1, -1)
        with self._lock:
            for k, v in st.items():
                if k.startswith("last_"):
                    continue
                if v:
                    self.counters[k] = self.counters.get(k, 0) + int(v)
            if st["last_bad_block_size"] >= 0:
                self.last_bad_block_size = int(st["last_bad_block_size"])
        return st


#: Hashes recorded per hold of :class:`ApproxTracker`'s lock (a few ms), so that a sweep on the
#: event loop never waits for a thread recording a prompt of millions of tokens.
_ROUTED_PIECE = 4096


class ApproxTracker:
    """Approximate index entries for instances that publish no KV events.

    :meth:`routed` records that an instance computed a request's blocks; each entry expires
    ``ttl_s`` after its last refresh (the engine may have evicted it by then). :meth:`sweep` removes
    what expired; call it now and then (the live router does, once a second). Memory: one ordered
    dict entry per (location, block) tracked, at most ``max_entries``, and none that keeps the index
    over its ``max_blocks`` (it adds them with ``evict=False``, and trims them itself): the least recently
    refreshed are dropped first, down to 1/64 under the cap as the native eviction does. A request's
    blocks are refreshed from its chain's tail to its head, so a chain loses its tail first (a head
    dropped first left the tail in the index, never matched: a match counts leading blocks). A
    refresh moves the entry, it queues nothing more.
    """

    def __init__(self, index: BlockIndex, ttl_s: float = 120.0, max_entries: int = 1_000_000) -> None:
        if ttl_s <= 0:
            raise InvalidArgument("ttl_s must be > 0")
        if max_entries <= 0:
            raise InvalidArgument("max_entries must be > 0")
        self.index = index
        self.ttl_s = float(ttl_s)
        self.max_entries = int(max_entries)
        # (location id, block hash) -> expiry, least recently refreshed first
        self._expiry: OrderedDict[tuple[int, int], float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many (location, block) entries are tracked."""
        return len(self._expiry)

    def routed(self, loc: Location, hashes: Sequence[int], now: float | None = None) -> None:
        """Record that ``loc`` now holds ``hashes`` (called by the live router per routed request, in
        a thread for a long prompt; thread-safe)."""
        now = time.monotonic() if now is None else now
        exp = now + self.ttl_s
        for b in range(len(hashes), 0, -_ROUTED_PIECE):  # the lock is never held long
            hs = list(hashes[max(0, b - _ROUTED_PIECE) : b])  # tail pieces first: the head is newest
            with self._lock:
                expiry = self._expiry
                for h in reversed(hs):
                    key = (loc.id, h)
                    expiry[key] = exp
                    expiry.move_to_end(key)
                self.index.add(loc, hs, evict=False)  # trimmed below: the tracker stays in step
                self._trim_locked(now)

    def _trim_locked(self, now: float) -> None:
        """Drop the least recently refreshed entries over ``max_entries``, and while the index
        holds more than its ``max_blocks``, down to 1/64 under it (a block another location holds
        too stays in the index: it is looked at again)."""
        if len(self._expiry) > self.max_entries:
            self._sweep_locked(now, limit=len(self._expiry) - self.max_entries)
        cap = self.index.max_blocks
        if cap and len(self.index) > cap:
            target = cap - cap // 64
            while self._expiry and len(self.index) > target:
                self._sweep_locked(now, limit=len(self.index) - target)

    def sweep(self, now: float | None = None) -> int:
        """Remove expired entries from the index; returns how many blocks were removed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._sweep_locked(now)

    def _sweep_locked(self, now: float, limit: int = 0) -> int:
        """Drop entries that expired by ``now``, and at least ``limit`` of the oldest."""
        gone: dict[int, list[int]] = {}
        removed = 0
        expiry = self._expiry
        while expiry:
            key, exp = next(iter(expiry.items()))
            if exp > now and removed >= limit:
                break
            expiry.popitem(last=False)
            gone.setdefault(key[0], []).append(key[1])
            removed += 1
        for loc_id, hs in gone.items():
            self.index.remove(self.index.locations[loc_id], hs)
        return removed
