"""What kvpool's vLLM connector stats cost, per decode step and per transfer, through vLLM's own
classes: the upper bound behind "no measurable change in P/D per-token time".

Per step, vLLM's model runner calls ``get_kv_connector_stats()`` (nothing recorded since the last
step: the common case). Per transfer, the connector records it on its load thread; the next step
hands the stats object to vLLM, which pickles it to the scheduler, aggregates it with the
scheduler's, logs ``reduce()`` and feeds ``KvpoolPromMetrics.observe``. Both are timed here in one
process and printed next to the decode step time they are compared with.

    python benchmarks/connector_stats_cost.py [--step-ms 10]
"""

from __future__ import annotations

import argparse
import functools
import pickle
import time
import types

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpool._smoke import shorten
from kvpool.connectors.vllm import KvpoolConnector
from kvpool.connectors.vllm.stats import make_stats


def _per_call_us(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=10.0, help="decode step time to compare with")
    ap.add_argument("--calls", type=int, default=20_000, help="transfers timed (steps: 10x)")
    a = shorten(ap.parse_args(), calls=200)
    reg = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}
    cfg = types.SimpleNamespace(kv_transfer_config=None)
    prom = KvpoolConnector.build_prom_metrics(cfg, kinds, ["model_name", "engine"], {0: ["m", "0"]})
    worker, sched = make_stats(True), make_stats(True)

    step = _per_call_us(worker.clone_and_reset, 10 * a.calls)  # nothing recorded: returns None

    def one_transfer() -> None:
        worker.record_transfer(0.0007, 2 << 20, 32)  # the load thread
        got = pickle.loads(pickle.dumps(worker.clone_and_reset()))  # worker -> scheduler
        total = KvpoolConnector.build_kv_connector_stats(got.data)
        if sched.clone_and_reset() is not None:
            raise AssertionError("scheduler half recorded nothing")
        total.reduce()  # the log line
        prom.observe(total.data, 0)  # /metrics

    per_transfer = _per_call_us(one_transfer, a.calls)
    tokens = 32  # the P/D benchmark's output length: one transfer per 32 decode steps
    per_token = step + per_transfer / tokens
    print(f"per decode step (nothing recorded): {step:.2f} us")
    print(f"per transfer (record, pickle, aggregate, reduce, prometheus): {per_transfer:.1f} us")
    print(f"per output token at {tokens} tokens per request: {per_token:.2f} us = "
          f"{per_token / (a.step_ms * 1e3) * 100:.3f}% of a {a.step_ms:g} ms decode step")  # fmt: skip


if __name__ == "__main__":
    main()
