"""Scheduler half of :class:`~kvpool.connectors.vllm.pd.KvpoolConnector` and the metadata it
sends the workers once per step (:class:`KvpoolConnectorMetadata`: loads to start, blocks to hold).

Runs in vLLM's scheduler process: every hook returns at once (no I/O). A decode's load is one
:class:`RecvJob`; a prefill's finished request becomes ``kv_transfer_params`` naming its blocks and
side channel, and its blocks are held (``delay_free``) until the worker reports them sent.

Streaming (layer-wise) P/D: the proxy sends the prefill and the decode request at once with a
``transfer_id``. The prefill's scheduler tells its worker, each step, which blocks of a streaming
request the step computes up to which token (:class:`StreamStep`); the decode's load
(:class:`RecvJob` with ``transfer_id``) asks the prefill side channel for that progress and reads
each layer's final blocks while later layers are still being computed.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpool.connectors.vllm.common import VllmConnectorConfig
from kvpool.errors import ConfigError

log = logging.getLogger("kvpool.connectors.vllm")

_MAX_TP = 512
_MAX_BLOCKS = 1 << 22
# vLLM's BlockPool.null_block (id 0): a sliding-window model's block lists name it for blocks out
# of the window (freed, no KV in them); every request shares it, so nothing is read into it or
# reported about it.
NULL_BLOCK = 0
#: ``RecvJob.stream_first`` of a streaming load that read nothing (failed, or nothing to read): its
#: digest names no block (``blocks_digest(id, [])``), its "done" notice only frees the blocks.
NOTHING_READ = 1 << 31


def blocks_digest(request_id: str, block_ids: list[int], hold: int | None = None) -> str:
    """The digest binding a prefill request id to the block ids its ``kv_transfer_params`` name
    (hex). The prefill's scheduler records it per held request (``KvpoolConnectorMetadata.
    send_digest``); the decode computes it from the (request id, block ids) of the params it reads
    by and sends it in its "done" notice: the prefill confirms a read only when it matches its own
    record for that id, so params naming one request's id and another's blocks are refused.
    ``hold``: the hold's number (``remote_hold``; every hold is numbered, from one count per
    incarnation), so that the params of another hold of the id, naming the same blocks, never
    match this one's record, however long ago it was (nothing has to be remembered for that).
    None: a streamed read's digest (fenced by the stream's generation instead)."""
    rid = request_id.encode("utf-8", "surrogatepass")
    person = b"kvpool-pd-blocks" if hold is None else b"kvpool-pd-hold"
    h = hashlib.blake2b(digest_size=16, person=person)
    if hold is not None:
        h.update(hold.to_bytes(8, "little"))
    h.update(len(rid).to_bytes(4, "little"))
    h.update(rid)
    h.update(np.asarray(block_ids, dtype="<i8").tobytes())
    return h.hexdigest()


def _int(x: Any, lo: int, hi: int) -> int | None:
    if isinstance(x, str) and x.isdecimal() and len(x) <= 10:
        x = int(x)
    return x if isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi else None


#: The longest request id (and other text) a decode's ``kv_transfer_params`` may name.
MAX_ID_CHARS = 1024


def _text(x: Any, limit: int = MAX_ID_CHARS) -> str | None:
    return x if isinstance(x, str) and 0 < len(x) <= limit else None


def remote_params(params: dict[str, Any]) -> dict[str, Any] | None:
    """The prefill a decode request's ``kv_transfer_params`` name, checked: they come from a client
    (normally the proxy, but anyone who can reach the server), so a malformed value must make the
    request compute locally, never raise in vLLM's scheduler (which would end the engine). None when
    the parameters name no complete, well-formed prefill: a per-request load (``remote_block_ids``,
    ``remote_request_id``) or a streaming one (``transfer_id``, blocks learnt later)."""
    tp = 1 if params.get("tp_size") is None else _int(params["tp_size"], 1, _MAX_TP)
    host, port = _text(params.get("remote_host"), 255), _int(params.get("remote_port"), 1, 65535)
    engine = params.get("remote_engine_id")
    if tp is None or host is None or port is None or port + tp - 1 > 65535:
        return None
    if engine is not None and _text(engine) is None:
        return None
    out = dict(
        host=host, port=port, tp_size=tp, engine_id=engine, transfer_id=None, request_id="", block_ids=None
    )
    blocks = params.get("remote_block_ids")
    if blocks is None:  # streaming: the prefill's blocks come from its side channel
        out["transfer_id"] = _text(params.get("transfer_id"), 256)
        return out if out["transfer_id"] is not None else None
    out["request_id"] = _text(params.get("remote_request_id"))
    computed = params.get("remote_num_tokens")
    out["num_tokens"] = None if computed is None else _int(computed, 0, 1 << 40)
    if (
        out["request_id"] is None
        or (computed is not None and out["num_tokens"] is None)
        or not isinstance(blocks, list)
        or len(blocks) > _MAX_BLOCKS
        or not all(type(b) is int and 0 <= b < 1 << 31 for b in blocks)
    ):
        return None
    hold = params.get("remote_hold")  # the prefill's number of this hold (a digest without it: refused)
    out["hold"] = None if hold is None else _int(hold, 1, 1 << 62)
    if hold is not None and out["hold"] is None:
        return None
    out["block_ids"] = blocks
    out["digest"] = blocks_digest(out["request_id"], blocks, out["hold"])
    return out


@dataclass
class RecvJob:
    """Decode side: read ``remote_block_ids`` of a prefill instance into ``local_block_ids``."""

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_engine_id: str | None = None
    remote_tp_size: int = 1
    transfer_id: str | None = None
    """Streaming load: the prefill's blocks are learnt from its side channel (``progress``)."""
    num_tokens: int = 0
    """Streaming load: prompt tokens; ``local_block_ids`` receive the tail of its blocks."""
    block_index: list[int] = field(default_factory=list)
    """Streaming load: the prompt block (index into the prefill's block list) each of
    ``local_block_ids`` receives (ascending; vLLM's null blocks are left out); empty: the last
    ``len(local_block_ids)`` blocks of the prompt."""
    gen: int | None = None
    """Streaming load: the prefill stream's generation the blocks were read under (the fence)."""
    refused: str | None = None
    """Why the load cannot be made (blocks that do not match): the worker fails it at once, so
    vLLM recomputes (its blocks are reported), and tells the prefill to free its blocks."""
    waited: bool = False
    """vLLM waits for this request in ``finished_recving`` even when ``local_block_ids`` is empty
    (every block it was given is vLLM's null block: nothing to read)."""
    blocks_digest: str | None = None
    """Per-request load: :func:`blocks_digest` of ``remote_request_id`` and the params' block ids
    (``remote_block_ids`` is taken from them), sent with the "done" notice: the prefill confirms the
    read only if it handed out those blocks for that request. Streaming load: set once it ended,
    the digest of the prompt's blocks from ``stream_first`` on, as the progress answers named them."""
    stream_first: int | None = None
    """Streaming load, once it ended: the first prompt block it read (:data:`NOTHING_READ`: none);
    the prefill checks ``blocks_digest`` against the blocks it holds for the request from there on."""


@dataclass
class StreamStep:
    """Prefill side, one step of a streaming request: after this step's forward pass its first
    ``tokens`` tokens are in ``block_ids`` (``restart``: the request starts or resumed from
    preemption in this step, with ``computed`` tokens already in its blocks)."""

    transfer_id: str
    block_ids: list[int]
    tokens: int
    total: int
    restart: bool = False
    computed: int = 0
    gen: int | None = None
    """``restart``: the stream's generation from this step on, the scheduler's count (identical on
    every TP rank; never repeated, so no two streams of one request id share a generation)."""
    ends: bool = False
    """The request ends with its prompt (``max_tokens`` 1, as every P/D proxy sends): the step
    that makes the prompt final also finishes it and hands its blocks over as a hold, so nothing
    frees them in between (a decode's read may be confirmed before the hold arrives)."""


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: loads to start, blocks to hold for a decode."""

    recv: dict[str, RecvJob] = field(default_factory=dict)
    send: dict[str, float] = field(default_factory=dict)  # req id -> seconds to keep its blocks
    send_digest: dict[str, str] = field(default_factory=dict)  # req id -> blocks_digest handed out
    # req id -> the hold number its params and digest carry (every hold's): the worker takes back
    # an "expired" answer for the id (another hold's reads never match this digest)
    send_hold: dict[str, int] = field(default_factory=dict)
    # streaming req id -> the prompt's blocks it holds (its streamed reads are checked against them)
    send_blocks: dict[str, list[int]] = field(default_factory=dict)
    stream: dict[str, StreamStep] = field(default_factory=dict)  # prefill req id -> this step
    stream_end: set[str] = field(default_factory=set)  # prefill req ids aborted while streaming
    cancel: set[str] = field(default_factory=set)  # decode req ids whose streaming load ends
    engine_id: str = ""  # this incarnation's engine id (the workers answer "done" with it)
    step: int = 0  # the scheduler's count of metadata built: ``send`` was computed by step - 1 at the latest


def _tp(vllm_config: Any) -> tuple[int, int]:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank(), size
    except Exception:  # noqa: BLE001 - not initialised (scheduler process, tests)
        return 0, size


def refuse_context_parallel(vllm_config: Any) -> None:
    """Raise ConfigError when the instance shards each block's tokens over ranks (decode or
    prefill context parallelism, DCP/PCP > 1). Called by both halves of the connector at start.

    Such a rank holds every DCP-th token of a block (its scheduler's blocks are ``block_size *
    DCP`` tokens long): a rank-to-rank copy of blocks lined up by ``block_size`` fed a decode's
    block tokens of other positions -- e.g. an MLA prefill at TP 8 and a DCP 8 decode, whose
    per-rank caches have the same shape, so no size or layout check told them apart."""
    pc = getattr(vllm_config, "parallel_config", None)
    sizes = {
        name: int(getattr(pc, name, 1) or 1)
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size")
    }
    if any(v > 1 for v in sizes.values()):
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ConfigError(
            f"KvpoolConnector (P/D) does not support context parallelism ({shown}): each rank holds "
            "only some tokens of a block; serve P/D instances without DCP/PCP"
        )


def refuse_pipeline_parallel(vllm_config: Any) -> None:
    """Raise ConfigError when the instance runs pipeline parallelism (PP > 1). Called by both
    halves of the connector at start.

    Each stage holds only its layers' KV: a decode reads every layer of a request from the one
    prefill rank of its TP rank (``side_channel_port + tp_rank``, which two stages of one TP rank
    would both bind) and confirms the read with that rank alone; serving PP takes per-stage side
    channels, reads gathered from every stage and notices counted per stage, not a port."""
    pc = getattr(vllm_config, "parallel_config", None)
    pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise ConfigError(
            f"KvpoolConnector (P/D) does not support pipeline parallelism (pipeline_parallel_size={pp}): "
            "each stage holds only its layers' KV; serve P/D instances with tensor parallelism only"
        )


class _PdScheduler:
    def __init__(self, cfg: VllmConnectorConfig, vllm_config: Any, engine_id: str) -> None:
        refuse_context_parallel(vllm_config)
        refuse_pipeline_parallel(vllm_config)
        self.cfg = cfg
        # The engine id the params name and the workers answer with: the configured one (often set
        # by hand, so a restarted instance keeps it) plus a nonce of this incarnation. A decode's
        # "done" fence fails a read whose answer names another id: after a restart on that port,
        # the old params' block ids name blocks of the new instance, which never held the request
        # and would answer "held" (it cannot tell a request it never had from one whose "send"
        # notice has not reached its worker yet).
        self.engine_id = f"{engine_id}.{secrets.token_hex(8)}"
        self.block_size = int(vllm_config.cache_config.block_size)
        _, self.tp_size = _tp(vllm_config)
        self._recv: dict[str, RecvJob] = {}
        self._send: dict[str, float] = {}
        self._send_digest: dict[str, str] = {}
        self._send_blocks: dict[str, list[int]] = {}
        self._send_hold: dict[str, int] = {}
        # Holds for decodes so far: each hold's number (``remote_hold``, bound into its digest),
        # never repeated within this incarnation (another one has another engine id).
        self._holds = 0
        # Requests whose blocks a worker may still be writing: they are never freed before the
        # worker reports them in finished_recving (abort or failure included).
        self._loading: set[str] = set()
        # Prefill: streaming requests -> [transfer id, prompt tokens, block ids so far].
        self._streams: dict[str, list[Any]] = {}
        self._stream_end: set[str] = set()
        self._gens = 0  # streams' generations handed out (StreamStep.gen)
        self._cancel: set[str] = set()
        self._step = 0  # metadata built so far (the workers tell sends computed before a sleep)

    def loads_done(self, req_ids: Any) -> None:
        self._loading.difference_update(req_ids)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            if remote_params(params) is None:
                log.warning("request %s: incomplete or malformed kv_transfer_params %.300r; computing "
                            "locally", request.request_id, params)  # fmt: skip
                params["do_remote_prefill"] = False
                return 0, False
            missing = [k for k in ("remote_engine_id", "remote_hold") if params.get(k) is None]
            if params.get("remote_block_ids") is not None and missing:
                # Every kvpool prefill's params name the incarnation that holds the blocks and the
                # hold's number; without them no prefill may confirm the read (a restarted one
                # would, never having held them; without the number it never matches the digest).
                log.warning("request %s: kv_transfer_params name no %s (edited on the way?): the prefill "
                            "cannot confirm a read of them; computing locally",
                            request.request_id, " or ".join(missing))  # fmt: skip
                params["do_remote_prefill"] = False
                return 0, False
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and _text(params.get("transfer_id"), 256):
            # Prefill of a streaming request: its progress goes to the worker with every step.
            total = len(request.prompt_token_ids or ())
            ends = getattr(request, "max_tokens", None) == 1
            self._streams[request.request_id] = [params["transfer_id"], total, [], ends]
            return
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        r = remote_params(params)
        if r is None:
            return
        if r["block_ids"] is None:
            self._stream_job(request, blocks, num_external_tokens, r)
            return
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        remote = list(r["block_ids"])
        # The prompt's blocks lead the prefill's list (a prefill that generated more than one token
        # has more blocks after them); a local prefix-cache hit covers the leading ones: read the
        # rest of the prompt's, aligned from the head.
        n = -(-len(request.prompt_token_ids or ()) // self.block_size)
        refused = None
        prompt = len(request.prompt_token_ids or ())
        if len(local) > n or len(remote) < n:
            refused = f"{len(local)} local blocks, {len(remote)} remote ones for a {n}-block prompt"
        elif r["num_tokens"] is not None and r["num_tokens"] < prompt - 1:
            # The prefill computed a shorter prompt (vLLM needs the KV of all but the last token):
            # the tail of its last block holds no KV of this request.
            refused = f"the prefill computed {r['num_tokens']} tokens of a {prompt}-token prompt"
        elif params.get("remote_blocks_digest", r["digest"]) != r["digest"]:
            # The prefill's digest does not match the ids and blocks named: edited on the way
            # (the prefill would refuse to confirm the read anyway; nothing is read).
            refused = "kv_transfer_params' remote_block_ids are not the ones the prefill named"
        if refused is not None:
            log.warning("request %s: %s; its KV is recomputed", request.request_id, refused)
        remote = remote[:n][n - len(local) :] if local and refused is None else []
        waited = bool(local)
        if waited:
            self._loading.add(request.request_id)  # finished by the worker: loaded, or failed
        # A sliding-window model: blocks out of the decode's window are vLLM's null block (shared,
        # never read): nothing is read into them. A block the decode needs that the prefill freed
        # (its null block, out of its window) cannot be read: vLLM recomputes.
        pairs = [(lb, rb) for lb, rb in zip(local, remote or local, strict=True) if lb != NULL_BLOCK]
        if refused is None and any(rb == NULL_BLOCK for _, rb in pairs):
            refused = "the prefill freed blocks (out of its sliding window) this decode needs"
            log.warning("request %s: %s; its KV is recomputed", request.request_id, refused)
        local = [lb for lb, _ in pairs]
        remote = [rb for _, rb in pairs] if refused is None else []
        self._recv[request.request_id] = RecvJob(
            req_id=request.request_id,
            local_block_ids=list(local),
            remote_block_ids=remote,
            remote_host=r["host"],
            remote_port=r["port"],
            remote_request_id=r["request_id"],
            remote_engine_id=r["engine_id"],
            remote_tp_size=r["tp_size"],
            refused=refused,
            waited=waited,
            blocks_digest=r["digest"],
        )

    def _stream_job(self, request: Any, blocks: Any, num_external_tokens: int, r: dict[str, Any]) -> None:
        """Decode: a load from a prefill that may not have started; its blocks come later."""
        total = len(request.prompt_token_ids or ())
        n = -(-total // self.block_size)
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        refused = None
        if len(local) > n:  # the worker fails the load at once: vLLM recomputes (it waits for it)
            refused = f"{len(local)} local blocks for a {n}-block prompt"
            log.warning("request %s: %s; its KV is recomputed", request.request_id, refused)
        waited = bool(local)
        if waited:
            self._loading.add(request.request_id)
        # The local blocks receive the prompt's last ones. A sliding-window model: those out of
        # the decode's window are vLLM's null block (shared by every request): nothing is read
        # into them (vLLM needs no KV there); the others keep their place in the prompt.
        first = n - len(local) if refused is None else 0
        pairs = [(lb, first + i) for i, lb in enumerate(local) if lb != NULL_BLOCK]
        self._recv[request.request_id] = RecvJob(
            req_id=request.request_id,
            local_block_ids=[lb for lb, _ in pairs],
            remote_block_ids=[],
            remote_host=r["host"],
            remote_port=r["port"],
            remote_request_id="",
            remote_engine_id=r["engine_id"],
            remote_tp_size=r["tp_size"],
            transfer_id=r["transfer_id"],
            num_tokens=total,
            block_index=[i for _, i in pairs] if refused is None else [],
            refused=refused,
            waited=waited,
        )

    def close(self) -> None:
        return None

    def build_meta(self, out: Any = None) -> KvpoolConnectorMetadata:
        """vLLM's scheduler, once per step (``out``: its ``SchedulerOutput``)."""
        self._step += 1
        meta = KvpoolConnectorMetadata(
            recv=self._recv, send=self._send, send_digest=self._send_digest, send_blocks=self._send_blocks,
            send_hold=self._send_hold, cancel=self._cancel, engine_id=self.engine_id, step=self._step,
        )  # fmt: skip
        self._recv, self._send, self._send_digest, self._send_blocks, self._cancel = {}, {}, {}, {}, set()
        self._send_hold = {}
        if self._streams and out is not None:
            meta.stream = self._stream_steps(out)
        if self._stream_end:
            meta.stream_end, self._stream_end = self._stream_end, set()
        return meta

    def _stream_steps(self, out: Any) -> dict[str, StreamStep]:
        """This step's progress of every streaming prefill request it schedules."""
        steps: dict[str, StreamStep] = {}
        n_sched = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            st = self._streams.get(new.req_id)
            if st is not None:
                st[2] = list(new.block_ids[0])
                done = new.num_computed_tokens
                steps[new.req_id] = StreamStep(st[0], st[2], done + n_sched[new.req_id], st[1], True, done,
                                               self._gen(), st[3])  # fmt: skip
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._streams.get(rid)
            if st is None:
                continue
            resumed = rid in cached.resumed_req_ids
            nb = cached.new_block_ids[i]
            if resumed:
                st[2] = list(nb[0]) if nb else []
            elif nb:
                st[2] = st[2] + list(nb[0])
            done = cached.num_computed_tokens[i]
            gen = self._gen() if resumed else None
            steps[rid] = StreamStep(st[0], st[2], done + n_sched[rid], st[1], resumed, done, gen, st[3])
        for rid in getattr(out, "preempted_req_ids", None) or ():
            st = self._streams.get(rid)
            if st is not None and rid not in steps:  # its blocks are freed: nothing of it is final
                st[2] = []
                steps[rid] = StreamStep(st[0], [], 0, st[1], True, 0, self._gen(), st[3])
        return steps

    def _gen(self) -> int:
        self._gens += 1
        return self._gens

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        if request.request_id in self._loading:
            # Finished (aborted, or failed by vLLM's load-failure policy) while its blocks are being
            # written: they are freed when the worker reports the load finished.
            self._cancel.add(request.request_id)  # a streaming load stops waiting for the prefill
            return True, None
        stream = self._streams.pop(request.request_id, None)
        streaming = stream is not None
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Aborted before its blocks were allocated: still tell the prefill to free its blocks.
            params["do_remote_prefill"] = False
            r = remote_params(params)
            if r is not None and r["block_ids"] is not None:
                self._recv[request.request_id] = RecvJob(
                    request.request_id, [], [], r["host"], r["port"], r["request_id"],
                    remote_engine_id=r["engine_id"], remote_tp_size=r["tp_size"],  # every rank frees
                    blocks_digest=r["digest"],
                )  # fmt: skip
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            if streaming:  # a decode may be reading it: its worker fails those reads
                self._end_stream(request.request_id)
            return False, None  # aborted prefill: free at once, no decode will read
        if not block_ids:
            if streaming:
                self._end_stream(request.request_id)
            return False, None
        blocks = list(block_ids)
        self._holds += 1
        hold = self._holds
        digest = blocks_digest(request.request_id, blocks, hold)
        self._send[request.request_id] = self.cfg.abort_timeout_s
        self._send_digest[request.request_id] = digest  # the worker confirms reads of these only
        self._send_hold[request.request_id] = hold
        if stream is not None:  # and streamed reads of the prompt's blocks as vLLM holds them now
            self._send_blocks[request.request_id] = blocks[: -(-stream[1] // self.block_size)]
        return True, dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=blocks,
            remote_blocks_digest=digest,
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.cfg.hostname,
            remote_port=self.cfg.side_channel_port,
            remote_num_tokens=int(request.num_computed_tokens),
            tp_size=self.tp_size,
            remote_hold=hold,
        )

    def _end_stream(self, req_id: str) -> None:
        """A streaming request ended unheld (aborted): its worker answers its reads "expired" (a
        later hold of the id is numbered, as every one is: the worker takes that mark back)."""
        self._stream_end.add(req_id)
