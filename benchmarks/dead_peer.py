"""A decode server with one dead prefill peer keeps serving the others (issue 12's third target).

Two prefill servers (A, B) and one decode server with KvpoolConnector on real vLLM CPU servers
(the tiny random Llama), and ``kvpool proxy`` in front of A + decode. Same run:

1. **healthy**: TTFT of ``--requests`` streamed completions through the proxy (A prefills, the
   decode loads from A);
2. **B stopped**: ``--stuck`` requests are prefilled on B, then B is SIGSTOPped and their decode
   requests are sent (the decode's loads from B now hang until the transfer timeout); while they
   hang, the same completions through A are timed again;
3. B is SIGKILLed; the stuck decode requests must end (an error or a recompute, not a hang).

Prints median TTFT of phases 1 and 2 and their ratio (target: unchanged, ~1.0), and whether the
outputs of phase 2 equal phase 1's.

    python benchmarks/dead_peer.py --requests 8 --stuck 2 --length 512
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_pd import OPENER, Proxy, kv_args, prompts, stream  # noqa: E402
from tests.vllm_support import VllmServer, build_tiny_llama  # noqa: E402

from kvpool._smoke import shorten  # noqa: E402
from kvpool.child import free_port  # noqa: E402


def post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with OPENER.open(req, timeout=timeout) as r:
        return json.loads(r.read())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--stuck", type=int, default=2, help="decode requests waiting on the stopped prefill")
    ap.add_argument("--length", type=int, default=512, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="the decode's transfer timeout")
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "auto"],
                    help="tcp (default): a stopped prefill's server hangs the decode's reads; with auto "
                    "the same-host path still reads a stopped process's memory")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    shorten(args, requests=2, stuck=1, length=64, max_tokens=4)
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-dead-peer-"))
    model = build_tiny_llama(tmp / "tiny-llama")
    work = prompts([args.length], args.requests + args.stuck)[args.length]
    live, stuck = work[: args.requests], work[args.requests :]
    common = dict(kv_cache_bytes=1 << 30, max_model_len=8192)
    mod = "kvpool.connectors.vllm"
    proto = {"protocol": args.protocol}
    pa = [kv_args("KvpoolConnector", "kv_producer", mod, {"side_channel_port": free_port(), **proto})
          for _ in range(2)]  # fmt: skip
    da = kv_args("KvpoolConnector", "kv_consumer", mod, {"transfer_timeout_s": args.timeout_s, **proto})
    a = VllmServer(model, tmp, name="prefill-a", cpu=0, extra_args=pa[0], **common)
    b = VllmServer(model, tmp, name="prefill-b", cpu=0, extra_args=pa[1], **common)
    d = VllmServer(model, tmp, name="decode", cpu=1, extra_args=da, **common)
    servers = [a, b, d]
    proxy = None
    out: dict[str, Any] = {}
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout=300)
        proxy = Proxy(a.url, d.url)
        stream(proxy.url, live[0][:16], 2)  # warm-up, first handshake
        healthy = [stream(proxy.url, p, args.max_tokens) for p in live]
        # prefill the stuck requests on B, then stop B before the decode reads their KV
        params = []
        for p in stuck:
            r = post(b.url, {"model": "tiny", "prompt": p, "max_tokens": 1, "temperature": 0.0,
                             "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
            params.append(r.get("kv_transfer_params"))
        b_pids = b.pids()
        for pid in b_pids:
            os.kill(pid, signal.SIGSTOP)
        results: list[Any] = [None] * len(stuck)

        def decode_stuck(i: int) -> None:
            body = {"model": "tiny", "prompt": stuck[i], "max_tokens": args.max_tokens, "temperature": 0.0,
                    "kv_transfer_params": params[i]}  # fmt: skip
            t0 = time.perf_counter()
            try:
                post(d.url, body, timeout=args.timeout_s * 4)
                results[i] = ("ok", time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - an error is an acceptable end, a hang is not
                results[i] = (type(exc).__name__, time.perf_counter() - t0)

        threads = [threading.Thread(target=decode_stuck, args=(i,), daemon=True) for i in range(len(stuck))]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the decode has scheduled them and its loads from B hang
        degraded = [stream(proxy.url, p, args.max_tokens) for p in live]
        stuck_still = sum(1 for r in results if r is None)
        for pid in b_pids:
            os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(args.timeout_s * 4)
        h = statistics.median(x[0] for x in healthy)
        g = statistics.median(x[0] for x in degraded)
        out = {
            "protocol": args.protocol,
            "prompt_tokens": args.length,
            "requests": args.requests,
            "stuck": args.stuck,
            "healthy_ttft_ms": round(h * 1e3, 1),
            "b_stopped_ttft_ms": round(g * 1e3, 1),
            "ratio": round(g / h, 3),
            "outputs_equal": [x[2] for x in healthy] == [x[2] for x in degraded],
            "stuck_pending_while_measuring": stuck_still,
            "stuck_outcomes": results,
        }
    finally:
        if proxy is not None:
            proxy.close()
        for s in servers:
            s.stop()
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0 if out.get("outputs_equal") and all(r is not None for r in out.get("stuck_outcomes", [])) else 1


if __name__ == "__main__":
    raise SystemExit(main())
