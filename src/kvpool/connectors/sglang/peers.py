"""Decode ranks' registrations with a prefill rank of the SGLang P/D backend (no SGLang import).

A decode rank registers once with every prefill rank it reads from (``KVPOOL_REG`` over the
control socket, signed with a secret: :mod:`kvpool.connectors.sglang.control_auth`): its transfer
engine session and the addresses and per-page lengths of its KV and aux buffers, its engine rank,
attention TP size and page size. The prefill rank's control thread parses it
(:func:`parse_registration`) and keeps the result in its bounded
:class:`~kvpool.connectors.sglang.rooms.PeerTable`; transfer workers read it to plan WRITEs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REG_TAG = b"KVPOOL_REG"


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


def parse_registration(b: dict[str, Any], mgr: Any) -> PeerArgs:
    """A decode rank's registration ``b`` as prefill manager ``mgr`` keeps it (its control
    thread), marked ``incompatible`` (with the reason rooms fail with) when its layout differs."""
    peer = PeerArgs(
        str(b["session"]),
        list(b["kv_ptrs"]),
        list(b["kv_item_lens"]),
        list(b["aux_ptrs"]),
        list(b["aux_item_lens"]),
        int(b["engine_rank"]),
        int(b["attn_tp_size"]),
        int(b["page_size"]),
    )
    a = mgr.kv_args
    if peer.attn_tp_size != mgr.attn_tp_size and not mgr.is_mla_backend:
        peer.incompatible = (
            "kvpool backend needs equal attention TP sizes for non-MLA models: "
            f"prefill {mgr.attn_tp_size}, decode {peer.attn_tp_size}"
        )
    elif len(peer.kv_ptrs) != len(a.kv_data_ptrs) or peer.kv_item_lens != list(map(int, a.kv_item_lens)):
        peer.incompatible = (
            f"KV layout differs: prefill has {len(a.kv_data_ptrs)} buffers of "
            f"{list(a.kv_item_lens)[:2]}... bytes per page, decode {len(peer.kv_ptrs)} of "
            f"{peer.kv_item_lens[:2]}..."
        )
    return peer
