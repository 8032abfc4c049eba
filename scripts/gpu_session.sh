#!/usr/bin/env bash
# What a session that is lent a GPU should run, in ONE device call (device time is short: about
# 15 minutes a session, machine start included). On this machine first, once:
#     bash scripts/gpu_session.sh prepare      # wheels the GPU machine lacks -> .dev/ (git-ignored)
# then with the device tool, from the project root:
#     run(command="bash scripts/gpu_session.sh run", carry=[".dev"], timeout_s=580)
# It builds kvpool there (~20 s; recipe: ../shared/gpu/README.md), runs the real-GPU suite
# (tests/test_gpu_real.py) and benchmarks/gpu_kv.py, and leaves each step's log and gpu_kv.json
# in $OUT. Each step has its own time limit: a hang costs that step only. The GPU machine has no
# vLLM, so the GPU P/D setups of benchmarks/vllm_pd.py are not part of it.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
  set -e
  P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  python -m pip download -q "${P[@]}" -d .dev/whl pydantic pydantic-core annotated-types typing-inspection
  ls .dev/whl
  ;;
run)
  OUT=${OUT:-/tmp/kvpool-gpu-out}
  mkdir -p "$OUT"
  step() {  # step NAME SECONDS command...: its log in $OUT/NAME.log, the tail here
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n 20 "$OUT/$name.log"
  }
  step gpu 20 nvidia-smi
  export PYTHONUNBUFFERED=1
  step deps 30 python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/whl/*.whl
  export PYTHONPATH=/tmp/site
  step build 120 python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/kv .
  export PYTHONPATH=/tmp/kv:/tmp/site
  step suite 150 python3 -m pytest -m gpu -p no:cacheprovider -v -rs tests/test_gpu_real.py
  step bench 150 python3 benchmarks/gpu_kv.py --reps 10 --json "$OUT/gpu_kv.json"
  # the gather kernel alone next to the contiguous-copy limit (GPU time; cupy): the GPU's share
  step kernel 60 python3 benchmarks/gpu_gather_kernel.py --json "$OUT/gather_kernel.json"
  # the software cost of a synchronous CUDA IPC call (1 and 4,096 ranges of 256 B), native since stop 39
  step overhead 60 python3 benchmarks/ipc_overhead.py --reps 1000
  # kvpool bench transfer: CUDA IPC (auto) and TCP with GPU memory on both sides next to host <->
  # host TCP in the same run (issue 10: GPU over TCP >= 80 % of host, >= 3x Mooncake's 1.35 GB/s)
  kv() { python3 -c 'import sys; from kvpool.cli import main; sys.exit(main())' bench transfer \
           --duration 2 --json --quiet "$@"; }
  step cli 90 bash -c "$(declare -f kv); set -x
    kv --protocol auto --location cuda:0 --remote-location cuda:0 --block-size 1M 64M --threads 1
    kv --protocol tcp --location cuda:0 --remote-location cuda:0 --block-size 1M --threads 2
    kv --protocol tcp --block-size 1M --threads 2"
  # NIXL in the same run, when its wheels were put in .dev/nixl and ../shared/gpu's anchor script in
  # .dev/gpu (recipe: ../shared/gpu/README.md; 59 MB: within the device tool's carry limit)
  if ls .dev/nixl/*.whl > /dev/null 2>&1 && [ -f .dev/gpu/gpu_nixl_anchor.py ]; then
    step nixl_install 60 python3 -m pip install -q --no-index --no-deps --target /tmp/nx .dev/nixl/*.whl
    step nixl 150 env PYTHONPATH="/tmp/nx:$PYTHONPATH" python3 .dev/gpu/gpu_nixl_anchor.py
  fi
  ;;
*)
  echo "usage: bash scripts/gpu_session.sh prepare|run" >&2
  exit 2
  ;;
esac
