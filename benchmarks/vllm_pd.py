"""P/D disaggregation on real vLLM CPU servers: TTFT, time per output token and KV transfer time.

Same tiny random Llama (float32, block size 32), same prompts (distinct random token ids, so no
prefix-cache hits) for every setup. Setups:

* ``single``: one ordinary server (reference, and the greedy outputs every P/D run must match);
* ``kvpool``: KvpoolConnector prefill + decode + ``kvpool proxy`` (``--protocol auto|tcp``);
* ``kvpool-stream``: the same with ``kvpool proxy --stream-kv`` (streaming P/D: prefill and decode
  requests sent at once, the decode reads each layer's KV while the prefill computes the next; its
  transfer time is the time spent reading, not waiting for the prefill);
* ``kvpool-paired``: one kvpool prefill + decode pair behind two proxies, one per-request and one
  ``--stream-kv``; the prompts go through them alternately (A B B A A B B A ...), so both modes see
  the same servers, warm-up and drift: per mode medians, and the change of each adjacent pair
  (streaming over per-request) — the same-run comparison with the least noise on a shared VM;
* ``kvpool-p2d1`` / ``kvpool-p1d2``: the same with a TP=2 prefill or a TP=2 decode (heterogeneous
  TP: each decode rank reads the KV heads it holds from the prefill ranks that hold them); a TP=2
  server's two ranks share its core (``VLLM_CPU_OMP_THREADS_BIND="c|c"``, docs/vllm.md: spinning
  vLLM ranks on both cores starve the other server on this 2-core VM);
* ``nixl``: vLLM's NixlConnector (``UCX_TLS`` as given), same proxy (it speaks vLLM's P/D
  convention), run with ``--python`` pointing at an interpreter that has ``nixl`` installed;
* ``mooncake``: vLLM's built-in MooncakeConnector (records the error it fails with on CPU).

Prefill and decode servers are pinned to cores 0 and 1. Transfer time is the decode side's own
figure: kvpool logs ``loaded N blocks ... in X ms`` per decode rank (a request's time is its slowest
rank's); NIXL's is read from vLLM's periodic KV
transfer metrics log lines when present. ``xfer_stats_ms`` is, for every connector, the mean that
vLLM's connector stats report (those log lines: the connector's ``reduce()``), the like-for-like
figure between kvpool and NIXL.

    python benchmarks/vllm_pd.py --setups single kvpool --lengths 128 1024 4096 --requests 5
    python benchmarks/vllm_pd.py --setups nixl --python /tmp/vllmenv/bin/python --ucx-tls tcp,self,sm
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.vllm_support import VllmServer, build_tiny_llama, cpu_seconds  # noqa: E402

from kvpool.child import ChildProcess, free_port, free_port_range  # noqa: E402

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def kv_args(connector: str, role: str, module: str | None, extra: dict[str, Any]) -> list[str]:
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
    if module:
        cfg["kv_connector_module_path"] = module
    return ["--kv-transfer-config", json.dumps(cfg)]


class Proxy(ChildProcess):
    """``kvpool proxy`` for one prefill and one decode server."""

    def __init__(self, prefill: str, decode: str, stream_kv: bool = False) -> None:
        cmd = [
            sys.executable,
            "-m",
            "kvpool.cli",
            "proxy",
            "--port",
            "0",
            "--prefill",
            prefill,
            "--decode",
            decode,
            *(["--stream-kv"] if stream_kv else []),
        ]
        super().__init__(cmd, stdin=False)
        self.url = f"http://127.0.0.1:{self.info['port']}"


def stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, str]:
    """(TTFT s, time per output token s, text) of one greedy streaming completion."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    times, text = [], ""
    with OPENER.open(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
                    text += chunk["choices"][0]["text"]
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / max(1, len(times) - 1)
    return ttft, tpot, text


def prompts(lengths: list[int], n: int, seed: int = 1) -> dict[int, list[list[int]]]:
    rng = random.Random(seed)
    return {length: [[rng.randrange(4, 760) for _ in range(length)] for _ in range(n)] for length in lengths}


def stats_ms(text: str) -> float | None:
    """Mean transfer time reported through vLLM's connector stats: its periodic ``KV Transfer
    metrics`` log lines (the connector's ``reduce()``: NIXL's, or kvpool's with the same keys),
    weighted by their transfer counts."""
    stats = re.findall(r"Num successful transfers=(\d+), Avg xfer time \(ms\)=([\d.]+)", text)
    n = sum(int(c) for c, _ in stats)
    return sum(int(c) * float(t) for c, t in stats) / n if n else None


def transfer_ms(log: Path, since: int) -> tuple[list[float], float | None]:
    """(per-transfer times from kvpool's own log lines, or for NIXL the stats mean; the stats
    mean) of what the decode server logged after ``since``."""
    text = log.read_text(errors="replace")[since:]
    pat = r"kvpool connector: (?:loaded|streamed) \d+ blocks \(\d+ bytes\) for (\S+) in ([\d.]+) ms"
    per_request: dict[str, float] = {}
    for rid, x in re.findall(pat, text):  # one line per decode rank: the slowest rank's time
        per_request[rid] = max(per_request.get(rid, 0.0), float(x))
    ms = list(per_request.values())
    via_stats = stats_ms(text)
    if ms:
        return ms, via_stats
    return ([via_stats] if via_stats is not None else []), via_stats


def paired(per_request: list[float], streamed: list[float]) -> dict[str, Any]:
    """The ``kvpool-paired`` figures: per mode median TTFT, and the streaming request's change
    against the per-request one it was sent next to (pairs in send order)."""
    pairs = [s / r - 1 for r, s in zip(per_request, streamed, strict=False)]
    return {
        "ttft_per_request_ms": statistics.median(per_request) * 1e3,
        "ttft_stream_ms": statistics.median(streamed) * 1e3,
        "change_of_medians": statistics.median(streamed) / statistics.median(per_request) - 1,
        "pair_change_median": statistics.median(pairs),
        "pairs_stream_faster": sum(c < 0 for c in pairs) / len(pairs),
        "pairs": len(pairs),
    }


def run_setup(
    name: str,
    args: argparse.Namespace,
    model: Path,
    logs: Path,
    work: dict[int, list[list[int]]],
    ref: dict[tuple[int, int], str] | None,
) -> dict[str, Any]:
    """Start the servers of one setup, run every prompt, stop them; medians per prompt length."""
    py = args.python if name == "nixl" else sys.executable
    common = dict(kv_cache_bytes=1 << 30, max_model_len=8192, python=py)
    if name == "single":
        servers = [VllmServer(model, logs, name="single", cpu=0, **common)]
    else:
        if name.startswith("kvpool"):
            side = free_port_range(2)  # a TP=2 prefill's second rank listens on side + 1
            off = {"stats": False} if name == "kvpool-nostats" else {}  # the stats-overhead baseline
            pa = kv_args(
                "KvpoolConnector",
                "kv_producer",
                "kvpool.connectors.vllm",
                {"side_channel_port": side, "protocol": args.protocol, **off},
            )
            da = kv_args(
                "KvpoolConnector", "kv_consumer", "kvpool.connectors.vllm", {"protocol": args.protocol, **off}
            )
            env: dict[str, str] = {}
        elif name == "nixl":
            pa = kv_args("NixlConnector", "kv_producer", None, {})
            da = kv_args("NixlConnector", "kv_consumer", None, {})
            env = {"UCX_TLS": args.ucx_tls}
        else:
            pa = kv_args("MooncakeConnector", "kv_producer", None, {})
            da = kv_args("MooncakeConnector", "kv_consumer", None, {})
            env = {}
        env_p = dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        env_d = dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        tp_p, tp_d = {"kvpool-p2d1": (2, 1), "kvpool-p1d2": (1, 2)}.get(name, (1, 1))
        servers = [  # a TP=2 server's ranks all on its core (VllmServer's tensor_parallel)
            VllmServer(model, logs, name=f"{name}-prefill", cpu=0, tensor_parallel=tp_p, extra_args=pa,
                       env=env_p, **common),
            VllmServer(model, logs, name=f"{name}-decode", cpu=1, tensor_parallel=tp_d, extra_args=da,
                       env=env_d, **common),
        ]  # fmt: skip
    for s in servers:
        s.start()
    proxy = proxy_b = None
    try:
        try:
            for s in servers:
                s.wait_ready(timeout=300)
        except RuntimeError as exc:
            return {"setup": name, "error": str(exc).splitlines()[0], "log_tail": str(exc)[-3000:]}
        if name == "single":
            url = servers[0].url
        else:
            proxy = Proxy(servers[0].url, servers[1].url, stream_kv=name == "kvpool-stream")
            url = proxy.url
            if name == "kvpool-paired":  # the streaming twin on the same servers
                proxy_b = Proxy(servers[0].url, servers[1].url, stream_kv=True)
                stream(proxy_b.url, work[min(work)][1][:16], 4)  # its warm-up
        decode_log = servers[-1].log_path
        stream(url, work[min(work)][0][:16], 4)  # warm-up (also the first handshake)
        # vLLM logs connector transfer statistics every 10 s: keep each prompt length in its own
        # window. kvpool-nostats waits as long (it has no window to wait for): idle time before a
        # measurement changes the per-token time, so the stats on/off comparison idles alike.
        settle = 11.0 if name == "nixl" or name.startswith("kvpool") else 0.5
        time.sleep(settle)
        out: dict[str, Any] = {
            "setup": name,
            "protocol": args.protocol if name.startswith("kvpool") else None,
            "lengths": {},
        }
        texts: dict[tuple[int, int], str] = {}
        mismatches = 0
        for length, ps in work.items():
            since = len(decode_log.read_text(errors="replace"))
            ttfts, tpots = [], []
            by_mode: dict[bool, list[float]] = {False: [], True: []}
            for i, p in enumerate(ps):
                streamed = proxy_b is not None and (i + i // 2) % 2 == 1  # A B B A A B B A ...
                ttft, tpot, text = stream(proxy_b.url if streamed else url, p, args.max_tokens)  # type: ignore[union-attr]
                ttfts.append(ttft)
                tpots.append(tpot)
                by_mode[streamed].append(ttft)
                texts[(length, i)] = text
                if ref is not None and ref.get((length, i)) != text:
                    mismatches += 1
            time.sleep(settle)
            xfer, via_stats = transfer_ms(decode_log, since)
            out["lengths"][length] = {
                "kv_mb": length * 2 * 2 * 2 * 64 * 4 / 1e6,  # layers * (K,V) * kv heads * head * fp32
                "ttft_ms": statistics.median(ttfts) * 1e3,
                "tpot_ms": statistics.median(tpots) * 1e3,
                "xfer_ms": statistics.median(xfer) if xfer else None,
                "xfer_stats_ms": via_stats,  # the mean vLLM's connector stats report
            }
            if proxy_b is not None:
                out["lengths"][length].update(paired(by_mode[False], by_mode[True]))
        out["mismatches"] = mismatches
        out["texts"] = texts
        pids = [pid for s in servers for pid in s.pids()]
        time.sleep(2)
        c0, t0 = cpu_seconds(pids), time.monotonic()
        time.sleep(5)
        out["idle_cores"] = (cpu_seconds(pids) - c0) / (time.monotonic() - t0)
        return out
    finally:
        for px in (proxy, proxy_b):
            if px is not None:
                px.close()
        for s in servers:
            s.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--setups",
        nargs="+",
        default=["single", "kvpool"],
        choices=[
            "single",
            "kvpool",
            "kvpool-stream",
            "kvpool-paired",
            "kvpool-nostats",
            "kvpool-p2d1",
            "kvpool-p1d2",
            "nixl",
            "mooncake",
        ],
    )
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 1024, 4096])
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--protocol", default="auto", choices=["auto", "tcp"])
    ap.add_argument(
        "--python", default=sys.executable, help="interpreter with vLLM (+nixl) for nixl/mooncake"
    )
    ap.add_argument("--ucx-tls", default="tcp,self,sm")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-vllm-bench-"))
    model = build_tiny_llama(args.model or tmp / "tiny-llama")
    work = prompts(args.lengths, args.requests)
    ref: dict[tuple[int, int], str] | None = None
    results = []
    for name in args.setups:
        res = run_setup(name, args, model, tmp, work, ref)
        if name == "single" and "texts" in res:
            ref = res["texts"]
        res.pop("texts", None)
        results.append(res)
        print(json.dumps(res), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results))
        return 0
    print(
        "| setup | prompt tokens | KV MB | transfer ms | transfer ms (vLLM stats, mean) | TTFT ms "
        "| per-token ms | outputs differ | idle cores |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['setup']} | – | – | – | – | – | – | – | failed: {r['error'][:120]} |")
            continue
        label = r["setup"] + (f" ({r['protocol']})" if r.get("protocol") else "")
        for length, m in r["lengths"].items():
            x = "–" if m["xfer_ms"] is None else f"{m['xfer_ms']:.2f}"
            xs = "–" if m.get("xfer_stats_ms") is None else f"{m['xfer_stats_ms']:.2f}"
            print(
                f"| {label} | {length} | {m['kv_mb']:.2f} | {x} | {xs} | {m['ttft_ms']:.1f} | "
                f"{m['tpot_ms']:.2f} | {r['mismatches']} | {r['idle_cores']:.3f} |"
            )
            if "pairs" in m:
                print(
                    f"|   {length} tokens: per-request {m['ttft_per_request_ms']:.1f} ms, streaming "
                    f"{m['ttft_stream_ms']:.1f} ms; change of medians {m['change_of_medians']:+.1%}, "
                    f"median pair {m['pair_change_median']:+.1%}, streaming faster in "
                    f"{m['pairs_stream_faster']:.0%} of {m['pairs']} pairs |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
