"""The conductor on real vLLM CPU servers: three tiny-model servers publishing KV events
(``--kv-events-config``, ZMQ) behind ``kvpool proxy --backends ... --policy conductor``.

Checked from the servers' own metrics and events: repeated prefixes go to the server holding them
(its prefix-cache hits rise by the prefix), the proxy's index equals what the engines published
(an independent subscriber mirrors the events), outputs equal a direct request to a server, and a
request beyond the TTFT SLO gets 429 before any server sees a prompt token.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conductor_support import BLOCK, EventMirror, RouterProxy, start_servers, wait_until
from tests.vllm_support import CORPUS, VllmServer, tiny_llama  # noqa: F401  (fixture)

pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")  # never skipped in CI

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with _opener.open(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def get_json(url: str) -> dict:
    with _opener.open(url, timeout=10) as r:
        return json.loads(r.read())


def complete(base: str, prompt: str, max_tokens: int = 6) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return post(base + "/v1/completions", body)


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
            ) -> Iterator[tuple[list[VllmServer], EventMirror, RouterProxy, Path]]:  # fmt: skip
    logs = tmp_path_factory.mktemp("conductor-vllm")
    servers, endpoints = start_servers(tiny_llama, logs, 3)
    mirror = EventMirror(endpoints)
    mirror.start()
    try:
        for s in servers:
            s.wait_ready()
        flags = ["--block-size", str(BLOCK), "--kv-events", ",".join(endpoints)]
        flags += ["--tokenizer", str(tiny_llama)]
        with RouterProxy([s.url for s in servers], "conductor", *flags) as proxy:
            yield servers, mirror, proxy, tiny_llama
    finally:
        mirror.stop()
        for s in servers:
            s.stop()


def conversation(c: int, turn: int) -> str:
    """Conversation ``c``: a long private prefix (distinct per conversation), then a new turn."""
    lines = [ln for ln in CORPUS.splitlines() if ln.strip()]
    head = " ".join(lines[(c * 5 + i) % len(lines)] for i in range(12))
    return f"Conversation {c} {'x' * c}. {head} Turn {turn}: {lines[(turn * 7 + c) % len(lines)]}"


def served_by(servers: list[VllmServer], before: list[float]) -> int:
    """The one server whose prompt-token counter moved (metrics may trail the answer a little)."""
    moved: list[int] = []

    def changed() -> bool:
        after = [s.metric("vllm:prompt_tokens") for s in servers]
        moved[:] = [k for k in range(len(servers)) if after[k] > before[k]]
        return bool(moved)

    assert wait_until(changed, timeout=5)
    assert len(moved) == 1, moved
    return moved[0]


def test_conductor_routes_repeated_prefixes_to_their_holder(cluster) -> None:  # type: ignore[no-untyped-def]
    servers, mirror, proxy, model = cluster
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    # Turn 0 of three conversations at once: nobody holds anything, the load spreads them.
    codes: list[int] = []

    def first(c: int) -> None:
        codes.append(complete(proxy.url, conversation(c, 0), max_tokens=24)[0])

    threads = [threading.Thread(target=first, args=(c,)) for c in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200, 200, 200]
    holder = {}
    for c in range(3):
        ids = tok(conversation(c, 0))["input_ids"]
        assert len(ids) >= 6 * BLOCK, len(ids)
        assert wait_until(lambda ids=ids: len(mirror.holder_of(ids[:BLOCK])) >= 1)
        holder[c] = mirror.holder_of(ids[:BLOCK])[0]
    # Later turns, one at a time: each goes to its conversation's holder and hits its cache.
    for turn in (1, 2):
        for c in range(3):
            prompt = conversation(c, turn)
            shared = 0
            ids0, ids = tok(conversation(c, 0))["input_ids"], tok(prompt)["input_ids"]
            while shared < min(len(ids0), len(ids)) and ids0[shared] == ids[shared]:
                shared += 1
            before = [s.metric("vllm:prompt_tokens") for s in servers]
            hits0 = [s.metric("vllm:prefix_cache_hits") for s in servers]
            code, _ = complete(proxy.url, prompt)
            assert code == 200
            k = served_by(servers, before)
            assert k == holder[c], (turn, c, k, holder)
            hits = servers[k].metric("vllm:prefix_cache_hits") - hits0[k]
            assert hits >= (shared // BLOCK) * BLOCK - BLOCK, (hits, shared)
    # The proxy's index holds exactly what the engines published (an independent subscriber).
    urls = [s.url for s in servers]

    def same() -> bool:
        st = get_json(proxy.url + "/health")["router"]
        return [st["per_instance_blocks"][u] for u in urls] == mirror.counts()

    assert wait_until(same, timeout=10), (get_json(proxy.url + "/health")["router"], mirror.counts())
    st = get_json(proxy.url + "/health")["router"]
    assert st["hash_mismatch"] == 0 and not st["block_size_mismatch"] and st["events"]["stored"] > 0
    assert st["events"].get("malformed", 0) == 0 and st["tokenize_failed"] == 0


def test_outputs_equal_a_direct_request(cluster) -> None:  # type: ignore[no-untyped-def]
    servers, _, proxy, _ = cluster
    for c in (0, 4):
        prompt = conversation(c, 9)
        code, via = complete(proxy.url, prompt, max_tokens=12)
        assert code == 200
        _, direct = complete(servers[2].url, prompt, max_tokens=12)
        assert via["choices"][0]["text"] == direct["choices"][0]["text"]


def test_request_beyond_the_slo_is_refused_before_prefill(cluster) -> None:  # type: ignore[no-untyped-def]
    servers, _, _, model = cluster
    with RouterProxy([s.url for s in servers], "conductor", "--block-size", str(BLOCK),
                     "--tokenizer", str(model), "--ttft-slo", "0.000001") as strict:  # fmt: skip
        before = [s.metric("vllm:prompt_tokens") for s in servers]
        code, body = complete(strict.url, conversation(7, 0))
        assert code == 429, body
        assert "refused before prefill" in body["error"]["message"]
        assert [s.metric("vllm:prompt_tokens") for s in servers] == before


def test_calibrate_against_a_real_server(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``kvpool conductor calibrate`` on one real server: the fit predicts a held-out prompt length's
    TTFT within 2x of a measurement, and the saved report loads as a CostModel. Timing on a shared
    2-core machine: the fit and the measurement right after it are taken again (once) when they
    disagree, so a load spike between the two does not fail it; a wrong fit fails both times."""
    import asyncio
    import statistics
    import time

    from kvpool.conductor.calibrate import calibrate
    from kvpool.conductor.cost import CostModel

    url = cluster[0][0].url
    tries = []
    for _attempt in range(2):
        probes = {
            "prefill_lengths": (32, 256, 1024, 2048), "cached_lengths": (1024,), "cached_extra": 128,
            "batches": (1, 2, 4), "decode_contexts": (64, 512), "decode_tokens": 8, "repeats": 3,
        }  # fmt: skip
        report = asyncio.run(calibrate([url], max_token_id=700, **probes))
        cm: CostModel = report.pop("cost_model")
        out = tmp_path / "cm.json"
        cm.save(out, extra=report)
        assert CostModel.load(out) == cm
        held = 768  # not a probed length; fresh random ids (no prefix hit)
        ttfts = []
        for k in range(3):
            ids = [(7 * k + 13 * i + 31 * _attempt) % 690 + 5 for i in range(held)]
            t0 = time.perf_counter()
            status, _ = post(
                url + "/v1/completions", {"model": report["model"], "prompt": ids, "max_tokens": 1}
            )
            ttfts.append(time.perf_counter() - t0)
            assert status == 200
        measured = statistics.median(ttfts)
        tries.append((cm.prefill_s(held), measured))
        if measured / 2 <= cm.prefill_s(held) <= measured * 2:
            break
    else:
        raise AssertionError(f"predicted vs measured TTFT of {held} tokens, two fits: {tries}; last: {cm}")
    # the decode fit explains its own probes (per-stream token gaps at several batches/contexts)
    print("calibrate errors:", report["errors"], "cost model:", cm)
    assert report["errors"]["decode"]["mean_rel_err"] <= 0.5, report["errors"]


def test_a_hot_prefix_is_copied_to_a_second_server(cluster) -> None:  # type: ignore[no-untyped-def]
    """One prompt asked for again and again: the conductor warms a spare server with its prefix
    (a background ``max_tokens=1`` request), and that server's own KV events then show it holding
    the prefix's blocks: two holders. Runs last (the copy is prefill work on a server)."""
    servers, mirror, proxy, model = cluster
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    prompt = conversation(9, 0)
    ids = tok(prompt)["input_ids"]
    for _ in range(24):
        code, _ = complete(proxy.url, prompt, max_tokens=1)
        assert code == 200
        if get_json(proxy.url + "/health")["router"]["hot_copies"] >= 1:
            break
    assert wait_until(lambda: get_json(proxy.url + "/health")["router"]["hot_copies_in_flight"] == 0)
    st = get_json(proxy.url + "/health")["router"]
    assert st["hot_copies"] == 1 and st["hot_copies_failed"] == 0, st
    assert wait_until(lambda: len(mirror.holder_of(ids[:BLOCK])) >= 2), mirror.holder_of(ids[:BLOCK])
