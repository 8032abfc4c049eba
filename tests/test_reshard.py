"""Reshard plans (kvpool.connectors.vllm.reshard): every (prefill TP, decode TP, KV heads, block
layout) combination is executed on simulated rank memories and every decode block checked byte for
byte against the single-instance cache."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvpool.connectors.vllm.reshard import (
    KvLayout,
    RegionAddr,
    ReshardError,
    check_compatible,
    plan_columns,
    plan_sources,
    region_pairs,
)

LAYERS, BLOCKS, BS, HTB = 2, 6, 4, 8  # layers, blocks per rank, tokens per block, bytes per head-token


def layout(kind: str, tp: int, rank: int, heads: int, order: str = "HND", **kw) -> KvLayout:
    base = dict(kind=kind, tp_size=tp, tp_rank=rank, total_kv_heads=heads, head_size=HTB // 2,
                dtype="auto/bfloat16", block_size=BS, num_layers=LAYERS, head_token_bytes=HTB,
                order=order, model_type="llama")  # fmt: skip
    base.update(kw)
    return KvLayout(**base)


def reference(heads: int, rng: np.random.Generator) -> np.ndarray:
    """The single-instance cache: [layer, block, head, token, byte]."""
    return rng.integers(0, 256, (LAYERS, BLOCKS, heads, BS, HTB), dtype=np.uint8)


def rank_memory(ref: np.ndarray, lay: KvLayout) -> np.ndarray:
    """One rank's flat memory: regions (layers) one after another, blocks in each."""
    if lay.kind == "mla":
        part = ref[:, :, :1]
    else:
        part = ref[:, :, lay.heads().start : lay.heads().stop]
    if lay.order == "NHD":
        part = part.transpose(0, 1, 3, 2, 4)
    return np.ascontiguousarray(part).reshape(-1).copy()


def regions(lay: KvLayout, base: int) -> list[RegionAddr]:
    bb = lay.block_bytes()
    return [RegionAddr(base + layer * BLOCKS * bb, bb, BLOCKS) for layer in range(LAYERS)]


def run_transfer(ptp: int, dtp: int, heads: int, kind: str, order: str, perm: np.ndarray) -> int:
    rng = np.random.default_rng(ptp * 100 + dtp * 10 + heads)
    ref = reference(heads, rng)
    P = [layout(kind, ptp, r, heads, order) for r in range(ptp)]
    # prefill block b holds reference block b; decode stores it in local block perm[b]
    remote_blocks = np.arange(BLOCKS)
    moved = 0
    for d in range(dtp):
        D = layout(kind, dtp, d, heads, order)
        mem = np.zeros(LAYERS * BLOCKS * D.block_bytes(), np.uint8)
        srcs = plan_sources(ptp, D, P[0])
        assert len(srcs) == len(set(srcs))
        for p in srcs:
            pmem = rank_memory(ref, P[p])
            pbase = 1 << 40  # remote addresses live elsewhere than local ones
            pairs = list(zip(regions(D, 0), regions(P[p], pbase), strict=True))
            cols = plan_columns(P[p], D, pairs, perm, remote_blocks)
            # the region arrays kept for later loads (pd.py) and short Python lists plan the same
            kept = plan_columns(P[p], D, region_pairs(P[p], D, pairs), list(perm), list(remote_blocks))
            assert all(np.array_equal(a, b) for a, b in zip(cols, kept, strict=True))
            for lo, ro, n in zip(*cols, strict=True):
                assert 0 <= ro - pbase and ro - pbase + n <= len(pmem)
                mem[lo : lo + n] = pmem[ro - pbase : ro - pbase + n]
                moved += int(n)
        # expected: the decode rank's memory of the reference, with blocks placed at perm
        exp_ref = np.empty_like(ref)
        exp_ref[:, perm] = ref
        assert np.array_equal(mem, rank_memory(exp_ref, D)), (ptp, dtp, heads, kind, order, d)
    return moved


CASES = [
    (ptp, dtp, heads, order)
    for ptp, dtp, heads, order in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), ("HND", "NHD"))
]


@pytest.mark.parametrize("ptp,dtp,heads,order", CASES)
def test_every_decode_block_byte_exact(ptp: int, dtp: int, heads: int, order: str) -> None:
    perm = np.random.default_rng(7).permutation(BLOCKS)
    moved = run_transfer(ptp, dtp, heads, "heads", order, perm)
    # exactly the decode side's bytes move, each once: no duplicate traffic, no missing slice
    per_decode_rank = LAYERS * BLOCKS * BS * HTB * (heads // dtp if dtp <= heads else 1)
    assert moved == dtp * per_decode_rank


@pytest.mark.parametrize("ptp,dtp", [(2, 1), (1, 2), (4, 2), (2, 4), (8, 1)])
def test_mla_each_decode_rank_reads_once_from_one_prefill_rank(ptp: int, dtp: int) -> None:
    perm = np.arange(BLOCKS)[::-1].copy()
    moved = run_transfer(ptp, dtp, 1, "mla", "HND", perm)
    assert moved == dtp * LAYERS * BLOCKS * BS * HTB
    P0 = layout("mla", ptp, 0, 1)
    srcs = [plan_sources(ptp, layout("mla", dtp, d, 1), P0) for d in range(dtp)]
    assert all(len(s) == 1 for s in srcs)
    assert {s[0] for s in srcs} == set(range(min(ptp, dtp)))  # spread over prefill ranks


def test_gqa_tp2_to_tp1_reads_both_halves_not_one_slice() -> None:
    """vLLM PR #52516's bug: a TP8->TP1 GQA load moved one head slice of four. Every source must
    be in the plan."""
    D = layout("heads", 1, 0, 8)
    assert plan_sources(8, D, layout("heads", 8, 0, 8)) == list(range(8))
    assert plan_sources(2, D, layout("heads", 2, 0, 8)) == [0, 1]


def test_replicated_heads_read_from_one_holder_each() -> None:
    # 2 KV heads over TP 4: ranks 0,1 hold head 0; ranks 2,3 head 1. Decode TP 1 reads 2 ranks.
    P0 = layout("heads", 4, 0, 2)
    assert plan_sources(4, layout("heads", 1, 0, 2), P0) in ([0, 2], [1, 3], [0, 3], [1, 2])
    # decode TP 4 rank r needs head r//2: one source each, spread over the replicas
    srcs = [plan_sources(4, layout("heads", 4, d, 2), P0) for d in range(4)]
    assert all(len(s) == 1 for s in srcs)
    assert [P0.__class__(**{**P0.wire(), "tp_rank": s[0]}).heads().start for s in srcs] == [0, 0, 1, 1]


def test_ranges_are_merged() -> None:
    # equal head sets, HND, consecutive blocks: one range (the simulated layers are adjacent too)
    P, D = layout("heads", 2, 0, 4), layout("heads", 2, 0, 4)
    regs = list(zip(regions(D, 0), regions(P, 1 << 40), strict=True))
    loc, rem, ln = plan_columns(P, D, regs, list(range(BLOCKS)), list(range(BLOCKS)))
    assert len(ln) == 1 and int(ln.sum()) == LAYERS * BLOCKS * D.block_bytes()
    # TP2 -> TP1, HND: one range per (layer, block) from each source (half a block each)
    D1 = layout("heads", 1, 0, 4)
    loc, rem, ln = plan_columns(P, D1, list(zip(regions(D1, 0), regions(P, 1 << 40), strict=True)),
                                list(range(BLOCKS)), list(range(BLOCKS)))  # fmt: skip
    assert len(ln) == LAYERS * BLOCKS and set(ln.tolist()) == {P.block_bytes()}


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("head_size", 8, "head size"),
        ("dtype", "fp8/bfloat16", "dtype"),
        ("num_layers", 3, "layer count"),
        ("total_kv_heads", 2, "KV head count"),
        ("block_size", 8, "block size"),
        ("order", "NHD", "block layout"),
        ("kind", "mla", "kind"),
        ("model_type", "qwen2", "model type"),
        ("head_token_bytes", 16, "bytes per head"),
    ],
)
def test_mismatches_refused_with_reason(field: str, value: object, needle: str) -> None:
    P = layout("heads", 2, 0, 4)
    D = KvLayout(**{**layout("heads", 1, 0, 4).wire(), field: value})
    with pytest.raises(ReshardError, match=needle):
        check_compatible(P, D)
    with pytest.raises(ReshardError):  # plan_columns refuses too, before producing any range
        plan_columns(P, D, [], [0], [0])


def test_unsupported_layouts_name_the_model_type() -> None:
    H = layout("hybrid", 1, 0, 4, model_type="jamba")
    with pytest.raises(ReshardError, match="jamba.*hybrid/Mamba"):
        check_compatible(H, H)
    with pytest.raises(ReshardError, match="do not split evenly"):
        layout("heads", 4, 0, 6).validate()
    with pytest.raises(ReshardError, match="block ids out of range"):
        P = layout("heads", 1, 0, 4)
        plan_columns(P, P, list(zip(regions(P, 0), regions(P, 0), strict=True)), [BLOCKS], [0])


def test_wire_roundtrip_ignores_unknown_keys() -> None:
    L = layout("heads", 2, 1, 4)
    assert KvLayout.from_wire({**L.wire(), "future": 1}) == L


def _expand_reference(d, p, lb, rb, t):
    """What kvpool._native.reshard_ranges computes, in plain Python (region, block, template order,
    merged where both sides continue the previous range)."""
    out: list[list[int]] = []
    for (da, ds, _), (pa, ps, _) in zip(d, p, strict=True):
        for lbk, rbk in zip(lb, rb, strict=True):
            for tl, tr, tn in zip(*t, strict=True):
                lo, ro = da + lbk * ds + tl, pa + rbk * ps + tr
                if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == ro:
                    out[-1][2] += tn
                else:
                    out.append([lo, ro, tn])
    return out


def test_native_expansion_matches_a_python_reference_and_checks_bounds() -> None:
    from kvpool import _native
    from kvpool.errors import InvalidArgument

    rng = np.random.default_rng(7)
    for trial in range(200):
        nreg, nblk = int(rng.integers(1, 4)), int(rng.integers(0, 9))
        stride = int(rng.choice([16, 32]))
        d = np.array([(1000 + r * 10_000, stride, 12) for r in range(nreg)], np.int64)
        p = np.array([(1 << 40 | r * 10_000, stride, 12) for r in range(nreg)], np.int64)
        lb = [int(x) for x in rng.integers(0, 12, nblk)]
        rb = sorted(int(x) for x in rng.integers(0, 12, nblk)) if trial % 2 else list(range(nblk))
        whole = trial % 3 == 0  # a template covering the whole block merges across blocks
        t = ([0], [0], [stride]) if whole else ([0, 8], [4, 12], [4, 4])
        locs, rems, lens, total = _native.reshard_ranges(d, p, lb if trial % 4 else np.array(lb), rb, *t)
        exp = _expand_reference(d.tolist(), p.tolist(), lb, rb, t)
        assert [list(x) for x in zip(locs.tolist(), rems.tolist(), lens.tolist(), strict=True)] == exp
        assert total == sum(x[2] for x in exp) == nreg * nblk * sum(t[2])
    d = np.array([(0, 16, 4)], np.int64)
    for lb, rb in (([4], [0]), ([0], [4]), ([-1], [0]), ([0, 1], [0])):
        with pytest.raises(InvalidArgument):
            _native.reshard_ranges(d, d, lb, rb, [0], [0], [16])
    with pytest.raises(InvalidArgument):  # rows must be (n, 3)
        _native.reshard_ranges(np.zeros((1, 2), np.int64), d, [0], [0], [0], [0], [16])
