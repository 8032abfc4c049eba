#!/usr/bin/env bash
# Cross-instance prefix reuse: two vLLM instances share one kvpool store (a master and a storage
# server that contributes 4 GiB of DRAM). A prompt served by the first is a prefix hit on the second.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a model directory or name}

kvpool master --host 127.0.0.1 --port 50051 &
MASTER=$!
kvpool store-server --master 127.0.0.1:50051 --segment-size 4294967296 &
STORAGE=$!
trap 'kill $A $B $STORAGE $MASTER 2>/dev/null' EXIT

# The short connector name works because kvpool registers a vllm.general_plugins entry point.
CFG='{"kv_connector":"KvpoolStoreConnector","kv_role":"kv_both","kv_connector_extra_config":{"master":"127.0.0.1:50051"}}'
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port 8101 --block-size 32 --kv-transfer-config "$CFG" &
A=$!
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port 8102 --block-size 32 --kv-transfer-config "$CFG" &
B=$!
for port in 8101 8102; do until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done; done

PROMPT=$(python -c "print('The history of the city begins long ago. ' * 60)")
for port in 8101 8102; do
  curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"$MODEL\",\"prompt\":\"$PROMPT\",\"max_tokens\":8,\"temperature\":0}" >/dev/null
  sleep 1
done
# The second instance counted the stored prefix as an external hit:
curl -s http://127.0.0.1:8102/metrics | grep '^vllm:external_prefix_cache_hits_total'
