"""Reshard plans: which bytes of which prefill TP rank land where in a decode TP rank's KV blocks.

Pure functions, no I/O. The P/D connector's decode worker calls :func:`check_compatible` and
:func:`plan_sources` once per prefill instance (after the layout handshake), and
:func:`plan_columns` once per load and source rank, then submits each source's columns as one
batch. Nothing here loops over bytes or blocks in Python: the per-block template is expanded
over the regions and block ids, and adjacent ranges merged, in one native pass
(``kvpool._native.reshard_ranges``).

Model of a KV cache (what the layout handshake carries, :class:`KvLayout`):

* ``kind="heads"`` (MHA/GQA): the model has ``total_kv_heads`` KV heads. With ``tp_size <=
  total_kv_heads`` rank ``r`` holds the contiguous heads ``[r*H/tp, (r+1)*H/tp)``; with more ranks
  than heads each rank holds one head, replicated over ``tp/H`` consecutive ranks (vLLM's rule).
  Inside one block of one region the bytes are ordered heads-outermost (``order="HND"``, the
  vLLM CPU backend's ``LBHNC``, FlashInfer HND) or tokens-outermost (``order="NHD"``,
  FlashAttention). ``head_token_bytes`` is the size of one head of one token in one region
  (``planes * head_size * element size``; 2 planes where K and V share the region).
* ``kind="mla"``: one latent vector per token, identical on every TP rank. A decode rank reads
  its blocks from exactly one prefill rank (``decode_rank % prefill_tp``), never once per rank.

Anything else (hybrid / Mamba state, unknown kinds) is refused with the model type named.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool import _native
from kvpool.errors import InvalidArgument

KINDS = ("heads", "mla")
ORDERS = ("HND", "NHD")


class ReshardError(InvalidArgument):
    """The two sides' KV cache layouts cannot be resharded into each other; nothing was moved."""


@dataclass(frozen=True)
class KvLayout:
    """One TP rank's KV cache layout, as sent in the P/D layout handshake."""

    kind: str
    tp_size: int
    tp_rank: int
    total_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    num_layers: int
    head_token_bytes: int
    order: str = "HND"
    model_type: str = ""

    def heads(self) -> range:
        """Global KV head ids held by this rank (``range(0, 1)`` for MLA)."""
        if self.kind == "mla":
            return range(0, 1)
        h, tp, r = self.total_kv_heads, self.tp_size, self.tp_rank
        if tp <= h:
            per = h // tp
            return range(r * per, (r + 1) * per)
        return range(r // (tp // h), r // (tp // h) + 1)

    def block_bytes(self) -> int:
        """Bytes of one block of one region."""
        return len(self.heads()) * self.block_size * self.head_token_bytes

    def validate(self) -> None:
        """Refuse layouts this module cannot describe (raises :class:`ReshardError`)."""
        what = f"model type {self.model_type or 'unknown'}"
        if self.kind not in KINDS:
            raise ReshardError(
                f"{what}: KV cache kind {self.kind!r} is not supported for P/D transfer (supported: "
                "attention heads (MHA/GQA) and MLA; hybrid/Mamba state is not); serve it without kvpool P/D"
            )
        if self.order not in ORDERS:
            raise ReshardError(f"{what}: block layout {self.order!r} unknown (HND or NHD)")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ReshardError(f"{what}: TP rank {self.tp_rank} outside TP size {self.tp_size}")
        if min(self.head_size, self.block_size, self.num_layers, self.head_token_bytes) < 1:
            raise ReshardError(f"{what}: head size, block size, layer count and head bytes must be positive")
        if self.kind == "heads":
            h, tp = self.total_kv_heads, self.tp_size
            if h < 1 or (h % tp if tp <= h else tp % h):
                raise ReshardError(
                    f"{what}: {h} KV heads do not split evenly over TP {tp} (vLLM requires it as well)"
                )

    def wire(self) -> dict[str, Any]:
        """msgpack form."""
        return asdict(self)

    @classmethod
    def from_wire(cls, w: dict[str, Any]) -> KvLayout:
        """Inverse of :meth:`wire` (unknown keys ignored, so newer peers can add fields)."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in w.items() if k in names})


@functools.lru_cache(maxsize=256)  # a layout pair is checked once (an error is not cached)
def check_compatible(prefill: KvLayout, decode: KvLayout) -> None:
    """Raise :class:`ReshardError` naming the first difference that no reshard can bridge.

    Called before any byte moves; TP size and rank may differ, nothing else may.
    """
    prefill.validate()
    decode.validate()
    for field, label in (
        ("kind", "KV cache kind"), ("model_type", "model type"), ("total_kv_heads", "KV head count"),
        ("head_size", "head size"), ("dtype", "KV cache dtype"), ("num_layers", "layer count"),
        ("head_token_bytes", "bytes per head and token"), ("order", "block layout (HND/NHD)"),
    ):  # fmt: skip
        a, b = getattr(prefill, field), getattr(decode, field)
        if a != b:
            raise ReshardError(
                f"{label} differs: prefill {a!r}, decode {b!r}; prefill and decode must serve the same "
                "model with the same KV cache dtype and attention backend"
            )
    if prefill.block_size != decode.block_size:
        raise ReshardError(
            f"block size differs: prefill {prefill.block_size}, decode {decode.block_size}; "
            "set the same --block-size on both"
        )


def plan_sources(prefill_tp: int, decode: KvLayout, prefill_template: KvLayout) -> list[int]:
    """Prefill TP ranks this decode rank reads from, each once.

    ``prefill_template`` is any prefill rank's layout (only its TP size and head split matter).
    Heads held by several prefill ranks (replication) are read from one of them, spread by decode
    rank; MLA caches from ``decode_rank % prefill_tp`` alone. Computed once per layout pair.
    """
    return list(_plan_sources(prefill_tp, decode, prefill_template))


@functools.lru_cache(maxsize=256)
def _plan_sources(prefill_tp: int, decode: KvLayout, prefill_template: KvLayout) -> tuple[int, ...]:
    if decode.kind == "mla":
        return (decode.tp_rank % prefill_tp,)
    want = decode.heads()
    chosen: list[int] = []
    covered: set[int] = set()
    for h in want:
        if h in covered:
            continue
        holders = [p for p in range(prefill_tp) if h in _with_rank(prefill_template, p).heads()]
        p = holders[decode.tp_rank % len(holders)]
        covered.update(_with_rank(prefill_template, p).heads())
        if p not in chosen:
            chosen.append(p)
    return tuple(chosen)


def _with_rank(layout: KvLayout, rank: int) -> KvLayout:
    d = asdict(layout)
    d["tp_rank"] = rank
    return KvLayout(**d)


@functools.lru_cache(maxsize=256)
def block_template(prefill: KvLayout, decode: KvLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte ranges inside one block: (decode offsets, prefill offsets, lengths), merged; computed
    once per layout pair (the arrays are read-only).

    Empty when the two ranks share no head.
    """
    out = _block_template(prefill, decode)
    for a in out:
        a.setflags(write=False)
    return out


def _block_template(prefill: KvLayout, decode: KvLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if decode.kind == "mla":
        n = decode.block_bytes()
        return np.array([0], np.int64), np.array([0], np.int64), np.array([n], np.int64)
    ph, dh = prefill.heads(), decode.heads()
    lo, hi = max(ph.start, dh.start), min(ph.stop, dh.stop)
    if lo >= hi:
        z = np.zeros(0, np.int64)
        return z, z, z
    htb, bs = decode.head_token_bytes, decode.block_size
    if decode.order == "HND":  # [head][token][bytes]: one run of whole heads
        per_head = bs * htb
        one = np.array([1], np.int64)
        return one * (lo - dh.start) * per_head, one * (lo - ph.start) * per_head, one * (hi - lo) * per_head
    # NHD: [token][head][bytes]: one run per token, merged when the rows are whole on both sides
    tok = np.arange(bs, dtype=np.int64)
    d_off = tok * len(dh) * htb + (lo - dh.start) * htb
    p_off = tok * len(ph) * htb + (lo - ph.start) * htb
    ln = np.full(bs, (hi - lo) * htb, np.int64)
    return merge_ranges(d_off, p_off, ln)


def merge_ranges(
    loc: np.ndarray, rem: np.ndarray, ln: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge ranges in order where the next starts where this one ends on both sides."""
    if len(ln) <= 1:
        return loc, rem, ln
    brk = (loc[1:] != loc[:-1] + ln[:-1]) | (rem[1:] != rem[:-1] + ln[:-1])
    starts = np.concatenate(([0], np.flatnonzero(brk) + 1))
    return loc[starts], rem[starts], np.add.reduceat(ln, starts)


@dataclass(frozen=True)
class RegionAddr:
    """Where one region's blocks are: block ``b`` starts at ``addr + b * stride``."""

    addr: int
    stride: int
    num_blocks: int


@dataclass(frozen=True)
class RegionPairs:
    """The region arrays of one (decode rank, prefill rank) pair, built and checked once per
    handshake (regions do not move while both sides live): rows of (addr, stride, num_blocks),
    with the two layouts they were checked against and their block template."""

    d: np.ndarray
    p: np.ndarray
    prefill: KvLayout
    decode: KvLayout
    template: tuple[np.ndarray, np.ndarray, np.ndarray]


def region_pairs(
    prefill: KvLayout, decode: KvLayout, regions: list[tuple[RegionAddr, RegionAddr]]
) -> RegionPairs:
    """``regions`` (each decode region with the same layer's region on the prefill rank) as
    :class:`RegionPairs`; :class:`ReshardError` when the layouts cannot be resharded or a stride
    contradicts them."""
    check_compatible(prefill, decode)
    d = np.array([(dr.addr, dr.stride, dr.num_blocks) for dr, _ in regions], np.int64).reshape(-1, 3)
    p = np.array([(pr.addr, pr.stride, pr.num_blocks) for _, pr in regions], np.int64).reshape(-1, 3)
    dbb, pbb = decode.block_bytes(), prefill.block_bytes()
    if len(d) and (d[:, 1].min() < dbb or p[:, 1].min() < pbb):
        raise ReshardError(
            f"region stride {d[:, 1].min()}/{p[:, 1].min()} below the layout's block size {dbb}/{pbb} bytes "
            "(the layout handshake does not describe this KV cache)"
        )
    for a in (d, p):
        a.setflags(write=False)
    return RegionPairs(d, p, prefill, decode, block_template(prefill, decode))


def plan_columns(
    prefill: KvLayout,
    decode: KvLayout,
    regions: list[tuple[RegionAddr, RegionAddr]] | RegionPairs,
    local_blocks: list[int] | np.ndarray,
    remote_blocks: list[int] | np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The READ columns (local addresses, remote addresses, lengths) from one prefill rank.

    ``regions`` pairs each decode region with the same layer's region on that prefill rank (or is
    their :func:`region_pairs`, kept by the caller for the next load: checked when it was built
    for these two layouts). Raises :class:`ReshardError` for block ids out of range, region sizes
    that contradict the layouts, or pairs checked against other layouts (before any byte moves).
    """
    if len(local_blocks) != len(remote_blocks):
        raise ReshardError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks")
    if not isinstance(regions, RegionPairs):
        rp = region_pairs(prefill, decode, regions)
    elif (regions.prefill is prefill or regions.prefill == prefill) and (
        regions.decode is decode or regions.decode == decode
    ):
        rp = regions
    else:
        raise ReshardError("these region pairs were checked against other layouts")
    t_loc, t_rem, t_len = rp.template
    if len(t_len) == 0 or len(local_blocks) == 0 or len(rp.d) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    try:  # one native pass: every region, block and template range, merged, bounds checked first
        locs, rems, lens, _ = _native.reshard_ranges(
            rp.d, rp.p, local_blocks, remote_blocks, t_loc, t_rem, t_len
        )
    except InvalidArgument as exc:
        raise ReshardError(str(exc)) from None
    return locs, rems, lens


def layout_from_vllm(vllm_config: Any, tp_rank: int, tp_size: int, head_token_bytes: int) -> KvLayout:
    """This rank's :class:`KvLayout` from vLLM's config (called once by the connector worker)."""
    mc = vllm_config.model_config
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    model_type = str(getattr(hf, "model_type", "") or "")
    layer_types = getattr(hf, "layer_types", None) or ()
    if getattr(mc, "is_hybrid", False) or any("mamba" in str(t) or "linear" in str(t) for t in layer_types):
        kind = "hybrid"
    elif getattr(mc, "use_mla", False):
        kind = "mla"
    else:
        kind = "heads"
    pc = vllm_config.parallel_config
    num_layers = int(mc.get_num_layers(pc)) if hasattr(mc, "get_num_layers") else 0
    total = int(getattr(hf, "num_key_value_heads", 0) or getattr(hf, "num_attention_heads", 0) or 1)
    return KvLayout(
        kind=kind, tp_size=tp_size, tp_rank=tp_rank, total_kv_heads=1 if kind == "mla" else total,
        head_size=int(mc.get_head_size()), dtype=f"{vllm_config.cache_config.cache_dtype}/{mc.dtype}",
        block_size=int(vllm_config.cache_config.block_size), num_layers=num_layers,
        head_token_bytes=head_token_bytes, order="HND", model_type=model_type,
    )  # fmt: skip
