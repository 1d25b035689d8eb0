#!/usr/bin/env bash
# A named subset of the trainer's tests against the oldest torch the trainer supports
# (docs/trainer.md, "Supported torch and CUDA"), in a venv of its own outside the repository.
#
# The oldest supported torch is the one requirements-cu12.lock pins (the CUDA 12 trainer image's
# torch); the venv gets it and the rest of the trainer extra at that lock's pins, pytest, and
# meshtrain itself (editable, so the checkout the target runs from is what is tested).  PyPI's
# torch wheels pull their CUDA libraries: the venv is about 7 GB, kept between runs under
#   ${MESHTRAIN_CACHE:-$HOME/.cache/meshtrain}/venv-torch-<version>/
# and removed with `scripts/test-torch-oldest.sh --remove`.  Extra arguments go to pytest.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
LOCK="requirements-cu12.lock"
TORCH="$(grep -E '^torch==' "$LOCK")"
CACHE_ROOT="${MESHTRAIN_CACHE:-$HOME/.cache/meshtrain}"
VENV="$CACHE_ROOT/venv-${TORCH/==/-}"

# The subset (<= 10 minutes on 2 quiet cores): gloo's reduce-scatter and all-gather and the
# tensor-parallel layers; every layout family against one device (dp, the pipeline schedules,
# tp with sequence parallelism, ZeRO 1-3, the hierarchical all-reduce, dp2·pp2·tp2); ZeRO's
# stages against stage 0; a checkpoint saved and resumed at ZeRO 0, 2 and 3; `meshtrain plan
# --calibrate` (every collective timed); `meshtrain run`; the shipped DDP example under torchrun.
SUBSET=(
  tests/trainer/test_layers.py
  tests/trainer/test_equivalence.py
  tests/trainer/test_zero_stages.py
  tests/trainer/test_resume_exact.py::test_resume_gives_identical_losses_dp2
  tests/trainer/test_calibrate_progress.py
  tests/trainer/test_launch.py
  tests/trainer/test_ddp_example.py
)

if [[ "${1:-}" == "--remove" ]]; then
  rm -rf "$VENV"
  echo "removed $VENV"
  exit 0
fi

# the checkout is part of the stamp: the editable install points at the one the target runs from
STAMP="$VENV/.installed-$({ echo "$ROOT"; cat pyproject.toml "$LOCK"; } | sha1sum | cut -c1-12)"
if [[ ! -e "$STAMP" ]]; then
  test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  # torch first, at the lock's pins of it and what it needs (as the trainer image installs it)
  "$VENV/bin/pip" install --quiet -c "$LOCK" torch
  "$VENV/bin/pip" install --quiet -c "$LOCK" \
    $("$PYTHON" scripts/image-requirements.py extras pyproject.toml trainer) \
    pytest pytest-timeout pytest-xdist
  "$VENV/bin/pip" install --quiet --no-deps -e .
  rm -f "$VENV"/.installed-* && touch "$STAMP"
fi

"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'
exec "$VENV/bin/pytest" -p no:cacheprovider --durations=10 "${SUBSET[@]}" "$@"
