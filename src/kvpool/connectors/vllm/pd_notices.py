"""The prefill side channel's ``done`` notices of :class:`~kvpool.connectors.vllm.pd._PdWorker`:
the fence that confirms a decode's read only for blocks this worker still holds for that request.

A decode sends, per request id it read (or gave up on), the digest of the (id, block ids) its
params named; :meth:`DoneNotices._done` answers which of them were freed unread, freed by an
earlier notice, never handed out with those blocks, or read under a stale stream generation
("expired"; those also "refused" when the digest is not this request's), and frees the blocks of
the others. A notice naming requests this worker does not know yet (it can beat the step's
metadata) is parked (bounded) and decided again when they become known or its wait ends
(:meth:`DoneNotices._answer_parked`, on the side-channel thread). Split out of pd.py (size);
the state lives on the worker (``_lock``, ``_pending_send``, ``_expired``, ``_digests``...).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.connectors.vllm.pd_load import MAX_DONE_IDS
from kvpool.connectors.vllm.pd_scheduler import MAX_ID_CHARS, blocks_digest

if TYPE_CHECKING:
    from kvpool.connectors.vllm.pd import _PdWorker

    _Base = _PdWorker
else:
    _Base = object

# A "done" notice naming requests this prefill does not know yet waits for them this long at most
# (the decode asks for less than its RPC timeout); this many notices / ids wait at most.
_DONE_WAIT_MAX_S = 10.0
_PARKED_DONE_MAX = 256
_PARKED_IDS_MAX = 1 << 14


@dataclass(eq=False)
class _Notice:
    """A "done" notice being decided (side channel): what is decided so far, what waits."""

    conn: Any
    rid: Any
    of: int
    rank: int | None
    gens: dict[Any, Any]
    digests: dict[Any, Any]
    firsts: dict[Any, Any]
    until: float
    waiting: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


class DoneNotices(_Base):
    """The ``done`` side of ``_PdWorker``'s side channel (see the module docstring)."""

    def _done(self, req: dict[str, Any], conn: Any) -> dict[str, Any] | None:
        """Side channel, ``done``: a decode read (or gave up on) the blocks of ``req_ids``.

        The answer fences late or misdirected reads. "held" (not listed) only for a request this
        worker holds (its ``send`` metadata arrived) whose notice carries the :func:`blocks_digest`
        of this request's own id and blocks (a streamed read, named in ``gens``: of its id and the
        prompt's blocks from ``firsts[id]`` on, as vLLM holds them now); "expired": freed unread
        after abort_timeout_s, freed by an earlier notice, a stale streamed read (its generation
        moved, or it read other blocks), or a digest that is not this request's (its
        params were edited: the decode read other blocks; missing counts as wrong) -- that notice
        frees nothing. A request not known yet (a notice can beat the metadata) is parked up to
        ``wait_s`` (capped) until it is, then answered "expired" (``unknown``): never "held"
        unchecked. A read whose ``engines`` entry is not this incarnation's engine id (another one's,
        or none) is answered "expired" at once (``unknown``) and frees nothing. "engine_id" tells a
        restarted instance (that never held the blocks) from the one that did."""
        rid = req.get("id")
        of = max(1, min(int(req.get("of") or 1), 64))  # decode ranks that each send one notice
        gens = req.get("gens") or {}  # streamed reads: the generation they were made under
        digests = req.get("digests") or {}
        firsts = req.get("firsts") or {}  # streamed reads: the first prompt block their digest covers
        engines = req.get("engines") or {}  # the incarnation each read's params named
        req_ids = req.get("req_ids") or []
        if not isinstance(req_ids, list) or len(req_ids) > MAX_DONE_IDS:
            # Refused whole (a decode sends at most MAX_DONE_IDS): nothing recorded, its
            # sender treats every read in it as unconfirmed.
            msg = f"req_ids must be a list of at most {MAX_DONE_IDS}"
            return {"id": rid, "ok": False, "err": "INVALID", "msg": msg}
        if not all(isinstance(m, dict) for m in (gens, digests, firsts, engines)):
            msg = "gens, digests, firsts, engines must be maps"
            return {"id": rid, "ok": False, "err": "INVALID", "msg": msg}
        wait = req.get("wait_s")
        wait = min(float(wait), _DONE_WAIT_MAX_S) if isinstance(wait, (int, float)) else 0.0
        gens = {k: g for k, g in gens.items() if type(g) is int}  # (another value: no generation)
        rank = req.get("rank")  # the sender's decode TP rank: each counts once toward ``of``
        rank = rank if type(rank) is int and 0 <= rank < of else None
        firsts = {k: f for k, f in firsts.items() if type(f) is int and f >= 0}
        notice = _Notice(conn, rid, of, rank, gens, digests, firsts, time.monotonic() + wait)
        with self._lock:
            # Each id answered as it was sent (the decode matches the answer's ids with its own: a
            # shortened one was never matched, and its read counted as "held"); one no params
            # can name (not text, too long) is unknown.
            notice.waiting = [r if isinstance(r, str) else str(r)[:64] for r in req_ids]
            # named by another incarnation's params, or by params naming none (edited: every
            # kvpool prefill's params name it, a streamed read learns it from the progress
            # answers): this one cannot know it held those bytes for that read, answered now,
            # before it is settled (a request of that id held here may not be the one that was
            # read: a restarted instance would confirm its predecessor's params); frees nothing
            mine = [
                isinstance(r, str) and len(r) <= MAX_ID_CHARS and engines.get(r) == self.engine_id
                for r in req_ids
            ]
            notice.unknown = [r for r, m in zip(notice.waiting, mine, strict=True) if not m]
            notice.waiting = [r for r, m in zip(notice.waiting, mine, strict=True) if m]
            self._settle(notice, time.monotonic())
            parked = (
                notice.waiting and wait > 0 and conn is not None
                and len(self._parked_done) < _PARKED_DONE_MAX
                and self._parked_ids + len(notice.waiting) <= _PARKED_IDS_MAX
            )  # fmt: skip
            if parked:
                self._parked_done.append(notice)
                self._parked_ids += len(notice.waiting)
                return None  # answered by _answer_parked: once every id is known, or at the deadline
        return {"id": rid, **self._done_answer(notice)}

    def _settle(self, n: _Notice, now: float) -> None:
        """Decide the ids of ``n`` this worker can (caller holds ``_lock``); the others stay in
        ``n.waiting`` (not known yet)."""
        left: list[str] = []
        for r in n.waiting:
            g = n.gens.get(r)
            state = self.streams.read_gen(r, g) if g is not None and self.streams is not None else "ok"
            if r in self._expired or state != "ok":
                n.expired.append(r)  # freed, or preempted or aborted since that read: may be stale
                if state != "stale":
                    continue  # freed already, or an earlier stream's of the id (reused): frees nothing
                if r not in self._pending_send:
                    assert self.streams is not None
                    self.streams.give_up(r)  # a load of this stream gave up: its hold is freed once held
                    continue
                if r in self._expired or r not in self._stream_blocks:
                    continue  # not that stream's hold (a non-streamed one of the id, reused)
                # (else a load of the stream held gave up: the hold is freed)
            elif r not in self._pending_send:
                # Not held yet. A streamed read of a stream live under its generation, whose
                # request ends with its prompt and whose whole prompt is final
                # (``StreamTable.final_blocks``), is confirmed now when it read the blocks the
                # stream holds (the hold, when it comes, is freed at once: ``_notified``); any
                # other waits for its metadata (or is answered at the deadline).
                table = self.streams if g is not None else None
                live = table.final_blocks(r, g, self.block_size) if table is not None else None
                first = n.firsts.get(r)
                if live is None or first is None or n.digests.get(r) != blocks_digest(r, live[first:]):
                    left.append(r)
                    continue
            elif g is not None:
                # Streamed: the prompt's blocks it read, as the progress answers named them, must
                # be those held for this request (a stale or edited progress answer, blocks
                # reused under one generation: other bytes than this request's were read).
                # (One that read nothing names no block: it frees them, as a notice always did.)
                # Only a streamed hold is checked so: a non-streamed hold of the id (a client
                # reused it) holds no stream its read could have come from, and a late empty
                # read of the old stream would match any list's empty tail (it freed the new hold).
                held, first = self._stream_blocks.get(r), n.firsts.get(r)
                if held is None or first is None or n.digests.get(r) != blocks_digest(r, held[first:]):
                    n.expired.append(r)
                    n.refused.append(r)
                    continue
            else:
                want, got = self._digests.get(r), n.digests.get(r)
                if want is None or got != want:
                    n.expired.append(r)  # other blocks than this request's were read: frees nothing
                    n.refused.append(r)
                    continue
            if n.of > 1:  # freed after a notice from every decode rank
                if n.rank is None:
                    n.expired.append(r)  # cannot be counted: confirms and frees nothing
                    continue
                ranks = self._notice_counts.setdefault(r, set())  # a repeated rank counts once
                ranks.add(n.rank)
                if len(ranks) < n.of:
                    continue
                del self._notice_counts[r]
            self._notified[r] = now
            self._notified.move_to_end(r)
        n.waiting = left

    def _done_answer(self, n: _Notice) -> dict[str, Any]:
        """The reply to a ``done`` notice; ids still unknown are answered "expired"."""
        unknown = n.unknown + n.waiting
        return {
            "ok": True, "expired": n.expired + unknown, "refused": n.refused, "unknown": unknown,
            "engine_id": self.engine_id,
        }  # fmt: skip

    def _answer_parked(self) -> None:
        """Side-channel thread (its tick, or woken by a change): answer the parked progress
        questions that have news or waited long enough, and the parked "done" notices whose
        requests are all known now or whose wait is over."""
        table, server = self.streams, self._server
        if server is None:
            return
        now = time.monotonic()
        due: list[_Notice] = []
        if self._parked_done:
            with self._lock:  # at most _PARKED_IDS_MAX ids looked up again
                keep = []
                for n in self._parked_done:
                    self._parked_ids -= len(n.waiting)
                    self._settle(n, now)
                    self._parked_ids += len(n.waiting)
                    if n.waiting and now < n.until:
                        keep.append(n)
                    else:
                        self._parked_ids -= len(n.waiting)
                        due.append(n)
                self._parked_done = keep
        for n in due:
            server.reply(n.conn, n.rid, self._done_answer(n))
        if table is not None:
            for conn, rid, ids in table.due(now):
                server.reply(conn, rid, self._progress(ids))

    def _wake_parked_done(self) -> None:
        """Model thread: requests became known or expired; parked "done" notices are decided again."""
        server = self._server
        if server is not None and self._parked_done:  # (one parked under the lock is seen here)
            server.call_soon(self._answer_parked)
