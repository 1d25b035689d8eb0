"""Resume: a run restored from its checkpoint continues with exactly the losses of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import mt_harness
import pytest
import torch
import torch.distributed as dist

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.checkpointing import checkpointer, store
from meshtrain.trainer.parallel import mesh as mesh_mod
from tests.builders import JobBuilder

STEPS, SAVE_AT = 5, 2


def _engine(raw: dict) -> engine.Engine:
    job = loading.parse_spec(raw)
    return engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")))


def resume_case(raw: dict, root: str) -> dict:
    """Uninterrupted losses, then: train to SAVE_AT, save, rebuild from scratch, restore, train to the end."""
    straight = _engine(raw)
    uninterrupted = [straight.train_step().loss for _ in range(STEPS)]
    first = _engine(raw)
    for _ in range(SAVE_AT):
        first.train_step()
    published = checkpointer.Checkpointer(first, root=root).save()
    second = _engine(raw)
    restored = checkpointer.Checkpointer(second, root=root).restore()
    resumed = [second.train_step().loss for _ in range(STEPS - SAVE_AT)]
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "restored": restored,
        "published": str(published),
        "rank": dist.get_rank(),
    }


def shape_mismatch_case(raw_saved: dict, raw_other: dict, root: str) -> str:
    """Save with one model shape; restoring another must refuse (the error text is returned)."""
    first = _engine(raw_saved)
    first.train_step()
    checkpointer.Checkpointer(first, root=root).save()
    try:
        checkpointer.Checkpointer(_engine(raw_other), root=root).restore()
    except store.CheckpointError as err:
        return str(err)
    return "restored without complaint"


def corrupt_case(raw: dict, root: str) -> str:
    """Save, damage a data file (rank 0, between barriers), then restore: the error names the file."""
    first = _engine(raw)
    first.train_step()
    published = checkpointer.Checkpointer(first, root=root).save()
    if dist.get_rank() == 0:
        victim = sorted(published.glob("*.distcp"))[0]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    try:
        checkpointer.Checkpointer(_engine(raw), root=root).restore()
    except store.CheckpointError as err:
        return str(err)
    return "restored without complaint"


def scenarios(root: str) -> dict:
    """Every scenario of this module in one 2-rank session (process start-up dominates on small machines)."""
    out, dp2 = {}, JobBuilder.cpu_run().layout(data=2)
    for stage in (0, 2, 3):
        raw = dp2.clone().training(steps=STEPS).parallelism(zeroStage=stage).raw()
        out[f"resume-zero{stage}"] = resume_case(raw, f"{root}/resume-zero{stage}")
    for mode in (
        {"mode": "powersgd", "rank": 2, "warmupSteps": 0},
        {"mode": "topk", "topkRatio": 0.1},
    ):
        # error feedback (and PowerSGD's warm-start Q) must come back, or the next step differs
        raw = dp2.clone().training(steps=STEPS).parallelism(gradientCompression=mode).raw()
        out[f"resume-{mode['mode']}"] = resume_case(raw, f"{root}/resume-{mode['mode']}")
    saved = dp2.clone().training(steps=2).raw()
    other = dp2.clone().training(steps=2).model(hidden=64).raw()
    out["shape"] = shape_mismatch_case(saved, other, f"{root}/shape")
    out["corrupt"] = corrupt_case(saved, f"{root}/corrupt")
    return out


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("resume")
    return root, mt_harness.run_distributed(scenarios, 2, str(root))


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_resume_gives_identical_losses_dp2(
    session: tuple[Path, list[dict]], zero_stage: int
) -> None:
    root, results = session
    for result in results:
        case = result[f"resume-zero{zero_stage}"]
        assert case["restored"] == SAVE_AT
        assert case["resumed"] == case["uninterrupted"][SAVE_AT:]  # bit-for-bit
    published, marker = store.latest(root / f"resume-zero{zero_stage}")
    assert published.step == SAVE_AT
    assert marker.layout == {"data": 2, "pipeline": 1, "tensor": 1, "zero_stage": zero_stage}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["powersgd", "topk"])
def test_resume_restores_error_feedback(session: tuple[Path, list[dict]], mode: str) -> None:
    for result in session[1]:
        case = result[f"resume-{mode}"]
        assert case["restored"] == SAVE_AT
        assert case["resumed"] == case["uninterrupted"][SAVE_AT:]  # bit-for-bit


@pytest.mark.slow
def test_model_shape_mismatch_is_refused_with_both_shapes(session: tuple[Path, list[dict]]) -> None:
    for result in session[1]:  # every rank refuses, with both shapes
        message = result["shape"]
        assert "model shape mismatch" in message
        assert "hidden=32" in message and "hidden=64" in message
        assert "COMPLETE" in message


@pytest.mark.slow
def test_corrupt_checkpoint_is_an_error_naming_the_file(session: tuple[Path, list[dict]]) -> None:
    for result in session[1]:
        message = result["corrupt"]
        assert "sha256" in message and ".distcp" in message and "step-00000001" in message
