"""KvpoolConnector P/D: loads that must fail rather than feed a request another request's KV, and
hostile or unlucky inputs that must not hang a request or a load thread. vLLM's real schedulers,
kvpool's real worker halves and transfer engines; the forward pass is the test double of
tests/vllm_sched.py."""

from __future__ import annotations

import copy
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool._rpc import RpcClient
from kvpool._rpc_server import RpcServer
from kvpool.child import free_port
from tests.vllm_support import tiny_llama  # noqa: F401  (fixture)

pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")  # never skipped in CI

from kvpool.connectors.vllm import pd as pd_mod  # noqa: E402
from kvpool.connectors.vllm import pd_load, pd_notices  # noqa: E402
from tests.vllm_sched import Instance  # noqa: E402

PROMPT = [(i * 37) % 500 + 3 for i in range(80)]  # 2.5 blocks


def _pd(model: Path, **decode: Any) -> tuple[Instance, Instance]:
    p = Instance(
        model, "KvpoolConnector", "kv_producer", {"side_channel_port": free_port(), "abort_timeout_s": 30}
    )
    d = Instance(model, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()}, **decode)
    return p, d


def _failures(inst: Instance) -> dict[str, int]:
    return dict(inst.worker._worker.stats.data.get("failures") or {})


def _finished(d: Instance, rid: str, steps: int = 300, other: Instance | None = None) -> Any:
    """Step the decode (and ``other``) until ``rid`` produced a token or finished; its output."""
    for _ in range(steps):
        _, o = d.step()
        if other is not None:
            other.step()
        if rid in o and (o[rid].new_token_ids or o[rid].finish_reason):
            return o[rid]
        if rid not in d.scheduler.requests:
            return None  # finished in a step whose output the loop did not see
        time.sleep(0.005)
    raise AssertionError(f"{rid} still {d.scheduler.requests[rid].status} after {steps} steps")


def _prefill(p: Instance, rid: str, prompt: list[int]) -> dict[str, Any]:
    """Add a one-token prefill request ``rid`` to ``p``, run one step, and the next one (it hands
    the worker the blocks held for ``rid``: a decode's "done" notice is confirmed only then); its
    kv_transfer_params."""
    p.add(rid, prompt, 1, {"do_remote_decode": True})
    _, o = p.step()
    p.step()
    return o[rid].kv_transfer_params


def _assert_refused(d: Instance, rid: str, out: Any, failure: str, prompt: list[int] = PROMPT) -> None:
    """The decode's load of ``rid`` failed once with ``failure``; if it recomputed, from the right KV."""
    assert _failures(d).get(failure) == 1, _failures(d)
    if out is not None and out.new_token_ids:  # recomputed: then from the right KV
        assert d.holds_prompt_kv(rid, prompt)


def test_a_second_read_of_blocks_the_prefill_already_freed_is_not_confirmed(tiny_llama: Path) -> None:  # noqa: F811
    """Two decode requests carry the same kv_transfer_params (vLLM copies them into every child
    of an n > 1 request; a client may retry). The first read frees the prefill's blocks, another
    prefill request reuses them; the second read must fail (recompute), not be confirmed "held"."""
    p, d = _pd(tiny_llama)
    try:
        params = _prefill(p, "p1", PROMPT)
        d.add("d1", PROMPT, 2, copy.deepcopy(params))
        d.run_until(lambda o: "d1" in o and o["d1"].new_token_ids)
        p.run_until(lambda o: p.free_blocks() == p.idle_free)  # the done notice freed p1's blocks
        p.add("p2", [(i * 11) % 450 + 5 for i in range(90)], 1, {"do_remote_decode": True})
        p.step()  # p2 computes into the freed blocks
        d.add("d2", PROMPT, 2, copy.deepcopy(params))
        out = _finished(d, "d2")
        _assert_refused(d, "d2", out, "PrefillFreed")
    finally:
        d.close()
        p.close()


def test_a_reused_request_id_is_read_again_and_its_old_params_stay_refused(tiny_llama: Path) -> None:  # noqa: F811
    """A client reuses a prefill request id (vLLM allows it) once the first request's blocks were
    read and freed: the new request's params are confirmed and read (they were answered "expired"
    for an hour: every P/D load of that id recomputed), while a late read of the old params
    (the same id, here the same blocks: the prompt's prefix is cached) is still refused, frees
    nothing, and the new read after it succeeds."""
    p, d = _pd(tiny_llama)
    try:
        old = _prefill(p, "p1", PROMPT)
        d.add("d1", PROMPT, 2, copy.deepcopy(old))
        d.run_until(lambda o: "d1" in o and o["d1"].new_token_ids)
        p.run_until(lambda o: p.free_blocks() == p.idle_free)  # the done notice freed p1's blocks
        new = _prefill(p, "p1", PROMPT)  # the id held again
        d.add("d2", PROMPT, 2, copy.deepcopy(old))  # the old params, read late
        out = _finished(d, "d2", other=p)
        assert sum(_failures(d).values()) == 1, _failures(d)  # refused (PrefillFreed or Unconfirmed)
        if out is not None and out.new_token_ids:
            assert d.holds_prompt_kv("d2", PROMPT)
        assert p.free_blocks() < p.idle_free  # the new hold was not freed by the old params' notice
        d.add("d3", PROMPT, 2, copy.deepcopy(new))
        out = _finished(d, "d3", other=p)
        assert out is not None and out.new_token_ids and d.holds_prompt_kv("d3", PROMPT)
        assert sum(_failures(d).values()) == 1, _failures(d)  # the new hold's read was confirmed
        p.run_until(lambda o: p.free_blocks() == p.idle_free)  # and its notice freed the blocks
    finally:
        d.close()
        p.close()


def test_remote_blocks_are_lined_up_from_the_head_of_the_prompt(tiny_llama: Path) -> None:  # noqa: F811
    """A prefill that generated 3 tokens names 3 blocks for a 2-block prompt: the decode reads
    the first two (it read blocks 2 and 3, shifted by one block)."""
    prompt = PROMPT[:64]
    p, d = _pd(tiny_llama)
    try:
        p.add("p1", prompt, 3, {"do_remote_decode": True})
        o = p.run_until(lambda o: "p1" in o and o["p1"].finish_reason)
        p.step()  # the worker learns the blocks held for p1
        params = o["p1"].kv_transfer_params
        assert len(params["remote_block_ids"]) == 3
        d.add("d1", prompt, 2, params)
        out, _ = d.step()
        job = out.kv_connector_metadata.recv["d1"]
        assert job.remote_block_ids == params["remote_block_ids"][:2]
        _finished(d, "d1")
        assert d.holds_prompt_kv("d1", prompt)
    finally:
        d.close()
        p.close()


def test_blocks_that_do_not_match_fail_the_load_instead_of_leaving_it_waiting(tiny_llama: Path) -> None:  # noqa: F811
    """kv_transfer_params naming fewer blocks than the decode's prompt needs: the request's load
    fails at once (vLLM recomputes or fails it) and its blocks are freed; it used to wait in
    WAITING_FOR_REMOTE_KVS holding them forever (any client could exhaust the KV cache)."""
    p, d = _pd(tiny_llama)
    try:
        p.add("p1", PROMPT[:64], 1, {"do_remote_decode": True})
        o = p.run_until(lambda o: "p1" in o and o["p1"].finish_reason)
        d.add("d1", PROMPT[:64] + [5] * 40, 2, o["p1"].kv_transfer_params)
        _finished(d, "d1")
        assert _failures(d).get("BlocksMismatch") == 1
        for _ in range(50):
            if "d1" not in d.scheduler.requests and d.free_blocks() == d.idle_free:
                break
            d.step()
        assert "d1" not in d.scheduler.requests and d.free_blocks() == d.idle_free
        p.run_until(lambda o: p.free_blocks() == p.idle_free)  # the prefill was told to free its blocks
    finally:
        d.close()
        p.close()


def test_hostile_peers_do_not_kill_the_load_threads(
    tiny_llama: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client-named host whose label is too long (the connect raises UnicodeError) and a side
    channel answering "done" with garbage: each load fails, every load thread lives on, and a
    real P/D request on the same (shared) thread still loads (the thread died: it waited forever)."""
    monkeypatch.setattr(pd_load, "MAX_PEER_THREADS", 1)  # every peer on one load thread
    fport = free_port()

    def garbage(req: dict[str, Any]) -> dict[str, Any]:
        if req.get("op") == "layout":
            return {"id": req.get("id"), "ok": False, "err": "INVALID", "msg": "no"}
        return {"id": req.get("id"), "ok": True, "expired": 5, "engine_id": "x"}

    srv = RpcServer("127.0.0.1", fport, garbage, lambda: None)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    p, d = _pd(tiny_llama, blocks=128)
    try:
        evil = [
            {"remote_host": "a" * 64, "remote_port": 20000},
            {"remote_host": "127.0.0.1", "remote_port": fport},
        ]
        for i, e in enumerate(evil):
            params = {"do_remote_prefill": True, "remote_block_ids": [0, 1, 2], "remote_request_id": "x",
                      "remote_engine_id": "x", "remote_hold": 1, **e}  # fmt: skip
            d.add(f"evil{i}", PROMPT, 2, params)
            _finished(d, f"evil{i}")
        lanes = d.worker._worker._lane_list
        assert len(lanes) == 1 and lanes[0].thread.is_alive()
        d.add("good", PROMPT, 2, _prefill(p, "p1", PROMPT))
        out = _finished(d, "good", other=p)
        assert out is not None and out.new_token_ids and out.finish_reason != "error"
        assert d.holds_prompt_kv("good", PROMPT)
    finally:
        srv.stop()
        d.close()
        p.close()


def test_a_kv_dtype_that_differs_fails_the_load(tiny_llama: Path) -> None:  # noqa: F811
    """bfloat16 prefill, float16 decode: the same bytes per block, another number format. The
    load fails naming the dtype (it was read as raw bytes: the decode saw other numbers)."""
    p = Instance(
        tiny_llama, "KvpoolConnector", "kv_producer", {"side_channel_port": free_port()}, dtype="bfloat16"
    )
    d = Instance(
        tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()}, dtype="float16"
    )
    try:
        assert p.worker._worker.kv_layout.dtype != d.worker._worker.kv_layout.dtype
        d.add("d1", PROMPT, 2, _prefill(p, "p1", PROMPT))
        _finished(d, "d1")
        assert _failures(d).get("ReshardError") == 1, _failures(d)
        assert d.worker._worker.loaded_blocks == 0
    finally:
        d.close()
        p.close()


def test_done_notices_are_bounded(tiny_llama: Path) -> None:  # noqa: F811
    """A "done" notice longer than MAX_DONE_IDS is refused whole (nothing recorded, so nothing of
    it is confirmed); notices for requests the prefill does not hold are answered "expired" and
    kept nowhere, and a step stays cheap (2M ids held the worker lock ~1 s and slowed every step
    for 120 s)."""
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer", {"side_channel_port": free_port()})
    try:
        w = p.worker._worker
        too_many = [str(i) for i in range(pd_load.MAX_DONE_IDS + 1)]
        reply = w._handle({"op": "done", "id": 1, "req_ids": too_many})
        assert reply["ok"] is False and len(w._notified) == 0
        for k in range(20):  # 81,920 unknown ids in allowed notices
            ids = [f"{k}-{i}" for i in range(pd_load.MAX_DONE_IDS)]
            reply = w._handle({"op": "done", "id": 2, "req_ids": ids, "wait_s": 5})
            assert reply["ok"] is True and reply["expired"] == ids and reply["unknown"] == ids
        assert len(w._notified) == 0 and not w._parked_done
        t = time.perf_counter()
        p.step()
        assert time.perf_counter() - t < 0.5
    finally:
        p.close()


def test_done_notices_waiting_for_unknown_requests_are_bounded(tiny_llama: Path) -> None:  # noqa: F811
    """Notices naming requests the prefill does not know yet wait (parked) for at most
    _PARKED_IDS_MAX ids in all; past that they are answered at once, "expired", and a parked one
    is answered "expired" at its deadline: no notice waits forever, none is confirmed."""
    from kvpool._rpc import RpcClient

    port = free_port()
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer", {"side_channel_port": port})
    try:
        w = p.worker._worker
        ids = [f"w-{i}" for i in range(pd_load.MAX_DONE_IDS)]
        mine = dict.fromkeys(ids, w.engine_id)  # (a notice naming no engine is answered at once)
        replies: list[Any] = []
        clients = [RpcClient(f"127.0.0.1:{port}", 10.0) for _ in range(5)]
        threads = [
            threading.Thread(
                target=lambda c=c: replies.append(c.call("done", req_ids=ids, engines=mine, wait_s=1.0))
            )
            for c in clients
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for _ in range(200):
            if len(replies) == 1 and w._parked_ids == pd_notices._PARKED_IDS_MAX:
                break
            time.sleep(0.01)
        assert len(replies) == 1 and replies[0]["expired"] == ids  # the fifth: no room, at once
        assert w._parked_ids == pd_notices._PARKED_IDS_MAX
        for t in threads:
            t.join(5)
        assert 0.9 < time.monotonic() - t0 < 3 and len(replies) == 5
        assert all(r["expired"] == ids for r in replies) and w._parked_ids == 0 and not w._notified
        for c in clients:
            c.close()
    finally:
        p.close()


def test_params_naming_one_requests_id_and_anothers_blocks_are_not_confirmed(tiny_llama: Path) -> None:  # noqa: F811
    """kv_transfer_params edited on the way (a hostile client, a buggy proxy): request A's id with
    request B's block ids (B is still held for its decode). The decode reads B's blocks; the prefill
    must not confirm the read as A's "held" (the decode ran on another prompt's KV): the load fails
    (recomputed from the right prompt), and neither request's blocks are freed by that notice."""
    other = [(i * 11) % 450 + 5 for i in range(80)]
    p, d = _pd(tiny_llama)
    try:
        pa, pb = _prefill(p, "pA", PROMPT), _prefill(p, "pB", other)
        assert pa["remote_block_ids"] != pb["remote_block_ids"]
        forged = {**copy.deepcopy(pa), "remote_block_ids": list(pb["remote_block_ids"])}
        forged.pop("remote_blocks_digest", None)  # (the client drops the digest it cannot match)
        d.add("d1", PROMPT, 2, forged)
        out = _finished(d, "d1", other=p)
        _assert_refused(d, "d1", out, "Unconfirmed")
        held = p.worker._worker._pending_send
        assert "pA" in held and "pB" in held  # the forged notice freed nothing
        d.add("d2", PROMPT, 2, pa)  # A's own decode still reads A's KV
        out = _finished(d, "d2", other=p)
        assert out.new_token_ids and d.holds_prompt_kv("d2", PROMPT) and _failures(d) == {"Unconfirmed": 1}
        # the prefill's digest kept with the forged blocks: refused before any read
        forged = {**copy.deepcopy(pb), "remote_block_ids": list(pa["remote_block_ids"])}
        d.add("d3", other, 2, forged)
        _finished(d, "d3", other=p)
        assert _failures(d) == {"Unconfirmed": 1, "BlocksMismatch": 1}
    finally:
        d.close()
        p.close()


def test_a_done_notice_before_the_prefill_knows_the_request_waits_for_it(
    tiny_llama: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode's "done" notice can reach the prefill worker before the step that hands it the
    request's blocks. It is not answered "held" then (the worker cannot tell such a request from
    one it never had): the load completes once the metadata arrived, or fails at the deadline."""
    monkeypatch.setattr(pd_load, "DONE_WAIT_S", 0.5, raising=False)
    p, d = _pd(tiny_llama)
    try:
        p.add("p1", PROMPT, 1, {"do_remote_decode": True})
        params = p.step()[1]["p1"].kv_transfer_params  # the worker learns p1 in the next step
        d.add("d1", PROMPT, 2, copy.deepcopy(params))
        for _ in range(30):  # the read is made, its notice waits at the prefill
            d.step()
            time.sleep(0.005)
        assert "d1" in d.scheduler.requests and not d.scheduler.requests["d1"].output_token_ids
        assert p.worker._worker._parked_ids == 1
        p.step()
        out = _finished(d, "d1")
        assert out.new_token_ids and d.holds_prompt_kv("d1", PROMPT) and not _failures(d)
        # never learnt: failed at the deadline, not confirmed
        p.add("p2", PROMPT, 1, {"do_remote_decode": True})
        params = p.step()[1]["p2"].kv_transfer_params
        d.add("d2", PROMPT, 2, params)
        out = _finished(d, "d2", steps=400)
        _assert_refused(d, "d2", out, "Unconfirmed")
    finally:
        d.close()
        p.close()


def test_an_abort_before_allocation_notifies_every_prefill_rank(tiny_llama: Path) -> None:  # noqa: F811
    """A decode request aborted before its blocks were allocated still tells the prefill to free
    its blocks -- on every TP rank of the prefill (rank 0 only: the others held them until
    abort_timeout_s)."""
    from vllm.v1.request import RequestStatus

    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()})
    try:
        params = {
            "do_remote_prefill": True, "remote_block_ids": [0, 1, 2], "remote_request_id": "r",
            "remote_host": "127.0.0.1", "remote_port": 20000, "remote_engine_id": "e", "tp_size": 2,
            "remote_hold": 1,
        }  # fmt: skip
        d.add("d1", PROMPT, 2, params)
        d.scheduler.finish_requests(["d1"], RequestStatus.FINISHED_ABORTED)
        out, _ = d.step()
        job = out.kv_connector_metadata.recv["d1"]
        assert job.local_block_ids == [] and job.remote_tp_size == 2 and job.remote_engine_id == "e"
    finally:
        d.close()


def test_a_read_from_a_restarted_prefill_with_the_same_engine_id_fails(tiny_llama: Path) -> None:  # noqa: F811
    """The prefill restarts on its side-channel port with the engine id set by hand (the same
    one): the old params' block ids name blocks of the new instance, which never held that
    request. The decode's read must fail (recompute), not be confirmed by the new instance."""
    port = free_port()
    extra = {"side_channel_port": port, "abort_timeout_s": 30}
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer", extra, engine_id="prefill-0")
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()})
    try:
        params = _prefill(p, "p1", PROMPT)
        p.close()
        p = Instance(tiny_llama, "KvpoolConnector", "kv_producer", extra, engine_id="prefill-0")
        p.add("p2", [(i * 11) % 450 + 5 for i in range(90)], 1, {"do_remote_decode": True})
        p.step()  # the new instance's blocks hold another prompt's KV
        d.add("d1", PROMPT, 2, copy.deepcopy(params))
        out = _finished(d, "d1", other=p)
        _assert_refused(d, "d1", out, "Unconfirmed")
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("cp", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallel_instances_refuse_to_start(tiny_llama: Path, cp: str) -> None:  # noqa: F811
    """DCP/PCP shard each block's tokens over ranks: an MLA prefill at TP 8 and a DCP 8 decode
    have per-rank caches of one shape, and a block-for-block copy fed the decode tokens of other
    positions. Both connector halves refuse such an instance at start."""
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.pd_scheduler import _PdScheduler
    from kvpool.errors import ConfigError
    from tests.vllm_sched import kv_cache_config, vllm_config

    vc = vllm_config(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()}, 64)
    object.__setattr__(vc.parallel_config, cp, 2)
    cfg = VllmConnectorConfig()
    with pytest.raises(ConfigError, match="context parallelism"):
        _PdScheduler(cfg, vc, "e")
    with pytest.raises(ConfigError, match="context parallelism"):
        pd_mod._PdWorker(cfg, vc, "e", kv_cache_config(64))


def test_pipeline_parallel_instances_refuse_to_start(tiny_llama: Path) -> None:  # noqa: F811
    """PP > 1: each stage holds only its layers' KV and two stages of one TP rank would bind the
    same side-channel port (``side_channel_port + tp_rank``); a decode reads every layer from one
    prefill rank. Both connector halves refuse such an instance at start, naming it."""
    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.pd_scheduler import _PdScheduler
    from kvpool.errors import ConfigError
    from tests.vllm_sched import kv_cache_config, vllm_config

    for role in ("kv_producer", "kv_consumer"):
        vc = vllm_config(tiny_llama, "KvpoolConnector", role, {"side_channel_port": free_port()}, 64)
        object.__setattr__(vc.parallel_config, "pipeline_parallel_size", 2)
        cfg = VllmConnectorConfig()
        with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
            _PdScheduler(cfg, vc, "e")
        with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
            pd_mod._PdWorker(cfg, vc, "e", kv_cache_config(64))


def test_params_of_a_shorter_prompt_in_as_many_blocks_fail_the_load(tiny_llama: Path) -> None:  # noqa: F811
    """The prefill computed 70 tokens (3 blocks), the decode's prompt has 80 (3 blocks too): the
    block counts match, but tokens 70-79 of the last block hold no KV of this prompt. The params'
    remote_num_tokens tells: the load is refused (recomputed), not read."""
    p, d = _pd(tiny_llama)
    try:
        params = _prefill(p, "p1", PROMPT[:70])
        assert params["remote_num_tokens"] == 70 and len(params["remote_block_ids"]) == 3
        d.add("d1", PROMPT, 2, params)
        out = _finished(d, "d1", other=p)
        _assert_refused(d, "d1", out, "BlocksMismatch")
        p.run_until(lambda o: p.free_blocks() == p.idle_free)  # the prefill was still told "done"
    finally:
        d.close()
        p.close()


def test_a_read_after_the_prefill_slept_and_woke_is_not_confirmed(tiny_llama: Path) -> None:  # noqa: F811
    """vLLM's sleep mode releases the prefill's KV cache while a request's blocks are held for a
    decode; after the wake-up those block ids hold the restored cache, not the request's KV. A
    decode reading them then must fail (recompute), not be confirmed "held"."""
    p, d = _pd(tiny_llama)
    try:
        params = _prefill(p, "p1", PROMPT)
        p.step()  # the worker holds p1's blocks (vLLM sleeps an idle engine)
        assert "p1" in p.worker._worker._pending_send
        p.worker.unregister_kv_caches()
        p.kv = {name: torch.zeros_like(t) for name, t in p.kv.items()}
        p.worker.restore_kv_caches(p.kv)
        d.add("d1", PROMPT, 2, params)
        out = _finished(d, "d1", other=p)
        _assert_refused(d, "d1", out, "PrefillFreed")
    finally:
        d.close()
        p.close()


def test_a_request_computed_before_the_prefill_slept_is_not_held_after_it(tiny_llama: Path) -> None:  # noqa: F811
    """The prefill computes a request; vLLM's sleep mode releases its KV cache before the "send"
    metadata that holds the request's blocks reached the worker (it comes with the next step).
    After the wake-up those blocks hold the restored cache: the worker must not hold them for a
    decode, whose read must fail (recompute), not be confirmed "held". A request computed after
    the wake-up is held and read as always."""
    p, d = _pd(tiny_llama)
    try:
        p.add("p1", PROMPT, 1, {"do_remote_decode": True})
        _, o = p.step()
        params = o["p1"].kv_transfer_params
        assert params and "p1" not in p.worker._worker._pending_send  # not handed to the worker yet
        p.worker.unregister_kv_caches()
        p.kv = {name: torch.zeros_like(t) for name, t in p.kv.items()}
        p.worker.restore_kv_caches(p.kv)
        p.step()  # the "send" metadata comes after the wake-up: p1's blocks are freed, not held
        assert "p1" not in p.worker._worker._pending_send and "p1" in p.worker._worker._expired
        d.add("d1", PROMPT, 2, params)
        out = _finished(d, "d1", other=p)
        _assert_refused(d, "d1", out, "PrefillFreed")
        prompt = [(i * 11) % 450 + 5 for i in range(90)]  # (vLLM resets its prefix cache at a sleep)
        d.add("d2", prompt, 2, _prefill(p, "p2", prompt))
        out = _finished(d, "d2", other=p)
        assert _failures(d) == {"PrefillFreed": 1} and out.new_token_ids and d.holds_prompt_kv("d2", prompt)
    finally:
        d.close()
        p.close()


def _prefill_worker(tp_size: int = 1) -> Any:
    """A prefill worker half (no server, no KV cache: its "done" fence is driven directly) with a
    progress table, as ``register_kv_caches`` makes it."""
    from types import SimpleNamespace

    from kvpool.connectors.vllm.common import Region, VllmConnectorConfig
    from kvpool.connectors.vllm.pd_stream import StreamTable

    vc = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
        kv_transfer_config=SimpleNamespace(kv_role="kv_producer"),
    )
    w = pd_mod._PdWorker(VllmConnectorConfig(abort_timeout_s=30), vc, "p", SimpleNamespace(num_blocks=8))
    w.streams = StreamTable([Region("l0", 0, 64, 64, 8)])
    return w


def _meta(step: int, **kw: Any) -> Any:
    from kvpool.connectors.vllm.pd_scheduler import KvpoolConnectorMetadata

    return KvpoolConnectorMetadata(engine_id="e.1", step=step, **kw)


def _streamed(w: Any, rid: str, tid: str, blocks: list[int], step: int) -> None:
    """Prefill worker: ``rid`` streams under ``tid`` into ``blocks`` and is computed in one step."""
    from kvpool.connectors.vllm.pd_scheduler import StreamStep

    n = 16 * len(blocks)
    w.begin_step(_meta(step, stream={rid: StreamStep(tid, blocks, n, n, True, 0)}))
    w.step_done()


def _done(w: Any, rid: str, digest: str, **kw: Any) -> dict[str, Any]:
    return w._handle({"op": "done", "id": 1, "req_ids": [rid], "digests": {rid: digest}, **kw})


def test_a_late_empty_streamed_notice_does_not_free_a_reused_ids_new_hold() -> None:
    """A streamed hold of ``r`` is freed (abort_timeout_s); the notice of a streamed load of it
    that read nothing (it failed: only frees) comes late, once a client reused the id for a
    non-streamed prefill now held for its own decode. The empty read's digest matched the empty
    tail of the new hold's (absent) stream blocks: that notice was answered "held" and freed the
    new hold's blocks (its decode then read freed blocks: recomputed). Refused now, frees
    nothing; the new hold's own read is confirmed."""
    from kvpool.connectors.vllm.pd_scheduler import NOTHING_READ, blocks_digest

    w = _prefill_worker()
    _streamed(w, "r", "t1", [4, 5], 1)
    w.start(
        _meta(2, send={"r": -1.0}, send_digest={"r": blocks_digest("r", [4, 5])}, send_blocks={"r": [4, 5]})
    )
    assert w.get_finished()[0] == {"r"}  # freed unread (abort_timeout_s)
    hold = blocks_digest("r", [4, 5], 1)  # a cached prefix: the same blocks, numbered hold
    w.start(_meta(3, send={"r": 30.0}, send_digest={"r": hold}, send_hold={"r": 1}))
    late = _done(
        w, "r", blocks_digest("r", []), gens={"r": 0}, firsts={"r": NOTHING_READ}, engines={"r": "e.1"}
    )
    assert late["expired"] == ["r"] and late["refused"] == ["r"]
    assert w.get_finished()[0] is None and "r" in w._pending_send  # the new hold is not freed
    own = _done(w, "r", hold, engines={"r": "e.1"})
    assert own["expired"] == [] and w.get_finished()[0] == {"r"}


def test_a_stale_streamed_notice_does_not_free_a_reused_ids_non_streamed_hold() -> None:
    """A stream of ``r`` ends (aborted; or preempted: its generation moved) with a load of it
    that read under the old generation; its "done" notice is answered "expired" and frees that
    stream's hold, now or once it is held. Once a client reused the id for a non-streamed prefill
    (held with a hold number), that notice -- arriving late, or early, before the new hold --
    freed the new hold (its decode then read freed blocks and recomputed). Now it frees only a
    streamed hold; the new hold's own read is confirmed."""
    from kvpool.connectors.vllm.pd_scheduler import NOTHING_READ, StreamStep, blocks_digest

    def stale(w: Any, rid: str) -> dict[str, Any]:
        return _done(
            w, rid, blocks_digest(rid, []), gens={rid: 0}, firsts={rid: NOTHING_READ}, engines={rid: "e.1"}
        )

    for early in (False, True):
        w = _prefill_worker()
        _streamed(w, "r", "t1", [4, 5], 1)
        if early:  # preempted; the stale notice comes before the stream is aborted
            w.begin_step(_meta(2, stream={"r": StreamStep("t1", [], 0, 32, True, 0)}))
            assert stale(w, "r")["expired"] == ["r"]
        w.begin_step(_meta(3, stream_end={"r"}))  # aborted
        hold = blocks_digest("r", [4, 5], 1)
        w.start(_meta(4, send={"r": 30.0}, send_digest={"r": hold}, send_hold={"r": 1}))
        if not early:
            assert stale(w, "r")["expired"] == ["r"]
        assert w.get_finished()[0] is None and "r" in w._pending_send, early  # the new hold is kept
        assert _done(w, "r", hold, engines={"r": "e.1"})["expired"] == []
        assert w.get_finished()[0] == {"r"}


def test_an_earlier_streams_notices_neither_confirm_nor_free_a_later_stream_of_the_id() -> None:
    """Streams of one request id (a client reused it) carry the scheduler's generations, so a new
    streamed hold of the id is read and confirmed; a notice of the earlier stream -- late, after
    the new hold, or one that gave up before it -- is answered "expired" and frees nothing,
    whatever blocks it names. A load of the new stream that gave up before its hold (a stale
    generation: preempted since) still frees that hold once it comes."""
    from kvpool.connectors.vllm.pd_scheduler import NOTHING_READ, StreamStep, blocks_digest

    def step(w: Any, k: int, tid: str, blocks: list[int], gen: int) -> None:
        n = 16 * len(blocks)
        w.begin_step(_meta(k, stream={"r": StreamStep(tid, blocks, n, n, True, 0, gen)}))
        w.step_done()

    def notice(w: Any, gen: int, blocks: list[int] | None) -> dict[str, Any]:
        first = 0 if blocks is not None else NOTHING_READ
        digest = blocks_digest("r", blocks or [])
        return _done(w, "r", digest, gens={"r": gen}, firsts={"r": first}, engines={"r": "e.1"})

    def hold(w: Any, k: int, number: int | None) -> None:
        extra = {"send_hold": {"r": number}} if number else {}
        w.start(_meta(k, send={"r": 30.0}, send_digest={"r": blocks_digest("r", [4, 5], number)},
                      send_blocks={"r": [4, 5]}, **extra))  # fmt: skip

    w = _prefill_worker()
    step(w, 1, "t1", [4, 5], 1)
    hold(w, 2, None)
    assert notice(w, 1, [4, 5])["expired"] == [] and w.get_finished()[0] == {"r"}
    step(w, 3, "t2", [4, 5], 2)  # the id streams again (a cached prefix: the same blocks)
    assert notice(w, 1, None)["expired"] == ["r"]  # the earlier stream's, given up: not this one's
    hold(w, 4, 1)
    assert notice(w, 1, [4, 5])["expired"] == ["r"]  # late, naming the same blocks
    assert w.get_finished()[0] is None and "r" in w._pending_send
    assert notice(w, 2, [4, 5])["expired"] == [] and w.get_finished()[0] == {"r"}
    step(w, 5, "t3", [4, 5], 3)
    w.begin_step(_meta(6, stream={"r": StreamStep("t3", [], 0, 32, True, 0, 4)}))  # preempted
    assert notice(w, 3, None)["expired"] == ["r"]  # its load gave up
    step(w, 7, "t3", [4, 5], 5)  # resumed
    hold(w, 8, 2)
    assert w.get_finished()[0] == {"r"}  # freed as it is held: its decode gave up


def _served(w: Any) -> tuple[RpcServer, int]:
    """The prefill worker's side channel over a real socket (its ``done`` answered at once)."""
    port = free_port()
    srv = RpcServer("127.0.0.1", port, w._handle, lambda: None)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, port


def _confirmed(jobs: list[Any]) -> set[str]:
    """A decode worker half sends the "done" notice of ``jobs`` (each read) in one RPC per peer:
    the decode requests whose loads it reports finished and not failed (told "held")."""
    from types import SimpleNamespace

    from kvpool.connectors.vllm.common import VllmConnectorConfig

    vc = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_role="kv_consumer"),
    )
    d = pd_mod._PdWorker(VllmConnectorConfig(), vc, "d", SimpleNamespace(num_blocks=8))
    try:
        d._confirming.update(j.req_id for j in jobs)
        d._notify(jobs)
        finished, errors = d.get_finished()[1] or set(), d.take_load_errors()
        assert finished == {j.req_id for j in jobs}
        return {j.req_id for j in jobs if not set(j.local_block_ids) & errors}
    finally:
        d.close()


def test_a_request_id_longer_than_256_characters_is_fenced_like_any_other() -> None:
    """The prefill shortened the ids of a "done" notice to 256 characters and answered with the
    short ones; the decode matched the answer with its own id and found nothing listed: a read of
    a request whose id is longer (a client's X-Request-Id; params may name up to 1,024) was
    confirmed "held" even after the prefill freed its blocks, and a held one was never freed by
    its notice. Now each id is answered as sent."""
    from kvpool.connectors.vllm.pd_scheduler import RecvJob, blocks_digest

    w = _prefill_worker()
    gone, held = "g" * 300, "h" * 300
    w.begin_step(_meta(1))
    w.start(_meta(2, send={gone: -1.0}, send_digest={gone: blocks_digest(gone, [4, 5])}))
    assert w.get_finished()[0] == {gone}  # freed unread (abort_timeout_s)
    w.start(_meta(3, send={held: 30.0}, send_digest={held: blocks_digest(held, [6, 7])}))
    srv, port = _served(w)
    try:
        jobs = [
            RecvJob(f"d{i}", [1 + 2 * i, 2 + 2 * i], blocks, "127.0.0.1", port, rid, remote_engine_id="e.1",
                    blocks_digest=blocks_digest(rid, blocks))
            for i, (rid, blocks) in enumerate([(gone, [4, 5]), (held, [6, 7])])
        ]  # fmt: skip
        assert _confirmed(jobs) == {"d1"}  # the freed one's read fails (recompute)
        assert w.get_finished()[0] == {held}  # the held one's notice freed it
    finally:
        srv.stop()


def test_a_read_of_params_naming_no_engine_id_is_never_confirmed() -> None:
    """Every kvpool prefill's params name its incarnation (``remote_engine_id``); params without it
    (edited on the way) could be confirmed by an instance restarted on that port that never held
    the blocks: a notice naming no engine counted as this incarnation's. Now the decode's scheduler
    computes such a request locally (a warning, nothing read), and a prefill answers such a notice
    "expired" at once and frees nothing; the same read naming the engine is confirmed."""
    from types import SimpleNamespace

    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.pd_scheduler import RecvJob, _PdScheduler, blocks_digest

    vc = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16), parallel_config=SimpleNamespace(tensor_parallel_size=1)
    )
    sched = _PdScheduler(VllmConnectorConfig(), vc, "d")
    params = {"do_remote_prefill": True, "remote_block_ids": [4, 5], "remote_host": "127.0.0.1",
              "remote_port": 5555, "remote_request_id": "r"}  # fmt: skip
    req = SimpleNamespace(request_id="d0", kv_transfer_params=dict(params), prompt_token_ids=list(range(32)))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # computed locally, never read
    req.kv_transfer_params = {**params, "remote_engine_id": "e.1", "remote_hold": 1}
    assert sched.get_num_new_matched_tokens(req, 0) == (32, True)

    w = _prefill_worker()
    w.begin_step(_meta(1))
    digest = blocks_digest("r", [4, 5])
    w.start(_meta(2, send={"r": 30.0}, send_digest={"r": digest}))
    reply = _done(w, "r", digest)  # (no "engines")
    assert reply["expired"] == ["r"] and reply["unknown"] == ["r"]
    assert w.get_finished()[0] is None and "r" in w._pending_send  # freed nothing
    srv, port = _served(w)
    try:

        def job(engine: str | None) -> Any:
            return RecvJob("d1", [1, 2], [4, 5], "127.0.0.1", port, "r", engine, blocks_digest=digest)

        assert _confirmed([job(None)]) == set()  # the decode's notice without it: refused
        assert w.get_finished()[0] is None and "r" in w._pending_send
        assert _confirmed([job("e.1")]) == {"d1"}
        assert w.get_finished()[0] == {"r"}
    finally:
        srv.stop()


def test_old_params_of_a_reused_id_never_match_a_new_hold_however_many_holds_came_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefill's scheduler numbered a hold only when it still remembered the id held before
    (65,536 ids, an hour), its worker answered "expired" as long: past that, a client's reused id
    got a first hold's params and digest again, so a very late read of the earlier params naming
    the same blocks (a cached prefix) matched the new hold and was confirmed. Every hold is
    numbered now (one count per incarnation, never repeated): the late read is refused, frees
    nothing, and the new hold's own read is confirmed. A decode computes params naming no hold
    number locally (they can match no hold's digest)."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    from kvpool.connectors.vllm.common import VllmConnectorConfig
    from kvpool.connectors.vllm.pd_scheduler import _PdScheduler, remote_params

    vc = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16), parallel_config=SimpleNamespace(tensor_parallel_size=1)
    )
    sched = _PdScheduler(VllmConnectorConfig(), vc, "p")

    def hold(rid: str, blocks: list[int]) -> dict[str, Any]:
        req = SimpleNamespace(request_id=rid, kv_transfer_params={"do_remote_decode": True},
                              status=RequestStatus.FINISHED_STOPPED, num_computed_tokens=32)  # fmt: skip
        delay, params = sched.request_finished(req, blocks)
        assert delay and params is not None
        return params

    w = _prefill_worker()
    old = hold("r", [4, 5])
    meta = sched.build_meta()
    w.begin_step(meta)
    w.start(meta)
    engines = {"r": sched.engine_id}
    assert _done(w, "r", remote_params(old)["digest"], engines=engines)["expired"] == []
    assert w.get_finished()[0] == {"r"}
    for i in range((1 << 16) + 1):  # past what the scheduler remembered
        hold(f"o{i}", [6])
    sched.build_meta()  # (those holds: not this test's)
    monkeypatch.setattr(pd_mod, "_EXPIRED_KEEP_S", 0.0)  # the worker forgot "r" too (an hour passed)
    w.get_finished()
    assert "r" not in w._expired
    new = hold("r", [4, 5])  # a client reused the id; a cached prefix: the same blocks
    assert new["remote_blocks_digest"] != old["remote_blocks_digest"]
    w.start(sched.build_meta())
    late = _done(w, "r", remote_params(old)["digest"], engines=engines)
    assert late["expired"] == ["r"] and late["refused"] == ["r"]
    assert w.get_finished()[0] is None and "r" in w._pending_send  # the new hold is not freed
    assert _done(w, "r", remote_params(new)["digest"], engines=engines)["expired"] == []
    assert w.get_finished()[0] == {"r"}

    decode = _PdScheduler(VllmConnectorConfig(), vc, "d")
    stripped = {k: v for k, v in new.items() if k != "remote_hold"}
    for params, want in ((stripped, (0, False)), (new, (32, True))):
        req = SimpleNamespace(request_id="d0", kv_transfer_params=dict(params), prompt_token_ids=[3] * 32)
        assert decode.get_num_new_matched_tokens(req, 0) == want


def test_two_streamed_reads_of_one_request_under_other_generations_are_not_confirmed_together() -> None:
    """Two streamed loads of one prefill request (vLLM copies the transfer id into every child of
    an n > 1 decode request) end in one "done" notice, one under generation 0 (its last READ may
    have raced the preemption that freed the blocks), one under the generation after the resume,
    into the same block ids (a prefix-cache hit). The notice carried one generation per id, the
    last one's: both were confirmed, the stale read too. Now they conflict: neither is confirmed
    (both recompute) and the notice frees nothing."""
    from kvpool.connectors.vllm.pd_scheduler import RecvJob, StreamStep, blocks_digest

    w = _prefill_worker()
    _streamed(w, "r", "t1", [4, 5], 1)
    w.begin_step(_meta(2, stream={"r": StreamStep("t1", [], 0, 32, True, 0)}))  # preempted
    _streamed(w, "r", "t1", [4, 5], 3)  # resumed into the same blocks
    assert w.streams.progress(["t1"])[0]["t1"]["gen"] == 2
    digest = blocks_digest("r", [4, 5])
    w.start(
        _meta(4, send={"r": 30.0}, send_digest={"r": blocks_digest("r", [4, 5])}, send_blocks={"r": [4, 5]})
    )
    srv, port = _served(w)
    try:

        def job(req: str, local: list[int], gen: int) -> RecvJob:
            return RecvJob(req, local, [4, 5], "127.0.0.1", port, "r", "e.1", transfer_id="t1", num_tokens=32,
                           gen=gen, blocks_digest=digest, stream_first=0)  # fmt: skip

        assert _confirmed([job("stale", [1, 2], 0), job("fresh", [3, 6], 2)]) == set()
        assert w.get_finished()[0] is None  # nothing freed
        assert _confirmed([job("fresh", [3, 6], 2), job("child", [1, 2], 2)]) == {"fresh", "child"}
        assert w.get_finished()[0] == {"r"}
    finally:
        srv.stop()


def _connections_look_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode's side-channel connections are sent on without a look at whether the peer
    closed them, as when a busy decode used them less than a second ago."""
    monkeypatch.setattr(RpcClient, "_peer_closed", staticmethod(lambda sock: False))


def test_a_load_after_the_prefill_restarted_reads_the_new_instances_regions(
    tiny_llama: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode cached the prefill's layout (segment, region addresses) from a first load; the
    prefill restarts on that port with another cache (other addresses). The next load's params
    name the new incarnation: the decode asks for the layout again, over a new connection (the
    old instance closed its own), and reads the right KV -- the first load after the restart too,
    not failed and recomputed."""
    _connections_look_alive(monkeypatch)
    port = free_port()
    extra = {"side_channel_port": port, "abort_timeout_s": 30}
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer", extra, engine_id="prefill-0")
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()})
    try:
        d.add("d1", PROMPT, 2, _prefill(p, "p1", PROMPT))
        assert _finished(d, "d1", other=p).new_token_ids and d.holds_prompt_kv("d1", PROMPT)
        old = d.worker._worker._remotes[("127.0.0.1", port)]
        p.close()
        keep = p  # its cache stays allocated: the new one lies elsewhere
        p = Instance(tiny_llama, "KvpoolConnector", "kv_producer", extra, blocks=48, engine_id="prefill-0")
        prompt = [(i * 11) % 450 + 5 for i in range(90)]
        d.add("d2", PROMPT, 2, _prefill(p, "p2", PROMPT))
        out = _finished(d, "d2", other=p)
        assert _failures(d) == {} and out.new_token_ids and d.holds_prompt_kv("d2", PROMPT)
        d.add("d3", prompt, 2, _prefill(p, "p3", prompt))
        out = _finished(d, "d3", other=p)
        assert _failures(d) == {} and out.new_token_ids and d.holds_prompt_kv("d3", prompt)
        assert d.worker._worker._remotes[("127.0.0.1", port)] is not old
        del keep
    finally:
        d.close()
        p.close()


def test_a_notice_after_the_prefill_restarted_reconnects_and_is_refused(
    tiny_llama: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The prefill restarts between a decode's read and its "done" notice. The notice finds the
    connection closed by the old instance, connects again and asks the new one, which must not
    confirm a read of the old one's blocks: it holds a request of that id in the same blocks (the
    digest matches), only the engine id's per-incarnation nonce tells them apart. The new
    instance's request is not freed by it, and its own read is then confirmed."""
    _connections_look_alive(monkeypatch)
    port = free_port()
    extra = {"side_channel_port": port, "abort_timeout_s": 30}
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer", extra, engine_id="prefill-0")
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()})
    monkeypatch.setattr(logging.getLogger("kvpool"), "propagate", True)  # (its own handler in vLLM)
    w = d.worker._worker
    notify, reading, restarted = w._notify, threading.Event(), threading.Event()

    def held_notice(jobs: list[Any]) -> None:  # d2's notice waits until the prefill restarted
        if any(j.req_id == "d2" for j in jobs):
            reading.set()
            restarted.wait(60)
        notify(jobs)

    monkeypatch.setattr(w, "_notify", held_notice)
    try:
        d.add("d1", PROMPT, 2, _prefill(p, "p1", PROMPT))  # the side-channel connection is made
        assert _finished(d, "d1", other=p).new_token_ids and _failures(d) == {}
        old = _prefill(p, "p2", PROMPT)
        d.add("d2", PROMPT, 2, copy.deepcopy(old))
        d.step_until(lambda o: reading.is_set())  # read from the old instance, notice not sent
        p.close()
        p = Instance(tiny_llama, "KvpoolConnector", "kv_producer", extra, engine_id="prefill-0")
        new = _prefill(p, "p2", PROMPT)
        assert (
            new["remote_block_ids"] == old["remote_block_ids"]
            and new["remote_engine_id"] != old["remote_engine_id"]
        )
        with caplog.at_level("WARNING", "kvpool.connectors.vllm"):
            restarted.set()
            out = _finished(d, "d2", other=p)
        _assert_refused(d, "d2", out, "Unconfirmed")
        why = [r.getMessage() for r in caplog.records if "d2" in r.getMessage()]
        assert any("is another instance now" in m for m in why), why  # answered by the new one
        p.step()
        assert "p2" in p.worker._worker._pending_send and "p2" not in p.worker._worker._notified
        d.add("d3", PROMPT, 2, new)
        out = _finished(d, "d3", other=p)
        assert _failures(d) == {"Unconfirmed": 1} and out.new_token_ids and d.holds_prompt_kv("d3", PROMPT)
    finally:
        restarted.set()
        d.close()
        p.close()


def test_a_load_whose_gpu_copies_outlive_the_timeout_is_reported_only_once_they_ended(
    fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode worker whose KV blocks are (fake-driver) GPU memory READs a prefill's GPU blocks
    over CUDA IPC; the stream then stops (its event never completes until the test lets it). A
    per-request load and a streamed one raise TransferTimeout at the engine's timeout, but their
    copies may still land in the blocks: neither is reported (not finished, no load error: vLLM
    keeps the requests waiting and the blocks allocated) while the stream is stopped. Once it
    resumes and the copies landed, both are reported failed (recompute), never before. The
    prefill is a scripted side channel over a real socket, its memory a real peer process."""
    import hashlib
    from types import SimpleNamespace

    from kvpool import TransferEngine, _native
    from kvpool.connectors.vllm.common import Region, VllmConnectorConfig
    from kvpool.connectors.vllm.pd_scheduler import RecvJob
    from kvpool.connectors.vllm.pd_stream import StreamLoad
    from kvpool.testing.fakecuda import SyncHold
    from kvpool.transfer.cuda_driver import load_driver
    from kvpool.transfer.cuda_ipc import CudaIpcTransport
    from tests.cuda_ipc_peer import Peer

    bs, nb, bb = 16, 8, 4096  # tokens per block, blocks, bytes per block
    drv = load_driver()
    assert drv is not None
    peer = Peer(1, nb * bb)
    r = peer.gpu[0]
    assert peer.ask(f"fill {r} {nb * bb} 7") == "ok"
    remote = Region("l0", r, bb, bb, nb)

    def prefill(req: dict[str, Any]) -> dict[str, Any]:
        op, rid = req.get("op"), req.get("id")
        if op == "layout":
            return {"id": rid, "ok": True, "engine_id": "e1", "segment": peer.name, "block_size": bs,
                    "tp_rank": 0, "tp_size": 1, "regions": [remote.wire()], "kv_layout": None}  # fmt: skip
        if op == "progress":
            live = {"state": "live", "req_id": "ps1", "gen": 0, "total": bs, "blocks": [7], "final": [bs]}
            return {"id": rid, "ok": True, "streams": {"t1": live}, "version": 1, "engine_id": "e1"}
        return {"id": rid, "ok": True, "expired": [], "engine_id": "e1"}  # "done": held

    pport = free_port()
    srv = RpcServer("127.0.0.1", pport, prefill, lambda: None)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    cfg = VllmConnectorConfig(side_channel_port=free_port(), transfer_timeout_s=10.0)
    vc = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=bs, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_role="kv_consumer"),
    )
    w = pd_mod._PdWorker(cfg, vc, "d", SimpleNamespace(num_blocks=nb))
    w.engine = TransferEngine(**{**cfg.engine_kwargs(), "timeout_s": 0.5})
    g = drv.alloc(nb * bb, 0)
    w.engine.register_local_memory(g, nb * bb, location="cuda:0")
    w.regions = [Region("l0", g, bb, bb, nb)]

    def sha(addr: int, n: int) -> str:
        buf = bytearray(n)
        drv.memcpy(_native.buffer_address(buf)[0], addr, n)
        return hashlib.sha256(buf).hexdigest()

    def reported() -> tuple[set[str], set[int]]:
        return w.get_finished()[1] or set(), w.take_load_errors()

    def job(rid: str, local: list[int], remote: list[int], **kw: Any) -> RecvJob:
        engine = None if kw.get("transfer_id") else "e1"  # (a streamed load learns it from progress)
        return RecvJob(rid, local, remote, "127.0.0.1", pport, f"p{rid}", engine, **kw)

    release: Any = threading.Event()  # the stream's hold, once stopped (set: let it go)
    try:
        first = job("d0", [0, 1], [0, 1])
        w._lane(first).load(first)
        deadline = time.monotonic() + 20
        got: tuple[set[str], set[int]] = (set(), set())
        while not got[0] and time.monotonic() < deadline:
            time.sleep(0.01)
            got = reported()
        assert got == ({"d0"}, set())  # read and confirmed: the setup moves bytes
        assert sha(g, 2 * bb) == peer.ask(f"dump {r} {2 * bb}")

        ipc = next(t for t in w.engine._transports if isinstance(t, CudaIpcTransport))
        release = SyncHold(ipc.driver)  # the stream stops until the test lets it go
        try:
            hung = job("d1", [2, 3], [4, 5])
            w._lane(hung).load(hung)
            streamed = job("s1", [6], [], transfer_id="t1", num_tokens=bs)
            w._lane(streamed).stream(StreamLoad(streamed, time.monotonic() + 30))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                fails = dict(w.stats.data.get("failures") or {})
                if fails.get("TransferTimeout") == 1 and fails.get("StreamFailed") == 1:
                    break
                assert reported() == (set(), set()), "reported while its copies were still queued"
                time.sleep(0.01)
            else:
                raise AssertionError(f"the loads did not time out: {w.stats.data.get('failures')}")
            time.sleep(0.3)  # the lane looks at its parked loads meanwhile
            assert reported() == (set(), set())  # still parked: neither finished nor failed
            assert not release.landed()
        finally:
            release.set()
        done: set[str] = set()
        errors: set[int] = set()
        deadline = time.monotonic() + 20
        while done != {"d1", "s1"} and time.monotonic() < deadline:
            fin, errs = reported()
            # each reported load's copy had landed before (the stream runs them in order)
            assert release.landed() >= len(done | fin), (done | fin, release.landed())
            done |= fin
            errors |= errs
            time.sleep(0.01)
        assert done == {"d1", "s1"} and errors == {2, 3, 6}  # failed: vLLM recomputes them
        assert sha(g + 2 * bb, 2 * bb) == peer.ask(f"dump {r + 4 * bb} {2 * bb}")  # the late bytes
        assert sha(g + 6 * bb, bb) == peer.ask(f"dump {r + 7 * bb} {bb}")
        assert w.engine.batches.deferred() == 0  # the timed-out batches were freed
    finally:
        release.set()
        w.close()
        srv.stop()
        peer.close()
