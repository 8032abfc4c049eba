"""Decode ranks' registrations with a prefill rank of the SGLang P/D backend (no SGLang import).

A decode rank registers once with every prefill rank it reads from (``KVPOOL_REG`` over the
control socket, signed with a secret: :mod:`kvpool.connectors.sglang.control_auth`): its transfer
engine session and the addresses and per-page lengths of its KV and aux buffers, its engine rank,
attention TP size and page size. The prefill rank's control thread parses it
(:func:`parse_registration`) and keeps the result in its bounded
:class:`~kvpool.connectors.sglang.rooms.PeerTable`; transfer workers read it to plan WRITEs.

A registration the prefill cannot serve is refused there, and only its session and the reason
are kept (:class:`RefusedPeer`, at most :data:`MAX_REASON_LEN` characters): another attention TP
size (non-MLA models), another number of KV buffers or bytes per page, another page size, aux rows
shorter than the prefill's (its rows would overrun the decode's), or fields of the wrong type.
Every room that decode rank sends metadata for then fails on both sides with the reason. A
registration without a session string of at most :data:`MAX_SESSION_LEN` characters is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REG_TAG = b"KVPOOL_REG"
MAX_SESSION_LEN = 1024  # a transfer engine's segment name; longer: the registration is dropped
MAX_REASON_LEN = 512


@dataclass
class PeerArgs:
    """A decode rank's buffers, as registered with this prefill rank."""

    session: str
    kv_ptrs: list[int]
    kv_item_lens: list[int]
    aux_ptrs: list[int]
    aux_item_lens: list[int]
    engine_rank: int
    attn_tp_size: int
    page_size: int
    incompatible: str | None = None


@dataclass
class RefusedPeer:
    """A decode rank whose registration was refused (layout, TP size or page size differs from
    the prefill's, or malformed): its session and why, nothing more, so that what a refused
    registration keeps is bounded; each room of its fails with the reason."""

    session: str
    incompatible: str


def registration_message(mgr: Any) -> list[bytes]:
    """The ``KVPOOL_REG`` message of decode manager ``mgr`` (SGLang's
    ``build_receiver_registration_message``, sent once to each prefill rank)."""
    import msgpack

    a = mgr.kv_args
    body = {
        "ip": mgr.local_ip,
        "port": mgr.rank_port,
        "session": mgr.session_id,
        "kv_ptrs": list(map(int, a.kv_data_ptrs)),
        "kv_item_lens": list(map(int, a.kv_item_lens)),
        "aux_ptrs": list(map(int, a.aux_data_ptrs)),
        "aux_item_lens": list(map(int, a.aux_item_lens)),
        "engine_rank": int(a.engine_rank),
        "attn_tp_size": int(mgr.attn_tp_size),
        "page_size": int(getattr(a, "page_size", 0) or 0),
    }
    return [REG_TAG, msgpack.packb(body)]


def _ints(values: Any, what: str) -> list[int]:
    """``values`` as a list of unsigned 64-bit ints (ValueError naming ``what`` otherwise)."""
    if not isinstance(values, (list, tuple)) or not all(type(v) is int and 0 <= v < 2**64 for v in values):
        raise ValueError(f"{what} is not a list of unsigned 64-bit integers")
    return list(values)


def _incompatibility(b: dict[str, Any], mgr: Any) -> str | None:
    """Why decode registration ``b`` cannot be served by prefill manager ``mgr`` (None: it can).
    Sizes are compared before any list is copied."""
    a = mgr.kv_args
    tp = b.get("attn_tp_size")
    if type(tp) is not int or type(b.get("engine_rank")) is not int or type(b.get("page_size")) is not int:
        return "malformed registration: attn_tp_size, engine_rank and page_size must be integers"
    if tp != mgr.attn_tp_size and not mgr.is_mla_backend:
        return (
            "kvpool backend needs equal attention TP sizes for non-MLA models: "
            f"prefill {mgr.attn_tp_size}, decode {tp}"
        )
    kv_ptrs, kv_lens, mine = b.get("kv_ptrs"), b.get("kv_item_lens"), list(map(int, a.kv_item_lens))
    if not isinstance(kv_ptrs, (list, tuple)) or len(kv_ptrs) != len(a.kv_data_ptrs) or kv_lens != mine:
        n = len(kv_ptrs) if isinstance(kv_ptrs, (list, tuple)) else "?"
        theirs = list(kv_lens[:2]) if isinstance(kv_lens, (list, tuple)) else "?"
        return (
            f"KV layout differs: prefill has {len(a.kv_data_ptrs)} buffers of {mine[:2]}... bytes per "
            f"page, decode {n} of {theirs}..."
        )
    page, my_page = b["page_size"], int(getattr(a, "page_size", 0) or 0)
    if page and my_page and page != my_page:
        return f"page sizes differ: prefill {my_page} tokens per page, decode {page}"
    aux_ptrs, aux_lens = b.get("aux_ptrs"), b.get("aux_item_lens")
    if not isinstance(aux_ptrs, (list, tuple)) or not isinstance(aux_lens, (list, tuple)):
        return "malformed registration: aux_ptrs and aux_item_lens must be lists"
    if len(aux_ptrs) != len(aux_lens):
        return f"malformed registration: {len(aux_ptrs)} aux buffers but {len(aux_lens)} aux row lengths"
    for i, (theirs, ours) in enumerate(zip(aux_lens, a.aux_item_lens, strict=False)):
        if type(theirs) is not int or theirs < int(ours):
            # the prefill writes its row at the decode's stride: a shorter row overruns the next one
            return f"aux (metadata) buffer {i} differs: prefill rows of {int(ours)} bytes, decode {theirs!r}"
    return None


def parse_registration(b: Any, mgr: Any) -> PeerArgs | RefusedPeer | None:
    """Decode registration ``b`` as prefill manager ``mgr`` keeps it (its control thread): a
    compatible one whole (aux buffers beyond the prefill's dropped: never written); an incompatible
    or malformed one as a :class:`RefusedPeer`, its session and reason only (its rooms fail with
    the reason); None when it names no usable session (nothing to keep)."""
    session = b.get("session") if isinstance(b, dict) else None
    if not isinstance(session, str) or not session or len(session) > MAX_SESSION_LEN:
        return None
    why = _incompatibility(b, mgr)
    if why is None:
        n_aux = len(b["aux_ptrs"])
        mgr.check_peer_aux_buffer_count(session, n_aux)  # SGLang's: logs a count mismatch
        keep = min(n_aux, len(mgr.kv_args.aux_data_ptrs))
        try:
            return PeerArgs(
                session,
                _ints(b["kv_ptrs"], "kv_ptrs"),
                list(b["kv_item_lens"]),
                _ints(b["aux_ptrs"][:keep], "aux_ptrs"),
                list(b["aux_item_lens"][:keep]),
                b["engine_rank"],
                b["attn_tp_size"],
                b["page_size"],
            )
        except ValueError as exc:
            why = f"malformed registration: {exc}"
    return RefusedPeer(session, why[:MAX_REASON_LEN])
