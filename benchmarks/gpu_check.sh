#!/usr/bin/env bash
# The GPU measurements of issue #19 in one run on a lent GPU machine (one GPU, no network):
# bench_mfu, bench_fused_loss, the CUDA-capable tests.
#
#   benchmarks/gpu_check.sh RESULTS_DIR
#
# Writes, under RESULTS_DIR, one bench_mfu results file per run (mfu-<preset>-b<N>/), the
# CUDA-capable tests' output and a log of everything (gpu-check-log.txt).  Each step has its
# own time limit, so a slow one leaves the others' results.
#
# The device image has torch but not every package meshtrain imports.  Wheels for them, if
# present in .whl/ (docs/trainer.md, "Measuring on a GPU", says how to get them), go into
# /tmp/site first; the repository itself is never put on PYTHONPATH (only meshtrain/ is
# importable, with trainer/ and operator/ linked in as pip's package-dir would map them).
set -uo pipefail
results=$(realpath -m "${1:?usage: benchmarks/gpu_check.sh RESULTS_DIR}")
cd "$(dirname "$0")/.."
mkdir -p "$results"
failed=0

mfu() {  # mfu PRESET MICRO_BATCH SECONDS [bench_mfu options...]
  local preset=$1 micro_batch=$2 limit=$3
  shift 3
  echo "== bench_mfu $preset micro-batch $micro_batch $*"
  MESHTRAIN_BENCH_RESULTS="$results/mfu-$preset-b$micro_batch" timeout "$limit" \
    python3 benchmarks/bench_mfu.py --presets "$preset" --micro-batch "$preset=$micro_batch" \
    --micro-batches 4 --steps 8 "$@" || failed=1
}

check() {
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || return 1
    export PYTHONPATH=/tmp/site
  fi
  ln -sfn "$PWD/trainer" meshtrain/trainer
  ln -sfn "$PWD/operator" meshtrain/operator
  export PYTHONUNBUFFERED=1

  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' || return 1
  # what the trainer and the tests import besides torch (requirements.lock pins each)
  python3 - <<'PY' || return 1
import importlib.util, sys
needed = ["pydantic", "cryptography", "yaml", "prometheus_client", "safetensors", "tokenizers", "pytest"]
missing = [m for m in needed if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing modules {missing}: put their wheels, at requirements.lock's versions, in .whl/")
PY

  # bare throughput first, then CUDA-event timings against torch.profiler on as many more steps
  mfu 1.3b 16 240 --profile
  mfu 1.3b 8 150
  mfu llama3.2-1b 2 240 --profile
  mfu 125m 16 120
  mfu 350m 8 120

  echo "== bench_fused_loss (the loss's chunk arithmetic eager and compiled, bf16)"
  MESHTRAIN_BENCH_RESULTS="$results" timeout 120 python3 benchmarks/bench_fused_loss.py || failed=1

  echo "== CUDA-capable tests"
  timeout 180 python3 -m pytest -q -p no:cacheprovider \
    tests/unit/test_clocks.py tests/trainer/test_device_clock.py || failed=1
  date -u
  return $failed
}

check 2>&1 | tee -a "$results/gpu-check-log.txt"
