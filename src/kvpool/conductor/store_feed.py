"""The store tier of the live router's index: which vLLM blocks the kvpool store holds.

:class:`StoreFeed` follows the master's key change feed (``changes``, :mod:`kvpool.store.changes`)
in a thread of its own and keeps, per store namespace of TP rank 0 and PP stage 0 (model, dtype,
block size ... as :mod:`kvpool.connectors.vllm.store` names them), the set of block digests whose
commit markers are all stored: every TP rank and PP stage writes its own (under its own
namespace, the digest being the same), and a block with some missing is not loaded by the
connector either (its lookup needs them all). Who calls what:

* the feed thread polls the master every ``poll_s`` (and at once while there is more to read);
  after a master restart, a start, or falling behind the master's ring it walks the key table in
  pages (``resync``);
* the router, once per request on its event loop, asks :meth:`StoreFeed.leading_blocks` for the
  request's tokens: the chain of store keys is hashed only up to the first block the store lacks
  (a few µs per block, no I/O, no lock).

The store's keys are BLAKE2b chains, not the router's own block hashes, so the store tier is
looked up from the tokens rather than kept in :class:`~kvpool.conductor.index.BlockIndex`.
Requests whose blocks carry vLLM extra keys (LoRA, multimodal, ``cache_salt``) are not looked up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvpool._rpc import RpcClient
from kvpool.connectors.blockkeys import MARKER_RE, NAMESPACE_RE
from kvpool.connectors.blockkeys import leading_blocks as _leading
from kvpool.errors import KvpoolError

__all__ = ["StoreFeed"]

_log = logging.getLogger("kvpool.conductor")

# Markers one block may have (TP size x PP stages): keys naming more are not block markers.
MAX_PARTS = 1024

Blocks = dict[str, dict[bytes, None]]  # namespace -> digests whose every marker is stored
# namespace -> digest -> bitmask of the markers seen (bit: TP rank + TP size x PP stage), for the
# blocks of namespaces with several markers per block that lack some
Partial = dict[str, dict[bytes, int]]


def _mark(blocks: Blocks, partial: Partial, ns: str, dig: bytes, idx: int, parts: int) -> None:
    """Marker ``idx`` of the ``parts`` of block ``dig`` of ``ns`` is stored: the block is in
    ``blocks`` once all are."""
    have = blocks.get(ns)
    if have is not None and dig in have:
        return
    if parts > 1:
        seen = partial.setdefault(ns, {})
        mask = seen.get(dig, 0) | (1 << idx)
        if mask != (1 << parts) - 1:
            seen[dig] = mask
            return
        seen.pop(dig, None)
    blocks.setdefault(ns, {})[dig] = None


def _unmark(blocks: Blocks, partial: Partial, ns: str, dig: bytes, idx: int, parts: int) -> None:
    """Marker ``idx`` of block ``dig`` of ``ns`` is gone: the block is no longer stored whole."""
    have, whole = blocks.get(ns), False
    if have is not None and dig in have:
        del have[dig]
        whole = True
    if parts == 1:
        return
    seen = partial.get(ns)
    mask = ((1 << parts) - 1 if whole else (seen or {}).get(dig, 0)) & ~(1 << idx)
    if mask:
        partial.setdefault(ns, {})[dig] = mask
    elif seen is not None:
        seen.pop(dig, None)


class _View(NamedTuple):
    """The sets the router reads, replaced in one assignment by a resync: the router takes
    ``self._view`` once per call and so never sees a namespace's blocks without its block size
    (a resync that cleared the block sizes before it swapped the blocks in made a router call
    in between raise KeyError on the event loop)."""

    # namespace -> digest -> None (a dict keeps insertion order; membership is all we use):
    # blocks whose every marker is stored
    blocks: Blocks
    models: dict[str, list[str]]  # model name -> namespaces
    bs: dict[str, int]  # namespace -> its block size


class StoreFeed(threading.Thread):
    """Follows one store master's key feed (see the module docstring)."""

    def __init__(self, master: str, *, secret: str | None = None, block_size: int | None = None,
                 poll_s: float = 0.2, timeout_s: float = 5.0) -> None:  # fmt: skip
        super().__init__(name="kvpool-store-feed", daemon=True)
        self.master = master
        self.block_size = block_size
        self.poll_s = poll_s
        self._rpc = RpcClient(master, timeout_s, secret, what="store master")
        self._halt = threading.Event()
        # what the router reads, swapped whole by a resync (see _View); the feed thread's changes
        # go into its dicts in place, a namespace's block size before its first block
        self._view = _View({}, {}, {})
        self._partial: Partial = {}  # the feed thread's alone
        self._incarnation: int | None = None
        self.seq = -1
        self.master_seq = 0
        self.synced = threading.Event()
        self.stats = {"adds": 0, "removes": 0, "resyncs": 0, "errors": 0, "polls": 0}
        self.last_ok = 0.0

    # -- the router's side (event loop) --------------------------------------------------------------

    def namespaces(self, model: str | None) -> list[str]:
        """Namespaces of ``model`` (all when None) with this router's block size."""
        view = self._view
        if model is None:
            return list(view.blocks)
        return list(view.models.get(model, ()))

    def leading_blocks(self, tokens: Sequence[int], model: str | None) -> int:
        """Leading full blocks of ``tokens`` the store holds for ``model`` (the best namespace
        when several match; 0 when the model has none or its name is ambiguous)."""
        view = self._view  # one resync's sets throughout, however the feed thread swaps them
        best = 0
        names = list(view.models.get(model, ())) if model is not None else []
        if not names and len(view.blocks) == 1:  # one model in the store: the request's name may differ
            names = list(view.blocks)
        for ns in names:
            blocks, bs = view.blocks.get(ns), view.bs.get(ns)
            if blocks and bs:
                best = max(best, _leading(ns, tokens, bs, blocks.__contains__))
        return best

    def size(self) -> int:
        return sum(len(b) for b in list(self._view.blocks.values()))

    def lag(self) -> int:
        """Changes the master has that this feed has not applied yet (as of the last poll)."""
        return max(0, self.master_seq - self.seq) if self.seq >= 0 else self.master_seq

    def snapshot(self) -> dict[str, Any]:
        return {
            "master": self.master,
            "synced": self.synced.is_set(),
            "namespaces": {ns: len(b) for ns, b in list(self._view.blocks.items())},
            "blocks": self.size(),
            "seq": self.seq,
            "lag": self.lag(),
            **self.stats,
        }

    # -- the feed thread ------------------------------------------------------------------------------

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                try:
                    more = self.poll()
                    self.last_ok = time.monotonic()
                except KvpoolError as exc:
                    self.stats["errors"] += 1
                    _log.debug("store feed: %s", exc)
                    more = False
                    self._halt.wait(min(2.0, self.poll_s * 5))
                if not more:
                    self._halt.wait(self.poll_s)
        finally:
            self._rpc.close()

    def poll(self) -> bool:
        """One read of the feed; True when the master has more right away."""
        self.stats["polls"] += 1
        r = self._rpc.call("changes", after=self.seq, incarnation=self._incarnation)
        self.master_seq = int(r["seq"])
        if r.get("reset"):
            self.resync()
            return True
        for _seq, op, key in r["changes"]:
            self._apply(op, key)
        self.seq = int(r["upto"])
        return self.seq < self.master_seq

    def resync(self) -> None:
        """Rebuild the sets from the master's key table, page by page (the master restarted, this
        feed started, or fell behind its ring)."""
        self.stats["resyncs"] += 1
        fresh: Blocks = {}
        partial: Partial = {}
        cursor: list[int] | None = [0, 0, 0]
        seq = incarnation = None
        while cursor is not None and not self._halt.is_set():
            r = self._rpc.call("changes", cursor=cursor, prefix="kvpool/v2/")
            if seq is None:
                seq, incarnation = int(r["seq"]), r["incarnation"]
            elif r["incarnation"] != incarnation:
                return self.resync()  # restarted meanwhile
            for key in r["keys"]:
                m = self._match(key)
                if m is not None:
                    _mark(fresh, partial, *m)
            cursor = r["cursor"]
        view = _View(fresh, {}, {})
        for ns in fresh:
            self._index_namespace(view, ns)
        self._view, self._partial = view, partial  # the router sees the old sets or the new, whole
        self.seq, self._incarnation = int(seq or 0), incarnation
        self.synced.set()

    def _match(self, key: str) -> tuple[str, bytes, int, int] | None:
        """A block marker key's (namespace of TP rank 0 and PP stage 0, digest, which of the
        block's markers: TP rank + TP size x PP stage, how many it has); None for other keys."""
        m = MARKER_RE.match(key)
        if m is None or (self.block_size is not None and int(m["bs"]) != self.block_size):
            return None
        tp, tps = int(m["tp"]), int(m["tps"])
        pp, pps = (0, 1) if m["pp"] is None else (int(m["pp"]), int(m["pps"]))
        if not (tp < tps and pp < pps and tps * pps <= MAX_PARTS):
            return None
        ranks = f"tp0of{tps}" if m["pp"] is None else f"tp0of{tps}pp0of{pps}"
        return f"{m['pre']}/{ranks}{m['dev']}", bytes.fromhex(m["hex"]), tp + tps * pp, tps * pps

    @staticmethod
    def _index_namespace(view: _View, ns: str) -> None:
        m = NAMESPACE_RE.match(ns + "/" + "0" * 32)
        if m is not None:
            view.bs[ns] = int(m["bs"])
            view.models.setdefault(m["model"], []).append(ns)

    def _apply(self, op: str, key: str) -> None:
        m = self._match(key)
        if m is None:
            return
        ns, view = m[0], self._view
        if op == "+":
            if ns not in view.bs:  # indexed before its first block: the router reads it at once
                self._index_namespace(view, ns)
            _mark(view.blocks, self._partial, *m)
            self.stats["adds"] += 1
        else:
            _unmark(view.blocks, self._partial, *m)
            self.stats["removes"] += 1
