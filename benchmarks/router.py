"""Routing policies on real vLLM CPU servers, one run: round-robin vs load vs conductor.

    flock /work/heavy.lock python benchmarks/router.py [--servers 3] [--conversations 6] [--turns 4] [--json]

Three tiny-model vLLM CPU servers (KV events over ipc://, block size 32) behind one
``kvpool proxy --backends ... --policy P`` per policy, in turn, on the same servers. The workload
is multi-turn conversations: each has a long private prefix (about 1,000 tokens) and every turn
adds a short question to it; ``--concurrency`` clients send the turns (a conversation's turns in
order). Each policy gets fresh conversations (no cache carried over from the previous policy).
TTFT is the time to the first streamed chunk, measured by the client.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conductor_support import BLOCK, RouterProxy, start_servers  # noqa: E402
from tests.vllm_support import CORPUS, build_tiny_llama  # noqa: E402

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def stream_ttft(url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, total seconds) of one streamed completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    first = None
    with _opener.open(req, timeout=300) as r:
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
            if not chunk:
                break
            if first is None and b"data:" in chunk:
                first = time.perf_counter() - t0
    return (first if first is not None else float("nan")), time.perf_counter() - t0


def conversations(n: int, turns: int, seed: int, prefix_lines: int) -> list[list[str]]:
    rng = random.Random(seed)
    lines = [ln for ln in CORPUS.splitlines() if ln.strip()]
    out = []
    for c in range(n):
        head = " ".join(rng.choice(lines) for _ in range(prefix_lines))
        conv, text = [], f"Session {seed}-{c}. {head}"
        for t in range(turns):
            text += f" Question {t}: {rng.choice(lines)}"
            conv.append(text)
        out.append(conv)
    return out


def run_policy(url: str, convs: list[list[str]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    work: queue.Queue[list[str] | None] = queue.Queue()
    for conv in convs:
        work.put(conv)
    ttfts: list[float] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                conv = work.get_nowait()
            except queue.Empty:
                return
            for prompt in conv:
                ttft, _ = stream_ttft(url, prompt, max_tokens)
                with lock:
                    ttfts.append(ttft)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    s = sorted(ttfts)
    return {"requests": len(s), "mean_ttft_s": statistics.fmean(s), "p90_ttft_s": s[int(0.9 * (len(s) - 1))],
            "throughput_rps": len(s) / wall, "wall_s": wall}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-lines", type=int, default=60, help="corpus lines in each private prefix")
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--policies", default="round-robin,load,conductor")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-router-bench-"))
    model = build_tiny_llama(tmp / "tiny-llama")
    servers, endpoints = start_servers(model, tmp, a.servers, kv_bytes=512 << 20)
    results: dict[str, Any] = {}
    try:
        for s in servers:
            s.wait_ready()
        for i, policy in enumerate(a.policies.split(",")):
            flags = ["--block-size", str(BLOCK), "--tokenizer", str(model)]
            if policy != "round-robin":
                flags += ["--kv-events", ",".join(endpoints)]
            with RouterProxy([s.url for s in servers], policy, *flags) as proxy:
                # warm-up (not timed): one request per server's worth of fresh text
                for w in conversations(a.servers, 1, 1000 + i, 4):
                    stream_ttft(proxy.url, w[0], 2)
                convs = conversations(a.conversations, a.turns, i, a.prefix_lines)
                results[policy] = run_policy(proxy.url, convs, a.concurrency, a.max_tokens)
                print(f"{policy}: {json.dumps(results[policy])}", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    if "round-robin" in results and "conductor" in results:
        results["conductor_vs_round_robin_mean_ttft"] = (
            results["conductor"]["mean_ttft_s"] / results["round-robin"]["mean_ttft_s"]
        )
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        print("| policy | requests | mean TTFT s | P90 TTFT s | throughput req/s |")
        print("|---|---|---|---|---|")
        for p, r in results.items():
            if isinstance(r, dict):
                print(f"| {p} | {r['requests']} | {r['mean_ttft_s']:.3f} | {r['p90_ttft_s']:.3f} "
                      f"| {r['throughput_rps']:.2f} |")  # fmt: skip
        if "conductor_vs_round_robin_mean_ttft" in results:
            print(f"conductor / round-robin mean TTFT: {results['conductor_vs_round_robin_mean_ttft']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
