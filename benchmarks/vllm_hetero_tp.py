"""Heterogeneous-TP P/D transfer time against equal TP, same run, at the connector worker level.

Real ``_PdWorker`` halves (one per simulated TP rank, each with its own transfer engine and side
channel on loopback, all in this process) move the KV of one request of ``--tokens`` tokens of a
Llama-like layout (``--layers`` layers, ``--heads`` KV heads of ``--head-size``, fp16, CPU backend
block layout). Reports the median decode-side load time of P1->D1 (the equal-TP figure), P2->D1 and
P1->D2 (the slowest decode rank; ranks load one after another here), and their ratios, and the
median time of the "done" round trip that confirms each read before the load is reported finished.

    python benchmarks/vllm_hetero_tp.py --tokens 4096 --reps 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from kvpool.child import free_port_range
from kvpool.connectors.vllm import pd
from kvpool.connectors.vllm.common import VllmConnectorConfig
from kvpool.connectors.vllm.pd import _PdWorker
from kvpool.connectors.vllm.pd_scheduler import RecvJob, blocks_digest


def _cfg(a: argparse.Namespace, tp: int, role: str) -> Any:
    hf = SimpleNamespace(model_type="llama", num_key_value_heads=a.heads, num_attention_heads=a.heads)
    mc = SimpleNamespace(
        hf_text_config=hf,
        use_mla=False,
        is_hybrid=False,
        dtype=torch.float16,
        get_head_size=lambda: a.head_size,
        get_num_layers=lambda pc: a.layers,
    )
    return SimpleNamespace(
        model_config=mc,
        cache_config=SimpleNamespace(block_size=a.block_size, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        kv_transfer_config=SimpleNamespace(kv_role=role),
    )


def _instance(a: argparse.Namespace, tp: int, role: str, port: int, nb: int) -> list[_PdWorker]:
    cfg = VllmConnectorConfig(side_channel_port=port, inline_load_bytes=0)
    out = []
    for r in range(tp):
        pd._tp = lambda _c, r=r: (r, tp)  # noqa: B023 - simulated TP rank of the next worker
        w = _PdWorker(cfg, _cfg(a, tp, role), f"{role}-{port}", SimpleNamespace(num_blocks=nb))
        per = a.heads // tp
        w.register_kv_caches(
            {
                f"model.layers.{i}.self_attn.attn": torch.randn(
                    (nb, per, a.block_size, 2 * a.head_size)
                ).half()
                for i in range(a.layers)
            }
        )
        out.append(w)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    nblocks = a.tokens // a.block_size
    nb = 2 * nblocks + 8
    base = free_port_range(32)  # side channels listen on base + 10 * instance + rank
    tp_of = {"P1": 1, "P2": 2, "D1": 1, "D2": 2}
    inst = {}
    for i, (name, tp) in enumerate(tp_of.items()):
        inst[name] = _instance(a, tp, "kv_producer" if name[0] == "P" else "kv_consumer", base + 10 * i, nb)
    ports = {name: base + 10 * i for i, name in enumerate(tp_of)}
    remote = list(range(nblocks))
    local = list(range(nblocks, 2 * nblocks))
    results: dict[str, list[float]] = {"P1->D1": [], "P2->D1": [], "P1->D2": []}
    fence: dict[str, list[float]] = {case: [] for case in results}
    for rep in range(a.reps + 2):
        for case in results:
            p, d = case.split("->")
            dt = df = 0.0
            rid, digest = f"r{rep}-{case}", blocks_digest(f"r{rep}-{case}", remote)
            # as a real prefill engine: the step after the request finished hands every prefill
            # rank the blocks it holds for it (and their digest) before the decode learns of them
            meta = pd.KvpoolConnectorMetadata(send={rid: 30.0}, send_digest={rid: digest})
            for w in inst[p]:
                w.start(meta)
            for w in inst[d]:  # decode ranks run in parallel processes in vLLM: the slowest counts
                addr = ("127.0.0.1", ports[p])
                engine = inst[p][0].engine_id  # the params name the prefill's engine (the fence checks it)
                job = RecvJob(rid, local, remote, *addr, rid, engine, tp_of[p], blocks_digest=digest)
                t0 = time.perf_counter()
                w._load(job)
                t1 = time.perf_counter()
                w._notify([job])  # the "done" notice that confirms the read (the fence)
                df = max(df, time.perf_counter() - t1)
                dt = max(dt, t1 - t0)
                assert w.take_load_errors() == set(), case
                assert w.get_finished()[1] == {job.req_id}, case
            for w in inst[p]:  # every prefill rank heard every decode rank: its blocks are freed
                assert w.get_finished()[0] == {rid}, case
            if rep >= 2:  # first two: handshakes, segment opens
                results[case].append(dt)
                fence[case].append(df)
    nbytes = a.layers * nblocks * a.heads * a.block_size * 2 * a.head_size * 2
    eq = statistics.median(results["P1->D1"])
    print(f"{a.tokens} tokens, {nbytes / 2**20:.1f} MiB per request, median of {a.reps}:")
    for case, xs in results.items():
        m = statistics.median(xs)
        f = statistics.median(fence[case])
        print(f"  {case}: {m * 1e3:.2f} ms ({nbytes / m / 2**30:.2f} GiB/s)  ratio to equal TP {m / eq:.2f}"
              f"  + confirmation (done round trip) {f * 1e3:.3f} ms")  # fmt: skip
    for ws in inst.values():
        for w in ws:
            w.close()


if __name__ == "__main__":
    main()
