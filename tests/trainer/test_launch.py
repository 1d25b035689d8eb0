"""``run_local``: refuses bad input before starting processes, trains and logs, and fails fast when a rank dies."""

from __future__ import annotations

import os
import time

import mt_harness
import pytest

from meshtrain.trainer import launch
from meshtrain.trainer.guards import faults
from meshtrain.trainer.recovery import device_fault
from meshtrain.trainer.telemetry import steplog
from tests.builders import JobBuilder


def _write(tmp_path, raw: dict, name: str = "job.yaml"):
    return mt_harness.write_job(tmp_path, raw, name)


def test_invalid_spec_refused_before_any_process(tmp_path, capsys):
    raw = JobBuilder.cpu_run().layout(tensor=3).raw()  # 4 heads do not split over 3 ranks
    code = launch.run_local(_write(tmp_path, raw), log_dir=tmp_path / "logs")
    assert code == 2
    err = capsys.readouterr().err
    assert "spec.model.heads" in err and "tensor=3" in err
    assert not (tmp_path / "logs").exists()


def test_invalid_override_refused(tmp_path, capsys):
    code = launch.run_local(
        _write(tmp_path, JobBuilder.cpu_run().raw()),
        log_dir=tmp_path / "logs",
        overrides=["parallelism.microBatches=0"],
    )
    assert code == 2
    assert "microBatches" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_missing_dataset_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "corpus.bin"
    code = launch.run_local(
        _write(tmp_path, JobBuilder.cpu_run().training(dataset=str(missing)).raw()),
        log_dir=tmp_path / "logs",
    )
    assert code == 3
    err = capsys.readouterr().err
    assert str(missing) in err and "spec.training.dataset" in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_run_trains_and_writes_step_log(tmp_path, capsys):
    run = JobBuilder.cpu_run().layout(pipeline=2).parallelism(microBatches=2).training(steps=20)
    path = _write(tmp_path, run.raw())
    code = launch.run_local(path, steps=3, log_dir=tmp_path / "logs")
    assert code == 0
    records = steplog.read(tmp_path / "logs" / steplog.FILENAME)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert {"step", "loss", "tokens", "step_seconds", "tokens_per_second"} <= set(r)
        assert r["tokens"] == 8 * 32
    out = capsys.readouterr().out
    assert "last loss" in out and "dp1·pp2·tp1" in out


@pytest.mark.slow
def test_dead_rank_stops_the_run_within_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "1:3")
    path = _write(tmp_path, JobBuilder.cpu_run().layout(data=2).training(steps=50).raw())
    code = launch.run_local(path, log_dir=tmp_path / "logs")
    returned = time.time()
    assert code == faults.EXIT_CODE
    died = os.stat(tmp_path / "logs" / "rank-1.log").st_mtime  # its last words: the fault message
    assert "rank 1 dies before step 3" in (tmp_path / "logs" / "rank-1.log").read_text()
    assert returned - died < 10, f"the run took {returned - died:.1f} s to stop after rank 1 died"
    assert len(steplog.read(tmp_path / "logs" / steplog.FILENAME)) == 2


def test_fault_injection_variable():
    assert faults.parse("3:2") == (3, 2)
    assert faults.parse("") is None
    with pytest.raises(ValueError, match="RANK:STEP"):
        faults.parse("three")


def test_a_device_fault_kept_to_one_node_fails_only_a_pod_bound_there(monkeypatch):
    """``MESHTRAIN_FAULT_NODE``: the sandbox's bad-GPU test fails rank 1 on one node only, so the
    replacement the operator places on the other node runs clean."""
    monkeypatch.setenv(faults.ENV, "1:3:device")
    monkeypatch.setenv(faults.NODE_ENV, "gpu-b0-l0-n0")
    monkeypatch.setenv("MESHTRAIN_NODE_NAME", "gpu-b0-l0-n1")
    faults.maybe_fail(1, 3, generation=0)  # elsewhere: nothing
    monkeypatch.setenv("MESHTRAIN_NODE_NAME", "gpu-b0-l0-n0")
    faults.maybe_fail(1, 2, generation=0)  # another step: nothing
    for generation in (0, 1):  # a device fault meets every generation of the rank
        with pytest.raises(RuntimeError) as raised:
            faults.maybe_fail(1, 3, generation=generation)
        assert device_fault.is_device_error(raised.value), raised.value


def test_step_log_tail_returns_only_new_complete_records(tmp_path):
    log = steplog.StepLog(tmp_path)
    tail = steplog.Tail(tmp_path / steplog.FILENAME)
    log.write({"step": 1})
    log.write({"step": 2})
    assert [r["step"] for r in tail.new_records()] == [1, 2]
    assert tail.new_records() == []
    with (tmp_path / steplog.FILENAME).open("a") as handle:
        handle.write('{"step": 3')  # a line being written
    assert tail.new_records() == []
    with (tmp_path / steplog.FILENAME).open("a") as handle:
        handle.write("}\n")
    assert [r["step"] for r in tail.new_records()] == [3]
    assert steplog.Tail(tmp_path / "missing.jsonl").new_records() == []
