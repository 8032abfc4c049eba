"""Bounds of what a prefill rank of the SGLang P/D backend keeps per room (no SGLang import).

SGLang's ``transfer_infos`` maps a room to its decode destinations (one per decode rank, keyed by
session). Entries come from the decode's metadata messages; the request's sender drops the room
when done. Metadata for rooms this prefill never serves (a request that never reached it, a late
message after the room was cleared) and sessions beyond what a room needs would otherwise stay
forever. :class:`RoomTable` admits metadata only within bounds:

* sessions per room: the room's ``required_dst_info_num`` (the decode ranks that send for it), at
  most ``KVPOOL_SGLANG_MAX_SESSIONS_PER_ROOM`` (default 256);
* rooms in total: ``KVPOOL_SGLANG_MAX_ROOMS`` (default 16384);
* age: a room that no request of this prefill holds (no sender) is dropped, with what SGLang
  keeps for it (its status, made WaitingForInput by complete metadata), after
  ``KVPOOL_SGLANG_ROOM_TTL_S`` (default twice the longer of SGLang's bootstrap and waiting
  timeouts: its decode gave it up).

A normal flow, where each room is cleared when done, never reaches them. :class:`PeerTable` bounds
the decode ranks' registrations (``KVPOOL_SGLANG_MAX_PEERS``, the one unused longest is evicted).
:class:`LateRooms` holds a transfer worker's rooms whose GPU copies outlived the timeout until
those copies ended, so that the worker goes on with its other rooms meanwhile.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvpool.connectors.sglang.control_auth import Throttle

log = logging.getLogger("kvpool.connectors.sglang")


class RoomTable:
    """Admission to a prefill manager's ``transfer_infos``: its one control thread calls
    :meth:`admit`; senders call :meth:`claim` when created and :meth:`forget` when cleared."""

    def __init__(
        self,
        infos: dict[int, dict[str, Any]],
        drop: Callable[[int], None],
        *,
        max_rooms: int,
        max_sessions: int,
        ttl_s: float,
    ) -> None:
        self.infos = infos
        self.drop = drop  # forgets everything the manager keeps for a room no sender holds
        self._claimed: set[int] = set()  # rooms a sender of this prefill holds
        self.max_rooms = max(1, max_rooms)
        self.max_sessions = max(1, max_sessions)
        self.ttl_s = ttl_s if ttl_s > 0 else 600.0
        self._seen: dict[int, float] = {}  # room -> when its first metadata came, oldest first
        self.refused = 0
        self.evicted = 0
        self._log = Throttle()

    @classmethod
    def from_env(
        cls, infos: dict[int, dict[str, Any]], drop: Callable[[int], None], waited_s: float
    ) -> RoomTable:
        """Bounds from ``KVPOOL_SGLANG_*``; ``waited_s``: how long SGLang waits for a room."""
        env = os.environ
        return cls(
            infos,
            drop,
            max_rooms=int(env.get("KVPOOL_SGLANG_MAX_ROOMS", "16384")),
            max_sessions=int(env.get("KVPOOL_SGLANG_MAX_SESSIONS_PER_ROOM", "256")),
            ttl_s=float(env.get("KVPOOL_SGLANG_ROOM_TTL_S", "0") or 0) or 2 * waited_s,
        )

    def admit(self, room: int, session: str, need: int) -> str | None:
        """Before metadata of ``room`` from ``session`` is stored: None when it may be, else why
        not (counted and logged, rate-limited)."""
        infos = self.infos.get(room)
        why = None
        if infos is None:
            now = time.monotonic()
            self._sweep(now)
            if len(self.infos) >= self.max_rooms:
                why = f"the prefill holds destinations of {len(self.infos)} rooms (KVPOOL_SGLANG_MAX_ROOMS)"
            else:
                # last in the age order (a room seen before, its destinations popped since, kept
                # its old place with a new time: each sweep stopped at it, the rooms behind it
                # not dropped for their age)
                self._seen.pop(room, None)
                self._seen[room] = now
        elif session not in infos and len(infos) >= min(max(1, need), self.max_sessions):
            why = f"room {room} already has its {len(infos)} decode destinations"
        if why is not None:
            self.refused += 1
            if self._log.ready():
                log.warning(
                    "kvpool prefill: metadata of room %s from decode %s refused: %s (%d refused so far)",
                    room,
                    session,
                    why,
                    self.refused,
                )
        return why

    def claim(self, room: int) -> None:
        """A sender (request) of this prefill holds ``room``: it is never dropped for its age."""
        self._claimed.add(room)

    def forget(self, room: int) -> None:
        """The room's sender was cleared: SGLang dropped what it kept for the room."""
        self._claimed.discard(room)
        self._seen.pop(room, None)

    def _sweep(self, now: float) -> None:
        """Forget rooms cleared meanwhile; drop rooms older than the TTL that no request holds.
        Oldest first, so each room is looked at about once per TTL."""
        seen, evicted = self._seen, []
        while seen:
            room, t = next(iter(seen.items()))
            if now - t < self.ttl_s and room in self.infos:
                break
            del seen[room]
            if room not in self.infos:
                continue
            if room in self._claimed:  # its sender clears it
                seen[room] = now
                continue
            self.drop(room)
            evicted.append(room)
        if evicted:
            self.evicted += len(evicted)
            if self._log.ready():
                log.warning(
                    "kvpool prefill: dropped the destinations of %d room(s) no request claimed in %.0f s: %s",
                    len(evicted),
                    self.ttl_s,
                    evicted[:8],
                )


class PeerTable:
    """The decode ranks registered with a prefill rank (session -> what its registration said),
    bounded: at most ``max_peers`` (``KVPOOL_SGLANG_MAX_PEERS``, default 4096); a registration
    beyond evicts the peer unused longest (neither registered nor written to), counted and logged
    (rate-limited). A decode rank registers once per prefill rank and keeps its session for its
    life, so only sessions of decodes long gone (restarted under a new session) or registrations
    nobody uses reach the bound in practice. Its control thread calls :meth:`put`, transfer
    workers :meth:`get`."""

    def __init__(self, max_peers: int | None = None) -> None:
        if max_peers is None:
            max_peers = int(os.environ.get("KVPOOL_SGLANG_MAX_PEERS", "4096"))
        self.max_peers = max(1, max_peers)
        self._peers: OrderedDict[str, Any] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.evicted = 0
        self._log = Throttle()

    def put(self, session: str, peer: Any) -> None:
        """Store (or replace) a decode rank's registration; evicts the longest unused beyond the bound."""
        with self._lock:
            self._peers[session] = peer
            self._peers.move_to_end(session)
            gone = []
            while len(self._peers) > self.max_peers:
                gone.append(self._peers.popitem(last=False)[0])
            self.evicted += len(gone)
            evicted = self.evicted
        if gone and self._log.ready():
            log.warning(
                "kvpool prefill: %d decode rank(s) registered (KVPOOL_SGLANG_MAX_PEERS); forgot the one(s) "
                "unused longest: %s (%d so far); a room of theirs fails",
                self.max_peers,
                gone[:4],
                evicted,
            )

    def get(self, session: str) -> Any:
        """The registration of ``session`` (None when it never registered or was evicted)."""
        with self._lock:
            peer = self._peers.get(session)
            if peer is not None:
                self._peers.move_to_end(session)
            return peer

    def __len__(self) -> int:
        return len(self._peers)

    def sessions(self) -> list[str]:
        """The registered sessions, unused longest first."""
        with self._lock:
            return list(self._peers)


def writing_key(room: int) -> str:
    """With pipeline parallelism: the key under which a stage's PPConsensusStore (SGLang's,
    replicated to stage 0, whose sender alone polls) says that the stage writes a chunk of
    ``room`` (its manager's transfer worker puts it, and pops it once the chunk ended)."""
    return f"kvpool-writing:{room}"


class LateRooms:
    """The rooms of one transfer worker whose batch raised TransferTimeout with its GPU copies
    still queued (a hung stream; ``kvpool.errors.late_batch``), parked until ``settled(batch_id)``
    (``TransferEngine.batch_settled``, never blocks) says they ended. The worker thread alone
    uses it: :meth:`park` when a chunk's copies outlive the timeout, :meth:`wait_s` as its
    queue's get timeout, :meth:`ended` on every turn of its loop, so that the parked rooms hold
    up none of the rooms behind them in its queue. At most one entry per chunk being written
    (the worker drops later chunks of a parked room), so no bound beyond the rooms'."""

    MIN_WAIT_S = 0.01
    MAX_WAIT_S = 0.5

    def __init__(self, settled: Callable[[int], bool]) -> None:
        self._settled = settled
        self._parked: list[tuple[int, int, str]] = []  # (room, batch id, failure reason)
        self._wait = self.MIN_WAIT_S

    def park(self, room: int, batch_id: int, reason: str) -> None:
        """``room``'s batch ``batch_id`` outlived the timeout (it fails with ``reason`` once its
        copies ended); looked at again soon, then less often (backoff to :attr:`MAX_WAIT_S`)."""
        self._parked.append((room, batch_id, reason))
        self._wait = self.MIN_WAIT_S

    def wait_s(self) -> float | None:
        """How long the worker may wait for its next chunk: None (no bound) when nothing is
        parked, else the backoff's current step."""
        return self._wait if self._parked else None

    def ended(self) -> list[tuple[int, str]]:
        """(room, reason) of the parked rooms whose copies ended since the last call, each once."""
        done = [p for p in self._parked if self._settled(p[1])]
        if done:
            self._parked = [p for p in self._parked if p not in done]
        if self._parked:
            self._wait = min(self._wait * 2, self.MAX_WAIT_S)
        return [(room, reason) for room, _, reason in done]

    def __len__(self) -> int:
        return len(self._parked)


class Unsettled:
    """A prefill manager's rooms of which a WRITE to one decode rank raised TransferTimeout: that
    rank's control endpoint (ip, port). Its pages may still be written: a stalled decode may
    apply WRITE frames it received (TCP), GPU copies may outlive the timeout (until their batch
    settles, :class:`LateRooms`). Its abort is not acked meanwhile (the decode keeps the pages
    until SGLang's release timeout); the room's other decode ranks, whose writes completed or
    never started (a room's chunks stop at its first failure), are acked at once. The transfer
    workers :meth:`add` (and :meth:`settled` once late copies ended), the control thread reads;
    callers hold the manager's room lock. Bounded: the oldest entry beyond ``max_rooms``
    (``KVPOOL_SGLANG_MAX_ROOMS``) is forgotten, logged (an abort of it would then be acked)."""

    def __init__(self, max_rooms: int | None = None) -> None:
        if max_rooms is None:
            max_rooms = int(os.environ.get("KVPOOL_SGLANG_MAX_ROOMS", "16384"))
        self.max_rooms = max(1, max_rooms)
        self._rooms: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self.forgotten = 0
        self._log = Throttle()

    def add(self, room: int, endpoint: tuple[str, int]) -> None:
        """A WRITE of ``room`` to the decode rank at ``endpoint`` timed out."""
        self._rooms[room] = (str(endpoint[0]), int(endpoint[1]))
        self._rooms.move_to_end(room)
        while len(self._rooms) > self.max_rooms:
            gone = self._rooms.popitem(last=False)[0]
            self.forgotten += 1
            if self._log.ready():
                log.warning(
                    "kvpool prefill: forgot that a WRITE of room %s timed out (%d such rooms kept, "
                    "KVPOOL_SGLANG_MAX_ROOMS): an abort of it is acked (%d forgotten so far)",
                    gone,
                    self.max_rooms,
                    self.forgotten,
                )

    def settled(self, room: int) -> None:
        """Nothing of ``room``'s timed-out WRITE can still land (its late copies ended)."""
        self._rooms.pop(room, None)

    def holds(self, room: int, ip: str, port: int) -> bool:
        """Whether a timed-out WRITE of ``room`` may still write the decode rank at (ip, port)."""
        return self._rooms.get(room) == (str(ip), int(port))

    def __len__(self) -> int:
        return len(self._rooms)
