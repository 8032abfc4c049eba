#!/usr/bin/env bash
# kvpool's vLLM connectors against vLLM 0.33.0 (a CUDA build: it imports on this CPU machine but
# cannot run a model here). A separate venv over this interpreter's packages, vllm 0.33.0 without
# its dependencies (336 MB wheel), kvpool from this checkout; then scripts/check_vllm_interface.py.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:-.venv-vllm033}
[ -x "$V/bin/python" ] || python -m venv --system-site-packages "$V"
"$V/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.33.0')" 2>/dev/null ||
  "$V/bin/pip" install -q --no-deps vllm==0.33.0
"$V/bin/pip" install -q --no-deps --no-build-isolation -Cbuild-dir=build/vllm033 -e .
"$V/bin/python" scripts/check_vllm_interface.py
