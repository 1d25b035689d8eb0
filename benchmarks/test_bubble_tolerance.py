"""Measured pipeline bubble of real local runs against (p - 1) / (m + p - 1).

A benchmark-tier check, not part of `make test`: it holds only on a machine
whose cores nothing else uses (on the shared 2-core development VM gpipe at
m = 8 read 0.163 against 0.111 at load ~2; with nothing else running it
passed 8 of 8, twice, in 53 s each).  Run it with
``.venv/bin/pytest benchmarks/test_bubble_tolerance.py`` on a quiet machine;
the CI suite checks the bubble arithmetic exactly on replayed schedules
(tests/unit/test_telemetry_*.py) and that real runs report it.

dp1·pp2·tp1 runs (two processes, gloo) of a model whose compute dominates
the step (4 x 256-wide layers, 512 tokens per micro-batch: ~25 ms forward,
~50 ms backward per stage on one core), balanced stages, for gpipe and 1f1b
at m = 2, 4, 8.

What decides whether this holds (docs/telemetry.md, "The bubble test"):

* one intra-op thread per rank: two ranks on two cores.  ``run_local``
  shares the cores out through ``OMP_NUM_THREADS`` unless it is already set,
  so the test sets it to 1 for its runs (a CI environment with a larger
  value would oversubscribe the cores);
* the executor posts each receive one action early on gloo (gloo hands a
  sent tensor over only when its receive is posted; posted at the point of
  need, the 512 KiB hand-over cost 2-5 ms per micro-batch, +0.01..0.02 of
  bubble at m = 8; ``tests/trainer/test_pipeline_prefetch.py``);
* what is left is the machine: another process on one of the two cores
  stretches that stage's compute and idles the other stage (bubble above
  theory), or stretches the phases where both stages compute more than the
  fill and drain (bubble below theory at m = 2).  So the runs get a higher
  CPU priority where the test may raise it (root), and the estimator keeps
  the least disturbed steps: per step the mean of the two stages' measured
  bubble (a stall on one stage moves idle time to the other), then the
  median over the ``FASTEST`` shortest of the steps after ``WARMUP``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from meshtrain.planner.timing import pipeline_window
from meshtrain.trainer import launch
from meshtrain.trainer.telemetry import trace
from tests.telemetry import promserver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SCHEDULES = ("gpipe", "1f1b")
MICRO_BATCHES = (2, 4, 8)
STEPS, WARMUP, FASTEST = 10, 2, 3  # 8 candidate steps for the 3 least disturbed
TOLERANCE = 0.05


def measured_bubble(log_dir: Path) -> float:
    """Median, over the FASTEST shortest steps after warm-up, of the stages' mean measured bubble."""
    traces = trace.read_trace(log_dir)
    lines = [line for per_rank in traces.values() for line in per_rank if line["step"] > WARMUP]
    by_step: dict[int, list[dict]] = {}
    for line in lines:
        by_step.setdefault(line["step"], []).append(line)
    fastest = sorted(by_step.values(), key=lambda group: max(line["seconds"] for line in group))[
        :FASTEST
    ]
    return statistics.median(
        statistics.fmean(line["bubble_ratio"] for line in group) for group in fastest
    )


@contextlib.contextmanager
def higher_priority(niceness: int = -20) -> Iterator[None]:
    """Raise this process' (and its children's) CPU priority if allowed; restore it after."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except PermissionError:
        pass  # not root: run at normal priority, the estimator still picks the calmest steps
    try:
        yield
    finally:
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, before)


@contextlib.contextmanager
def one_thread_per_rank() -> Iterator[None]:
    """Two ranks on two cores: one intra-op thread each, whatever the environment says."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


@pytest.fixture(scope="module")
def bubbles(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], float]:
    work = tmp_path_factory.mktemp("bubble")
    out = {}
    for schedule in SCHEDULES:
        for m in MICRO_BATCHES:
            spec = {
                "parallelism": {
                    "data": 1,
                    "pipeline": 2,
                    "tensor": 1,
                    "schedule": schedule,
                    "microBatches": m,
                },
                "resources": {"gpusPerNode": 2},
                "model": {"layers": 4, "hidden": 256, "heads": 4, "vocab": 256, "seqLen": 128},
                "training": {"steps": STEPS, "microBatch": 4},
                "checkpoint": {"path": str(work / f"ckpt-{schedule}-m{m}"), "intervalSteps": 0},
                "metrics": {"port": promserver.free_port_block(2)},
            }
            path = work / f"{schedule}-m{m}.yaml"
            path.write_text(yaml.safe_dump(spec))
            log_dir = work / f"{schedule}-m{m}"
            with higher_priority(), one_thread_per_rank():
                code = launch.run_local(path, log_dir=log_dir)
            assert code == 0, f"run {path.stem} failed; logs in {log_dir}"
            out[(schedule, m)] = measured_bubble(log_dir)
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_measured_bubble_matches_theory(bubbles, schedule, m):
    theory = pipeline_window.bubble_ratio(2, m)
    measured = bubbles[(schedule, m)]
    assert abs(measured - theory) <= TOLERANCE, (
        f"{schedule} m={m}: measured {measured:.3f} vs theory {theory:.3f}"
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_measured_bubble_falls_as_micro_batches_grow(bubbles, schedule):
    series = [bubbles[(schedule, m)] for m in MICRO_BATCHES]
    assert series == sorted(series, reverse=True), (
        f"{schedule}: bubble for m={MICRO_BATCHES} is {series}"
    )
