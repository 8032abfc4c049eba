"""What a prefill rank of the SGLang P/D backend (:mod:`kvpool.connectors.sglang.conn`) writes
for one chunk: a decode rank's destination for a room (:class:`TransferInfo`), a queued chunk
(:class:`Chunk`), and the columns of its transfer batch (source addresses, destination
addresses, lengths): every layer's K and V pages (:func:`page_columns`) plus, on the last chunk,
the aux rows (:func:`aux_columns`); and the buffers a manager registers (:func:`buffers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous

from kvpool.connectors.sglang.peers import PeerArgs

Columns = tuple[list[int], list[int], list[int]]


@dataclass
class TransferInfo:
    """One decode rank's destination for one room (attribute names as SGLang's Common expects)."""

    room: int
    endpoint: str
    dst_port: int
    session: str
    dst_kv_indices: np.ndarray
    dst_aux_index: int | None
    required_dst_info_num: int
    decode_prefix_len: int
    is_dummy: bool
    refused: str | None = None  # why this prefill cannot serve the decode rank (its registration)


@dataclass
class Chunk:
    room: int
    kv_indices: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: int | None
    state_indices: Any = None


def buffers(kv_args: Any, server_args: Any) -> list[tuple[int, int, str]]:
    """(address, length, location) of a manager's KV, state and aux buffers, deduplicated: what
    it registers with its transfer engine.

    KV and state buffers live on the server's device (``cuda:<gpu_id>`` unless SGLang runs with
    ``--device cpu``); aux (metadata) buffers are always host memory.
    """
    a = kv_args
    device = str(getattr(server_args, "device", None) or "cuda")
    dev_loc = "cpu:0" if device == "cpu" else f"cuda:{int(getattr(a, 'gpu_id', 0) or 0)}"
    pairs = [(p, n, dev_loc) for p, n in zip(a.kv_data_ptrs, a.kv_data_lens, strict=False)]
    for ptrs, lens in zip(
        getattr(a, "state_data_ptrs", None) or [], getattr(a, "state_data_lens", None) or [], strict=False
    ):
        pairs += [(p, n, dev_loc) for p, n in zip(ptrs, lens, strict=False)]
    pairs += [(p, n, "cpu:0") for p, n in zip(a.aux_data_ptrs, a.aux_data_lens, strict=False)]
    seen: dict[int, tuple[int, str]] = {}
    for ptr, n, loc in pairs:
        if ptr and n:
            prev = seen.get(int(ptr))
            seen[int(ptr)] = (max(prev[0] if prev else 0, int(n)), loc)
    return sorted((p, n, loc) for p, (n, loc) in seen.items())


def page_columns(kv_args: Any, peer: PeerArgs, src: np.ndarray, dst: np.ndarray) -> Columns:
    """Every layer's K then V of prefill ``kv_args`` pages ``src`` to decode ``peer``'s pages
    ``dst``: one WRITE per run of pages contiguous on both sides (source addresses, destination
    addresses, lengths). Called by the transfer worker threads."""
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    if not len(src):
        return srcs, dsts, lens
    a = kv_args
    src_groups, dst_groups = group_concurrent_contiguous(src.astype(np.int32), dst.astype(np.int32))
    runs = [(int(s[0]), int(d[0]), len(s)) for s, d in zip(src_groups, dst_groups, strict=True)]
    for src_ptr, dst_ptr, item in zip(a.kv_data_ptrs, peer.kv_ptrs, a.kv_item_lens, strict=False):
        for s0, d0, n in runs:
            srcs.append(src_ptr + s0 * item)
            dsts.append(dst_ptr + d0 * item)
            lens.append(n * item)
    return srcs, dsts, lens


def aux_columns(kv_args: Any, peer: PeerArgs, src_index: int, dst_index: int, cols: Columns) -> None:
    """Append the request's aux (metadata) rows (prefill slot ``src_index``, decode slot
    ``dst_index``) to the same batch's columns."""
    a = kv_args
    for i in range(min(len(a.aux_data_ptrs), len(peer.aux_ptrs))):
        if a.aux_item_lens[i]:
            cols[0].append(a.aux_data_ptrs[i] + a.aux_item_lens[i] * src_index)
            cols[1].append(peer.aux_ptrs[i] + peer.aux_item_lens[i] * dst_index)
            cols[2].append(a.aux_item_lens[i])
