#!/usr/bin/env bash
# P/D and the store together through vLLM's MultiConnector: the prefill instance both hands its
# KV to the decode instance (KvpoolConnector) and saves it into the pool (KvpoolStoreConnector),
# so a later prefill anywhere reuses the prefix.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a model directory or name}
MASTER=${MASTER:-127.0.0.1:50051}   # a running `kvpool master` (see store.sh)

PREFILL_CFG=$(cat <<JSON
{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":{"connectors":[
  {"kv_connector":"KvpoolConnector","kv_role":"kv_producer","kv_connector_extra_config":{"side_channel_port":15600}},
  {"kv_connector":"KvpoolStoreConnector","kv_role":"kv_both","kv_connector_extra_config":{"master":"$MASTER"}}]}}
JSON
)
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port 8100 --block-size 32 \
  --kv-transfer-config "$PREFILL_CFG"
