#!/usr/bin/env bash
# SGLang HiCache with kvpool as the L3 storage backend (a kvpool master plus storage servers).
# NOT run end to end here (no model runs on this CPU-only machine); the backend itself is tested
# against SGLang's real host pool and backend factory (tests/test_sglang_hicache.py).
set -euo pipefail
MODEL=${MODEL:?set MODEL}
kvpool master --host 127.0.0.1 --port 50051 &
kvpool store-server --master 127.0.0.1:50051 --segment-size 17179869184 &   # 16 GiB of DRAM
python -m sglang.launch_server --model-path "$MODEL" --port 30000 \
  --enable-hierarchical-cache --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config '{"backend_name":"kvpool","module_path":"kvpool.connectors.sglang.hicache",
    "class_name":"KvpoolHiCacheStorage","interface_v1":1,"master":"127.0.0.1:50051"}'
