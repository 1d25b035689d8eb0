"""A dp2 checkpoint restored at dp1 through the trainer (``meshtrain run``): with microBatches doubled
the global batch and the rates are kept; with microBatches kept the batch halves and, under
``lrScaling: none``, so does the rate.  Expectations from the spec arithmetic (``optim.lr_at`` of
the resumed spec, times the batch ratio)."""

from __future__ import annotations

import shutil

import mt_harness
import pytest

from meshtrain.api import loading
from meshtrain.trainer import launch
from meshtrain.trainer.optim import lr_schedule
from meshtrain.trainer.telemetry import steplog
from tests.builders import JobBuilder

pytestmark = pytest.mark.slow

STEPS, SAVED = 4, 2
cpu = JobBuilder.cpu_run


def _spec(tmp_path, name: str, checkpoints, run: JobBuilder) -> tuple[object, object]:
    raw = (
        run.training(steps=STEPS)
        .checkpoint(path=str(checkpoints), intervalSteps=SAVED, asyncSave=False)
        .raw()
    )
    return mt_harness.write_job(tmp_path, raw, name), loading.parse_spec(raw)


def _resume(tmp_path, name: str, dp2_checkpoint, run: JobBuilder) -> tuple[list[dict], object]:
    checkpoints = tmp_path / f"{name}-ckpt"
    shutil.copytree(dp2_checkpoint, checkpoints)
    path, job = _spec(tmp_path, f"{name}.yaml", checkpoints, run)
    assert launch.run_local(path, log_dir=tmp_path / name) == 0
    return steplog.read(tmp_path / name / steplog.FILENAME), job


def _schedule(job, step: int) -> float:
    t = job.training
    peak, minimum = t.learning_rates(job.parallelism)
    return lr_schedule.lr_at(step, peak=peak, minimum=minimum, warmup=t.warmup_steps, total=t.steps)


def test_a_dp2_checkpoint_resumed_at_dp1_keeps_the_batch_or_scales_the_rate(tmp_path):
    dp2 = tmp_path / "dp2-ckpt"
    dp2_run = cpu().layout(data=2).parallelism(microBatches=1).training(globalBatch=4)
    path, before = _spec(tmp_path, "dp2.yaml", dp2, dp2_run)
    assert launch.run_local(path, steps=SAVED, log_dir=tmp_path / "dp2") == 0

    dp1_run = cpu().layout(data=1).parallelism(microBatches=2).training(globalBatch=4)
    kept, job = _resume(tmp_path, "kept", dp2, dp1_run)
    assert job.global_batch == before.global_batch == 4
    assert [r["step"] for r in kept] == [3, 4]
    assert kept[0]["batch_change"]["from_data"] == 2 and kept[0]["batch_change"]["data"] == 1
    assert "global batch kept at 4" in kept[0]["batch_change"]["message"]
    for r in kept:
        assert r["global_batch"] == 4 and r["lr"] == pytest.approx(_schedule(job, r["step"]))

    halved_run = cpu().layout(data=1).parallelism(microBatches=1).training(globalBatch=2)
    halved, job = _resume(tmp_path, "halved", dp2, halved_run)
    change = halved[0]["batch_change"]
    assert (change["from_global_batch"], change["global_batch"]) == (4, 2)
    ratio = job.global_batch / before.global_batch  # lrScaling none: the batch ratio, at once
    assert change["lr_scale"] == pytest.approx(ratio) and change["ramp_steps"] == 0
    for r in halved:
        assert r["global_batch"] == 2
        assert r["tokens"] == 2 * job.model.shape().seq_len
        assert r["lr"] == pytest.approx(_schedule(job, r["step"]) * ratio)
