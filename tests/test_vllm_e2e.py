"""End to end on real vLLM CPU servers (tiny random Llama): 1 prefill + 1 decode + ``kvpool proxy``
against one ordinary server, the store connector across two servers, and a prefill killed
before the decode reads."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.child import ChildProcess, free_port
from kvpool.conductor.store_feed import StoreFeed
from kvpool.store.procs import MasterProcess, StorageProcess
from tests.conductor_support import RouterProxy
from tests.vllm_support import VllmServer, tiny_llama  # noqa: F401  (fixture)

pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")  # never skipped in CI

MAX_TOKENS = 12
KV_BYTES = 256 << 20  # 64k tokens of the tiny model
# Prompts as token ids (lengths 19, 100, 500 and 1500: below one block, several, many).
PROMPTS = [[(i * k + 11) % 700 + 4 for i in range(n)] for k, n in ((3, 19), (7, 100), (13, 500), (17, 1500))]
# Streaming P/D gets prompts of its own (the others are in both servers' prefix caches by then).
STREAM_PROMPTS = [
    [(i * k + 5) % 700 + 4 for i in range(n)] for k, n in ((5, 19), (9, 100), (11, 500), (19, 1500))
]
STREAMED = 200  # reference keys STREAMED + i of STREAM_PROMPTS
SALTED = 99  # reference key of SALTED_PROMPT (9 full blocks), sent with cache_salt
SALTED_PROMPT = [(i * 29 + 5) % 700 + 4 for i in range(300)]


def kv_config(connector: str, role: str, short_name: bool = False, **extra: object) -> list[str]:
    cfg: dict[str, object] = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
    if not short_name:  # else the vllm.general_plugins entry point must make the name known
        cfg["kv_connector_module_path"] = "kvpool.connectors.vllm"
    return ["--kv-transfer-config", json.dumps(cfg)]


class ProxyProcess(ChildProcess):
    """``kvpool proxy`` in a child process (stopped by SIGTERM)."""

    def __init__(
        self, prefill: list[str], decode: list[str], health_interval_s: float = 1.0, *extra: str
    ) -> None:
        cmd = [sys.executable, "-m", "kvpool.cli", "proxy", "--port", "0", "--health-interval-s",
               str(health_interval_s), "--prefill", *prefill, "--decode", *decode, *extra]  # fmt: skip
        super().__init__(cmd, stdin=False)
        self.url = f"http://127.0.0.1:{self.info['port']}"


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:  # say which backend failed and how (the proxy's body)
        body = exc.read()[:2000].decode(errors="replace")
        raise urllib.error.HTTPError(url, exc.code, f"{exc.reason}: {body}", exc.headers, None) from exc


def completion(base: str, prompt: list[int], **kw: object) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, **kw}
    return post(base + "/v1/completions", body)


def _health(base: str) -> dict:
    """The router part of ``kvpool proxy``'s ``/health``."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(base + "/health", timeout=10) as r:
        return json.loads(r.read())["router"]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, logs: Path) -> dict[int, str]:  # noqa: F811
    """Greedy outputs of one ordinary server (no connector)."""
    with VllmServer(tiny_llama, logs, name="single", kv_cache_bytes=KV_BYTES) as s:
        out = {i: completion(s.url, p)["choices"][0]["text"] for i, p in enumerate(PROMPTS)}
        out[SALTED] = completion(s.url, SALTED_PROMPT)["choices"][0]["text"]
        out.update(
            {STREAMED + i: completion(s.url, p)["choices"][0]["text"] for i, p in enumerate(STREAM_PROMPTS)}
        )
        return out


@pytest.fixture(scope="module")
def pd(tiny_llama: Path, logs: Path) -> Iterator[tuple[VllmServer, VllmServer, ProxyProcess]]:  # noqa: F811
    side = free_port()
    prefill = VllmServer(tiny_llama, logs, name="prefill", cpu=0, kv_cache_bytes=KV_BYTES,
                         extra_args=kv_config("KvpoolConnector", "kv_producer", side_channel_port=side,
                                              abort_timeout_s=30))  # fmt: skip
    consumer = kv_config("KvpoolConnector", "kv_consumer", side_channel_port=free_port())
    decode = VllmServer(tiny_llama, logs, name="decode", cpu=1, kv_cache_bytes=KV_BYTES, extra_args=consumer)
    prefill.start()
    decode.start()
    try:
        prefill.wait_ready()
        decode.wait_ready()
        with ProxyProcess([prefill.url], [decode.url]) as proxy:
            yield prefill, decode, proxy
    finally:
        decode.stop()
        prefill.stop()


def test_pd_outputs_match_single_server_and_kv_was_loaded(
    reference: dict[int, str], pd: tuple[VllmServer, VllmServer, ProxyProcess]
) -> None:
    prefill, decode, proxy = pd
    hits0 = decode.metric("vllm:external_prefix_cache_hits")
    for i, p in enumerate(PROMPTS):
        out = completion(proxy.url, p)
        assert out["choices"][0]["text"] == reference[i], f"prompt {i} ({len(p)} tokens) differs"
    # The decode server computed none of the loaded prompts itself: its connector supplied the KV
    # of every prompt but the last token.
    hits = decode.metric("vllm:external_prefix_cache_hits") - hits0
    assert hits >= sum(len(p) - 1 for p in PROMPTS if len(p) > 1) - len(PROMPTS)
    log = decode.log_path.read_text()
    assert log.count("kvpool connector: loaded") >= len(PROMPTS)
    assert "failed" not in "\n".join(x for x in log.splitlines() if "kvpool connector" in x)
    # The transfers are visible through vLLM's own connector stats on /metrics (stats.py).
    assert _eventually(lambda: decode.metric("vllm:kvpool_xfer_time_seconds_count") >= len(PROMPTS))
    assert decode.metric("vllm:kvpool_bytes_transferred_sum") > 0
    assert decode.metric("vllm:kvpool_num_failed_transfers") == 0
    # Every prefill request's blocks were freed after the decode read them.
    deadline = time.monotonic() + 10
    while prefill.metric("vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefill.metric("vllm:kv_cache_usage_perc") == 0


def test_streaming_pd_through_the_proxy_matches_single_server(
    reference: dict[int, str], pd: tuple[VllmServer, VllmServer, ProxyProcess]
) -> None:
    """``kvpool proxy --stream-kv``: prefill and decode requests at once, the decode reads the KV
    layer by layer while the prefill computes (after one sequential request teaches the proxy the
    prefill's side channel)."""
    prefill, decode, _ = pd
    since = len(decode.log_path.read_text())
    with ProxyProcess([prefill.url], [decode.url], 1.0, "--stream-kv") as proxy:
        for i, p in enumerate(STREAM_PROMPTS):
            out = completion(proxy.url, p)
            assert out["choices"][0]["text"] == reference[STREAMED + i], (
                f"prompt {i} ({len(p)} tokens) differs"
            )
    log = decode.log_path.read_text()[since:]
    lines = [x for x in log.splitlines() if "kvpool connector" in x]
    assert sum("kvpool connector: streamed" in x for x in lines) >= len(PROMPTS) - 1, lines
    assert "failed" not in "\n".join(lines)
    deadline = time.monotonic() + 10
    while prefill.metric("vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefill.metric("vllm:kv_cache_usage_perc") == 0  # every stream's blocks were freed


def test_pd_streaming_and_chat_through_the_proxy(
    reference: dict[int, str], pd: tuple[VllmServer, VllmServer, ProxyProcess]
) -> None:
    _, decode, proxy = pd
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0.0}
    body["stream"] = True
    req = urllib.request.Request(proxy.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    text, chunks = "", 0
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
                chunks += 1
    assert text == reference[2] and chunks > 1
    chat = post(proxy.url + "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "the cat sat on the mat " * 20}],
        "max_tokens": 8, "temperature": 0.0,
    })  # fmt: skip
    assert chat["choices"][0]["message"]["content"] is not None


def test_malformed_kv_transfer_params_sent_to_the_decode_compute_locally(
    reference: dict[int, str], pd: tuple[VllmServer, VllmServer, ProxyProcess]
) -> None:
    """Anyone who reaches the decode server can send ``kv_transfer_params``: a malformed one makes
    that request compute locally (right answer) instead of raising in vLLM's scheduler, which would
    end the engine for every request."""
    _, decode, proxy = pd
    bad = {"do_remote_prefill": True, "remote_block_ids": [0, 1], "remote_host": "127.0.0.1",
           "remote_port": "not-a-port", "remote_request_id": "x"}  # fmt: skip
    out = completion(decode.url, PROMPTS[1], kv_transfer_params=bad)
    assert out["choices"][0]["text"] == reference[1]
    streamed = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1",
                "remote_port": 1, "tp_size": 10**9}  # fmt: skip
    assert (
        completion(decode.url, PROMPTS[0], kv_transfer_params=streamed)["choices"][0]["text"] == reference[0]
    )
    assert completion(proxy.url, PROMPTS[2])["choices"][0]["text"] == reference[2]  # the engine lives on


def test_idle_pd_servers_do_not_spin(pd: tuple[VllmServer, VllmServer, ProxyProcess]) -> None:
    from tests.vllm_support import cpu_seconds

    prefill, decode, _ = pd
    time.sleep(1.0)
    pids = prefill.pids() + decode.pids()
    c0, t0 = cpu_seconds(pids), time.monotonic()
    time.sleep(5.0)
    used = (cpu_seconds(pids) - c0) / (time.monotonic() - t0)
    assert used < 0.10, f"two idle servers use {used:.0%} of a core"


def test_prefill_killed_before_decode_reads(
    reference: dict[int, str], pd: tuple[VllmServer, VllmServer, ProxyProcess]
) -> None:
    prefill, decode, _ = pd
    idle = decode.metric("vllm:kv_cache_usage_perc")
    params = completion(prefill.url, PROMPTS[3], max_tokens=1,
                        kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]  # fmt: skip
    assert params and params["remote_block_ids"]
    os.killpg(prefill.pid, signal.SIGKILL)
    prefill.proc.wait(timeout=10)
    t0 = time.monotonic()
    try:
        out = completion(decode.url, PROMPTS[3], kv_transfer_params=params)
        # kv_load_failure_policy="recompute" would give the right answer; the default "fail" errors.
        assert out["choices"][0]["text"] == reference[3] or out["choices"][0]["finish_reason"] == "error"
    except urllib.error.HTTPError as exc:
        assert exc.code >= 500
    assert time.monotonic() - t0 < 60
    assert "kvpool connector: loading KV" in decode.log_path.read_text()
    deadline = time.monotonic() + 10
    while decode.metric("vllm:kv_cache_usage_perc") > idle and time.monotonic() < deadline:
        time.sleep(0.2)
    assert decode.metric("vllm:kv_cache_usage_perc") == idle
    assert decode.complete(PROMPTS[1], max_tokens=MAX_TOKENS)["choices"][0]["text"] == reference[1]


@pytest.fixture(scope="module")
def store_pair(tiny_llama: Path, logs: Path) -> Iterator[tuple[VllmServer, VllmServer]]:  # noqa: F811
    with MasterProcess() as m, StorageProcess(m.address, 256 << 20):
        extra = kv_config("KvpoolStoreConnector", "kv_both", short_name=True, master=m.address)
        a = VllmServer(tiny_llama, logs, name="store-a", cpu=0, kv_cache_bytes=KV_BYTES, extra_args=extra)
        b = VllmServer(tiny_llama, logs, name="store-b", cpu=1, kv_cache_bytes=KV_BYTES, extra_args=extra)
        a.start()
        b.start()
        try:
            a.wait_ready()
            b.wait_ready()
            yield a, b
        finally:
            a.stop()
            b.stop()


def test_store_connector_second_server_reuses_the_prefix(
    reference: dict[int, str], store_pair: tuple[VllmServer, VllmServer]
) -> None:
    a, b = store_pair
    assert completion(a.url, PROMPTS[3])["choices"][0]["text"] == reference[3]
    deadline = time.monotonic() + 20
    while "kvpool store: saved" not in a.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    hits0 = b.metric("vllm:external_prefix_cache_hits")
    assert completion(b.url, PROMPTS[3])["choices"][0]["text"] == reference[3]
    hits = b.metric("vllm:external_prefix_cache_hits") - hits0
    assert hits == (len(PROMPTS[3]) - 1) // 32 * 32  # every full block but a partial last one
    assert "kvpool store: loaded 46 blocks (0 failed)" in b.log_path.read_text()
    # A prompt the store has not seen: no hit, same output as the reference.
    assert completion(b.url, PROMPTS[2])["choices"][0]["text"] == reference[2]
    assert b.metric("vllm:external_prefix_cache_hits") - hits0 == hits
    # Hits, misses with their reason, saves and load transfers on /metrics (stats.py).
    assert _eventually(lambda: a.metric("vllm:kvpool_store_saved_blocks") >= 46)
    assert _eventually(lambda: b.metric("vllm:kvpool_store_hit_blocks") >= 46)
    assert _eventually(lambda: b.metric("vllm:kvpool_store_miss_blocks", reason="not_stored") > 0)
    assert b.metric("vllm:kvpool_xfer_time_seconds_count") >= 1


def _eventually(cond: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    """True once ``cond()`` is (stats reach /metrics with the scheduler's next step)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return True


def _wait_saves(server: VllmServer, count: int) -> None:
    deadline = time.monotonic() + 20
    while server.log_path.read_text().count("kvpool store: saved") < count and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.log_path.read_text().count("kvpool store: saved") >= count


def test_store_connector_cache_salt_isolates_tenants(
    reference: dict[int, str], store_pair: tuple[VllmServer, VllmServer]
) -> None:
    """Equal prompts with different cache_salt get no external hit from each other's blocks."""
    a, b = store_pair
    saves = a.log_path.read_text().count("kvpool store: saved")
    assert completion(a.url, SALTED_PROMPT, cache_salt="tenant-1")["choices"][0]["text"] == reference[SALTED]
    _wait_saves(a, saves + 1)
    hits0 = b.metric("vllm:external_prefix_cache_hits")
    for salt in ("tenant-2", None):  # another tenant, and no salt: nothing from tenant-1's blocks
        kw = {"cache_salt": salt} if salt else {}
        assert completion(b.url, SALTED_PROMPT, **kw)["choices"][0]["text"] == reference[SALTED]
        assert b.metric("vllm:external_prefix_cache_hits") == hits0
    # The same tenant on the other server: every full block but the last token's comes from the store.
    assert completion(b.url, SALTED_PROMPT, cache_salt="tenant-1")["choices"][0]["text"] == reference[SALTED]
    assert b.metric("vllm:external_prefix_cache_hits") - hits0 == (len(SALTED_PROMPT) - 1) // 32 * 32


def test_layerwise_store_connector_on_real_servers(
    reference: dict[int, str],
    tiny_llama: Path,  # noqa: F811
    logs: Path,
) -> None:
    """Layer-wise mode (``layerwise: true``, loads inside the forward pass) on two real vLLM
    servers: the first commits every full prompt block (saved per layer during its prefill,
    though vLLM 0.32 calls ``start_load_kv`` after the forward pass), the second loads them layer
    by layer as external hits, and both answer as a single server does."""
    with MasterProcess() as m, StorageProcess(m.address, 256 << 20):
        extra = kv_config("KvpoolStoreConnector", "kv_both", short_name=True, master=m.address,
                          layerwise=True, load_async=False, model_tag="lw-e2e")  # fmt: skip
        a = VllmServer(tiny_llama, logs, name="lw-a", cpu=0, kv_cache_bytes=KV_BYTES, extra_args=extra)
        b = VllmServer(tiny_llama, logs, name="lw-b", cpu=1, kv_cache_bytes=KV_BYTES, extra_args=extra)
        a.start()
        b.start()
        try:
            a.wait_ready()
            b.wait_ready()
            full = (len(PROMPTS[3]) - 1) // 32  # 46 full blocks (the last token is never a hit)
            assert completion(a.url, PROMPTS[3])["choices"][0]["text"] == reference[3]

            def committed() -> int:
                pat = r"kvpool store: committed (\d+) blocks \(layer-wise\)"
                found = re.findall(pat, a.log_path.read_text())
                return sum(int(n) for n in found)

            assert _eventually(lambda: committed() >= full), f"committed {committed()} of {full} blocks"
            # The conductor's store index (kvpool proxy --store-master) finds the same blocks from the
            # tokens alone: its key chain and namespace parsing match what the connector stored.
            feed = StoreFeed(m.address, block_size=32, poll_s=0.05)
            feed.start()
            try:
                assert _eventually(lambda: feed.leading_blocks(PROMPTS[3], "lw-e2e") >= full)
                assert feed.leading_blocks(PROMPTS[2], "lw-e2e") == 0  # never stored
            finally:
                feed.stop()
            hits0 = b.metric("vllm:external_prefix_cache_hits")
            assert completion(b.url, PROMPTS[3])["choices"][0]["text"] == reference[3]
            assert b.metric("vllm:external_prefix_cache_hits") - hits0 == full * 32
            assert f"kvpool store: loaded {full} blocks (0 failed)" in b.log_path.read_text()
            # The conductor behind both, following the store's key feed: it has no local prefix of
            # either instance (no KV events, nothing routed yet), sees the prompt's blocks in the
            # store and routes it to load them from there; the answer is still the single server's.
            flags = ("--block-size", "32", "--store-master", m.address)
            with RouterProxy([a.url, b.url], "conductor", *flags) as px:
                assert _eventually(lambda: _health(px.url)["store"]["blocks"] >= full)
                assert completion(px.url, PROMPTS[3])["choices"][0]["text"] == reference[3]
                assert _health(px.url)["store_fetch_decisions"] == 1
        finally:
            a.stop()
            b.stop()
