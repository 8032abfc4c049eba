"""Streaming (layer-wise) P/D: the decode reads each layer's KV while the prefill computes the next.

vLLM's real Scheduler on both sides, kvpool's real worker halves, transfer engine and side channel
over loopback; the forward pass is the layer-by-layer test double of tests/vllm_sched.py. Plus the
prefill's progress table on its own (generations, GPU-style readiness)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpool.child import free_port
from tests.vllm_support import tiny_llama  # noqa: F401  (fixture)

pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")  # never skipped in CI

from vllm.v1.request import RequestStatus  # noqa: E402

from kvpool.connectors.vllm.common import Region  # noqa: E402
from kvpool.connectors.vllm.pd_scheduler import KvpoolConnectorMetadata, StreamStep, blocks_digest  # noqa: E402
from kvpool.connectors.vllm.pd_stream import StreamTable  # noqa: E402
from tests.vllm_sched import BS, LAYERS, LayerInstance, expected_rows  # noqa: E402

PROMPT = [(i * 37) % 500 + 3 for i in range(80)]  # 2.5 blocks
LONG = [(i * 53) % 500 + 3 for i in range(200)]  # 6.25 blocks


@pytest.fixture
def pd(tiny_llama: Path) -> Iterator[tuple[LayerInstance, LayerInstance]]:  # noqa: F811
    p = LayerInstance(tiny_llama, "KvpoolConnector", "kv_producer",
                      {"side_channel_port": free_port(), "abort_timeout_s": 30})  # fmt: skip
    d = LayerInstance(tiny_llama, "KvpoolConnector", "kv_consumer",
                      {"side_channel_port": free_port(), "abort_timeout_s": 30})  # fmt: skip
    yield p, d
    d.close()
    p.close()


def _decode_params(p: LayerInstance, tid: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "transfer_id": tid, "remote_host": "127.0.0.1",
            "remote_port": p.worker._worker.cfg.side_channel_port}  # fmt: skip


def _rows(inst: LayerInstance, blocks: list[int], layer: int, n: int) -> torch.Tensor:
    kv = inst.kv[LAYERS[layer]]
    return torch.stack([kv[blocks[t // BS], :, t % BS, :] for t in range(n)])


def _chunk(inst: LayerInstance, tokens: int) -> None:
    """Chunked prefill of at most ``tokens`` tokens per step."""
    inst.scheduler.max_num_scheduled_tokens = tokens
    inst.scheduler.scheduler_config.max_num_batched_tokens = tokens


def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.002)


def test_decode_reads_each_layer_while_the_prefill_computes_the_next(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    p, d = pd
    d.add("d1", PROMPT, 4, _decode_params(p, "t1"))  # the decode gets the request first
    out, _ = d.step()
    job = out.kv_connector_metadata.recv["d1"]
    assert job.transfer_id == "t1" and job.remote_block_ids == [] and len(job.local_block_ids) == 3
    assert d.scheduler.requests["d1"].status.name == "WAITING_FOR_REMOTE_KVS"
    local = job.local_block_ids
    want = expected_rows(PROMPT, 80)
    seen: list[tuple[bool, bool]] = []

    def between_layers(li: int) -> None:
        if li == 0:  # layer 0 is final, layer 1 not computed yet: the decode reads layer 0 now
            _until(lambda: torch.equal(_rows(d, local, 0, 80), want[0]))
            seen.append((torch.equal(_rows(d, local, 0, 80), want[0]), bool(_rows(d, local, 1, 80).any())))

    p.after_save = between_layers
    p.add("p1", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "t1"})
    _, outputs = p.step()
    assert outputs["p1"].finish_reason is not None
    assert seen == [(True, False)]  # layer 0 arrived before layer 1 was even computed
    p.step()  # the worker learns p1's blocks are held (its notice was confirmed before: freed now)
    outputs = d.run_until(lambda o: "d1" in o and o["d1"].new_token_ids)
    assert outputs["d1"].new_token_ids == [7]
    assert d.holds_prompt_kv("d1", PROMPT)
    assert d.worker._worker.loaded_blocks == 3
    p.run_until(lambda o: p.free_blocks() == p.idle_free)  # "done" freed the prefill's blocks


def test_a_streamed_read_is_confirmed_before_the_prefill_request_finishes(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    """Once every layer of the prompt is final, the decode's read is confirmed by the live stream
    (its generation and blocks): the decode's first token comes while the prefill is still inside
    the forward pass that wrote the last layer (it used to wait for the prefill request to finish
    and be held, ~20 ms on a CPU vLLM server). The hold that follows is freed at once."""
    p, d = pd
    d.add("d1", PROMPT, 4, _decode_params(p, "t1"))
    out, _ = d.step()
    local = out.kv_connector_metadata.recv["d1"].local_block_ids
    first: list[list[int]] = []

    def after_layer(li: int) -> None:
        if li == len(LAYERS) - 1:  # the prompt is final; the prefill request has not finished
            outputs = d.run_until(lambda o: "d1" in o and o["d1"].new_token_ids)
            first.append(outputs["d1"].new_token_ids)

    p.after_save = after_layer
    p.add("p1", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "t1"})
    _, outputs = p.step()
    assert first == [[7]]  # the decode's first token before the prefill's step returned
    assert outputs["p1"].finish_reason is not None
    assert d.holds_prompt_kv("d1", PROMPT)
    assert len(local) == 3 and d.worker._worker.loaded_blocks == 3
    p.run_until(lambda o: p.free_blocks() == p.idle_free)  # the hold, already notified, is freed


def test_a_stream_read_early_then_aborted_leaves_no_notice_for_a_later_hold_of_its_id(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    """A decode reads a stream and is confirmed inside the prefill's last forward pass; the
    prefill request is aborted before that step ends, so it is never held. Its id used again for a
    per-request P/D must be held until that decode reads it: the early confirmation, left behind,
    freed the new hold at once (its decode's read "expired")."""
    p, d = pd
    d.add("d1", PROMPT, 4, _decode_params(p, "t1"))
    d.step()

    def after_layer(li: int) -> None:
        if li == len(LAYERS) - 1:
            d.run_until(lambda o: "d1" in o and o["d1"].new_token_ids)  # confirmed: p1 not held
            p.scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)

    p.after_save = after_layer
    p.add("p1", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "t1"})
    p.step()
    p.after_save = None
    p.run_until(lambda o: p.free_blocks() == p.idle_free)
    other = [(i * 29) % 500 + 5 for i in range(80)]
    p.add("p1", other, 1, {"do_remote_decode": True})
    _, outputs = p.step()
    params = outputs["p1"].kv_transfer_params
    p.step()  # held
    d.add("d2", other, 2, params)
    outputs = d.run_until(lambda o: "d2" in o and (o["d2"].new_token_ids or o["d2"].finish_reason))
    assert outputs["d2"].new_token_ids, d.worker._worker.stats.data.get("failures")
    assert d.holds_prompt_kv("d2", other)
    p.run_until(lambda o: p.free_blocks() == p.idle_free)


def test_a_stream_that_generates_on_is_confirmed_only_once_held(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    """A streaming prefill request with ``max_tokens`` 2 runs on after its prompt is final (a
    sliding window could free prompt blocks meanwhile, within one generation): the decode's read
    of it is confirmed only against the hold, as before the early confirmation."""
    p, d = pd
    d.add("d1", PROMPT, 4, _decode_params(p, "t1"))
    d.step()
    p.add("p1", PROMPT, 2, {"do_remote_decode": True, "transfer_id": "t1"})
    p.step()  # the prompt is final; p1 generates on
    local = d.scheduler.requests["d1"]
    until = time.monotonic() + 0.5
    while time.monotonic() < until:  # read, notice sent, parked at the prefill
        _, outputs = d.step()
        assert "d1" not in outputs or not outputs["d1"].new_token_ids
        time.sleep(0.01)
    assert local.status.name == "WAITING_FOR_REMOTE_KVS"
    p.run_until(lambda o: "p1" in o and o["p1"].finish_reason is not None)
    p.step()  # held: the parked notice is confirmed
    d.run_until(lambda o: "d1" in o and o["d1"].new_token_ids)
    assert d.holds_prompt_kv("d1", PROMPT)
    p.run_until(lambda o: p.free_blocks() == p.idle_free)


def test_handle_preemptions_ends_an_aborted_stream_before_the_step_writes(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    """vLLM calls ``handle_preemptions`` first in a step, before it zeroes or copies into blocks a
    preemption or abort freed, and ``bind_connector_metadata`` only after that: the stream's end
    (or new generation) must be applied at the first, so no notice is confirmed for a block
    written in between; the second does not apply it again."""
    p, d = pd
    p.add("p1", PROMPT, 2, {"do_remote_decode": True, "transfer_id": "t1"})
    p.step()
    table = p.worker._worker.streams
    assert table.progress(["t1"])[0]["t1"]["state"] == "live"
    p.scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    out = p.scheduler.schedule()
    meta = out.kv_connector_metadata
    assert meta.stream_end == {"p1"}
    p.worker.handle_preemptions(meta)
    assert table.progress(["t1"])[0]["t1"] == {"state": "dead"}
    assert "p1" in p.worker._worker._expired
    p.worker._worker._expired.pop("p1")
    p.worker.bind_connector_metadata(meta)  # the same step's metadata: not applied twice
    assert "p1" not in p.worker._worker._expired
    p.worker.clear_connector_metadata()


def test_chunked_prefill_streams_each_chunk_and_a_local_hit_reads_only_the_tail(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    p, d = pd
    _chunk(p, 96)  # the 200-token prompt takes three steps
    # The decode already holds the first 64 tokens (2 blocks) from an earlier request.
    d.add("warm", LONG[:64], 1, None)
    d.run_until(lambda o: "warm" in o and o["warm"].finish_reason is not None)
    d.add("d2", LONG, 2, _decode_params(p, "t2"))
    out, _ = d.step()
    job = out.kv_connector_metadata.recv["d2"]
    assert len(job.local_block_ids) == 5  # 7 blocks, the first 2 are a local prefix hit
    p.add("p2", LONG, 1, {"do_remote_decode": True, "transfer_id": "t2"})
    _, outputs = p.step()  # tokens 0..95: blocks 0-2 final, the decode reads block 2 of them
    assert "p2" not in outputs or outputs["p2"].finish_reason is None
    _until(lambda: torch.equal(_rows(d, job.local_block_ids[:1], 1, BS), expected_rows(LONG, 96)[1][64:96]))
    assert not _rows(d, job.local_block_ids[1:2], 0, BS).any()  # block 3 is not final yet
    p.run_until(lambda o: "p2" in o and o["p2"].finish_reason is not None)
    p.step()  # the worker learns p2's blocks are held
    outputs = d.run_until(lambda o: "d2" in o and o["d2"].new_token_ids)
    assert d.holds_prompt_kv("d2", LONG)
    assert d.worker._worker.loaded_blocks == 5
    p.run_until(lambda o: p.free_blocks() == p.idle_free)


def test_a_prefill_aborted_while_streaming_fails_the_decode_load(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    p, d = pd
    _chunk(p, 96)
    d.add("d3", LONG, 2, _decode_params(p, "t3"))
    d.step()
    p.add("p3", LONG, 1, {"do_remote_decode": True, "transfer_id": "t3"})
    p.step()
    p.scheduler.finish_requests("p3", RequestStatus.FINISHED_ABORTED)
    p.step()  # the worker learns the stream is dead before any forward pass reuses its blocks
    t0 = time.monotonic()
    # vLLM's default kv_load_failure_policy is "fail": the request ends, no hang, no wrong bytes.
    outputs = d.run_until(lambda o: "d3" in o and o["d3"].finish_reason is not None, timeout=10)
    assert time.monotonic() - t0 < 5
    assert outputs["d3"].finish_reason is not None and not outputs["d3"].new_token_ids
    d.run_until(lambda o: d.free_blocks() == d.idle_free)
    assert p.free_blocks() == p.idle_free


def test_a_reused_request_id_streams_again_and_is_confirmed(pd: tuple[LayerInstance, LayerInstance]) -> None:
    """A client reuses a prefill request id for another streamed request: once after the first
    stream was read and freed, once after a streaming prefill of the id was aborted. Each new
    stream's read is confirmed (both were answered "expired" for an hour: the streams of an id
    restarted at generation 0, the fence could not tell an old stream's notices from the new
    one's; every streamed load of the id recomputed). Each stream's generations are the
    scheduler's count now, so a notice of an earlier stream of the id is told apart."""
    p, d = pd
    _chunk(p, 96)
    other = [(i * 41) % 500 + 7 for i in range(200)]

    def failures() -> dict[str, int]:
        return dict(d.worker._worker.stats.data.get("failures") or {})

    def streamed(did: str, rid: str, tid: str, prompt: list[int]) -> None:
        d.add(did, prompt, 2, _decode_params(p, tid))
        d.step()
        p.add(rid, prompt, 1, {"do_remote_decode": True, "transfer_id": tid})
        p.run_until(lambda o: rid in o and o[rid].finish_reason is not None)
        p.step()  # the worker learns the blocks are held
        outputs = d.run_until(
            lambda o: did in o and (o[did].new_token_ids or o[did].finish_reason is not None)
        )
        assert outputs[did].new_token_ids, failures()
        assert d.holds_prompt_kv(did, prompt)
        p.run_until(lambda o: p.free_blocks() == p.idle_free)  # its notice freed the blocks

    streamed("d1", "p1", "t1", LONG)
    streamed("d2", "p1", "t2", LONG)  # the id held again, streamed (a cached prefix: the same blocks)
    assert failures() == {}
    d.add("d3", other, 2, _decode_params(p, "t3"))
    d.step()
    p.add("q1", other, 1, {"do_remote_decode": True, "transfer_id": "t3"})
    p.step()  # the first chunk: streaming
    p.scheduler.finish_requests("q1", RequestStatus.FINISHED_ABORTED)
    p.step()
    d.run_until(lambda o: "d3" in o and o["d3"].finish_reason is not None, timeout=10)
    assert failures() == {"StreamFailed": 1}
    streamed("d4", "q1", "t4", other)  # the aborted stream's id used again
    assert failures() == {"StreamFailed": 1}


def test_a_prefill_that_never_comes_and_a_decode_abort_end_the_load(tiny_llama: Path) -> None:  # noqa: F811
    d = LayerInstance(tiny_llama, "KvpoolConnector", "kv_consumer",
                      {"side_channel_port": free_port(), "abort_timeout_s": 1.0})  # fmt: skip
    p = LayerInstance(tiny_llama, "KvpoolConnector", "kv_producer", {"side_channel_port": free_port()})
    try:
        d.add("d4", PROMPT, 2, _decode_params(p, "never"))
        d.step()
        t0 = time.monotonic()
        d.run_until(lambda o: "d4" in o and o["d4"].finish_reason is not None, timeout=10)
        assert 0.9 < time.monotonic() - t0 < 5  # the decode gave up after abort_timeout_s
        d.run_until(lambda o: d.free_blocks() == d.idle_free)
        # A decode request aborted while its load waits: the blocks return once the worker stopped.
        d.add("d5", PROMPT, 2, _decode_params(p, "never2"))
        d.step()
        assert d.free_blocks() == d.idle_free - 3
        d.scheduler.finish_requests("d5", RequestStatus.FINISHED_ABORTED)
        d.step()
        t0 = time.monotonic()
        d.run_until(lambda o: d.free_blocks() == d.idle_free, timeout=10)
        assert time.monotonic() - t0 < 0.5  # cancelled, not left to the deadline
    finally:
        d.close()
        p.close()


def test_a_malformed_progress_answer_fails_the_load_and_stops_nothing_else(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    p, d = pd
    bad = {"ok": True, "streams": {"t9": {"state": "live", "total": "many"}}, "version": 0}
    p.worker._worker._progress = lambda ids: bad  # a buggy or hostile prefill
    d.add("d9", PROMPT, 2, _decode_params(p, "t9"))
    d.step()
    outputs = d.run_until(lambda o: "d9" in o and o["d9"].finish_reason is not None, timeout=10)
    assert not outputs["d9"].new_token_ids  # failed (vLLM's default policy), not left waiting
    d.run_until(lambda o: d.free_blocks() == d.idle_free)
    del p.worker._worker._progress
    # the load thread survived: the next streamed request of that prefill still loads
    d.add("d10", PROMPT, 4, _decode_params(p, "t10"))
    d.step()
    p.add("p10", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "t10"})
    p.step()
    p.step()  # the worker learns p10's blocks are held
    outputs = d.run_until(lambda o: "d10" in o and o["d10"].new_token_ids)
    assert d.holds_prompt_kv("d10", PROMPT)


def test_a_typed_streaming_failure_drops_the_cached_prefill_layout(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    """As a per-request load does: after a typed failure the prefill's layout is asked again (a
    restarted prefill on that port must not be read through its predecessor's descriptor)."""
    p, d = pd
    port = p.worker._worker.cfg.side_channel_port
    d.add("d11", PROMPT, 2, {**_decode_params(p, "t11"), "remote_engine_id": "an-earlier-instance"})
    d.step()
    p.add("p11", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "t11"})
    p.step()
    outputs = d.run_until(lambda o: "d11" in o and o["d11"].finish_reason is not None, timeout=10)
    assert not outputs["d11"].new_token_ids  # "another instance now": failed, vLLM's policy decides
    assert ("127.0.0.1", port) not in d.worker._worker._remotes
    d.run_until(lambda o: d.free_blocks() == d.idle_free)


def _meta(**kw: Any) -> KvpoolConnectorMetadata:
    return KvpoolConnectorMetadata(**kw)


def test_progress_table_generations_and_readiness() -> None:
    regions = [Region(f"l{i}#{k}", 0, 64, 64, 8) for i in range(2) for k in range(2)]  # K/V planes
    t = StreamTable(regions)
    assert t.progress(["x"])[0] == {"x": {"state": "pending"}}
    t.begin_step(_meta(stream={"r": StreamStep("x", [4, 5], 40, 60, True, 8)}), 60.0)
    st = t.progress(["x"])[0]["x"]
    assert st["state"] == "live" and st["final"] == [8, 8, 8, 8] and st["gen"] == 0  # prefix hit
    t.layer_saved("l0")
    assert t.progress(["x"])[0]["x"]["final"] == [40, 40, 8, 8]  # both planes of layer 0
    gate = SimpleNamespace(done=False)
    t.layer_saved("l1", lambda: gate.done)  # GPU: final once the recorded event completed
    assert t.progress(["x"])[0]["x"]["final"] == [40, 40, 8, 8]
    gate.done = True
    assert t.progress(["x"])[0]["x"]["final"] == [40, 40, 40, 40]
    t.step_done()
    assert t.gen_ok("r", 0)
    # Preempted: nothing of the old blocks is final, the generation moves, old reads are refused.
    t.begin_step(_meta(stream={"r": StreamStep("x", [], 0, 60, True, 0)}), 60.0)
    st = t.progress(["x"])[0]["x"]
    assert st["gen"] == 1 and st["final"] == [0, 0, 0, 0] and st["blocks"] == []
    assert not t.gen_ok("r", 0) and t.gen_ok("r", 1)
    t.begin_step(_meta(stream_end={"r"}), 60.0)  # aborted
    assert t.progress(["x"])[0]["x"] == {"state": "dead"} and not t.gen_ok("r", 1)
    t.layer_saved("l0")  # no step in progress: nothing changes, nothing fails
    t.begin_step(_meta(), 0.0)  # dead streams are dropped after keep_dead_s
    assert t.progress(["x"])[0]["x"] == {"state": "pending"}
    t.begin_step(_meta(stream={"q": StreamStep("y", [1], 16, 16, True, 0)}), 60.0)
    t.forget({"q"})
    assert t.progress(["y"])[0]["y"] == {"state": "pending"}


def test_final_blocks_only_for_a_live_stream_under_its_generation_with_the_prompt_final() -> None:
    """What a "done" notice for a stream not held yet is checked against: the prompt's blocks
    (not the ones past it), and only once every region is final for the whole prompt under the
    generation the read names; a preempted or aborted stream gives nothing."""
    t = StreamTable([Region(f"l{i}", 0, 64, 64, 8) for i in range(2)])
    assert t.final_blocks("r", 0, 16) is None  # no stream
    t.begin_step(_meta(stream={"q": StreamStep("y", [1, 2, 3], 40, 40, True, 0, 2)}), 60.0)
    t.step_done()
    assert t.final_blocks("q", 2, 16) is None  # final, but it generates on (max_tokens > 1)
    t.begin_step(_meta(stream={"r": StreamStep("x", [4, 5, 6, 9], 40, 40, True, 0, 3, ends=True)}), 60.0)
    assert t.final_blocks("r", 3, 16) is None  # nothing final yet
    t.layer_saved("l0")
    assert t.final_blocks("r", 3, 16) is None  # layer 1 not final
    gate = SimpleNamespace(done=False)
    t.layer_saved("l1", lambda: gate.done)
    assert t.final_blocks("r", 3, 16) is None  # its GPU write not complete
    gate.done = True
    assert t.final_blocks("r", 3, 16) == [4, 5, 6]  # 40 tokens in 16-token blocks: 3 of the 4
    assert t.final_blocks("r", 2, 16) is None and t.final_blocks("q", 3, 16) is None
    t.begin_step(_meta(stream={"r": StreamStep("x", [], 0, 40, True, 0, 4, ends=True)}), 60.0)  # preempted
    assert t.final_blocks("r", 3, 16) is None and t.final_blocks("r", 4, 16) is None
    t.begin_step(_meta(stream={"r": StreamStep("x", [7, 8, 2], 40, 40, ends=True)}), 60.0)
    t.step_done()
    assert t.final_blocks("r", 4, 16) == [7, 8, 2]
    t.begin_step(_meta(stream_end={"r"}), 60.0)  # aborted
    assert t.final_blocks("r", 4, 16) is None


def test_a_request_id_used_again_with_another_transfer_id_is_a_new_stream() -> None:
    """A prefill request id comes again with another transfer id while the first one's stream is
    live (a client's id used twice): the old entry was fed the new request's blocks under the old
    transfer id (its decode read them as the first request's KV, the new decode waited for a
    transfer id never announced). The old stream is dead now, the new one its own."""
    t = StreamTable([Region("l0", 0, 64, 64, 8)])
    t.begin_step(_meta(stream={"r": StreamStep("x", [4, 5], 40, 40, True, 0)}), 60.0)
    t.step_done()
    t.begin_step(_meta(stream={"r": StreamStep("y", [7, 8], 40, 40, True, 0)}), 60.0)
    assert t.progress(["x"])[0]["x"] == {"state": "dead"}
    st = t.progress(["y"])[0]["y"]
    assert st["state"] == "live" and st["blocks"] == [7, 8] and st["gen"] == 0 and st["final"] == [0]
    assert t.gen_ok("r", 0)  # (the new stream's: a read of it is still checked by its digest)


def test_a_dead_streams_sweep_keeps_a_later_stream_of_its_request_id() -> None:
    """A stream of ``r`` dies, another of ``r`` (a client's id used again) starts. Sweeping the
    dead one (after keep_dead_s) dropped the request id's entry, the later stream's: a notice read
    under its generation from before a preemption was then trusted (no stream known: any
    generation passed)."""
    t = StreamTable([Region("l0", 0, 64, 64, 8)])
    t.begin_step(_meta(stream={"r": StreamStep("x", [4, 5], 40, 40, True, 0)}), 60.0)
    t.begin_step(_meta(stream_end={"r"}), 60.0)
    t.begin_step(_meta(stream={"r": StreamStep("y", [7, 8], 40, 40, True, 0)}), 60.0)
    t.begin_step(_meta(stream={"r": StreamStep("y", [], 0, 40, True, 0)}), 60.0)  # preempted
    assert not t.gen_ok("r", 0)
    t.begin_step(_meta(), 0.0)  # the dead stream "x" is dropped
    assert t.progress(["x"])[0]["x"] == {"state": "pending"} and t.progress(["y"])[0]["y"]["gen"] == 1
    assert not t.gen_ok("r", 0) and t.gen_ok("r", 1)


def test_progress_questions_wait_at_the_prefill_until_news() -> None:
    t = StreamTable([Region("l0", 0, 64, 64, 8)])
    woken: list[int] = []
    t.on_change = lambda: woken.append(t.version)
    t.begin_step(_meta(stream={"r": StreamStep("x", [1], 32, 32, True, 0)}), 60.0)
    _, v = t.progress(["x"])
    assert not t.park("c0", 1, ["x"], v - 1, time.monotonic() + 1)  # news already: answer now
    assert t.park("c1", 2, ["x"], v, time.monotonic() + 1)
    assert t.park("c2", 3, ["x"], v, time.monotonic() - 1)  # its time is up
    assert t.due(time.monotonic()) == [("c2", 3, ["x"])] and not woken
    t.layer_saved("l0")  # news: the server is woken and the question answered
    assert woken == [v + 1] and t.due(time.monotonic()) == [("c1", 2, ["x"])]
    assert t.progress(["x"])[0]["x"]["final"] == [32] and t.due(time.monotonic()) == []
    t.step_done()  # nothing parked: no wake-up
    assert woken == [v + 1]
    t.begin_step(_meta(stream={"r": StreamStep("x", [1], 32, 32, False, 0)}), 60.0)
    t.layer_saved("l0", lambda: False)  # a GPU readiness outstanding: questions are not held
    assert not t.park("c3", 4, ["x"], t.version, time.monotonic() + 1)


def test_a_sliding_window_stream_reads_nothing_into_or_out_of_the_null_block(tiny_llama: Path) -> None:  # noqa: F811
    """A sliding-window model: the decode's blocks out of its window are vLLM's null block (0,
    shared by every request). The stream reads none of the prompt's blocks into it, the load
    still finishes (vLLM needs no KV out of the window) with the window's KV the prefill's; a
    prefill naming its null block for a block the decode needs fails the load without reporting
    block 0 to vLLM."""
    cfg = {"abort_timeout_s": 30}
    p = LayerInstance(tiny_llama, "KvpoolConnector", "kv_producer",
                      {**cfg, "side_channel_port": free_port()}, sliding_window=64)  # fmt: skip
    d = LayerInstance(tiny_llama, "KvpoolConnector", "kv_consumer",
                      {**cfg, "side_channel_port": free_port()}, sliding_window=64)  # fmt: skip
    try:
        d.add("w1", LONG, 4, _decode_params(p, "tw1"))
        out, _ = d.step()
        job = out.kv_connector_metadata.recv["w1"]
        assert d.scheduler.kv_cache_manager.get_block_ids("w1")[0][:4] == [0, 0, 0, 0]
        assert 0 not in job.local_block_ids and job.block_index == [4, 5, 6]
        p.add("pw1", LONG, 1, {"do_remote_decode": True, "transfer_id": "tw1"})
        p.step()
        p.step()  # the worker learns pw1's blocks are held
        outputs = d.run_until(lambda o: "w1" in o and o["w1"].new_token_ids)
        assert outputs["w1"].new_token_ids == [7]
        assert all(not d.kv[name][0].any() for name in d.kv)  # the decode's null block untouched
        lo = (199 - 64) // BS * BS
        for got, want in zip(d.block_values("w1", 199), expected_rows(LONG, 199), strict=True):
            assert torch.equal(got[lo:], want[lo:])
        assert d.worker._worker.loaded_blocks == 3
        p.run_until(lambda o: p.free_blocks() == p.idle_free)  # "done" freed the prefill's blocks
        # A prefill whose progress names its null block for a block the decode needs.
        for name in p.kv:
            p.kv[name][0] = 123.0
        real = p.worker._worker._progress

        def nulls(ids: Any) -> Any:
            reply = real(ids)
            st = reply["streams"].get("tw2") or {}
            if st.get("state") == "live":
                st["blocks"] = [0] * len(st["blocks"])
            return reply

        p.worker._worker._progress = nulls
        reported: list[int] = []
        errors = d.worker.get_block_ids_with_load_errors
        d.worker.get_block_ids_with_load_errors = lambda: (e := errors()) and reported.extend(e) or e
        other = [(i * 29) % 500 + 3 for i in range(200)]  # no prefix hit on either side
        d.add("w2", other, 4, _decode_params(p, "tw2"))
        d.step()
        p.add("pw2", other, 1, {"do_remote_decode": True, "transfer_id": "tw2"})
        p.step()
        # vLLM's default kv_load_failure_policy is "fail": the request ends, no wrong bytes.
        outputs = d.run_until(lambda o: "w2" in o and o["w2"].finish_reason is not None)
        assert not outputs["w2"].new_token_ids
        assert len(reported) == 3 and 0 not in reported  # its own blocks, never the null block
        assert all(not d.kv[name][0].any() for name in d.kv)
    finally:
        d.close()
        p.close()


def test_a_stream_into_only_the_null_block_finishes_at_once(pd: tuple[LayerInstance, LayerInstance]) -> None:
    """Every block vLLM gave a streaming load is its null block: nothing is read, the request is
    reported finished loading at once (vLLM waits for it), and the prefill is still told "done"."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    p, d = pd
    req = d.add("n1", PROMPT, 2, _decode_params(p, "tn1"))
    null = d.scheduler.kv_cache_manager.block_pool.null_block
    d.connector.update_state_after_alloc(req, KVCacheBlocks(([null],)), 32)
    meta = d.connector.build_connector_meta(None)
    assert meta.recv["n1"].local_block_ids == [] and meta.recv["n1"].waited
    d.worker.bind_connector_metadata(meta)
    d.worker.start_load_kv(None)
    assert d.worker.get_finished(set()) == (None, {"n1"})
    assert d.worker.get_block_ids_with_load_errors() == set()
    p.add("pn1", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "tn1"})
    p.run_until(lambda o: "pn1" in o and o["pn1"].finish_reason is not None)
    p.run_until(lambda o: p.free_blocks() == p.idle_free)  # the decode's "done" freed them
    assert not d.kv[LAYERS[0]][0].any()


def test_a_stream_given_more_blocks_than_the_prompt_is_recomputed_not_left_waiting(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    """vLLM gives a streaming load more blocks than the prompt has (the per-request load refuses
    such a load): the load fails at once, reporting its blocks (vLLM recomputes them) and the
    request finished loading (it waited forever: nothing was ever reported); the prefill is still
    told "done" and frees its blocks."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    p, d = pd
    req = d.add("m1", PROMPT, 2, _decode_params(p, "tm1"))
    blocks = d.scheduler.kv_cache_manager.block_pool.get_new_blocks(4)  # 80 tokens: 3 blocks
    d.connector.update_state_after_alloc(req, KVCacheBlocks((blocks,)), 80)
    meta = d.connector.build_connector_meta(None)
    assert meta.recv["m1"].refused is not None
    d.worker.bind_connector_metadata(meta)
    d.worker.start_load_kv(None)
    assert d.worker.get_finished(set()) == (None, {"m1"})
    assert d.worker.get_block_ids_with_load_errors() == {b.block_id for b in blocks}
    d.worker.clear_connector_metadata()
    p.add("pm1", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "tm1"})
    p.run_until(lambda o: "pm1" in o and o["pm1"].finish_reason is not None)
    p.run_until(lambda o: p.free_blocks() == p.idle_free)  # the decode's "done" freed them
    assert not any(d.kv[name][b.block_id].any() for name in d.kv for b in blocks)  # nothing read


def _stream_of_one_block() -> tuple[list[Any], Any, Any, Any]:
    """A decode's stream load of one block (d1 into block 5, transfer "t") over two layers, its
    reads recorded: (reads, worker, remote layout, load) for ``pd_stream._advance``."""
    from kvpool.connectors.vllm.pd_scheduler import RecvJob
    from kvpool.connectors.vllm.pd_stream import StreamLoad

    regions = [Region("l0", 0x1000, 64, 64, 8), Region("l1", 0x2000, 64, 64, 8)]
    reads: list[Any] = []
    engine = SimpleNamespace(batch_transfer_sync=lambda *a: reads.append(a))
    worker = SimpleNamespace(block_size=BS, tp_size=1, regions=regions, engine=engine,
                             _check_layout=lambda rem: None)  # fmt: skip
    rem = SimpleNamespace(block_size=BS, segment="p", regions={r.name: r for r in regions})
    job = RecvJob("d1", [5], [], "127.0.0.1", 1, "", transfer_id="t", num_tokens=BS)
    return reads, worker, rem, StreamLoad(job, time.monotonic() + 30)


def test_a_transfer_id_taken_over_by_another_prefill_request_fails_the_load() -> None:
    """A client sends one transfer id with two prefill requests (prompts of one length): the
    decode read some layers of the first one's blocks; once the id names the other request, the
    load fails instead of reading the rest from the other request's blocks."""
    from kvpool.connectors.vllm.pd_stream import _advance
    from kvpool.errors import TransferError

    reads, worker, rem, ld = _stream_of_one_block()

    def state(req_id: str, final: list[int]) -> dict[str, Any]:
        return {"state": "live", "req_id": req_id, "gen": 0, "total": BS, "blocks": [3], "final": final}

    assert _advance(worker, rem, ld, state("pA", [BS, 0]), {}) == (False, 64)  # layer 0 of pA
    assert len(reads) == 1
    with pytest.raises(TransferError, match="now names prefill request pB"):
        _advance(worker, rem, ld, state("pB", [BS, BS]), {})
    assert len(reads) == 1  # nothing of pB's blocks was read


def test_a_transfer_id_taken_over_by_a_later_stream_of_the_request_id_fails_the_load() -> None:
    """A client sends a request id and transfer id again (a second stream of the id) while a
    decode of the first stream still reads: the generation moved, so the decode started over on
    the new stream's blocks -- the new request's KV, confirmed since streams of a reused id are.
    The stream's first generation tells: the load fails."""
    from kvpool.connectors.vllm.pd_stream import _advance
    from kvpool.errors import TransferError

    reads, worker, rem, ld = _stream_of_one_block()

    def state(gen: int, first: int, final: list[int]) -> dict[str, Any]:
        return {"state": "live", "req_id": "pA", "gen": gen, "total": BS, "blocks": [3], "final": final,
                "first": first}  # fmt: skip

    assert _advance(worker, rem, ld, state(1, 1, [BS, 0]), {}) == (False, 64)
    assert _advance(worker, rem, ld, state(2, 1, [0, 0]), {}) == (False, 0)  # preempted: the same stream
    with pytest.raises(TransferError, match="later stream of prefill request pA"):
        _advance(worker, rem, ld, state(4, 4, [BS, BS]), {})
    assert len(reads) == 1  # nothing of the later stream's blocks was read


def test_a_stream_never_reads_through_a_layout_cached_from_a_predecessor() -> None:
    """The decode's cached layout of a prefill port came from an earlier incarnation; a stream
    whose params name no engine adopts the one that answers. Its region addresses may be stale:
    the load fails (and the layout is asked again) instead of reading through them."""
    from kvpool.connectors.vllm.pd_scheduler import RecvJob
    from kvpool.connectors.vllm.pd_stream import StreamLoad, _advance
    from kvpool.errors import TransferError

    regions = [Region("l0", 0x1000, 64, 64, 8)]
    reads: list[Any] = []
    engine = SimpleNamespace(batch_transfer_sync=lambda *a: reads.append(a))
    worker = SimpleNamespace(block_size=BS, tp_size=1, tp_rank=0, regions=regions, engine=engine,
                             _check_layout=lambda rem: None)  # fmt: skip
    rem = SimpleNamespace(block_size=BS, segment="p", regions={"l0": regions[0]}, engine_id="e.old")
    fresh = SimpleNamespace(block_size=BS, segment="p2", regions={"l0": regions[0]}, engine_id="e.new")
    asked: list[Any] = []
    answers = [rem, fresh]  # the handshake asked again: first still the old one, then the new one
    worker._remote = lambda host, port, eid=None: asked.append(eid) or answers.pop(0)
    job = RecvJob("d1", [5], [], "127.0.0.1", 1, "", transfer_id="t", num_tokens=BS)
    st = {"state": "live", "req_id": "pA", "gen": 0, "total": BS, "blocks": [3], "final": [BS]}
    with pytest.raises(TransferError, match="restarted"):
        _advance(worker, rem, StreamLoad(job, time.monotonic() + 30), st, {"engine_id": "e.new"})
    assert reads == [] and asked == ["e.new"]
    assert _advance(worker, rem, StreamLoad(job, time.monotonic() + 30), st, {"engine_id": "e.new"})[0]
    assert asked == ["e.new", "e.new"] and [a[0] for a in reads] == ["p2"]  # through the new layout


def test_a_streamed_read_of_blocks_not_held_for_the_request_is_not_confirmed(
    pd: tuple[LayerInstance, LayerInstance],
) -> None:
    """The decode takes a streamed load's blocks from the prefill's progress table; its "done"
    notice was checked by generation only. A table entry naming other blocks under the same
    generation (stale: a request id used again, blocks freed and handed to another request) had
    the load confirmed with another request's KV. The notice carries the digest of the request id
    and the blocks read: refused, the load fails (vLLM's policy), the notice frees nothing."""
    p, d = pd
    other = [(i * 29) % 500 + 3 for i in range(80)]
    p.add("pa", other, 1, {"do_remote_decode": True})  # held for a decode of its own
    p.run_until(lambda o: "pa" in o and o["pa"].finish_reason is not None)
    pa_blocks = list(p.scheduler.kv_cache_manager.get_block_ids("pa")[0])
    real = p.worker._worker._progress

    def stale(ids: Any) -> Any:
        reply = real(ids)
        st = reply["streams"].get("ts") or {}
        if st.get("state") == "live":
            st["blocks"] = list(pa_blocks)
        return reply

    p.worker._worker._progress = stale
    d.add("ds", PROMPT, 4, _decode_params(p, "ts"))
    d.step()
    p.add("ps", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "ts"})
    p.step()
    p.step()  # the worker learns ps's blocks are held
    outputs = d.run_until(
        lambda o: "ds" in o and (o["ds"].new_token_ids or o["ds"].finish_reason is not None)
    )
    assert not outputs["ds"].new_token_ids  # failed (vLLM's default policy), never decoded from pa's KV
    assert dict(d.worker._worker.stats.data.get("failures") or {}) == {"Unconfirmed": 1}
    held = p.worker._worker._pending_send
    assert "ps" in held and "pa" in held  # the refused notice freed nothing
    d.run_until(lambda o: d.free_blocks() == d.idle_free)


def test_a_streams_blocks_changed_under_one_generation_fail_the_load() -> None:
    """Blocks read in an earlier round are renamed by a later progress answer of the same
    generation: the load fails instead of finishing with a digest of blocks it did not read."""
    from kvpool.connectors.vllm.pd_stream import StreamLoad, _advance
    from kvpool.errors import TransferError

    reads, worker, rem, ld = _stream_of_one_block()

    def state(blocks: list[int], final: list[int], gen: int = 0) -> dict[str, Any]:
        return {"state": "live", "req_id": "pA", "gen": gen, "total": BS, "blocks": blocks, "final": final}

    assert _advance(worker, rem, ld, state([3], [BS, 0]), {}) == (False, 64)  # layer 0 of block 3
    with pytest.raises(TransferError, match="changed under one generation"):
        _advance(worker, rem, ld, state([4], [BS, BS]), {})
    job = ld.job
    assert len(reads) == 1 and job.blocks_digest is None  # nothing of block 4 was read
    ld = StreamLoad(job, time.monotonic() + 30)  # a new generation starts over: block 4 is read
    assert _advance(worker, rem, ld, state([3], [BS, 0]), {})[0] is False
    assert _advance(worker, rem, ld, state([4], [BS, BS], gen=1), {})[0] is True
    assert job.stream_first == 0 and job.blocks_digest == blocks_digest("pA", [4])
