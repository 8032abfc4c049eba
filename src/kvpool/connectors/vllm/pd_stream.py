"""Streaming (layer-wise) P/D for :class:`~kvpool.connectors.vllm.pd.KvpoolConnector`.

The proxy sends a request to a prefill and a decode instance at once, with one ``transfer_id``
(``kvpool proxy --stream-kv``). The decode allocates its blocks and its load thread asks the
prefill's side channel ``progress`` for that id: which blocks the prefill request holds and, per
KV region (layer, or K/V plane of a layer), up to which token the KV is final. It READs every block
whose KV became final since its last question -- layer *i* of a chunk while layer *i+1* is being
computed -- and the last ones when the prefill's forward pass ends. The owner of the memory still
decides: the prefill only announces, the decode pulls, and the load's ``done`` notice is the fence.

Prefill side (:class:`StreamTable`, in the worker): the scheduler sends, each step, every streaming
request's blocks and the token count its step computes up to (``StreamStep``); ``save_kv_layer``
(vLLM's attention layer, after writing that layer's KV) marks the layer final up to that count (on
a GPU once an event recorded on the compute stream has completed); ``wait_for_save`` marks every
layer. A preempted request (its blocks freed, recomputed later) bumps the stream's generation: a
decode that read under the old one starts over, and a ``done`` notice naming an old generation is
answered "expired" (the load fails; vLLM recomputes). Generations are the scheduler's count
(``StreamStep.gen``: identical on every TP rank, never repeated), so a notice of an earlier stream
of a reused request id is told from the new stream's (:meth:`StreamTable.read_gen`). The notice
also carries the :func:`~kvpool.connectors.vllm.pd_scheduler.blocks_digest` of the request id and
the prompt's blocks it read (from the first one on, as the progress answers named them; a list
that changed under one generation fails the load): confirmed only when they are the blocks vLLM
holds for that request once it finished. An aborted request's stream is dead: the decode's load
fails at its next question.

Decode side (:func:`stream_round`, on the peer's load thread): one ``progress`` RPC per peer and
round answers every streaming load from that peer; a load not seen by the prefill within
``abort_timeout_s`` fails (vLLM's ``kv_load_failure_policy`` then recomputes or fails it).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.connectors.vllm.common import Region, block_runs
from kvpool.connectors.vllm.pd_scheduler import NULL_BLOCK, blocks_digest
from kvpool.errors import KvpoolError, TransferError
from kvpool.transfer.types import OpCode

if TYPE_CHECKING:
    from kvpool.connectors.vllm.pd import _PdWorker
    from kvpool.connectors.vllm.pd_scheduler import KvpoolConnectorMetadata, RecvJob

#: Transfer ids one ``progress`` question may name.
MAX_PROGRESS_IDS = 64
#: Seconds between progress questions while nothing new is final (doubles up to the maximum),
#: where the question cannot wait at the prefill (several peers on one load thread).
POLL_MIN_S, POLL_MAX_S = 0.001, 0.01
#: How long a progress question may wait at the prefill for news (long poll), and how many may.
LONG_POLL_S, MAX_PARKED = 0.05, 256


@dataclass
class _Stream:
    req_id: str
    gen: int
    blocks: list[int]
    total: int
    target: int
    final: list[int]
    dead_at: float | None = None
    pending: list[tuple[Callable[[], bool], list[int], int]] = field(default_factory=list)
    first_gen: int = 0  # its first generation: a lower one is an earlier stream's of the request id
    ends: bool = False  # it ends with its prompt (StreamStep.ends): reads may be confirmed before the hold
    given_up: bool = False  # a load of it gave up before it was held: its hold is freed at once


class StreamTable:
    """Prefill worker: the progress of its streaming requests, answered on the side channel.

    ``begin_step`` (vLLM's model runner, before each forward pass), ``layer_saved`` (each attention
    layer), ``step_done`` (after the forward pass) run on the model thread; ``progress`` and
    ``gen_ok`` on the side-channel thread. One lock, held for a few dict operations.
    """

    def __init__(self, regions: list[Region]) -> None:
        self.num_regions = len(regions)
        self._layer: dict[str, list[int]] = {}
        for i, r in enumerate(regions):
            self._layer.setdefault(r.name.split("#")[0], []).append(i)
        self._lock = threading.Lock()
        self._by_tid: dict[str, _Stream] = {}
        self._by_req: dict[str, str] = {}
        self._step: list[_Stream] = []
        self.version = 0  # moves with every change a progress answer could show
        self._parked: list[tuple[Any, Any, list[str], int, float]] = []  # (conn, id, ids, seen, until)
        self.on_change: Callable[[], None] | None = None  # wakes the parked questions' server

    def begin_step(self, meta: KvpoolConnectorMetadata, keep_dead_s: float) -> None:
        now = time.monotonic()
        with self._lock:
            step = []
            for rid, st in meta.stream.items():
                tid = self._by_req.get(rid)
                s = self._by_tid.get(tid) if tid is not None else None
                if s is not None and s.dead_at is None and tid != st.transfer_id:
                    # The request id names another request now (a client's id used again): the
                    # old stream is dead (its decode fails), never fed the new request's blocks.
                    s.dead_at = now
                if s is None or s.dead_at is not None:
                    gen = st.gen if st.gen is not None else 0
                    s = _Stream(rid, gen, [], st.total, 0, [st.computed] * self.num_regions, first_gen=gen)
                    self._by_tid[st.transfer_id] = s
                    self._by_req[rid] = st.transfer_id
                elif st.restart:  # resumed after preemption: the old blocks were freed
                    s.gen = st.gen if st.gen is not None else s.gen + 1
                    s.final = [st.computed] * self.num_regions
                    s.pending.clear()
                s.blocks, s.target, s.total, s.ends = list(st.block_ids), st.tokens, st.total, st.ends
                if st.tokens > st.computed:
                    step.append(s)
            self._step = step
            for rid in meta.stream_end:
                tid = self._by_req.get(rid)
                if tid is not None and tid in self._by_tid:
                    self._by_tid[tid].dead_at = now
            for tid, s in list(self._by_tid.items()):
                if s.dead_at is not None and now - s.dead_at > keep_dead_s:
                    del self._by_tid[tid]
                    if self._by_req.get(s.req_id) == tid:  # (not a later stream of the id)
                        del self._by_req[s.req_id]
            wake = self._changed() if meta.stream or meta.stream_end else False
        self._wake(wake)

    def _changed(self) -> bool:
        """Under the lock: a change; whether parked questions wait for it."""
        self.version += 1
        return bool(self._parked)

    def _wake(self, wake: bool) -> None:
        if wake and self.on_change is not None:
            self.on_change()

    def busy(self) -> bool:
        """Whether the current step computes any streaming request (model thread)."""
        return bool(self._step)

    def layer_saved(self, layer_name: str, ready: Callable[[], bool] | None = None) -> None:
        """The layer's KV of this step is written (``ready``: once that returns True)."""
        idx = self._layer.get(layer_name)
        if not idx or not self._step:
            return
        with self._lock:
            for s in self._step:
                if ready is None:
                    for i in idx:
                        s.final[i] = max(s.final[i], s.target)
                else:
                    s.pending.append((ready, idx, s.target))
            wake = self._changed()
        self._wake(wake)

    def step_done(self, ready: Callable[[], bool] | None = None) -> None:
        """The forward pass ended: every layer of the step is written (``ready``: once True)."""
        with self._lock:
            for s in self._step:
                if ready is None:
                    s.final = [max(f, s.target) for f in s.final]
                    s.pending.clear()
                else:
                    s.pending.append((ready, list(range(self.num_regions)), s.target))
            wake = self._changed() if self._step else False
            self._step = []
        self._wake(wake)

    def forget(self, req_ids: set[str]) -> None:
        """The requests' blocks were freed (read, or given up on)."""
        with self._lock:
            for rid in req_ids:
                tid = self._by_req.pop(rid, None)
                if tid is not None:
                    self._by_tid.pop(tid, None)
            wake = self._changed()
        self._wake(wake)

    def park(self, conn: Any, rid: Any, tids: list[str], seen: int, until: float) -> bool:
        """Side channel: hold a progress question until :attr:`version` moves past ``seen`` or
        ``until``; False (answer now) when it moved already, a GPU readiness is outstanding, or
        too many wait."""
        with self._lock:
            if seen != self.version or len(self._parked) >= MAX_PARKED:
                return False
            if any(self._by_tid[t].pending for t in tids if t in self._by_tid):
                return False
            self._parked.append((conn, rid, tids, seen, until))
            return True

    def due(self, now: float) -> list[tuple[Any, Any, list[str]]]:
        """Side channel: the parked questions to answer now (news, or their time is up)."""
        with self._lock:
            if not self._parked:
                return []
            out, keep = [], []
            for p in self._parked:
                (out if p[3] != self.version or now >= p[4] else keep).append(p)
            self._parked = keep
        return [(c, r, t) for c, r, t, _, _ in out]

    def gen_ok(self, req_id: str, gen: int) -> bool:
        """Side channel, ``done``: may a read made under ``gen`` be trusted?"""
        return self.read_gen(req_id, gen) == "ok"

    def read_gen(self, req_id: str, gen: int) -> str:
        """Side channel, ``done``: a read made under ``gen`` is "ok" (the request's stream, if
        any, is live under it), "stale" (that stream was preempted or aborted since) or "other" (an
        earlier stream of the request id: nothing of it is held now)."""
        with self._lock:
            tid = self._by_req.get(req_id)
            s = self._by_tid.get(tid) if tid is not None else None
            if s is None or (s.gen == gen and s.dead_at is None):
                return "ok"
            return "other" if gen < s.first_gen else "stale"

    def final_blocks(self, req_id: str, gen: int, block_size: int) -> list[int] | None:
        """Side channel, ``done``: the prompt's blocks of the request's stream when it is live
        under ``gen``, ends with its prompt (``max_tokens`` 1) and every region is final for the
        whole prompt, else None. A streamed read of those blocks is then confirmed before the
        request finishes: the step that made the prompt final also finishes the request and holds
        its blocks, and a preemption or abort before that reaches this table (``handle_preemptions``)
        before vLLM writes into a freed block. A request that generates on (``max_tokens`` > 1)
        may free prompt blocks while it runs (a sliding window): its reads wait for the hold. The
        decode's first step then overlaps the end of the prefill's forward pass and its finishing."""
        with self._lock:
            tid = self._by_req.get(req_id)
            s = self._by_tid.get(tid) if tid is not None else None
            if s is None or s.dead_at is not None or s.gen != gen or not s.ends:
                return None
            _ripen(s)
            if min(s.final, default=0) < s.total:
                return None
            return s.blocks[: -(-s.total // block_size)]

    def numbered(self, req_id: str) -> bool:
        """Whether the request's stream has a generation of the scheduler's count (a new stream
        started in a step of this table: a lower generation is an earlier stream's)."""
        with self._lock:
            tid = self._by_req.get(req_id)
            s = self._by_tid.get(tid) if tid is not None else None
            return s is not None and s.first_gen > 0

    def give_up(self, req_id: str) -> None:
        """Side channel, ``done``: a load of the request's stream gave up before it was held."""
        with self._lock:
            tid = self._by_req.get(req_id)
            s = self._by_tid.get(tid) if tid is not None else None
            if s is not None:
                s.given_up = True

    def given_up(self, req_id: str) -> bool:
        """Model thread, as the request is held: whether a load of its stream gave up."""
        with self._lock:
            tid = self._by_req.get(req_id)
            s = self._by_tid.get(tid) if tid is not None else None
            return s is not None and s.given_up

    def progress(self, tids: list[str]) -> tuple[dict[str, Any], int]:
        """Side channel, ``progress``: per transfer id, ``pending`` (not scheduled yet), ``dead``
        (aborted) or ``live`` with the request id, generation, blocks, tokens and per-region final
        token counts; and the table's version."""
        out: dict[str, Any] = {}
        with self._lock:
            for tid in tids[:MAX_PROGRESS_IDS]:
                s = self._by_tid.get(str(tid))
                if s is None:
                    out[tid] = {"state": "pending"}
                elif s.dead_at is not None:
                    out[tid] = {"state": "dead"}
                else:
                    _ripen(s)
                    out[tid] = {"state": "live", "req_id": s.req_id, "gen": s.gen, "total": s.total,
                                "blocks": list(s.blocks), "final": list(s.final),
                                "first": s.first_gen}  # fmt: skip
            return out, self.version


@dataclass
class StreamLoad:
    """Decode: one streaming load in progress on a peer's load thread."""

    job: RecvJob
    deadline: float
    t0: float = field(default_factory=time.perf_counter)
    gen: int | None = None
    first: int | None = None
    """The first generation of the stream it reads (another one: a new stream under its transfer id)."""
    read: dict[str, int] = field(default_factory=dict)  # region name -> local blocks read (in order)
    blocks: list[int] = field(default_factory=list)  # the prompt's blocks read from, under ``gen``
    nbytes: int = 0
    read_s: float = 0.0  # time spent in READs (not waiting for the prefill)
    rounds: int = 0
    cancelled: bool = False
    error: KvpoolError | None = None
    """The typed error that ended it (a TransferTimeout's copies may still land: the lane parks it)."""


def _ripen(s: _Stream) -> None:
    """Under the table's lock: layers whose GPU writes completed since (``pending``) become final."""
    if s.pending:
        keep = []
        for ready, idx, target in s.pending:
            if ready():
                for i in idx:
                    s.final[i] = max(s.final[i], target)
            else:
                keep.append((ready, idx, target))
        s.pending = keep


def region_columns(
    loc: Region, rr: Region, local: list[int], remote: list[int], cols: tuple[list[int], list[int], list[int]]
) -> None:
    """Append the READ columns of blocks ``remote`` of ``rr`` into blocks ``local`` of ``loc``
    (contiguous runs merged; bounds and block sizes checked)."""
    if rr.block_bytes != loc.block_bytes:
        raise TransferError(
            f"layer {loc.name}: {rr.block_bytes}-byte blocks on prefill, {loc.block_bytes} on decode "
            "(dtype, head count or TP size differ)"
        )
    locs, rems, lens = cols
    for lb, rb, n in block_runs(local, remote):
        if lb < 0 or rb < 0 or lb + n > loc.num_blocks or rb + n > rr.num_blocks:
            raise TransferError(f"block ids out of range for layer {loc.name}")
        if loc.stride == loc.block_bytes and rr.stride == rr.block_bytes:
            locs.append(loc.addr + lb * loc.stride)
            rems.append(rr.addr + rb * rr.stride)
            lens.append(n * loc.block_bytes)
        else:
            for i in range(n):
                locs.append(loc.addr + (lb + i) * loc.stride)
                rems.append(rr.addr + (rb + i) * rr.stride)
                lens.append(loc.block_bytes)


def stream_round(
    worker: _PdWorker, loads: list[StreamLoad], seen: dict[tuple[str, int], int], wait_s: float
) -> tuple[list[tuple[StreamLoad, str | None]], bool, bool]:
    """Decode load thread: one progress question per peer for ``loads``, then READ what became
    final. Returns the loads that ended (with None, or why they failed), whether any bytes moved,
    and whether the question waited at the prefill for news (a long poll: ``wait_s`` > 0 and one
    peer; ``seen`` keeps each peer's last answered version). Loads of one peer share its question;
    a failing peer fails only its own loads."""
    ended: list[tuple[StreamLoad, str | None]] = []
    moved = False
    by_peer: dict[tuple[str, int], list[StreamLoad]] = {}
    now = time.monotonic()
    for ld in loads:
        if ld.cancelled:
            ended.append((ld, "the decode request ended before its KV arrived"))
        elif now > ld.deadline:
            ended.append((ld, f"the prefill did not produce the KV within {worker.cfg.abort_timeout_s:g} s"))
        else:
            by_peer.setdefault((ld.job.remote_host, _asked_port(worker, ld.job)), []).append(ld)
    waited = False
    wait_s = wait_s if len(by_peer) == 1 and len(loads) <= MAX_PROGRESS_IDS else 0.0
    for (host, port), pl in by_peer.items():
        for i in range(0, len(pl), MAX_PROGRESS_IDS):
            part = pl[i : i + MAX_PROGRESS_IDS]
            ids = [ld.job.transfer_id for ld in part]
            try:
                rem = worker._remote(host, port)
                t0 = time.monotonic()
                # its own connection: a waiting question never holds up a load or a "done" notice
                reply = worker._rpc(host, port, "poll").call(
                    "progress", ids=ids, seen=seen.get((host, port), -1), wait_s=wait_s
                )
                waited = waited or (wait_s > 0 and time.monotonic() - t0 >= wait_s / 2)
            except Exception as exc:  # noqa: BLE001 - unreachable, or a malformed answer: these loads fail
                worker._remotes.pop((host, port), None)
                ended.extend((ld, f"progress from {host}:{port}: {exc}") for ld in part)
                continue
            if isinstance(reply.get("version"), int):
                seen[(host, port)] = reply["version"]
            states = reply.get("streams") or {}
            for ld in part:
                try:
                    done, n = _advance(worker, rem, ld, states.get(ld.job.transfer_id) or {}, reply)
                except KvpoolError as exc:
                    worker._forget_remotes(ld.job)  # a restarted prefill is asked again next time
                    ld.error = exc
                    ended.append((ld, str(exc)))
                    continue
                except Exception as exc:  # noqa: BLE001 - a malformed answer: never a load left waiting
                    ended.append((ld, f"malformed progress from {host}:{port}: {type(exc).__name__}: {exc}"))
                    continue
                moved = moved or n > 0
                if done:
                    ended.append((ld, None))
    return ended, moved, waited


def _advance(
    worker: _PdWorker, rem: Any, ld: StreamLoad, st: dict[str, Any], reply: dict[str, Any]
) -> tuple[bool, int]:
    """READ the blocks of one load that became final; True once every block of every region was read."""
    job = ld.job
    state = st.get("state")
    if state == "pending":
        return False, 0
    if state != "live":
        raise TransferError(f"the prefill request of transfer {job.transfer_id} ended unfinished ({state})")
    engine = reply.get("engine_id")
    if job.remote_engine_id and engine and engine != job.remote_engine_id:
        raise TransferError(f"{job.remote_host}:{job.remote_port} is another instance now ({engine})")
    if engine and getattr(rem, "engine_id", None) and rem.engine_id != engine:
        # The cached layout (region addresses) came from another incarnation on that port (a
        # predecessor, or this one before its first step): asked again, never read through.
        rem = worker._remote(job.remote_host, _asked_port(worker, job), engine)
        if rem.engine_id != engine:
            raise TransferError(f"{job.remote_host}:{job.remote_port} restarted since its layout was read")
    bs = worker.block_size
    total = int(st["total"])
    if total != job.num_tokens:
        raise TransferError(f"prefill has {total} prompt tokens, decode {job.num_tokens}")
    nblocks = -(-total // bs)
    blocks = [int(b) for b in st["blocks"]][:nblocks]
    final = [int(f) for f in st["final"]]
    req_id = str(st["req_id"])
    if job.remote_request_id and req_id != job.remote_request_id:
        # Another prefill request took the transfer id over (a client that sent one id twice):
        # the blocks read so far hold the first one's KV, the rest would come from the other's.
        raise TransferError(
            f"transfer {job.transfer_id} now names prefill request {req_id}, not {job.remote_request_id}"
        )
    first = st.get("first")
    if type(first) is int and first != (first if ld.first is None else ld.first):
        # A new stream of the request id took the transfer id over (a client that sent both
        # again): its blocks hold the new request's KV, and its notices would be confirmed.
        raise TransferError(f"transfer {job.transfer_id} names a later stream of prefill request {req_id}")
    ld.first = first if type(first) is int else ld.first
    job.remote_request_id = req_id
    job.remote_engine_id = job.remote_engine_id or engine
    if ld.gen != int(st["gen"]):  # first answer, or the prefill was preempted: read from the start
        ld.gen, ld.read, ld.blocks = int(st["gen"]), {}, []
    if blocks[: len(ld.blocks)] != ld.blocks[: len(blocks)]:
        # One generation's block list only grows: blocks read so far may hold other KV now.
        raise TransferError(f"prefill blocks of transfer {job.transfer_id} changed under one generation")
    if len(blocks) > len(ld.blocks):
        ld.blocks = blocks
    local = job.local_block_ids
    index = job.block_index or list(range(nblocks - len(local), nblocks))  # default: the prompt's tail
    if not local:  # nothing to read (local prefix hit, null blocks only, or ended before allocation)
        return True, 0
    if len(index) != len(local) or index[-1] >= nblocks:
        raise TransferError(f"transfer {job.transfer_id}: local blocks do not match a {nblocks}-block prompt")
    if any(blocks[i] == NULL_BLOCK for i in index if i < len(blocks)):
        # A sliding-window prefill handed out its null block (shared, no KV of this request) for
        # a block this decode needs: nothing is read from it, vLLM recomputes.
        raise TransferError("the prefill freed blocks (out of its sliding window) this decode needs")
    if job.remote_tp_size != worker.tp_size:
        # Heterogeneous TP: one resharded load once every layer of every block is final on every
        # prefill rank (one rank can mark its last layer before another wrote it: they meet only
        # at the next collective).
        if len(blocks) < nblocks or min(final, default=0) < total or not _all_ranks_final(worker, job):
            return False, 0
        job.remote_block_ids = [blocks[i] for i in index]
        t = time.perf_counter()
        ld.nbytes = worker._load_resharded(job)
        ld.read_s += time.perf_counter() - t
        _read_all(ld, index[0])
        return True, ld.nbytes
    worker._check_layout(rem)  # dtype, model, heads: equal bytes per block is not the same layout
    if rem.block_size != bs:
        raise TransferError(f"block size differs: prefill {rem.block_size}, decode {bs}")
    names = list(rem.regions)
    if len(final) != len(names) or set(names) != {r.name for r in worker.regions}:
        raise TransferError("prefill and decode KV cache layers differ (same model and layout needed)")
    pos = {n: i for i, n in enumerate(names)}
    cols: tuple[list[int], list[int], list[int]] = ([], [], [])
    upto: dict[str, int] = {}
    for loc in worker.regions:
        f = final[pos[loc.name]]
        end = bisect.bisect_left(index, min(nblocks if f >= total else f // bs, len(blocks)))
        start = ld.read.get(loc.name, 0)
        if end > start:
            rr = rem.regions[loc.name]
            region_columns(loc, rr, local[start:end], [blocks[i] for i in index[start:end]], cols)
            upto[loc.name] = end
    n = sum(cols[2])
    if n:
        assert worker.engine is not None
        t = time.perf_counter()
        worker.engine.batch_transfer_sync(rem.segment, *cols, OpCode.READ)
        ld.read_s += time.perf_counter() - t
        ld.read.update(upto)
        ld.nbytes += n
    ld.rounds += 1
    if all(ld.read.get(r.name, 0) >= len(local) for r in worker.regions):
        job.remote_block_ids = [blocks[i] for i in index]
        _read_all(ld, index[0])
        return True, n
    return False, n


def _read_all(ld: StreamLoad, first: int) -> None:
    """Every block of the load was read: the digest its "done" notice carries (the prompt's blocks
    from the first one read, as the progress answers named them; the prefill confirms the read
    only when they are the blocks it holds for the request)."""
    ld.job.stream_first = first
    ld.job.blocks_digest = blocks_digest(ld.job.remote_request_id, ld.blocks[first:])


def _asked_port(worker: _PdWorker, job: RecvJob) -> int:
    """The side channel of the prefill rank this decode rank asks for a load's progress."""
    return job.remote_port + worker.tp_rank % max(job.remote_tp_size, 1)


def _all_ranks_final(worker: _PdWorker, job: RecvJob) -> bool:
    """Heterogeneous TP: whether every prefill rank reports the whole prompt final."""
    asked = _asked_port(worker, job)
    for p in range(job.remote_tp_size):
        port = job.remote_port + p
        if port == asked:
            continue
        reply = worker._rpc(job.remote_host, port, "poll").call("progress", ids=[job.transfer_id])
        st = (reply.get("streams") or {}).get(job.transfer_id) or {}
        if st.get("state") == "dead":
            raise TransferError(f"the prefill request of transfer {job.transfer_id} ended unfinished (dead)")
        if (
            st.get("state") != "live"
            or min((int(f) for f in st.get("final") or ()), default=0) < job.num_tokens
        ):
            return False
    return True
