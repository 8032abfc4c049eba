"""Heterogeneous TP P/D at the worker level: real ``_PdWorker`` halves (one per simulated TP rank,
each with its own transfer engine and side channel over loopback) move a prefill instance's KV into
a decode instance with a different TP size; every decode block is checked byte for byte."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpool.child import free_port_range
from kvpool.connectors.vllm import pd
from kvpool.connectors.vllm.common import VllmConnectorConfig
from kvpool.connectors.vllm.pd import _PdWorker
from kvpool.connectors.vllm.pd_scheduler import RecvJob, blocks_digest

LAYERS, NB, BS, HEADS, HS = 2, 16, 16, 4, 8


def _vllm_config(tp: int, role: str, head_size: int = HS, heads: int = HEADS) -> Any:
    hf = SimpleNamespace(model_type="llama", num_key_value_heads=heads, num_attention_heads=heads)
    mc = SimpleNamespace(
        hf_text_config=hf, use_mla=False, is_hybrid=False, dtype=torch.float16,
        get_head_size=lambda: head_size, get_num_layers=lambda pc: LAYERS,
    )  # fmt: skip
    return SimpleNamespace(
        model_config=mc, cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        kv_transfer_config=SimpleNamespace(kv_role=role),
    )  # fmt: skip


def _base_port() -> int:
    """Four consecutive free ports (a side channel listens on base + rank)."""
    return free_port_range(4)


@contextmanager
def _instance(
    monkeypatch: pytest.MonkeyPatch, tp: int, role: str, ref: torch.Tensor | None, port: int, **kw: Any
) -> Iterator[list[tuple[_PdWorker, dict[str, torch.Tensor]]]]:
    """``tp`` workers of one instance; prefill ranks hold their head slice of ``ref``
    ([layer, block, head, token, 2*head size]); decode ranks start zeroed."""
    proto = kw.pop("protocol", "auto")
    cfg = VllmConnectorConfig(
        side_channel_port=port, transfer_timeout_s=5.0, abort_timeout_s=30.0, protocol=proto
    )
    ranks = []
    try:
        for r in range(tp):
            monkeypatch.setattr(pd, "_tp", lambda _c, r=r: (r, tp))
            w = _PdWorker(cfg, _vllm_config(tp, role, **kw), f"{role}-{port}", SimpleNamespace(num_blocks=NB))
            heads = kw.get("heads", HEADS)
            per = max(heads // tp, 1)
            h0 = (r * per) if tp <= heads else r // (tp // heads)
            hs = kw.get("head_size", HS)
            caches = {}
            for layer in range(LAYERS):
                if ref is not None:
                    t = ref[layer, :, h0 : h0 + per].contiguous()
                else:
                    t = torch.zeros((NB, per, BS, 2 * hs), dtype=torch.float16)
                caches[f"model.layers.{layer}.self_attn.attn"] = t
            w.register_kv_caches(caches)
            assert w.kv_layout is not None and w.kv_layout.tp_rank == r
            ranks.append((w, caches))
        yield ranks
    finally:
        for w, _ in ranks:
            w.close()


def _ref() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn((LAYERS, NB, HEADS, BS, 2 * HS), generator=g).to(torch.float16)


def _job(rid: str, local: list[int], remote: list[int], port: int, ptp: int) -> RecvJob:
    return RecvJob(
        rid, local, remote, "127.0.0.1", port, rid, f"kv_producer-{port}", ptp,
        blocks_digest=blocks_digest(rid, remote),
    )  # fmt: skip


def _hold(ranks: list[tuple[_PdWorker, Any]], rid: str, remote: list[int], streamed: bool = False) -> None:
    """The prefill scheduler's metadata: every rank holds ``remote`` for ``rid`` (``streamed``: a
    streaming request, ``remote`` its prompt's blocks)."""
    meta = pd.KvpoolConnectorMetadata(send={rid: 30.0}, send_digest={rid: blocks_digest(rid, remote)})
    if streamed:
        meta.send_blocks[rid] = list(remote)
    for p, _ in ranks:
        p.start(meta)


@pytest.mark.parametrize("ptp,dtp", [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 1), (2, 2)])
def test_every_decode_block_is_byte_exact_after_a_heterogeneous_load(
    monkeypatch: pytest.MonkeyPatch, ptp: int, dtp: int
) -> None:
    ref = _ref()
    pport, dport = _base_port(), _base_port()
    local, remote = [9, 3, 4, 5, 12], [1, 2, 3, 4, 7]
    with (
        _instance(monkeypatch, ptp, "kv_producer", ref, pport) as P,
        _instance(monkeypatch, dtp, "kv_consumer", None, dport) as D,
    ):
        _hold(P, "r1", remote)
        for d, _ in D:
            d._load(_job("r1", local, remote, pport, ptp))
            assert d.take_load_errors() == set()
            assert d.get_finished()[1] is None  # read; finished once the prefill confirms (_notify)
        for d, caches in D:
            per = HEADS // dtp
            h0 = d.tp_rank * per
            for layer in range(LAYERS):
                got = caches[f"model.layers.{layer}.self_attn.attn"]
                for lb, rb in zip(local, remote, strict=True):
                    assert torch.equal(got[lb], ref[layer, rb, h0 : h0 + per]), (d.tp_rank, layer, lb)
                untouched = [b for b in range(NB) if b not in local]
                assert not got[untouched].any()  # nothing written outside the load's blocks
        # prefill ranks free their blocks only after every decode rank's notice
        for d, _ in D[:-1]:
            d._notify([_job("r1", local, remote, pport, ptp)])
            assert d.get_finished()[1] == {"r1"} and d.take_load_errors() == set()
        for p, _ in P:
            if dtp > 1 and ptp != dtp:  # (equal TP: rank r hears from decode rank r alone)
                assert p.get_finished()[0] is None
        D[-1][0]._notify([_job("r1", local, remote, pport, ptp)])
        assert D[-1][0].get_finished()[1] == {"r1"} and D[-1][0].take_load_errors() == set()
        for p, _ in P:
            assert p.get_finished()[0] == {"r1"}


def test_a_repeated_notice_from_one_decode_rank_does_not_free_the_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P TP=1, D TP=2: the prefill frees its blocks after a "done" notice from each decode rank.
    Decode rank 0 notifies twice (a retried notice, two decode requests naming the same params):
    counted once -- the blocks stay held for rank 1, which is still reading (two notices were two
    ranks, the blocks were freed under rank 1's read)."""
    pport, dport = _base_port(), _base_port()
    remote = [1, 2]
    with (
        _instance(monkeypatch, 1, "kv_producer", _ref(), pport) as P,
        _instance(monkeypatch, 2, "kv_consumer", None, dport) as D,
    ):
        p = P[0][0]
        _hold(P, "r1", remote)
        for _ in range(2):
            D[0][0]._notify([_job("r1", [3, 4], remote, pport, 1)])
            assert p.get_finished()[0] is None  # still held for decode rank 1
        reply = p._handle({"op": "done", "id": 1, "req_ids": ["r1"], "of": 2, "digests": {"r1": _job(
            "r1", [], remote, pport, 1).blocks_digest}, "engines": {"r1": p.engine_id}})  # fmt: skip
        assert reply["expired"] == ["r1"] and p.get_finished()[0] is None  # a notice naming no rank
        D[1][0]._notify([_job("r1", [3, 4], remote, pport, 1)])
        assert p.get_finished()[0] == {"r1"}


def test_two_loads_naming_one_prefill_request_with_other_blocks_are_both_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One "done" notice carries two loads naming prefill request r1: the honest one (its blocks)
    and a forged one (another request's blocks). The notice keys digests by request id: neither
    may be confirmed by the other's digest (the forged read confirmed as r1's), and the prefill
    frees nothing on that notice."""
    pport, dport = _base_port(), _base_port()
    with (
        _instance(monkeypatch, 1, "kv_producer", _ref(), pport) as P,
        _instance(monkeypatch, 1, "kv_consumer", None, dport) as D,
    ):
        p, d = P[0][0], D[0][0]
        _hold(P, "r1", [1, 2])
        forged = dataclasses.replace(_job("r1", [5, 6], [3, 4], pport, 1), req_id="forged")
        honest = dataclasses.replace(_job("r1", [7, 8], [1, 2], pport, 1), req_id="honest")
        d._confirming.update({"forged", "honest"})  # both read (as _load_done records)
        d._notify([forged, honest])
        assert d.get_finished()[1] == {"forged", "honest"} and d.take_load_errors() == {5, 6, 7, 8}
        assert p.get_finished()[0] is None and "r1" in p._pending_send


def test_a_failed_streamed_load_still_frees_the_prefills_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed load fails after it learnt the prefill request (a read failed, its deadline
    passed): its "done" notice, whose digest names no blocks (it read none), still frees the
    prefill's blocks -- it was refused as an unchecked
    per-request notice and the blocks stayed held until abort_timeout_s."""
    from kvpool.connectors.vllm.pd_stream import StreamLoad

    pport, dport = _base_port(), _base_port()
    with (
        _instance(monkeypatch, 1, "kv_producer", _ref(), pport) as P,
        _instance(monkeypatch, 1, "kv_consumer", None, dport) as D,
    ):
        p, d = P[0][0], D[0][0]
        _hold(P, "r1", [1, 2], streamed=True)  # (a streamed notice: a streamed hold)
        job = RecvJob(
            "d1", [5, 6], [1, 2], "127.0.0.1", pport, "r1", p.engine_id, 1, transfer_id="t1",
            num_tokens=2 * BS,
        )  # fmt: skip
        ld = StreamLoad(job, time.monotonic() + 30, gen=0)
        assert d._stream_ended(ld, "a read failed")  # the prefill is to be told
        d._notify([job])
        assert d.get_finished()[1] == {"d1"} and d.take_load_errors() == {5, 6}
        assert p.get_finished()[0] == {"r1"}


def test_a_failed_source_rank_fails_the_whole_load(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _ref()
    pport, dport = _base_port(), _base_port()
    with (
        _instance(monkeypatch, 2, "kv_producer", ref, pport) as P,
        _instance(monkeypatch, 1, "kv_consumer", None, dport) as D,
    ):
        assert len(P) == 2
        d, caches = D[0]
        _hold(P, "r0", [0])
        d._load(_job("r0", [0], [0], pport, 2))  # both ranks' layouts known, segments open
        d._notify([_job("r0", [0], [0], pport, 2)])
        assert d.take_load_errors() == set()
        # prefill rank 1's regions as cached by the decode now point outside its registered memory
        # (as after a restart there): its engine refuses the READs, rank 0's succeed
        rem1 = d._remotes[("127.0.0.1", pport + 1)]
        for name, r in list(rem1.regions.items()):
            rem1.regions[name] = dataclasses.replace(r, addr=r.addr + (1 << 44))
        rem1.pairs = None  # the region arrays kept from the first load are derived again from those
        d._load(_job("r1", [1, 2], [1, 2], pport, 2))
        assert d.take_load_errors() == {1, 2}  # every block failed, not only rank 1's half
        assert d.get_finished()[1] == {"r0", "r1"}  # finished (as failed): vLLM recomputes or fails
        assert sum(d.stats.data["failures"].values()) == 1
        assert ("127.0.0.1", pport + 1) not in d._remotes  # layouts asked again next time


def test_mismatched_layouts_are_refused_before_any_byte_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    pport, dport = _base_port(), _base_port()
    ref = _ref()
    with (
        _instance(monkeypatch, 2, "kv_producer", ref, pport) as P,
        _instance(monkeypatch, 1, "kv_consumer", None, dport, head_size=2 * HS) as D,
    ):
        assert P
        d, caches = D[0]
        d._load(_job("r1", [1, 2], [1, 2], pport, 2))
        assert d.take_load_errors() == {1, 2}
        assert not any(t.any() for t in caches.values())


def test_hybrid_models_are_refused_naming_the_model_type(monkeypatch: pytest.MonkeyPatch) -> None:
    pport, dport = _base_port(), _base_port()
    with (
        _instance(monkeypatch, 2, "kv_producer", _ref(), pport),
        _instance(monkeypatch, 1, "kv_consumer", None, dport) as D,
    ):
        d, caches = D[0]
        d.vllm_config.model_config.is_hybrid = True
        d.vllm_config.model_config.hf_text_config.model_type = "jamba"
        d.kv_layout = d._describe_layout(list(caches.values()))
        assert d.kv_layout is None
        d._load(_job("r1", [1], [1], pport, 2))
        assert d.take_load_errors() == {1}
        assert "jamba" in d._layout_why and "hybrid/Mamba" in d._layout_why


def test_a_streamed_heterogeneous_load_waits_for_every_prefill_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streaming P/D (P TP=2 -> D TP=1): the decode asks one prefill rank for progress, but the
    other rank may not have written its last layer yet (ranks meet only at the next collective):
    nothing moves until every rank reports the prompt final."""
    from kvpool.connectors.vllm.pd_scheduler import StreamStep

    ref = _ref()
    pport, dport = _base_port(), _base_port()
    local, remote = [9, 3, 4], [1, 2, 7]
    total = 3 * BS
    with (
        _instance(monkeypatch, 2, "kv_producer", ref, pport) as P,
        _instance(monkeypatch, 1, "kv_consumer", None, dport) as D,
    ):
        for p, _ in P:  # the step computing the whole prompt begins on both ranks
            p.begin_step(
                pd.KvpoolConnectorMetadata(stream={"r1": StreamStep("t1", remote, total, total, True, 0)})
            )
        d, caches = D[0]
        job = RecvJob("d1", local, [], "127.0.0.1", pport, "", None, 2, transfer_id="t1", num_tokens=total)
        d.start(pd.KvpoolConnectorMetadata(recv={"d1": job}))
        P[0][0].step_done()  # rank 0 wrote every layer, rank 1 not yet
        time.sleep(0.3)
        assert d.get_finished()[1] is None
        assert not any(c.any() for c in caches.values())
        P[1][0].step_done()
        _hold(P, "r1", remote, streamed=True)  # the request finished: its blocks wait for the decode's notice
        deadline = time.monotonic() + 10
        done: set[str] = set()
        while not done and time.monotonic() < deadline:
            done = d.get_finished()[1] or set()
            time.sleep(0.01)
        assert done == {"d1"} and d.take_load_errors() == set()
        for layer in range(LAYERS):
            got = caches[f"model.layers.{layer}.self_attn.attn"]
            for lb, rb in zip(local, remote, strict=True):
                assert torch.equal(got[lb], ref[layer, rb]), (layer, lb)
