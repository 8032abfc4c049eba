#!/usr/bin/env bash
# SGLang 0.5.23 for use with kvpool on a CPU host, in its own virtualenv: the recipe that
# scripts/test.sh runs for the SGLang tests, and the one docs/sglang.md gives users.
#
#   bash scripts/sglang_venv.sh [VENV]      (default .venv-sglang; run with the Python that has kvpool)
#
# The venv sees the active Python's packages (its torch, vLLM and kvpool; kvpool's entry point
# registers the SGLang plugin): it is created with --system-site-packages (the base interpreter's
# packages) and a .pth file that adds the active environment's site-packages first — when the active
# Python is itself a virtualenv, --system-site-packages alone would reach only the base interpreter
# and an older kvpool installed there. SGLang is installed with --no-deps (its metadata pins CUDA
# torch 2.14), plus gguf and torchvision 0.28, and an import hook (scripts/_torchvision_cpu_fix.py)
# that lets the CUDA-only torchvision wheel import on CPU torch; the hook lives only in this venv,
# never in the vLLM environment. When VENV already has sglang only the .pth files are rewritten.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-sglang}
if ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)" 2>/dev/null; then
  python -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" uninstall -q -y setuptools   # the venv's old setuptools would shadow the env's
  "$VENV/bin/pip" install -q --no-deps sglang==0.5.23 gguf==0.19.0 torchvision==0.28.0
fi
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ACTIVE=$(python -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' | sort -u)
{ for d in $ACTIVE; do echo "import site; site.addsitedir('$d')"; done; } > "$SP/_kvpool_active_env.pth"
cp scripts/_torchvision_cpu_fix.py "$SP/"
echo "import _torchvision_cpu_fix" > "$SP/_torchvision_cpu_fix.pth"
want=$(python -c 'import kvpool; print(kvpool.__file__)')
read -r version got < <("$VENV/bin/python" -c \
  'import sglang, kvpool.connectors.sglang.plugin, kvpool; print(sglang.__version__, kvpool.__file__)')
if [ "$got" != "$want" ]; then
  echo "sglang_venv.sh: $VENV imports kvpool from $got, not from $want" >&2
  exit 1
fi
echo "sglang_venv.sh: $VENV: sglang $version, kvpool from $got"
