"""``checkpoint.inMemory``: defaults, bounds, and the check that its snapshots fit the pod."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from meshtrain.api import loading, spec
from meshtrain.cli import main
from meshtrain.planner import parameters, snapshots
from tests.builders import JobBuilder


def test_in_memory_checkpoints_are_off_by_default_with_a_peer() -> None:
    job = loading.parse_spec(JobBuilder().raw())
    assert job.checkpoint.in_memory.interval_steps == 0
    assert job.checkpoint.in_memory.peer is True


def test_in_memory_fields_take_camel_case() -> None:
    raw = JobBuilder().checkpoint(inMemory={"intervalSteps": 5, "peer": False}).raw()
    job = loading.parse_spec(raw)
    assert (job.checkpoint.in_memory.interval_steps, job.checkpoint.in_memory.peer) == (5, False)


@pytest.mark.parametrize(
    ("value", "words"),
    [(-1, "greater than or equal to 0"), (10**9, "less than or equal to 100000000")],
)
def test_in_memory_interval_is_bounded(value: int, words: str) -> None:
    raw = JobBuilder().checkpoint(inMemory={"intervalSteps": value}).raw()
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(raw)
    assert "checkpoint.inMemory.intervalSteps" in str(err.value) and words in str(err.value)


def _validate(
    tmp_path: Path, builder: JobBuilder, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.to_manifest("mem", loading.parse_spec(builder.raw()))))
    code = main.main(["validate", str(path)])
    return code, capsys.readouterr().err


def _seven_b(**in_memory: object) -> JobBuilder:
    """7b on one pod of one GPU: its snapshot is every parameter at 4 + 8 bytes."""
    return JobBuilder().model(preset="7b").checkpoint(inMemory={"intervalSteps": 10, **in_memory})


def test_validate_refuses_snapshots_larger_than_shm_naming_the_fields_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = loading.parse_spec(_seven_b().raw())
    need = 2 * 12 * parameters.total_params(job.model.shape())  # old + new copy of one rank
    code, err = _validate(tmp_path, _seven_b().resources(shmSize="16Gi"), capsys)
    assert code == 2
    assert "resources.shmSize 16Gi" in err and "checkpoint.inMemory" in err
    assert f"at least {math.ceil(need / 2**30)}Gi" in err and "intervalSteps to 0" in err
    enough = _seven_b().resources(shmSize=f"{math.ceil(need / 2**30)}Gi")
    assert _validate(tmp_path, enough, capsys)[0] == 0


def test_validate_counts_the_snapshots_against_the_memory_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    builder = _seven_b().resources(shmSize="512Gi", memory="64Gi")
    code, err = _validate(tmp_path, builder, capsys)
    assert code == 2 and "resources.memory 64Gi" in err and "memory-backed" in err
    assert _validate(tmp_path, _seven_b().resources(shmSize="512Gi", memory="1Ti"), capsys)[0] == 0


def test_peer_copies_double_the_pod_cost_and_off_costs_nothing() -> None:
    two_pods = JobBuilder().model(preset="7b").layout(data=2, gpus_per_node=1)
    on = loading.parse_spec(two_pods.clone().checkpoint(inMemory={"intervalSteps": 5}).raw())
    alone = loading.parse_spec(
        two_pods.clone().checkpoint(inMemory={"intervalSteps": 5, "peer": False}).raw()
    )
    with_peer, without = snapshots.snapshot_memory(on), snapshots.snapshot_memory(alone)
    assert with_peer is not None and without is not None
    assert (with_peer.copies, without.copies) == (2, 1)
    assert with_peer.shm == 2 * without.shm
    assert snapshots.snapshot_memory(loading.parse_spec(two_pods.raw())) is None
    assert snapshots.snapshot_problems(loading.parse_spec(two_pods.raw())) == []
