"""Scheduler-level lifecycle of the vLLM connectors: vLLM's real Scheduler, kvpool's real worker
halves, transfer engine and store; the forward pass is a test double (tests/vllm_sched.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.child import free_port
from tests.vllm_support import tiny_llama  # noqa: F401  (fixture)

pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")  # never skipped in CI

from tests.vllm_sched import BS, Instance, expected_rows  # noqa: E402

PROMPT = [(i * 37) % 500 + 3 for i in range(80)]  # 2.5 blocks


@pytest.fixture
def pd(tiny_llama: Path) -> Iterator[tuple[Instance, Instance]]:  # noqa: F811
    port = free_port()
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer",
                 {"side_channel_port": port, "abort_timeout_s": 30})  # fmt: skip
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()})
    yield p, d
    d.close()
    p.close()


def prefill(p: Instance, rid: str = "p1", prompt: list[int] = PROMPT) -> dict:
    """A one-token prefill of ``rid``; its kv_transfer_params once the prefill worker holds its
    blocks (the next step tells it: a decode's "done" notice is confirmed only then)."""
    p.add(rid, prompt, 1, {"do_remote_decode": True})
    _, outputs = p.step()
    params = outputs[rid].kv_transfer_params
    assert outputs[rid].finish_reason is not None
    p.step()
    return params


def test_prefill_keeps_blocks_until_decode_has_read_them(pd: tuple[Instance, Instance]) -> None:
    p, d = pd
    params = prefill(p)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == 3  # ceil(80 / 32)
    assert params["remote_port"] == p.worker.cfg.side_channel_port
    assert p.free_blocks() == p.idle_free - 3
    for _ in range(3):  # no decode yet: the blocks stay
        p.step()
    assert p.free_blocks() == p.idle_free - 3

    d.add("d1", PROMPT, 4, params)
    out, _ = d.step()
    job = out.kv_connector_metadata.recv["d1"]
    assert job.remote_block_ids == params["remote_block_ids"] and len(job.local_block_ids) == 3
    assert d.scheduler.requests["d1"].status.name == "WAITING_FOR_REMOTE_KVS"
    outputs = d.run_until(lambda o: "d1" in o and o["d1"].new_token_ids)
    assert outputs["d1"].new_token_ids == [7]
    # The decode's KV of the 80 prompt tokens is exactly what the prefill computed.
    for got, want in zip(d.block_values("d1", 79), expected_rows(PROMPT, 79), strict=True):
        assert torch.equal(got, want)
    assert d.worker._worker.loaded_blocks == 3
    assert d.scheduler.requests["d1"].num_computed_tokens >= 80
    # The "done" notice frees the prefill's blocks.
    p.run_until(lambda o: p.free_blocks() == p.idle_free)


def test_decode_with_local_prefix_hit_reads_only_the_tail(pd: tuple[Instance, Instance]) -> None:
    p, d = pd
    # The decode instance already computed the first 2 blocks of the prompt locally.
    d.add("warm", PROMPT[:64] + [1, 2], 1, None)
    d.run_until(lambda o: "warm" in o and o["warm"].finish_reason is not None)
    params = prefill(p)
    d.add("d2", PROMPT, 2, params)
    out, _ = d.step()
    job = out.kv_connector_metadata.recv["d2"]
    assert len(job.local_block_ids) == 1 and job.remote_block_ids == params["remote_block_ids"][-1:]
    d.run_until(lambda o: "d2" in o and o["d2"].new_token_ids)
    for got, want in zip(d.block_values("d2", 79), expected_rows(PROMPT, 79), strict=True):
        assert torch.equal(got, want)
    p.run_until(lambda o: p.free_blocks() == p.idle_free)


def test_prefill_frees_blocks_after_abort_timeout(tiny_llama: Path) -> None:  # noqa: F811
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer",
                 {"side_channel_port": free_port(), "abort_timeout_s": 0.3})  # fmt: skip
    try:
        prefill(p)
        assert p.free_blocks() == p.idle_free - 3
        t0 = time.monotonic()
        p.run_until(lambda o: p.free_blocks() == p.idle_free, timeout=5)
        assert time.monotonic() - t0 >= 0.25
    finally:
        p.close()


def test_a_read_after_the_prefill_freed_the_blocks_fails_the_load(tiny_llama: Path) -> None:  # noqa: F811
    """The prefill gave up on the decode (abort_timeout_s) and freed the blocks, another request
    wrote its KV into them; a decode that reads them late must not use that KV: its "done" notice
    is answered "expired" and the load fails (the read itself succeeds: the memory is there)."""
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer",
                 {"side_channel_port": free_port(), "abort_timeout_s": 0.3})  # fmt: skip
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()})
    try:
        params = prefill(p)
        p.run_until(lambda o: p.free_blocks() == p.idle_free, timeout=5)  # freed unread
        other = [(i * 11) % 450 + 5 for i in range(90)]
        prefill(p, "p2", other)  # may reuse the freed blocks
        d.add("late", PROMPT, 2, params)
        outputs = d.run_until(lambda o: "late" in o, timeout=20)
        assert d.worker._worker.loaded_blocks == 3  # the bytes were read ...
        assert outputs["late"].finish_reason is not None  # ... and refused (policy "fail")
        assert not outputs["late"].new_token_ids
        stats = d.worker._worker.stats.data
        assert stats["failures"] == {"PrefillFreed": 1}
        d.run_until(lambda o: d.free_blocks() == d.idle_free)
    finally:
        d.close()
        p.close()


def test_a_read_from_another_instance_on_that_port_fails_the_load(pd: tuple[Instance, Instance]) -> None:
    """The params name an engine that is no longer the one on that side channel (the prefill
    restarted there): the bytes read are not that request's, so the load fails, and the notice
    (about another incarnation's request) frees nothing here."""
    p, d = pd
    params = dict(prefill(p), remote_engine_id="the-instance-before-a-restart")
    d.add("moved", PROMPT, 2, params)
    outputs = d.run_until(lambda o: "moved" in o, timeout=20)
    assert outputs["moved"].finish_reason is not None and not outputs["moved"].new_token_ids
    assert d.worker._worker.stats.data["failures"] == {"Unconfirmed": 1}
    assert "p1" in p.worker._worker._pending_send and p.free_blocks() == p.idle_free - 3


def test_load_from_dead_prefill_reports_failed_blocks(pd: tuple[Instance, Instance]) -> None:
    p, d = pd
    params = prefill(p)
    p.close()  # the prefill instance is gone before the decode reads
    d.add("d3", PROMPT, 2, params)
    t0 = time.monotonic()
    outputs = d.run_until(lambda o: "d3" in o, timeout=20)
    assert time.monotonic() - t0 < 15
    # vLLM's default kv_load_failure_policy is "fail": the request ends with an error, no hang.
    assert outputs["d3"].finish_reason is not None
    d.run_until(lambda o: d.free_blocks() == d.idle_free)


def test_recompute_policy_recomputes_after_failed_load(tiny_llama: Path) -> None:  # noqa: F811
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer", {"side_channel_port": free_port()})
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()})
    d.vc.kv_transfer_config.kv_load_failure_policy = "recompute"
    d.scheduler.recompute_kv_load_failures = True
    try:
        params = prefill(p)
        p.close()
        d.add("d4", PROMPT, 2, params)
        outputs = d.run_until(lambda o: "d4" in o and o["d4"].new_token_ids, timeout=20)
        assert outputs["d4"].finish_reason is None  # recomputed locally, still running
        for got, want in zip(d.block_values("d4", 79), expected_rows(PROMPT, 79), strict=True):
            assert torch.equal(got, want)
    finally:
        d.close()


def test_incomplete_params_compute_locally(pd: tuple[Instance, Instance]) -> None:
    _, d = pd
    d.add("d5", PROMPT, 1, {"do_remote_prefill": True, "remote_block_ids": [1]})
    out, _ = d.step()
    assert "d5" not in out.kv_connector_metadata.recv
    assert out.num_scheduled_tokens["d5"] == len(PROMPT)


_GOOD = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1",
         "remote_port": 5555, "remote_request_id": "p1"}  # fmt: skip
_STREAM = {"do_remote_prefill": True, "transfer_id": "t1", "remote_host": "127.0.0.1", "remote_port": 5555}


@pytest.mark.parametrize(
    "params",
    [
        {**_GOOD, "remote_port": "x"},
        {**_GOOD, "remote_port": 70000},
        {**_GOOD, "remote_port": 65535, "tp_size": 2},
        {**_GOOD, "remote_port": True},
        {**_GOOD, "tp_size": 0},
        {**_GOOD, "tp_size": 10**9},
        {**_GOOD, "tp_size": "two"},
        {**_GOOD, "remote_block_ids": "abc"},
        {**_GOOD, "remote_block_ids": [1, "2"]},
        {**_GOOD, "remote_block_ids": [-1]},
        {**_GOOD, "remote_block_ids": 7},
        {**_GOOD, "remote_host": 5},
        {**_GOOD, "remote_host": ""},
        {**_GOOD, "remote_request_id": ["p1"]},
        {**_GOOD, "remote_engine_id": {"a": 1}},
        {**_STREAM, "transfer_id": {"t": 1}},
        {**_STREAM, "transfer_id": "t" * 300},
        {**_STREAM, "remote_port": -1},
    ],
)
def test_malformed_params_compute_locally_and_the_engine_goes_on(
    pd: tuple[Instance, Instance], params: dict
) -> None:
    """A client can send any ``kv_transfer_params``; a malformed value must not raise in vLLM's
    scheduler hooks (that ends the engine): the request computes locally."""
    p, d = pd
    d.add("bad", PROMPT, 1, dict(params))
    out, _ = d.step()
    assert "bad" not in out.kv_connector_metadata.recv
    assert out.num_scheduled_tokens["bad"] == len(PROMPT)
    good = prefill(p, "p2", PROMPT[:40])
    d.add("good", PROMPT[:40], 1, good)
    out, _ = d.step()
    assert out.kv_connector_metadata.recv["good"].remote_request_id == "p2"  # well-formed ones still load


def test_block_size_mismatch_fails_the_load(tiny_llama: Path, pd: tuple[Instance, Instance]) -> None:  # noqa: F811
    p, d = pd
    params = prefill(p)
    d.worker._worker.block_size = BS * 2  # as if the decode ran another --block-size
    d.add("d6", PROMPT, 2, params)
    outputs = d.run_until(lambda o: "d6" in o, timeout=10)
    assert outputs["d6"].finish_reason is not None
    p.run_until(lambda o: p.free_blocks() == p.idle_free)  # the prefill is still told "done"


def test_abort_during_a_load_keeps_blocks_until_the_worker_is_done(tiny_llama: Path) -> None:  # noqa: F811
    import socket

    from vllm.v1.request import RequestStatus

    # A "prefill" side channel that accepts and never answers: the load hangs until the timeout.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer",
                 {"side_channel_port": free_port(), "transfer_timeout_s": 1.5})  # fmt: skip
    try:
        params = {
            "do_remote_prefill": True, "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1",
            "remote_port": silent.getsockname()[1], "remote_request_id": "gone", "remote_engine_id": "x",
            "remote_hold": 1,
        }  # fmt: skip
        d.add("d7", PROMPT, 2, params)
        d.step()
        assert d.free_blocks() == d.idle_free - 3
        d.scheduler.finish_requests("d7", RequestStatus.FINISHED_ABORTED)
        d.step()
        # The worker may still write into the blocks: they must not return to the pool yet.
        assert d.free_blocks() == d.idle_free - 3
        t0 = time.monotonic()
        d.run_until(lambda o: d.free_blocks() == d.idle_free, timeout=10)
        assert time.monotonic() - t0 < 5
        assert "d7" not in d.scheduler.requests
    finally:
        d.close()
        silent.close()


def test_full_local_hit_only_frees_the_prefill_blocks(pd: tuple[Instance, Instance]) -> None:
    p, d = pd
    params = prefill(p)
    # A request that gets no external tokens (vLLM found nothing to load) must not be reported as
    # finished loading, but the prefill must still be told to free its blocks.
    req = d.add("d8", PROMPT, 2, dict(params))
    d.connector.update_state_after_alloc(req, d.scheduler.kv_cache_manager.empty_kv_cache_blocks, 0)
    meta = d.connector.build_connector_meta(None)
    assert meta.recv["d8"].local_block_ids == []
    d.worker.bind_connector_metadata(meta)
    d.worker.start_load_kv(None)
    p.run_until(lambda o: p.free_blocks() == p.idle_free)
    assert d.worker.get_finished(set()) == (None, None)


def test_short_names_come_from_the_plugin_entry_point() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does at start-up
    assert KVConnectorFactory._registry["KvpoolConnector"]().__name__ == "KvpoolConnector"
    assert KVConnectorFactory._registry["KvpoolStoreConnector"]().__name__ == "KvpoolStoreConnector"


def test_vllm_whose_connector_interface_differs_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvpool.connectors.vllm.common import check_vllm

    assert check_vllm().startswith("0.32")
    monkeypatch.delattr(KVConnectorBase_V1, "get_block_ids_with_load_errors")
    with pytest.raises(ImportError, match="lacks get_block_ids_with_load_errors"):
        check_vllm()


def test_a_stopped_prefill_peer_delays_only_its_own_requests(tiny_llama: Path) -> None:  # noqa: F811
    """One prefill peer is a stopped process (its listening socket accepts, nothing answers): the
    decode's loads from the other prefill peer finish while the stopped peer's load waits for
    its transfer timeout (120 s here); a single load thread would hold every load behind it."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    dead_port = free_port()
    code = ("import socket, sys, time\ns = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))\n"
            "s.listen(64); print('ready', flush=True); time.sleep(600)\n")  # fmt: skip
    dead = subprocess.Popen([sys.executable, "-c", code, str(dead_port)], stdout=subprocess.PIPE, text=True)
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer", {"side_channel_port": free_port()})
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer",
                 {"side_channel_port": free_port(), "transfer_timeout_s": 120.0})  # fmt: skip
    d.vc.kv_transfer_config.kv_load_failure_policy = "recompute"
    d.scheduler.recompute_kv_load_failures = True
    try:
        assert dead.stdout is not None and dead.stdout.readline().strip() == "ready"
        os.kill(dead.pid, signal.SIGSTOP)
        live_prompt = [(i * 13) % 400 + 9 for i in range(90)]
        params = prefill(p, "l0", live_prompt)
        ghost = dict(params, remote_port=dead_port, remote_request_id="ghost")
        ghost.pop("remote_blocks_digest")  # (not l0's: the decode would refuse it before reading)
        d.add("from-dead", PROMPT, 2, ghost)
        d.step()  # its load is on the stopped peer's lane now
        with socket.create_connection(("127.0.0.1", dead_port), timeout=5):
            pass  # the stopped peer still completes TCP handshakes: it looks alive to a connect
        d.add("from-live", live_prompt, 2, params)
        t0 = time.monotonic()
        d.run_until(lambda o: "from-live" in o and o["from-live"].new_token_ids, timeout=60)
        waited = time.monotonic() - t0
        assert waited < 60  # far below the stopped peer's 120 s transfer timeout
        for got, want in zip(d.block_values("from-live", 89), expected_rows(live_prompt, 89), strict=True):
            assert torch.equal(got, want)
        p.run_until(lambda o: p.free_blocks() == p.idle_free)  # the live peer got its "done"
        assert d.scheduler.requests["from-dead"].status.name == "WAITING_FOR_REMOTE_KVS"
        # The stopped peer dies: its load fails at once and the request is recomputed locally.
        dead.kill()
        dead.wait()
        outputs = d.run_until(lambda o: "from-dead" in o and o["from-dead"].new_token_ids, timeout=60)
        assert outputs["from-dead"].finish_reason is None
        for got, want in zip(d.block_values("from-dead", 79), expected_rows(PROMPT, 79), strict=True):
            assert torch.equal(got, want)
    finally:
        if dead.poll() is None:
            dead.kill()
            dead.wait()
        d.close()
        p.close()


SWA_PROMPT = [(i * 37) % 500 + 3 for i in range(200)]  # 7 blocks; a 64-token window keeps the last 3


def test_sliding_window_load_reads_nothing_into_the_null_block(tiny_llama: Path) -> None:  # noqa: F811
    """A sliding-window model: the prefill hands out its blocks out of the window as vLLM's null
    block (0), the decode allocates its own null block for them; no pair with the decode's null
    block (shared by every request) is read, and the window's KV is the prefill's."""
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer",
                 {"side_channel_port": free_port(), "abort_timeout_s": 30}, sliding_window=64)  # fmt: skip
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()},
                 sliding_window=64)  # fmt: skip
    try:
        params = prefill(p, "s1", SWA_PROMPT)
        assert params["remote_block_ids"][:4] == [0, 0, 0, 0]  # out of the window: vLLM's null block
        for name in p.kv:  # whatever the prefill's null block holds must not reach the decode's
            p.kv[name][0] = 123.0
        d.add("s2", SWA_PROMPT, 4, params)
        out, _ = d.step()
        job = out.kv_connector_metadata.recv["s2"]
        assert d.scheduler.kv_cache_manager.get_block_ids("s2")[0][:4] == [0, 0, 0, 0]
        assert 0 not in job.local_block_ids and 0 not in job.remote_block_ids
        assert len(job.local_block_ids) == 3 and job.refused is None
        d.run_until(lambda o: "s2" in o and o["s2"].new_token_ids)
        assert all(not d.kv[name][0].any() for name in d.kv)  # the decode's null block untouched
        lo = (199 - 64) // BS * BS
        for got, want in zip(d.block_values("s2", 199), expected_rows(SWA_PROMPT, 199), strict=True):
            assert torch.equal(got[lo:], want[lo:])
        p.run_until(lambda o: p.free_blocks() == p.idle_free)
    finally:
        d.close()
        p.close()


def test_a_block_the_prefill_freed_out_of_its_window_is_recomputed(tiny_llama: Path) -> None:  # noqa: F811
    """The decode needs a block the prefill handed out as its null block (freed out of its
    sliding window): the load is refused and vLLM recomputes; never a read of the null block."""
    p = Instance(tiny_llama, "KvpoolConnector", "kv_producer",
                 {"side_channel_port": free_port(), "abort_timeout_s": 30}, sliding_window=64)  # fmt: skip
    d = Instance(tiny_llama, "KvpoolConnector", "kv_consumer", {"side_channel_port": free_port()})
    d.vc.kv_transfer_config.kv_load_failure_policy = "recompute"
    d.scheduler.recompute_kv_load_failures = True
    try:
        params = prefill(p, "s1", SWA_PROMPT)
        for name in p.kv:
            p.kv[name][0] = 123.0
        d.add("s3", SWA_PROMPT, 2, params)
        out, _ = d.step()
        job = out.kv_connector_metadata.recv["s3"]
        assert job.refused is not None and job.remote_block_ids == [] and len(job.local_block_ids) == 7
        outputs = d.run_until(lambda o: "s3" in o and o["s3"].new_token_ids, timeout=20)
        assert outputs["s3"].finish_reason is None  # recomputed locally, still running
        for got, want in zip(d.block_values("s3", 199), expected_rows(SWA_PROMPT, 199), strict=True):
            assert torch.equal(got, want)
        p.run_until(lambda o: p.free_blocks() == p.idle_free)  # the prefill is told to free them
    finally:
        d.close()
        p.close()


def test_a_load_into_only_the_null_block_finishes_at_once(pd: tuple[Instance, Instance]) -> None:
    """Every block vLLM gave the load is its null block: nothing is read, and the worker still
    reports the request finished loading (vLLM waits for it) and frees the prefill's blocks."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    p, d = pd
    params = prefill(p)
    req = d.add("d9", PROMPT, 2, dict(params))
    null = d.scheduler.kv_cache_manager.block_pool.null_block
    d.connector.update_state_after_alloc(req, KVCacheBlocks(([null],)), 32)
    meta = d.connector.build_connector_meta(None)
    assert meta.recv["d9"].local_block_ids == [] and meta.recv["d9"].refused is None
    d.worker.bind_connector_metadata(meta)
    d.worker.start_load_kv(None)
    assert d.worker.get_finished(set()) == (None, {"d9"})
    assert d.worker.get_block_ids_with_load_errors() == set()
    p.run_until(lambda o: p.free_blocks() == p.idle_free)
