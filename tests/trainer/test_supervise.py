"""The per-pod supervisor on loopback: in-place recovery with a warm spare, the limit, pass-through, SIGTERM.

Two supervisors play two pods of two local ranks (dp2·pp2, the tiny CPU model).  A rank SIGKILLed
mid-run is replaced by the spare its pod started before the failure; the healthy ranks keep their
processes, the supervisors never exit, rank 0 writes the recovery record, and the run ends with
the weights and optimizer state of an unfaulted run (every checkpoint tensor compared).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch.distributed.checkpoint import format_utils

from meshtrain.api import exitcodes
from meshtrain.trainer import launch
from meshtrain.trainer.checkpointing import store
from meshtrain.trainer.guards import faults
from meshtrain.trainer.telemetry import recoveries, steplog
from tests.builders import JobBuilder

REPO = Path(__file__).resolve().parents[2]
JOINED = re.compile(r"meshtrain worker rank (\d+) pid (\d+): joined generation (\d+)")
SPARES = re.compile(r"meshtrain supervise pod (\d+): spares \[([\d, ]*)\]")


def _spec(directory: Path, steps: int, **checkpoint: Any) -> Path:
    raw = (
        JobBuilder.cpu_run()
        .layout(data=2, pipeline=2)
        .training(steps=steps)
        .checkpoint(**{"intervalSteps": 1, "keep": 2, "asyncSave": False, **checkpoint})
        .raw()
    )
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _supervisors(
    spec: Path,
    out: Path,
    pods: int,
    local: int,
    *flags: str,
    trainer: tuple[str, ...] = (),
    **env: str,
) -> list[subprocess.Popen[bytes]]:
    """``pods`` supervisors on loopback, each logging to ``out/sup-<pod>.log``."""
    port = launch.free_port()
    full = {
        **os.environ,
        "MESHTRAIN_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "MESHTRAIN_SPEC_FILE": str(spec),
        "MESHTRAIN_LOG_DIR": str(out / "logs"),
        "MESHTRAIN_CHECKPOINT_DIR": str(out / "checkpoints"),
        **env,
    }
    procs = []
    for pod in range(pods):
        command = [
            sys.executable,
            "-m",
            "meshtrain.trainer.supervise",
            f"--nnodes={pods}",
            f"--nproc-per-node={local}",
            f"--node-rank={pod}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            *flags,
        ]
        if trainer:
            command += ["--", *trainer]
        log = (out / f"sup-{pod}.log").open("wb")
        procs.append(
            subprocess.Popen(command, cwd=REPO, env=full, stdout=log, stderr=subprocess.STDOUT)
        )
    return procs


def _wait(procs: list[subprocess.Popen[bytes]], out: Path, timeout: float = 400) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise AssertionError(_logs(out)) from None
    return codes


def _logs(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(out.glob("sup-*.log")))


def _tensors(directory: Path, scratch: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint, flattened, without the ``rng.*`` states: the global RNG is
    seeded at random in every process and training never draws from it (its generators are seeded)."""
    target = scratch / f"{directory.parent.parent.name}-{directory.name}.pt"
    format_utils.dcp_to_torch_save(str(directory), str(target))
    loaded = torch.load(target, weights_only=False)
    flat: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = value

    walk(loaded, "")
    return {k: v for k, v in flat.items() if not k.startswith("rng.")}


@pytest.mark.slow
def test_a_killed_rank_is_replaced_by_a_warm_spare_in_place(tmp_path: Path) -> None:
    steps = 5
    spec = _spec(tmp_path, steps)
    faulted = tmp_path / "faulted"
    faulted.mkdir()
    fault = {faults.ENV: "3:3:kill"}  # global rank 3 (pod 1) is SIGKILLed before step 3
    codes = _wait(_supervisors(spec, faulted, 2, 2, **fault), faulted)
    text = _logs(faulted)
    assert codes == [0, 0], text  # neither supervisor gave up; both finished the run

    joined: dict[int, dict[int, int]] = {}  # generation -> rank -> pid
    for rank, pid, generation in JOINED.findall(text):
        joined.setdefault(int(generation), {})[int(rank)] = int(pid)
    assert sorted(joined) == [0, 1], text
    before, after = joined[0], joined[1]
    assert sorted(before) == sorted(after) == [0, 1, 2, 3]
    assert all(before[r] == after[r] for r in (0, 1, 2)), "a healthy rank was restarted"
    spares_of_pod1 = [
        int(p) for pod, pids in SPARES.findall(text) if pod == "1" for p in pids.split(",") if p
    ]
    assert after[3] != before[3] and after[3] in spares_of_pod1, text  # the spare started first

    [record] = recoveries.read(faulted / "logs" / recoveries.FILENAME)
    assert record["generation"] == 1 and record["tier"] == "process"
    assert record["cause"] == "SIGKILL" and record["ranks"] == [3]
    assert record["resumedStep"] == 2 and record["lostSteps"] == 0
    assert record["source"] == "storage"
    times = [
        record[k] for k in ("failedAt", "detectedAt", "rejoinedAt", "restoredAt", "firstStepAt")
    ]
    assert times == sorted(times) and times[-1] - times[0] < 120, record
    assert max(r["step"] for r in steplog.read(faulted / "logs" / steplog.FILENAME)) == steps

    reference = tmp_path / "reference"
    assert launch.run_local(spec, log_dir=reference) == 0
    final = store.scan(faulted / "checkpoints")[-1]
    assert final.step == steps
    name = Path(str(final.path)).name
    ours = _tensors(faulted / "checkpoints" / name, tmp_path)
    theirs = _tensors(reference / "checkpoints" / name, tmp_path)
    assert sorted(ours) == sorted(theirs) and any(k.startswith("model.") for k in ours)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


@pytest.mark.slow
def test_past_the_in_place_limit_the_supervisor_exits_for_a_gang_rebuild(tmp_path: Path) -> None:
    spec = _spec(tmp_path, 4)
    termination = tmp_path / "termination-log"
    procs = _supervisors(
        spec,
        tmp_path,
        1,
        4,
        "--in-place-limit=0",
        "--warm-spares=0",
        **{faults.ENV: "1:2", "MESHTRAIN_TERMINATION_LOG": str(termination)},
    )
    assert _wait(procs, tmp_path) == [exitcodes.GANG_RESTART], _logs(tmp_path)
    code, message = exitcodes.read_failure_report(termination.read_text()) or (None, "")
    assert code == exitcodes.GANG_RESTART and "in-place" in message


@pytest.mark.slow
def test_a_permanent_worker_code_passes_through(tmp_path: Path) -> None:
    spec = _spec(tmp_path, 2)
    termination = tmp_path / "termination-log"
    procs = _supervisors(
        spec,
        tmp_path,
        1,
        4,
        "--warm-spares=0",
        trainer=("--set", "training.steps=-1"),  # refused by every worker: exit 2
        MESHTRAIN_TERMINATION_LOG=str(termination),
    )
    assert _wait(procs, tmp_path) == [exitcodes.SPEC], _logs(tmp_path)
    report = exitcodes.read_failure_report(termination.read_text())
    assert report is not None and report[0] == exitcodes.SPEC


@pytest.mark.slow
def test_sigterm_stops_every_rank_after_a_checkpoint(tmp_path: Path) -> None:
    spec = _spec(tmp_path, 500, intervalSteps=1000)
    [proc] = _supervisors(spec, tmp_path, 1, 4)
    log = tmp_path / "logs" / steplog.FILENAME
    deadline = time.monotonic() + 300
    while not (log.exists() and steplog.read(log)):
        assert proc.poll() is None and time.monotonic() < deadline, _logs(tmp_path)
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert _wait([proc], tmp_path) == [exitcodes.STOPPED], _logs(tmp_path)
    last = max(r["step"] for r in steplog.read(log))
    assert [c.step for c in store.scan(tmp_path / "checkpoints")] == [last]
    assert "supervise pod 0: exit 143" in _logs(tmp_path)
    assert last < 500
