"""Validation loss is the same on every layout, and the loss guard skips bad updates and stops the job.

* ``training.eval`` with a held-out share: the loss before training equals a
  plain single-process computation on the dense model (no engine, no
  parallel code), and after two steps every layout (tp2+SP, pp2, dp2, and
  one Llama row) reports the same loss as one device (1e-5 relative);
* the guard, in an engine: a poisoned embedding makes the loss NaN; the
  updates are skipped (an untouched parameter keeps its value), and the
  third skip in a row raises;
* with int8 gradient compression on dp2, one NaN step is skipped and the
  next steps train again (error feedback keeps nothing of the skipped step);
* the guard through ``meshtrain run``: a learning rate that makes the loss
  spike stops the job with exit code 5 and a message naming the field and
  the last good checkpoint, which ``keep: 1`` did not prune; none is written
  at the stop;
* through the checkpointer: checkpoints taken during a run of skips never
  push the last good one out (``keep: 2``), and a newer good one does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mt_harness
import mt_workers
import pytest
import torch

from meshtrain.api import exitcodes, loading
from meshtrain.trainer import engine, launch
from meshtrain.trainer.checkpointing import checkpointer, store
from meshtrain.trainer.guards import loss_guard
from meshtrain.trainer.parallel import mesh as mesh_mod
from tests.builders import LLAMA_TINY, JobBuilder

EVAL = {"eval": {"interval": 1, "batches": 2, "heldOut": 0.05}}
cpu = JobBuilder.cpu_run
CASES = {
    "one": cpu(),
    "tp2-sp": cpu().layout(tensor=2).parallelism(sequenceParallel=True),
    "pp2": cpu().layout(pipeline=2).parallelism(microBatches=2),
    "dp2": cpu().layout(data=2),
    "llama-tp2": cpu().model(LLAMA_TINY).layout(tensor=2),
    "llama-one": cpu().model(LLAMA_TINY),
}


@pytest.mark.slow
def test_validation_loss_is_the_same_on_every_layout():
    ones = [(n, run.clone().training(**EVAL).raw()) for n, run in CASES.items() if "one" in n]
    twos = [(n, run.clone().training(**EVAL).raw()) for n, run in CASES.items() if "one" not in n]
    results = {**mt_harness.run_distributed(mt_workers.evaluate_cases, 1, ones, 2)[0]}
    for rank_result in mt_harness.run_distributed(mt_workers.evaluate_cases, 2, twos, 2):
        for name, losses in rank_result.items():  # every rank reports the same
            assert results.setdefault(name, losses) == losses, name
    for name, run in CASES.items():
        one = "llama-one" if "llama" in name else "one"
        expected = mt_workers.reference_eval(cpu().model(run.raw()["model"]).training(**EVAL).raw())
        before, after = results[name]
        assert abs(before - expected) / expected < 1e-5, (name, before, expected)
        assert abs(after - results[one][1]) / results[one][1] < 1e-5, (name, after)
        assert after < before  # two steps of training lower the held-out loss


def _poisoned_run() -> dict:
    raw = cpu().training(lossGuard={"maxConsecutiveSkips": 3}).raw()
    job = loading.parse_spec(raw)
    eng = engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")))
    first = eng.train_step()
    params = dict(eng.model.named_params)
    with torch.no_grad():
        params["tok_emb.weight"].fill_(math.nan)
    kept = params["blocks.1.mlp.fc.weight"].detach().clone()
    skipped = [eng.train_step().skipped for _ in range(2)]
    untouched = torch.equal(params["blocks.1.mlp.fc.weight"], kept)
    try:
        eng.train_step()
        tripped = ""
    except loss_guard.LossGuardTripped as err:
        tripped = str(err)
    return {"first": first.skipped, "skipped": skipped, "untouched": untouched, "tripped": tripped}


def _streak_checkpoints(root: str) -> dict:
    """Three good steps, three skipped ones, one good again, a checkpoint after each (keep 2)."""
    raw = (
        cpu()
        .training(steps=20, lossGuard={"maxConsecutiveSkips": 5})
        .checkpoint(intervalSteps=1, keep=2, asyncSave=False)
        .raw()
    )
    job = loading.parse_spec(raw)
    eng = engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")))
    saver = checkpointer.Checkpointer(eng, root=root)
    on_disk = []

    def step() -> str:
        verdict = eng.train_step().skipped
        saver.after_step(eng.step)
        on_disk.append(sorted(p.name for p in Path(root).iterdir()))
        return verdict

    verdicts = [step() for _ in range(3)]
    weight = dict(eng.model.named_params)["tok_emb.weight"]
    good = weight.detach().clone()
    with torch.no_grad():
        weight.fill_(math.nan)
    verdicts += [step() for _ in range(3)]
    last_good_during_skips = saver.last_good
    with torch.no_grad():
        weight.copy_(good)
    verdicts.append(step())
    return {
        "verdicts": verdicts,
        "on_disk": on_disk,
        "last_good_during_skips": last_good_during_skips,
        "last_good": saver.last_good,
    }


@pytest.mark.slow
def test_pruning_keeps_the_last_good_checkpoint_through_a_run_of_skips(tmp_path):
    result = mt_harness.run_distributed(_streak_checkpoints, 1, str(tmp_path))[0]
    assert result["verdicts"] == ["", "", "", *["loss is nan"] * 3, ""]
    names = [[int(n.removeprefix("step-")) for n in step] for step in result["on_disk"]]
    assert names[:3] == [[1], [1, 2], [2, 3]]  # keep 2, as configured
    assert names[3:6] == [[3, 4], [3, 4, 5], [3, 5, 6]]  # step 3, the last good one, stays
    assert result["last_good_during_skips"] == 3
    assert names[6] == [6, 7] and result["last_good"] == 7  # a newer good one: back to keep 2
    markers = [store.read_marker(tmp_path / f"step-{n:08d}") for n in (6, 7)]
    assert [m.extra[store.GUARD_SKIPS] for m in markers] == [3, 0]


@pytest.mark.slow
def test_guard_skips_non_finite_updates_and_trips_after_k():
    result = mt_harness.run_distributed(_poisoned_run, 1)[0]
    assert result["first"] == ""
    assert result["skipped"] == ["loss is nan", "loss is nan"]
    assert result["untouched"]
    assert "training.lossGuard: 3 consecutive updates skipped" in result["tripped"]


def _one_nan_step_with_int8_compression() -> list[str]:
    raw = (
        cpu()
        .layout(data=2)
        .parallelism(gradientCompression={"mode": "int8"})
        .training(lossGuard={"maxConsecutiveSkips": 3})
        .raw()
    )
    job = loading.parse_spec(raw)
    eng = engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")))
    verdicts = [eng.train_step().skipped]
    weight = dict(eng.model.named_params)["tok_emb.weight"]
    good = weight.detach().clone()
    with torch.no_grad():
        weight.fill_(math.nan)  # one bad step on every rank, then the weights are whole again
    verdicts.append(eng.train_step().skipped)
    with torch.no_grad():
        weight.copy_(good)
    verdicts += [eng.train_step().skipped for _ in range(2)]
    return verdicts


@pytest.mark.slow
def test_one_skipped_step_does_not_poison_compressed_training():
    """int8 error feedback must not carry the skipped step's NaN into every later step."""
    for verdicts in mt_harness.run_distributed(_one_nan_step_with_int8_compression, 2):
        assert verdicts == ["", "loss is nan", "", ""], verdicts


@pytest.mark.slow
def test_spiking_run_stops_with_exit_5_and_keeps_its_checkpoints(tmp_path, capsys):
    raw = (
        cpu()
        .layout(data=2)
        .training(
            steps=12,
            learningRate=50.0,
            minLearningRate=50.0,
            warmupSteps=3,
            gradClip=0.0,
            lossGuard={"spikeFactor": 1.5, "window": 1, "maxConsecutiveSkips": 2},
        )
        .checkpoint(intervalSteps=1, keep=1)
        .raw()
    )
    job = mt_harness.write_job(tmp_path, raw)
    code = launch.run_local(job, log_dir=tmp_path / "logs")
    err = capsys.readouterr().err
    assert code == exitcodes.LOSS_GUARD, err[-2000:]
    assert "training.lossGuard: 2 consecutive updates skipped" in err
    records = [
        json.loads(line) for line in (tmp_path / "logs" / "steps.jsonl").read_text().splitlines()
    ]
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped == [records[-1]["step"]] and records[-1]["step"] >= 2
    # keep 1 keeps the skipped step's checkpoint and, before it, the last good one; none after the stop
    good = records[-2]["step"]
    saved = sorted(p.name for p in (tmp_path / "logs" / "checkpoints").iterdir())
    assert saved == [f"step-{r['step']:08d}" for r in records[-2:]]
    assert f"last good checkpoint: step {good} (" in err
