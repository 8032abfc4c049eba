"""The store master's records: segments, objects and their replicas, clients, and the LRU lists.

Plain data; the master (:mod:`kvpool.store.master`) and its space bookkeeping
(:mod:`kvpool.store.space`) change them under the master's lock.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvpool import _native
from kvpool.store.allocator import RangeAllocator
from kvpool.store.layout import HEADER_SIZE

CACHE_CLASSES = ("default", "ephemeral", "persistent")


class MasterError(Exception):
    """An error the master answers with (``code`` is the wire error code)."""

    def __init__(self, code: str, msg: str) -> None:
        super().__init__(msg)
        self.code = code


@dataclass(eq=False)
class Segment:
    """A client's mounted DRAM segment (one mount: a segment mounted again is a new record)."""

    name: str
    client: str
    base: int
    size: int
    host_id: str
    alloc: RangeAllocator
    objs: set[Obj] = field(default_factory=set)  # objects with a replica (or an allocation) here
    reads: float = 0.0
    dead: bool = False  # unmounted: its objects are being let go of (a few per tick)
    reported_until: float = 0.0  # a reader could not reach it: served last, not placed on, until then
    suspect: list[tuple[int, int]] = field(default_factory=list)  # ranges a lost writer may still hit
    mount: int = 0  # this mount's id (unique in the master): reports name it (not an earlier mount's)


@dataclass(slots=True, eq=False)
class Replica:
    """One copy of an object: its allocation (header + value) inside a segment."""

    seg: Segment
    offset: int
    committed: bool
    writer: str = ""  # uncommitted: the client writing it (its range is fenced if taken back)
    id: int = 0  # unique in the master: a reader's corrupt report names it (not a later one there)

    @property
    def addr(self) -> int:
        """Address of the object's header in the segment owner's memory."""
        return self.seg.base + self.offset


@dataclass(slots=True)
class SsdCopy:
    """An object's copy in a client's SSD directory."""

    client: str
    path: str
    checksum: str
    host_id: str
    checked_at: float = float("-inf")  # when a reader's miss last had its client check the file


@dataclass(slots=True, eq=False)
class Obj:
    """Metadata of one object (or of a pending put or a reservation, before it is committed)."""

    key: str | None  # None: a reservation not yet committed under a key
    size: int  # value bytes; the allocation is HEADER_SIZE more
    gen: int  # allocation generation: unique per master life, in the object's header
    owner: str  # the client that put it (only it may commit or revoke while pending)
    replicas: list[Replica]
    committed: bool = False
    deadline: float = 0.0  # pending: revoked after this
    verify: bool = False  # the value must carry a checksum (small, or placed in suspect space)
    checksum: int | None = None  # xxh3-64 of the value, recorded at commit
    soft_pin: bool = False
    pin_until: float = 0.0
    cache_class: str = "default"
    base_replicas: int = 1
    lease_until: float = 0.0  # latest lease deadline (bounds leases of readers that vanished)
    readers: int = 0  # reads in flight (leases not yet released)
    holders: dict[Any, int] = field(default_factory=dict)  # who holds those leases: holder -> count
    lease_seq: int = 0  # lease epoch: bumped when expired leases are written off; releases name it
    busy: int = 0  # master tasks (replicate/spill) and replica changes in flight
    ssd: SsdCopy | None = None
    lru: str | None = None  # the LRU list it is in (committed objects)
    lru_prev: Obj | None = None  # neighbours in that list (see ClassLru)
    lru_next: Obj | None = None

    @property
    def alloc_size(self) -> int:
        """Bytes allocated per replica."""
        return self.size + HEADER_SIZE


@dataclass(frozen=True)
class Placement:
    """The placement part of a put's config (``ReplicateConfig.wire()``), validated."""

    replicas: int
    cache_class: str
    preferred: str | None
    soft_pin: bool
    pin_ttl_s: float

    @classmethod
    def parse(cls, cfg: dict[str, Any]) -> Placement:
        """Validate a config map; bad values are an INVALID error."""
        pl = cls(
            int(cfg.get("replicas", 1)),
            cfg.get("cache_class", "default"),
            cfg.get("preferred_segment"),
            bool(cfg.get("soft_pin", False)),
            float(cfg.get("soft_pin_ttl_s", 3600.0)),
        )
        if pl.replicas < 1 or pl.cache_class not in CACHE_CLASSES:
            raise MasterError("INVALID", f"replicas must be >= 1 and cache_class one of {CACHE_CLASSES}")
        if pl.preferred is not None and not isinstance(pl.preferred, str):
            # checked here, before a request changes anything: placement looked it up as a key
            raise MasterError("INVALID", "preferred_segment must be a segment name (a string)")
        return pl


@dataclass
class Client:
    """A connected store client."""

    id: str
    host_id: str
    last_seen: float
    ssd_dir: str | None = None
    token: bytes = b""
    segments: set[str] = field(default_factory=set)
    tasks: list[dict[str, Any]] = field(default_factory=list)
    floor: int = 0  # it may still write allocations of this generation and newer (0: not reported)
    # master times of its last two heartbeats (the one before last: see Master._drained)
    beats: tuple[float, float] = (0.0, 0.0)
    pending: set[Obj] = field(default_factory=set)  # its puts and reservations not yet committed
    task_ids: set[int] = field(default_factory=set)
    # replica copies it runs (replica/promote_start): change id -> (object, the replicas it fills)
    changing: dict[int, tuple[Obj, list[Replica]]] = field(default_factory=dict)
    spill_failures: int = 0  # spills its disk failed in a row (full, EIO)
    spill_after: float = 0.0  # no spill is handed to it before this (backoff after failures)
    ssd_objs: set[Obj] = field(default_factory=set)  # objects with their SSD copy on its disk


class KeyTable:
    """key -> object. A dict that grows copies all its entries at once — about 100 ms at a million
    keys, with the master stalled meanwhile — so a big table lives in 64 dicts and every copy
    stays small. A small one (up to :attr:`SPLIT_AT` keys, whose copies take a few ms) is one
    dict: many-key lookups then run without Python per key."""

    SHARDS = 64
    SPLIT_AT = 1 << 15

    def __init__(self) -> None:
        self._d: list[dict[str, Obj]] = [{}]
        self._mask = 0  # SHARDS - 1 once split
        self._n = 0

    def _shard(self, key: str) -> dict[str, Obj]:
        return self._d[hash(key) & self._mask]

    def _split(self) -> None:
        """One dict -> SHARDS dicts (once, at SPLIT_AT keys: a few ms)."""
        shards: list[dict[str, Obj]] = [{} for _ in range(self.SHARDS)]
        mask = self.SHARDS - 1
        for k, o in self._d[0].items():
            shards[hash(k) & mask][k] = o
        self._d, self._mask = shards, mask

    def get(self, key: str, default: Obj | None = None) -> Obj | None:
        """The object under ``key``, or ``default`` (also for a key no object can have: one that is
        not hashable, from a bad request, is not found instead of failing the request halfway)."""
        try:
            return self._d[hash(key) & self._mask].get(key, default)
        except TypeError:
            return default

    def get_many(self, keys: list[str]) -> list[Obj | None]:
        """The object under each key (None where there is none), without a call per key."""
        d, mask = self._d, self._mask
        if not mask:
            return list(map(d[0].get, keys))
        return [d[hash(k) & mask].get(k) for k in keys]

    def committed_many(self, keys: list[str]) -> list[bool]:
        """Whether each key holds a committed object (``batch_exists``), in C: the shard, lookup
        and flag per key without Python bytecode (a 1,000-key lookup in the split table costs
        about what one dict's list comprehension did)."""
        return _native.committed_many(self._d, self._mask, keys)

    def __getitem__(self, key: str) -> Obj:
        return self._d[hash(key) & self._mask][key]

    def __setitem__(self, key: str, obj: Obj) -> None:
        d = self._d[hash(key) & self._mask]
        if key not in d:
            self._n += 1
            d[key] = obj
            if self._n >= self.SPLIT_AT and not self._mask:
                self._split()
        else:
            d[key] = obj

    def __delitem__(self, key: str) -> None:
        del self._d[hash(key) & self._mask][key]
        self._n -= 1

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._d[hash(key) & self._mask]

    def __len__(self) -> int:
        return self._n

    def page(self, cursor: list[int], limit: int, prefix: str = "") -> tuple[list[str], list[int] | None]:
        """Committed keys starting with ``prefix`` from ``cursor`` (``[shard, position, shards]``,
        ``[0, 0, 0]`` to begin), at most ``limit`` of them looked at; returns them and the next
        cursor (None at the end). Bounded work per call: the master never stalls on a big table.
        A cursor from before the table split starts again from the beginning."""
        shard, pos, n = cursor
        if n != len(self._d):
            shard, pos = 0, 0
        keys: list[str] = []
        looked = 0
        while shard < len(self._d) and looked < limit:
            d = self._d[shard]
            seen = 0
            for k, o in itertools.islice(d.items(), pos, pos + limit - looked):
                seen += 1
                if o.committed and k.startswith(prefix):
                    keys.append(k)
            looked += seen
            pos += seen
            if pos >= len(d):
                shard, pos = shard + 1, 0
        return keys, ([shard, pos, len(self._d)] if shard < len(self._d) else None)


class _Chain:
    """One LRU list: objects linked through their ``lru_prev``/``lru_next`` (no dict to grow)."""

    __slots__ = ("head", "tail", "n")

    def __init__(self) -> None:
        self.head: Obj | None = None  # least recently used
        self.tail: Obj | None = None  # most recently used
        self.n = 0

    def append(self, obj: Obj) -> None:
        obj.lru_prev, obj.lru_next = self.tail, None
        if self.tail is None:
            self.head = obj
        else:
            self.tail.lru_next = obj
        self.tail = obj
        self.n += 1

    def unlink(self, obj: Obj) -> None:
        prev, nxt = obj.lru_prev, obj.lru_next
        if prev is None:
            self.head = nxt
        else:
            prev.lru_next = nxt
        if nxt is None:
            self.tail = prev
        else:
            nxt.lru_prev = prev
        obj.lru_prev = obj.lru_next = None
        self.n -= 1


class ClassLru:
    """Committed objects in LRU order, one list per eviction class, evicted in the order
    ``ephemeral``, ``default``, ``pinned`` (soft-pinned until their pin ends), ``persistent``.
    Every operation is O(1)."""

    ORDER = ("ephemeral", "default", "pinned", "persistent")

    def __init__(self) -> None:
        self.lists: dict[str, _Chain] = {c: _Chain() for c in self.ORDER}

    @staticmethod
    def klass(obj: Obj, now: float) -> str:
        """The list an object belongs in."""
        if obj.cache_class in ("ephemeral", "persistent"):
            return obj.cache_class
        return "pinned" if obj.soft_pin and obj.pin_until > now else "default"

    def add(self, obj: Obj, now: float) -> None:
        """Insert a committed object as the most recent of its class."""
        obj.lru = self.klass(obj, now)
        self.lists[obj.lru].append(obj)

    def touch(self, obj: Obj) -> None:
        """Mark an object as just used."""
        if obj.lru is not None:
            chain = self.lists[obj.lru]
            if chain.tail is not obj:
                chain.unlink(obj)
                chain.append(obj)

    def remove(self, obj: Obj) -> None:
        """Take an object out of its list."""
        if obj.lru is not None:
            self.lists[obj.lru].unlink(obj)
        obj.lru = None

    def candidates(self, now: float, budget: int) -> Iterator[Obj]:
        """Least recently used objects, class by class, looking at most ``budget`` of them. A
        yielded object that is not evicted must be :meth:`skip`-ped (moved to the end)."""
        for name in self.ORDER:
            chain = self.lists[name]
            obj = chain.head
            for _ in range(chain.n):
                if budget <= 0:
                    return
                if obj is None:
                    break
                budget -= 1
                nxt = obj.lru_next
                if name == "pinned" and obj.pin_until <= now:
                    self.remove(obj)  # its soft pin ended: an ordinary object from now on
                    self.add(obj, now)
                else:
                    yield obj
                obj = nxt

    def skip(self, obj: Obj) -> None:
        """An object that cannot be evicted now goes to the end of its list."""
        self.touch(obj)

    def __len__(self) -> int:
        return sum(chain.n for chain in self.lists.values())
