"""The decode side of :class:`kvpool.connectors.vllm.pd.KvpoolConnector`: load threads (one per
prefill peer, bounded), the READs of a request's KV (equal TP: one batch of block runs; another
TP size: every prefill rank's head slices by the reshard plan, one wait), and the "done" notices
that fence each read (:meth:`DecodeLoads._notify`). A mixin of the connector's worker
(``_PdWorker``), whose state it uses: the model thread hands jobs over in ``start``; everything
here runs on the lanes' threads, except a small same-host load, done in ``start`` itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool._rpc import RpcClient
from kvpool.connectors.vllm.common import Region
from kvpool.connectors.vllm.pd_scheduler import NOTHING_READ, RecvJob, blocks_digest
from kvpool.connectors.vllm.pd_stream import (
    LONG_POLL_S,
    POLL_MAX_S,
    POLL_MIN_S,
    StreamLoad,
    region_columns,
    stream_round,
)
from kvpool.connectors.vllm.reshard import (
    KvLayout,
    RegionAddr,
    RegionPairs,
    ReshardError,
    check_compatible,
    plan_columns,
    plan_sources,
    region_pairs,
)
from kvpool.errors import KvpoolError, TransferError, late_batch
from kvpool.transfer.types import OpCode

if TYPE_CHECKING:
    from kvpool.connectors.vllm.pd import _PdWorker

    _Base = _PdWorker
else:
    _Base = object

log = logging.getLogger("kvpool.connectors.vllm")

# Load threads per decode worker: one per prefill peer up to this many, then peers share them.
MAX_PEER_THREADS = 32
# A lane sends its pending "done" notices after at most this many loads in a row.
_LOADS_BEFORE_NOTICES = 8
#: Request ids one "done" notice carries at most (a prefill refuses a longer one whole).
MAX_DONE_IDS = 4096
#: Seconds between a lane's looks at its parked loads' copies (doubling up to the maximum).
PARK_POLL_MIN_S, PARK_POLL_MAX_S = 0.01, 0.5
#: How long a "done" notice may wait at the prefill for requests it does not know yet (its
#: metadata can come after the notice), at most half the RPC timeout.
DONE_WAIT_S = 5.0


@dataclass
class _Remote:
    segment: str
    handle: Any
    regions: dict[str, Region]
    block_size: int
    kv_layout: dict[str, Any] | None = None
    layout: KvLayout | None = None
    """``kv_layout`` parsed (once, on the first resharded load)."""
    pairs: RegionPairs | None = None
    """This decode rank's regions paired with this prefill rank's (once, on the first resharded load)."""
    compatible: bool = False
    """Equal TP: its layout was found to be this rank's (once per handshake)."""
    engine_id: str | None = None
    """The incarnation that answered the handshake: its regions are where its blocks are."""


def _addr(r: Region) -> RegionAddr:
    return RegionAddr(r.addr, r.stride, r.num_blocks)


@dataclass
class _Parked:
    """A failed load whose READ raised TransferTimeout while its GPU copies were still queued (a
    hung stream): they may still land in its blocks. It stays in progress -- neither finished nor
    a load error, so vLLM keeps the request waiting and its blocks allocated -- until the engine
    says the batch ended (:meth:`~kvpool.transfer.engine.TransferEngine.batch_settled`); only then
    are its blocks reported (recompute). Held and polled by the job's lane."""

    job: RecvJob
    batch_id: int
    why: str
    since: float = field(default_factory=time.monotonic)


class _PeerLane:
    """Load thread of one prefill peer (past :data:`MAX_PEER_THREADS` peers, of a few): its loads
    first, then its "done" notices, one RPC per peer; between them it looks at its parked loads
    (:class:`_Parked`: failed, their late GPU copies not ended yet). A dead or stalled peer holds
    up only the requests whose KV is on it."""

    def __init__(self, worker: DecodeLoads, name: str) -> None:
        self.worker = worker
        self._cv = threading.Condition()
        self._loads: deque[RecvJob] = deque()
        self._notices: deque[RecvJob] = deque()
        self._new: list[StreamLoad] = []
        self._new_parked: list[_Parked] = []
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def load(self, job: RecvJob) -> None:
        with self._cv:
            self._loads.append(job)
            self._cv.notify()

    def notice(self, job: RecvJob) -> None:
        with self._cv:
            self._notices.append(job)
            self._cv.notify()

    def stream(self, ld: StreamLoad) -> None:
        with self._cv:
            self._new.append(ld)
            self._cv.notify()

    def park(self, p: _Parked) -> None:
        """Hold a failed load until its copies end (any thread: the lane itself or ``start``)."""
        with self._cv:
            self._new_parked.append(p)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _loop(self) -> None:
        in_a_row = 0
        active: list[StreamLoad] = []  # streaming loads: one progress question per round
        seen: dict[tuple[str, int], int] = {}  # per prefill peer: the progress version last seen
        wait_s = POLL_MIN_S
        parked: list[_Parked] = []  # failed loads whose late copies may still land in their blocks
        park_s = PARK_POLL_MIN_S
        while True:
            with self._cv:
                if active or parked:
                    if not (self._loads or self._notices or self._new or self._new_parked or self._stop):
                        step = min(wait_s, park_s) if parked else wait_s
                        self._cv.wait(step if active else park_s)
                else:
                    while not (self._loads or self._notices or self._new or self._new_parked or self._stop):
                        self._cv.wait()
                if self._stop:
                    return
                active.extend(self._new)
                self._new.clear()
                if self._new_parked:
                    parked.extend(self._new_parked)
                    self._new_parked.clear()
                    park_s = PARK_POLL_MIN_S
                job = None
                notices: list[RecvJob] = []
                if self._loads and (in_a_row < _LOADS_BEFORE_NOTICES or not self._notices):
                    job = self._loads.popleft()
                    in_a_row += 1
                elif self._notices:
                    notices, self._notices = list(self._notices), deque()
                    in_a_row = 0
            if job is not None:
                self.worker._load(job)
                with self._cv:
                    self._notices.append(job)
            elif notices:
                self.worker._notify(notices)
            if active:
                with self._cv:  # wait at the prefill only when nothing else is queued here
                    idle = not (self._loads or self._notices or self._new)
                try:
                    ended, moved, waited = stream_round(
                        self.worker, active, seen, LONG_POLL_S if idle else 0.0
                    )
                except Exception as exc:  # noqa: BLE001 - never a dead lane: its loads fail instead
                    log.exception("kvpool connector: streaming round failed")
                    why = f"{type(exc).__name__}: {exc}"
                    ended, moved, waited = [(ld, why) for ld in active], False, False
                for ld, why in ended:
                    active.remove(ld)
                    if self.worker._stream_ended(ld, why):
                        with self._cv:
                            self._notices.append(ld.job)
                wait_s = (
                    0.0 if waited else POLL_MIN_S if moved else min(max(wait_s, POLL_MIN_S) * 2, POLL_MAX_S)
                )
            if parked:
                n = len(parked)
                parked = self.worker._settle_parked(parked)
                park_s = PARK_POLL_MIN_S if len(parked) < n else min(park_s * 2, PARK_POLL_MAX_S)


class DecodeLoads(_Base):
    """Decode-side loads of ``_PdWorker`` (see the module docstring)."""

    def _lane(self, job: RecvJob) -> _PeerLane:
        """The load thread of the job's prefill peer (made on first use; bounded)."""
        key = (job.remote_host, job.remote_port + self.tp_rank)
        lane = self._lanes.get(key)
        if lane is None:
            if len(self._lane_list) < MAX_PEER_THREADS:
                lane = _PeerLane(self, f"kvpool-pd-load-{len(self._lane_list)}")
                self._lane_list.append(lane)
            else:
                lane = self._lane_list[hash(key) % MAX_PEER_THREADS]
            self._lanes[key] = lane
        return lane

    def _inline(self, job: RecvJob) -> bool:
        rem = self._remotes.get((job.remote_host, job.remote_port + self.tp_rank))
        if rem is None or self.engine is None or not self.cfg.inline_load_bytes:
            return False
        nbytes = len(job.local_block_ids) * sum(r.block_bytes for r in self.regions)
        return nbytes <= self.cfg.inline_load_bytes and self.engine.uses_same_host_path(rem.handle)

    def _rpc(self, host: str, port: int, use: str = "") -> RpcClient:
        """The side-channel client of a prefill rank (``use``: a separate connection). A call
        on a connection the prefill closed (it restarted on that port) is sent once more on a new
        one: ``layout`` and ``progress`` only read, and every answer names the incarnation that
        gave it (a read made against the old one is refused by the engine-id fence of
        :meth:`_notify` and the streaming rounds), so the first load after a restart works."""
        key = (host, port, use)
        rpc = self._rpcs.get(key)
        if rpc is None:
            rpc = self._rpcs[key] = RpcClient(
                f"{host}:{port}", self.cfg.transfer_timeout_s, self.cfg.secret, reconnect=True
            )
        return rpc

    def _remote(self, host: str, port: int, engine_id: str | None = None) -> _Remote:
        """The prefill rank's segment, regions and layout from its ``layout`` handshake (cached).
        ``engine_id``: the incarnation a load's params name; a handshake answered by another one
        (the prefill restarted on that port: its regions may have moved) is made again."""
        key = (host, port)
        rem = self._remotes.get(key)
        if rem is not None and engine_id and rem.engine_id != engine_id:
            rem = self._remotes.pop(key)
            rem = None
        if rem is None:
            assert self.engine is not None
            reply = self._rpc(host, port).call("layout")
            regions = {r.name: r for r in map(Region.from_wire, reply["regions"])}
            eid = reply.get("engine_id")
            rem = _Remote(reply["segment"], self.engine.open_segment(reply["segment"]), regions,
                          int(reply["block_size"]), reply.get("kv_layout"),
                          engine_id=eid if isinstance(eid, str) else None)  # fmt: skip
            self._remotes[key] = rem
        return rem

    def _check_layout(self, rem: _Remote) -> None:
        """Equal TP sizes: the prefill's KV layout must be this rank's -- dtype (bf16 against fp16
        has the same bytes per block), model, heads, head size, block order; ReshardError names the
        first difference. Where either side could not describe its layout, the block byte sizes
        (``region_columns``) are all that is compared."""
        if rem.compatible or rem.kv_layout is None or self.kv_layout is None:
            return
        if rem.layout is None:
            rem.layout = KvLayout.from_wire(rem.kv_layout)
        check_compatible(rem.layout, self.kv_layout)
        rem.compatible = True

    def _columns(self, rem: _Remote, job: RecvJob) -> tuple[list[int], list[int], list[int]]:
        """(local addresses, remote addresses, lengths) of the READs of one load."""
        self._check_layout(rem)
        if rem.block_size != self.block_size:
            raise TransferError(f"block size differs: prefill {rem.block_size}, decode {self.block_size}")
        if set(rem.regions) != {r.name for r in self.regions}:
            raise TransferError("prefill and decode KV cache layers differ (same model and layout needed)")
        cols: tuple[list[int], list[int], list[int]] = ([], [], [])
        for loc in self.regions:
            region_columns(loc, rem.regions[loc.name], job.local_block_ids, job.remote_block_ids, cols)
        return cols

    def _load_resharded(self, job: RecvJob) -> int:
        """Decode rank, prefill TP != decode TP: READ this rank's head slices from every prefill
        rank the reshard plan names. Runs on the load thread.

        Every source's plan is built and checked before any byte moves; the load succeeds only when
        every source's ranges completed (one ``batch_transfer_sync_multi``): a failed source fails the
        whole load and every block of it is reported to vLLM (never a partial load marked ready).
        """
        ptp = job.remote_tp_size
        if self.kv_layout is None:
            raise ReshardError(
                f"prefill TP {ptp} and decode TP {self.tp_size} differ and this decode's KV cache cannot be "
                f"resharded ({self._layout_why}); use equal TP sizes"
            )
        first = self._remote(job.remote_host, job.remote_port, job.remote_engine_id)
        if first.kv_layout is None:
            raise ReshardError(
                f"prefill TP {ptp} != decode TP {self.tp_size} and the prefill sent no KV layout"
            )
        if first.layout is None:
            first.layout = KvLayout.from_wire(first.kv_layout)
        sources = plan_sources(ptp, self.kv_layout, first.layout)
        lb, rb = job.local_block_ids, job.remote_block_ids
        parts = []  # (segment, locals, remotes, lengths) per source rank, numpy columns
        for p in sources:
            rem = self._remote(job.remote_host, job.remote_port + p, job.remote_engine_id)
            pl = rem.layout
            if pl is None:
                pl = rem.layout = KvLayout.from_wire(rem.kv_layout or {})
            if pl.tp_size != ptp or pl.tp_rank != p:
                raise ReshardError(
                    f"prefill rank {p} reports TP rank {pl.tp_rank} of {pl.tp_size}, not {p} of {ptp}"
                )
            if rem.pairs is None:  # once per handshake: the regions and layouts do not change
                if set(rem.regions) != {r.name for r in self.regions}:
                    raise ReshardError(
                        "prefill and decode KV cache layers differ (same model and layout needed)"
                    )
                rem.pairs = region_pairs(
                    pl, self.kv_layout, [(_addr(r), _addr(rem.regions[r.name])) for r in self.regions]
                )
            parts.append((rem.segment, *plan_columns(pl, self.kv_layout, rem.pairs, lb, rb)))
        engine = self.engine
        assert engine is not None

        # Every source in one call (short loads: one native call in this thread; longer ones: one
        # batch in flight on the engine's threads, one wait): the load is done only when all
        # completed; a failed range fails the whole load (never a partial load marked ready).
        return engine.batch_transfer_sync_multi(parts, OpCode.READ)

    def _notify(self, jobs: list[RecvJob]) -> None:
        """Tell prefill side channels their blocks may go (read or given up on), one RPC per
        peer, and complete the loads among ``jobs``. Runs on the peer's lane only.

        The notice is also the fence of a read: a load is reported finished only when every
        prefill rank it read from answers that it still held the blocks when the notice came
        (after the read). Blocks freed unread after ``abort_timeout_s``, an undeliverable notice,
        or an answer from another instance (the prefill restarted on that port) fail the load:
        those blocks may hold another request's KV by now.
        """
        by_peer: dict[tuple[str, int, int], list[RecvJob]] = {}
        for job in jobs:
            if job.remote_tp_size == self.tp_size:
                peers = [(job.remote_host, job.remote_port + self.tp_rank, 1)]
            else:  # every prefill rank frees its blocks after a notice from every decode rank
                peers = [
                    (job.remote_host, job.remote_port + p, self.tp_size) for p in range(job.remote_tp_size)
                ]
            for peer in peers:
                by_peer.setdefault(peer, []).append(job)
        bad: dict[str, str] = {}  # remote request id -> why its load fails
        for (host, port, of), all_jobs in by_peer.items():
            for k in range(0, len(all_jobs), MAX_DONE_IDS):
                pjobs = all_jobs[k : k + MAX_DONE_IDS]
                ids = [j.remote_request_id for j in pjobs]
                gens = {j.remote_request_id: j.gen for j in pjobs if j.gen is not None}
                # Two loads naming one id with other blocks, stream generations or incarnations
                # (one answer per id: the last one's generation was checked for both, so a read
                # under a generation preempted since was confirmed by a later one's): none matches.
                digests: dict[str, str] = {}
                firsts: dict[str, int] = {}  # streamed reads: the first prompt block the digest covers
                named: dict[str, tuple[str | None, int | None, int | None, str | None]] = {}
                for j in pjobs:
                    r = j.remote_request_id
                    mine = (j.blocks_digest, j.stream_first, j.gen, j.remote_engine_id)
                    if named.setdefault(r, mine) != mine:
                        digests[r] = "conflict"
                    elif j.blocks_digest and digests.get(r) != "conflict":
                        digests[r] = j.blocks_digest
                    if j.stream_first is not None:
                        firsts[r] = j.stream_first
                engines = {j.remote_request_id: j.remote_engine_id for j in pjobs if j.remote_engine_id}
                wait = min(DONE_WAIT_S, self.cfg.transfer_timeout_s / 2)
                try:
                    reply = self._rpc(host, port).call(
                        "done", req_ids=ids, of=of, rank=self.tp_rank, gens=gens, digests=digests,
                        firsts={r: f for r, f in firsts.items() if r in gens}, engines=engines, wait_s=wait,
                    )  # fmt: skip
                    expired, engine = reply.get("expired"), reply.get("engine_id")
                    if not isinstance(expired, list) or not isinstance(engine, (str, type(None))):
                        raise TypeError(f"malformed answer {reply!r:.200}")
                except Exception as exc:  # noqa: BLE001 - unreachable, or a malformed answer: unconfirmed
                    log.debug("done notice for %s not confirmed: %s", ids, exc)
                    for j in pjobs:
                        bad[j.remote_request_id] = f"the read could not be confirmed by {host}:{port} ({exc})"
                    continue
                alien = [x for k in ("refused", "unknown") if isinstance(y := reply.get(k), list) for x in y]
                for r in expired:
                    bad[str(r)] = (
                        f"{host}:{port} did not hand out these blocks for that request (its "
                        "kv_transfer_params were edited, or it never knew the request)"
                        if r in alien
                        else f"{host}:{port} had freed the blocks (abort_timeout_s passed, or another "
                        "decode request read them first)"
                    )
                for j in pjobs:
                    if engine and j.remote_engine_id and engine != j.remote_engine_id:
                        bad[j.remote_request_id] = (
                            f"{host}:{port} is another instance now ({engine}, restarted?)"
                        )
                    elif not j.remote_engine_id:  # (the prefill answers it "expired": never confirmed)
                        bad[j.remote_request_id] = (
                            f"its kv_transfer_params name no remote_engine_id: {host}:{port} cannot "
                            "confirm it held those blocks for this read"
                        )
        for job in jobs:
            with self._lock:
                if job.req_id not in self._confirming:
                    continue  # only a notice (aborted, failed): nothing waits on it
                self._confirming.discard(job.req_id)
                why = bad.get(job.remote_request_id)
                if why is not None:
                    self._load_errors.update(job.local_block_ids)
                self._recv_done.add(job.req_id)
            if why is not None:
                self.stats.record_failure("PrefillFreed" if "abort_timeout_s" in why else "Unconfirmed")
                log.warning("kvpool connector: KV of %s read but not confirmed: %s; blocks reported to vLLM "
                            "(kv_load_failure_policy: recompute or fail)", job.req_id, why)  # fmt: skip

    def _stream_ended(self, ld: StreamLoad, why: str | None) -> bool:
        """A streaming load ended on its lane (``why``: None, or why it failed). Returns whether
        the prefill must be sent a "done" notice (it knows the request: its blocks wait for it)."""
        job = ld.job
        with self._lock:
            self._stream_loads.pop(job.req_id, None)
        job.gen = ld.gen  # its notice is a streamed one (checked by generation and digest), failed or not
        if why is not None or job.stream_first is None:  # read nothing: the notice only frees
            job.stream_first = NOTHING_READ
            job.blocks_digest = blocks_digest(job.remote_request_id, [])
        if why is None:
            if job.local_block_ids:
                wait_ms = (time.perf_counter() - ld.t0) * 1e3
                log.info("kvpool connector: streamed %d blocks (%d bytes) for %s in %.2f ms of reads "
                         "(%d rounds, %.1f ms after the decode asked)", len(job.local_block_ids), ld.nbytes,
                         job.req_id, ld.read_s * 1e3, ld.rounds, wait_ms)  # fmt: skip
            self._load_done(job, True, ld.nbytes, ld.read_s)
            return True
        self.stats.record_failure("StreamFailed")
        late = self._late_batch(ld.error) if ld.error is not None else None
        if late is not None:
            self._park(job, late, why)  # a READ of this round may still land in its blocks
            return bool(job.remote_request_id)
        log.warning("kvpool connector: streaming the KV of %s from %s:%d failed (%s); blocks reported to "
                    "vLLM (kv_load_failure_policy: recompute or fail)",
                    job.req_id, job.remote_host, job.remote_port, why)  # fmt: skip
        self._load_done(job, False)
        return bool(job.remote_request_id)

    def _load_done(self, job: RecvJob, ok: bool, nbytes: int = 0, seconds: float = 0.0) -> None:
        """Record a load's outcome (per-request or streamed; a job without local blocks is only a
        notice): read -> counted, finished once the prefill confirms it (``_notify``); failed ->
        its blocks reported to vLLM and the request finished."""
        if not job.local_block_ids:
            return  # only a notice for the prefill: vLLM is not waiting for this request
        if ok:
            self.loaded_blocks += len(job.local_block_ids)
            self.loaded_bytes += nbytes
            self.stats.record_transfer(seconds, nbytes, len(job.local_block_ids))
        with self._lock:
            if ok:
                self._confirming.add(job.req_id)
            else:
                self._load_errors.update(job.local_block_ids)
                self._recv_done.add(job.req_id)

    def _forget_remotes(self, job: RecvJob) -> None:
        """After a typed failure: drop the cached layouts of every prefill rank the job reads from
        (a restarted peer is asked again on the next load)."""
        ranks = range(job.remote_tp_size) if job.remote_tp_size != self.tp_size else ()
        for p in {self.tp_rank, *ranks}:
            self._remotes.pop((job.remote_host, job.remote_port + p), None)

    def _late_batch(self, exc: Exception) -> int | None:
        """The batch of a READ that raised TransferTimeout while its GPU copies still run (they
        may still land in the load's blocks), or None where nothing of it is in flight."""
        bid = late_batch(exc)
        if bid is None or self.engine is None or self.engine.batch_settled(bid):
            return None
        return bid

    def _park(self, job: RecvJob, batch_id: int, why: str) -> None:
        """A load failed with its copies still queued: its lane holds it (:class:`_Parked`) until
        they end. Runs on the lane or, for a load done in ``start``, the model thread (the job's
        lane exists then: ``start`` made it)."""
        log.warning("kvpool connector: loading KV of %s from %s:%d failed (%s); the request keeps waiting "
                    "(its blocks stay allocated) until those GPU copies end, then its blocks are reported to "
                    "vLLM", job.req_id, job.remote_host, job.remote_port, why)  # fmt: skip
        key = (job.remote_host, job.remote_port + self.tp_rank)
        lane = self._lanes.get(key) or self._lane(job)
        lane.park(_Parked(job, batch_id, why))

    def _settle_parked(self, parked: list[_Parked]) -> list[_Parked]:
        """Lane thread: report the parked loads whose copies ended (failed: their blocks go to
        vLLM, which recomputes them); returns those still copying. Never blocks (one native
        status call each)."""
        assert self.engine is not None
        keep = []
        for p in parked:
            if not self.engine.batch_settled(p.batch_id):
                keep.append(p)
                continue
            log.warning("kvpool connector: the late GPU copies of %s's failed load (%s) ended after %.1f s; "
                        "blocks reported to vLLM (kv_load_failure_policy: recompute or fail)",
                        p.job.req_id, p.why, time.monotonic() - p.since)  # fmt: skip
            self._load_done(p.job, False)
        return keep

    def _load(self, job: RecvJob) -> None:
        """READ one request's KV into its blocks (a lane, or ``start`` for a small same-host
        load) and record the outcome; a READ whose GPU copies outlived the engine's timeout is
        parked instead (:meth:`_park`): reported only once they ended."""
        t0 = time.perf_counter()
        ok = True
        why = ""
        nbytes = 0
        late = None
        try:
            if job.local_block_ids:
                if job.remote_tp_size != self.tp_size:
                    nbytes = self._load_resharded(job)
                else:
                    port = job.remote_port + self.tp_rank
                    rem = self._remote(job.remote_host, port, job.remote_engine_id)
                    locs, rems, lens = self._columns(rem, job)
                    nbytes = sum(lens)
                    assert self.engine is not None
                    # One batch, submitted as columns; raises a typed error naming what failed.
                    self.engine.batch_transfer_sync(rem.segment, locs, rems, lens, OpCode.READ)
        except KvpoolError as exc:
            ok, why = False, str(exc)
            self.stats.record_failure(type(exc).__name__)
            self._forget_remotes(job)
            late = self._late_batch(exc)
        except Exception as exc:  # noqa: BLE001 - never leave a request waiting forever
            ok, why = False, f"{type(exc).__name__}: {exc}"
            self.stats.record_failure(type(exc).__name__)
        seconds = time.perf_counter() - t0
        if late is not None:
            self._park(job, late, why)
            return
        if ok and job.local_block_ids:
            log.info("kvpool connector: loaded %d blocks (%d bytes) for %s in %.2f ms",
                     len(job.local_block_ids), nbytes, job.req_id, seconds * 1e3)  # fmt: skip
        elif not ok:
            log.warning("kvpool connector: loading KV of %s from %s:%d failed (%s); blocks reported to vLLM "
                        "(kv_load_failure_policy: recompute or fail)",
                        job.req_id, job.remote_host, job.remote_port, why)  # fmt: skip
        self._load_done(job, ok, nbytes, seconds)
