"""The master's key change feed: which keys were committed or dropped, in order (``changes``).

Who reads it: a router that keeps an index of what the store holds (``kvpool proxy
--store-master``, :class:`kvpool.conductor.store_feed.StoreFeed`), polling a few times a second.
The feed is a routing hint, not a source of bytes: a get still goes through the master, leases
and header checks, so a stale or missed entry costs a slower route, never a wrong byte.

* :class:`ChangeLog` is a bounded ring of ``(seq, op, key)``: ``+`` when a key is committed, ``-``
  when a committed key is dropped (removed, evicted, lost with its last replica). The master
  appends under its lock (two tuple appends per put, no allocation beyond the tuple).
* ``changes`` with ``after`` = the last ``seq`` a reader saw returns the entries after it (at most
  ``limit``). A reader too far behind (its ``after`` left the ring), or one that starts (``after``
  = -1) or that talks to a restarted master (another ``incarnation``) gets ``reset``: it then walks
  the key table page by page (``snapshot`` with the ``cursor`` each page returns) and applies the
  entries after the ``seq`` the first page named. A key that stays unchanged while a page
  boundary moves (keys removed from an earlier page) can be missed until it changes again; that
  is the price of pages that never stall the master.
"""

from __future__ import annotations

import collections
import itertools
from typing import TYPE_CHECKING, Any

from kvpool.store.objects import MasterError

if TYPE_CHECKING:
    from kvpool.store.master import Master

    _Base = Master
else:
    _Base = object

MAX_PAGE = 8192  # keys (or entries) per reply


class ChangeLog:
    """Bounded ring of key changes with a sequence number (0 = nothing yet)."""

    __slots__ = ("ring", "seq")

    def __init__(self, capacity: int) -> None:
        self.ring: collections.deque[tuple[int, str, str]] = collections.deque(maxlen=max(1, capacity))
        self.seq = 0

    def add(self, op: str, key: str) -> None:
        self.seq += 1
        self.ring.append((self.seq, op, key))

    def since(self, after: int, limit: int) -> list[tuple[int, str, str]] | None:
        """Entries with ``seq > after`` (at most ``limit``), or None when some of them already left
        the ring (the reader must resynchronise)."""
        if after >= self.seq:
            return []
        first = self.ring[0][0] if self.ring else self.seq + 1
        if after + 1 < first:
            return None
        start = after + 1 - first  # entries are consecutive
        return list(itertools.islice(self.ring, start, start + limit))


class ChangeOps(_Base):
    """``_op_changes``: the key change feed (a mixin of :class:`kvpool.store.master.Master`)."""

    def _op_changes(self, req: dict[str, Any], sess: dict[str, Any]) -> dict[str, Any]:
        limit = min(int(req.get("limit", MAX_PAGE)), MAX_PAGE)
        prefix = req.get("prefix", "")
        if limit < 1 or not isinstance(prefix, str):
            raise MasterError("INVALID", "changes: limit must be >= 1 and prefix a string")
        log = self.changes
        if log is None:
            raise MasterError("INVALID", "this master keeps no change log (change_log=0)")
        out: dict[str, Any] = {"incarnation": self.incarnation, "seq": log.seq}
        if "cursor" in req:  # a snapshot page
            cur = [int(v) for v in req["cursor"]]
            if len(cur) != 3 or min(cur) < 0:
                raise MasterError("INVALID", "changes: cursor must be [shard, position, shards]")
            keys, nxt = self.objects.page(cur, limit, prefix)
            out["keys"] = keys
            out["cursor"] = nxt
            return out
        after = int(req["after"])
        got = None if after < 0 or req.get("incarnation") != self.incarnation else log.since(after, limit)
        if got is None:
            out["reset"] = True
            out["cursor"] = [0, 0, 0]
            return out
        out["changes"] = [[s, op, k] for s, op, k in got if k.startswith(prefix)]
        out["upto"] = got[-1][0] if got else after
        return out
