#!/usr/bin/env bash
# The GPU measurements of issue #19 in one run on a lent GPU machine (one GPU, no network):
# bench_mfu, the trainer's tests on the GPU (tests/trainer/test_on_device.py), bench_fused_loss.
#
#   benchmarks/gpu_check.sh RESULTS_DIR          on the GPU machine
#   benchmarks/gpu_check.sh --cpu RESULTS_DIR    rehearsal here: the same steps on the CPU, tiny
#
# Writes, under RESULTS_DIR, one bench_mfu results file per run (mfu-<preset>-b<N>/), the
# device tests' output and a log of everything (gpu-check-log.txt).  Each step has its own
# time limit, so a slow one leaves the others' results; the most wanted come first.  Exits
# non-zero if any step failed.  The rehearsal (CI runs it: tests/trainer/test_gpu_check.py)
# runs every step with --device cpu and tiny presets, so a device's few minutes are not spent
# finding a broken path or argument.
#
# The device image has torch but not every package meshtrain imports.  When one is missing,
# the wheels in .whl/ (docs/trainer.md, "Measuring on a GPU", says how to get them) go into
# /tmp/site first.  Where meshtrain is not installed, trainer/ and operator/ are linked into
# meshtrain/ as pip's package-dir would map them.  PYTHONSAFEPATH keeps the working directory
# off sys.path: the repository's operator/ would shadow the standard library's operator.
set -uo pipefail
device=cuda
if [ "${1:-}" = "--cpu" ]; then
  device=cpu
  shift
fi
results=$(realpath -m "${1:?usage: benchmarks/gpu_check.sh [--cpu] RESULTS_DIR}")
cd "$(dirname "$0")/.."
mkdir -p "$results"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
failed=0

mfu() {  # mfu PRESET MICRO_BATCH SECONDS [bench_mfu options...]
  local preset=$1 micro_batch=$2 limit=$3 size=(--micro-batches 4 --steps 8)
  shift 3
  local out="$results/mfu-$preset-b$micro_batch"
  if [ "$device" = cpu ]; then  # the same step, sized for two cores
    case $preset in llama*) preset=llama-tiny ;; *) preset=tiny ;; esac
    micro_batch=2 size=(--micro-batches 2 --steps 2 --device cpu)
  fi
  echo "== bench_mfu $preset micro-batch $micro_batch $*"
  MESHTRAIN_BENCH_RESULTS="$out" timeout "$limit" python3 benchmarks/bench_mfu.py \
    --presets "$preset" --micro-batch "$preset=$micro_batch" "${size[@]}" "$@" || failed=1
}

missing_modules() {  # what the trainer and the tests import besides torch (requirements.lock pins each)
  python3 - <<'PY'
import importlib.util, sys
needed = ["pydantic", "cryptography", "yaml", "prometheus_client", "safetensors", "tokenizers", "pytest"]
missing = [m for m in needed if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing modules {missing}: put their wheels, at requirements.lock's versions, in .whl/")
PY
}

device_tests() {
  echo "== tests/trainer/test_on_device.py on $device"
  MESHTRAIN_TEST_DEVICE=$device timeout 240 python3 -m pytest -q -p no:cacheprovider \
    --junitxml="$results/test-on-device.xml" tests/trainer/test_on_device.py || failed=1
}

fused_loss() {
  echo "== bench_fused_loss (the loss's chunk arithmetic eager and compiled, bf16)"
  local size=()
  [ "$device" = cpu ] && size=(--device cpu --precision bf16 --repeats 1)
  MESHTRAIN_BENCH_RESULTS="$results" timeout 120 python3 benchmarks/bench_fused_loss.py \
    "${size[@]}" || failed=1
}

check() {
  if ! (cd / && python3 -c 'import meshtrain.trainer' 2>/dev/null); then
    ln -sfn "$PWD/trainer" meshtrain/trainer
    ln -sfn "$PWD/operator" meshtrain/operator
  fi

  date -u
  if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' \
      || return 1
  else
    python3 -c 'import torch; print("torch", torch.__version__, "(CPU rehearsal)")' || return 1
  fi
  if ! missing_modules 2>/dev/null && [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || return 1
    export PYTHONPATH=/tmp/site
  fi
  missing_modules || return 1

  # bare throughput first, then CUDA-event timings against torch.profiler on as many more steps
  mfu 1.3b 16 240 --profile
  device_tests
  mfu llama3.2-1b 2 240 --profile
  fused_loss
  mfu 1.3b 8 150
  mfu 125m 16 120
  mfu 350m 8 120
  date -u
  return $failed
}

check 2>&1 | tee -a "$results/gpu-check-log.txt"
