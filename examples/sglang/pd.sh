#!/usr/bin/env bash
# SGLang prefill/decode disaggregation with the kvpool transfer backend (one host; two GPUs).
# NOT run end to end here: SGLang cannot run a model on the CPU-only development machine.
# `pip install kvpool` registers the `sglang.srt.plugins` entry point that adds the backend.
set -euo pipefail
MODEL=${MODEL:?set MODEL}
# GPU KV buffers are written by peers, which needs RDMA (GPUDirect); `auto`/`tcp` only for --device cpu.
export KVPOOL_PROTOCOL=${KVPOOL_PROTOCOL:-rdma}      # kvpool TransferConfig fields as KVPOOL_* variables
if [ "$KVPOOL_PROTOCOL" = rdma ] && ! ls /sys/class/infiniband/* >/dev/null 2>&1; then
  echo "pd.sh: no RDMA device under /sys/class/infiniband; GPU KV buffers need one (run \`kvpool doctor\`)," \
       "or run SGLang with --device cpu and KVPOOL_PROTOCOL=auto" >&2
  exit 1
fi

python -m sglang.launch_server --model-path "$MODEL" --port 30000 --base-gpu-id 0 \
  --disaggregation-mode prefill --disaggregation-transfer-backend kvpool \
  --disaggregation-bootstrap-port 8998 &
python -m sglang.launch_server --model-path "$MODEL" --port 30001 --base-gpu-id 1 \
  --disaggregation-mode decode --disaggregation-transfer-backend kvpool &
python -m sglang_router.launch_router --pd-disaggregation \
  --prefill http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30001 \
  --host 127.0.0.1 --port 8000
