"""Jobs sharing one ``checkpoint.path``: each in its own directory, none destroying another's (issue #33, item 3).

Real ``meshtrain run`` processes on the CPU (gloo, two ranks per job) write to one root, as jobs on
one claim do; the facts checked are the files they leave and the codes they exit with.  ``make test``
tier.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from meshtrain.api import exitcodes, job_dir
from meshtrain.trainer.checkpointing import checkpointer, owner, store
from meshtrain.trainer.telemetry import steplog
from tests.builders import JobBuilder

LAUNCH = (
    "import sys; from meshtrain.trainer import launch; "
    "sys.exit(launch.run_local(sys.argv[1], log_dir=sys.argv[2], steps=int(sys.argv[3])))"
)


def _job(
    tmp_path: Path, name: str, root: Path, *, keep: int = 2, data: int = 2, interval: int = 2
) -> Path:
    builder = (
        JobBuilder.cpu_run()
        .layout(data=data)
        .training(steps=4)
        .checkpoint(path=str(root), intervalSteps=interval, keep=keep)
    )
    manifest = builder.manifest() | {"metadata": {"name": name, "namespace": "team"}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


BEAT = {job_dir.HEARTBEAT_ENV: "0.5"}
"""A short heartbeat: a claimant watches a record 1.25 s for change, and a live writer 3 s."""


def _start(job: Path, log_dir: Path, steps: int, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(job), str(log_dir), str(steps)],
        env={**os.environ, **BEAT, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[bytes], timeout: float = 300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode(errors="replace")


def _steps(directory: Path) -> list[int]:
    return [p.step for p in store.scan(directory)]


def _rank0(log_dir: Path) -> str:
    return (log_dir / "rank-0.log").read_text(errors="replace")


@pytest.mark.slow
def test_two_jobs_on_one_root_keep_and_resume_their_own(tmp_path: Path) -> None:
    root = tmp_path / "claim"
    flat = root / "step-00000040"  # an older release's checkpoint, written straight into the root
    flat.mkdir(parents=True)
    (flat / "COMPLETE").write_text("{}")
    first = {name: _job(tmp_path, name, root) for name in ("alpha", "beta")}
    runs = {name: _start(job, tmp_path / f"{name}-1", 4) for name, job in first.items()}
    for proc in runs.values():  # both ran at once, on one root
        code, err = _finish(proc)
        assert code == 0, err[-3000:]
    dirs = {name: root / "team" / name for name in first}
    assert {name: _steps(d) for name, d in dirs.items()} == {"alpha": [2, 4], "beta": [2, 4]}
    for name, directory in dirs.items():
        record = owner.newest(directory)[1]
        assert record is not None
        assert (record.namespace, record.name, record.released) == ("team", name, True)
        marker = store.read_marker(directory / "step-00000004")
        assert marker.extra[checkpointer.JOB_UID_KEY] == record.uid
    assert "flat layout of older meshtrain releases" in _rank0(tmp_path / "alpha-1")
    assert flat.is_dir() and (flat / "COMPLETE").read_text() == "{}", "nothing deletes them"

    # alpha's directory holds an in-progress save of another writer; beta prunes with keep 1
    stray = dirs["alpha"] / ".tmp-step-00000006-0badc0de"
    stray.mkdir()
    (stray / "shard").write_bytes(b"x")
    for path in (stray / "shard", stray):  # an earlier writer's, untouched for an hour: stale
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    beta = _job(tmp_path, "beta", root, keep=1)
    code, err = _finish(_start(beta, tmp_path / "beta-2", 8))
    assert code == 0, err[-3000:]
    assert (stray / "shard").read_bytes() == b"x", (
        "beta's pruning never looks into alpha's directory"
    )
    code, err = _finish(_start(first["alpha"], tmp_path / "alpha-2", 6))
    assert code == 0, err[-3000:]
    log = _rank0(tmp_path / "beta-2")
    assert f"resumed from {dirs['beta'] / 'step-00000004'} (step 4, written by job uid" in log
    assert f"resumed from {dirs['alpha'] / 'step-00000004'}" in _rank0(tmp_path / "alpha-2")
    assert [r["step"] for r in steplog.read(tmp_path / "beta-2" / steplog.FILENAME)] == [5, 6, 7, 8]
    # each run of ``meshtrain run`` is a job of its own UID: it keeps what the earlier one wrote
    assert _steps(dirs["beta"]) == [2, 4, 8] and _steps(dirs["alpha"]) == [2, 4, 6]
    assert not stray.exists(), "alpha prunes a stale leftover save"


@pytest.mark.slow
def test_a_new_job_name_on_the_old_path_does_not_resume(tmp_path: Path) -> None:
    """The ``taint-one`` case: another job on the example's claim trains from step 0, alone."""
    root = tmp_path / "claim"
    code, err = _finish(_start(_job(tmp_path, "example", root), tmp_path / "example", 4))
    assert code == 0, err[-3000:]
    taint = _job(tmp_path, "taint-one", root, data=1)
    code, err = _finish(_start(taint, tmp_path / "taint", 2))
    assert code == 0, err[-3000:]
    assert "resumed from" not in _rank0(tmp_path / "taint")
    assert [r["step"] for r in steplog.read(tmp_path / "taint" / steplog.FILENAME)] == [1, 2]
    assert _steps(root / "team" / "example") == [2, 4]
    assert _steps(root / "team" / "taint-one") == [2]
    # the example applied again (a new UID) with nothing left to train: refused, not "Succeeded"
    code, _ = _finish(_start(_job(tmp_path, "example", root), tmp_path / "again", 4))
    refused = _rank0(tmp_path / "again")
    assert code == exitcodes.CHECKPOINT, refused[-3000:]
    assert "so it would train nothing. Raise training.steps" in refused
    assert _steps(root / "team" / "example") == [2, 4]


@pytest.mark.slow
def test_a_second_live_writer_is_refused_and_a_dead_ones_directory_resumed(tmp_path: Path) -> None:
    root = tmp_path / "claim"
    job = _job(tmp_path, "solo", root)
    # the first run saves step 2, then pauses in its save of step 4, alive and beating
    live = _start(job, tmp_path / "live", 1000, **{checkpointer.FAULT_ENV: "4:pause"})
    deadline = time.monotonic() + 300
    while f"{checkpointer.FAULT_ENV}: pause" not in (
        _rank0(tmp_path / "live") if (tmp_path / "live" / "rank-0.log").exists() else ""
    ):
        assert live.poll() is None, live.stderr.read().decode(errors="replace")[-3000:]  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the first run never reached its save of step 4"
        time.sleep(0.2)
    try:
        code, _ = _finish(_start(job, tmp_path / "second", 4))
        refused = _rank0(tmp_path / "second")
        assert code == exitcodes.CHECKPOINT, refused[-3000:]
        assert "another live writer holds it: job team/solo" in refused
        assert _steps(root / "team" / "solo") == [2], "the refused run wrote nothing"
    finally:
        os.killpg(live.pid, signal.SIGKILL)  # the launcher and its ranks: no clean release
        live.wait()
        live.stderr.close()  # type: ignore[union-attr]
    code, err = _finish(_start(job, tmp_path / "third", 4))
    assert code == 0, err[-3000:]
    log = _rank0(tmp_path / "third")
    assert "was re-created" in log and "resumed from" in log


@pytest.mark.slow
def test_a_writer_taken_over_stops_at_its_next_step(tmp_path: Path, monkeypatch) -> None:
    """A later attempt claims the directory of a running writer: the writer exits code 4 within seconds."""
    root = tmp_path / "claim"
    directory = root / "team" / "solo"
    # no save due for 50000 steps: only the per-step check can stop it
    run = _start(_job(tmp_path, "solo", root, interval=50_000), tmp_path / "old", 100_000)
    steps = tmp_path / "old" / steplog.FILENAME
    deadline = time.monotonic() + 300
    while not (steps.exists() and steplog.read(steps)):  # it claimed the directory and trains
        assert run.poll() is None, run.stderr.read().decode(errors="replace")[-3000:]  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the run never trained a step"
        time.sleep(0.2)
    held = owner.newest(directory)[1]
    assert held is not None and not held.released
    monkeypatch.setenv(job_dir.ATTEMPT_ENV, "99")
    later = owner.me(job_dir.JobIdentity("team", "solo", held.uid))
    owner.claim(directory, later, 0.5)
    try:
        code, _ = _finish(run, timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    log = _rank0(tmp_path / "old")
    assert code == exitcodes.CHECKPOINT and "no longer owns the directory" in log, log[-3000:]
    record = owner.newest(directory)[1]
    assert record is not None and record.writer == later.writer, (
        "the old writer left the claim alone"
    )
