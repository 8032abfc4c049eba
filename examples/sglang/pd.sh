#!/usr/bin/env bash
# SGLang prefill/decode disaggregation with the kvpool transfer backend (one host; two GPUs).
# NOT run end to end here: SGLang cannot run a model on the CPU-only development machine.
# `pip install kvpool` registers the `sglang.srt.plugins` entry point that adds the backend.
set -euo pipefail
MODEL=${MODEL:?set MODEL}
# The transfer path (kvpool TransferConfig fields as KVPOOL_* variables): RDMA (GPUDirect) when this
# host has an RDMA device, else `auto` (same-host path / TCP, GPU memory staged through pinned host
# memory). Set KVPOOL_PROTOCOL to choose; `kvpool doctor` says what the host offers. Without RDMA the
# prefill writes a decode's GPU KV over TCP into the target's GPU staging (run on a fake CUDA driver
# only, not on a real GPU: docs/hardware.md).
if [ -z "${KVPOOL_PROTOCOL:-}" ]; then
  if ls /sys/class/infiniband/* >/dev/null 2>&1; then KVPOOL_PROTOCOL=rdma; else KVPOOL_PROTOCOL=auto; fi
  echo "pd.sh: KVPOOL_PROTOCOL=$KVPOOL_PROTOCOL (set it to override)" >&2
fi
export KVPOOL_PROTOCOL

python -m sglang.launch_server --model-path "$MODEL" --port 30000 --base-gpu-id 0 \
  --disaggregation-mode prefill --disaggregation-transfer-backend kvpool \
  --disaggregation-bootstrap-port 8998 &
python -m sglang.launch_server --model-path "$MODEL" --port 30001 --base-gpu-id 1 \
  --disaggregation-mode decode --disaggregation-transfer-backend kvpool &
python -m sglang_router.launch_router --pd-disaggregation \
  --prefill http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30001 \
  --host 127.0.0.1 --port 8000
