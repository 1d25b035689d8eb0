"""The per-pod supervisor on loopback: in-place recovery with a warm spare, the limit, pass-through, SIGTERM.

Two supervisors play two pods of two local ranks (dp2·pp2, the tiny CPU model).  A rank SIGKILLed
mid-run is replaced by the spare its pod started before the failure; the healthy ranks keep their
processes, the supervisors never exit, rank 0 writes the recovery record, and the run ends with
the weights, optimizer and RNG state of an unfaulted run (every checkpoint tensor compared).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch.distributed.checkpoint import format_utils

from meshtrain.api import exitcodes
from meshtrain.trainer import launch, supervise
from meshtrain.trainer.checkpointing import memory, snapshot_file, store
from meshtrain.trainer.guards import faults
from meshtrain.trainer.parallel import mesh
from meshtrain.trainer.recovery import generations, rendezvous, stall
from meshtrain.trainer.telemetry import context, goodput, recoveries, steplog
from tests.builders import JobBuilder

REPO = Path(__file__).resolve().parents[2]
JOINED = re.compile(r"meshtrain worker rank (\d+) pid (\d+): joined generation (\d+)")
SPARES = re.compile(r"meshtrain supervise pod (\d+): spares \[([\d, ]*)\]")


def _spec(
    directory: Path,
    steps: int,
    recovery: dict[str, Any] | None = None,
    *,
    ranks: int = 4,
    **checkpoint: Any,
) -> Path:
    """dp2·pp2 for 4 ranks, dp2 for 2 (a test of one pod's signals needs no more processes)."""
    builder = (
        JobBuilder.cpu_run()
        .layout(data=2, pipeline=ranks // 2)
        .training(steps=steps)
        .checkpoint(**{"intervalSteps": 1, "keep": 2, "asyncSave": False, **checkpoint})
    )
    raw = builder.run_policy(recovery=recovery).raw() if recovery else builder.raw()
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
    port: int | None = None,
    only: int | None = None,
    shm: Path | None = None,
    nodes: Sequence[str] = (),
    **env: str,
) -> list[subprocess.Popen[bytes]]:
    """``pods`` supervisors on loopback (just pod ``only`` when given), each in its own session
    (a pod: its children die with it) logging to ``out/sup-<pod>.log``; ``shm``: each pod's
    in-memory snapshots under ``shm/pod-<pod>`` (its own /dev/shm); ``nodes``: the node each pod
    runs on, by pod index, as the downward API would say (unset: none)."""
    port = port or launch.free_port()
    full = {**supervise.loopback_env(spec, out), **env}
    procs = []
    for pod in range(pods) if only is None else [only]:
        command = supervise.loopback_command(pods, local, pod, port, *flags)
        if trainer:
            command += ["--", *trainer]
        log = (out / f"sup-{pod}.log").open("ab")
        own = {memory.ROOT_ENV: str(shm / f"pod-{pod}")} if shm is not None else {}
        own |= {context.NODE_ENV: nodes[pod]} if nodes else {}
        procs.append(
            subprocess.Popen(
                command,
                cwd=REPO,
                env=full | own,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
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


def _wait_for_step(
    watched: subprocess.Popen[bytes], out: Path, step: int = 1, timeout: float = 300
) -> Path:
    """Rank 0's step log once it holds ``step`` (while ``watched`` runs); the log's path."""
    log = out / "logs" / steplog.FILENAME
    deadline = time.monotonic() + timeout
    while not (log.exists() and max((r["step"] for r in steplog.read(log)), default=0) >= step):
        assert watched.poll() is None and time.monotonic() < deadline, _logs(out)
        time.sleep(0.1)
    return log


def _tensors(directory: Path, scratch: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint, flattened (the ``rng.<rank>`` states included: the worker
    seeds the global RNG from the spec's seed and the rank, and a restore sets the saved state)."""
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
    return flat


STEPS = 8
NO_SPARES = "--warm-spares=0"
"""For the tests whose subject is not the warm spare: each spare imports torch and the trainer,
seconds of CPU that the 2-core suite would spend on processes nothing uses."""


@pytest.fixture(scope="module")
def unfaulted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(spec, the checkpoint of the last step of an unfaulted ``meshtrain run`` of it)."""
    directory = tmp_path_factory.mktemp("unfaulted")
    spec = _spec(directory, STEPS)
    assert launch.run_local(spec, log_dir=directory / "run") == 0
    return spec, Path(str(store.scan(directory / "run" / "checkpoints")[-1].path))


def _same_final_state(out: Path, reference: Path, scratch: Path) -> None:
    """The run in ``out`` ended with ``reference``'s weights, optimizer and RNG states, bit for bit."""
    final = store.scan(out / "checkpoints")[-1]
    assert final.step == STEPS
    ours = _tensors(Path(str(final.path)), scratch)
    theirs = _tensors(reference, scratch)
    assert sorted(ours) == sorted(theirs) and any(k.startswith("model.") for k in ours)
    assert any(k.startswith("rng.") for k in ours)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


def _only_these_ranks_restarted(
    tmp_path: Path, text: str, restarted: tuple[int, ...], kept: tuple[int, ...]
) -> None:
    """By the supervisors' logs, the ``restarted`` ranks run new processes in the last round and
    the ``kept`` ones their first; the newest recovery record, a container's or pod's, names
    exactly the restarted ranks."""
    joined = _pids(text)
    last = max(joined)
    assert last >= 1 and all(joined[0][r] == joined[last][r] for r in kept), text
    assert all(joined[0][r] != joined[last][r] for r in restarted), text
    records = recoveries.read(tmp_path / "logs" / recoveries.FILENAME)
    assert records and records[-1]["tier"] in ("container", "pod"), records
    assert set(records[-1]["ranks"]) == set(restarted), records


def _pids(text: str) -> dict[int, dict[int, int]]:
    """generation -> rank -> pid, from the workers' "joined" lines."""
    joined: dict[int, dict[int, int]] = {}
    for rank, pid, generation in JOINED.findall(text):
        joined.setdefault(int(generation), {})[int(rank)] = int(pid)
    return joined


@pytest.mark.slow
def test_a_killed_rank_is_replaced_by_a_warm_spare_in_place(
    tmp_path: Path, unfaulted: tuple[Path, Path]
) -> None:
    spec, reference = unfaulted
    fault = {faults.ENV: "3:3:kill"}  # global rank 3 (pod 1) is SIGKILLed before step 3
    final = tmp_path / "termination.log"  # rank 0's last progress document
    codes = _wait(
        _supervisors(spec, tmp_path, 2, 2, **fault, MESHTRAIN_TERMINATION_LOG=str(final)), tmp_path
    )
    text = _logs(tmp_path)
    assert codes == [0, 0], text  # neither supervisor gave up; both finished the run

    joined = _pids(text)
    assert sorted(joined) == [0, 1], text
    before, after = joined[0], joined[1]
    assert sorted(before) == sorted(after) == [0, 1, 2, 3]
    assert all(before[r] == after[r] for r in (0, 1, 2)), "a healthy rank was restarted"
    spares_of_pod1 = [
        int(p) for pod, pids in SPARES.findall(text) if pod == "1" for p in pids.split(",") if p
    ]
    assert after[3] != before[3] and after[3] in spares_of_pod1, text  # the spare started first

    [record] = recoveries.read(tmp_path / "logs" / recoveries.FILENAME)
    assert record["generation"] == 1 and record["tier"] == "process"
    assert record["cause"] == "SIGKILL" and record["ranks"] == [3]
    assert record["resumedStep"] == 2 and record["lostSteps"] == 0
    assert record["source"] == "storage"
    times = [
        record[k] for k in ("failedAt", "detectedAt", "rejoinedAt", "restoredAt", "firstStepAt")
    ]
    assert times == sorted(times) and times[-1] - times[0] < 120, record
    assert max(r["step"] for r in steplog.read(tmp_path / "logs" / steplog.FILENAME)) == STEPS
    # the live goodput (one account across the generations) is the replay of the logs: one failure
    live = json.loads(final.read_text())["goodput"]
    replayed = goodput.account_of(tmp_path / "logs")
    assert [f.tier for f in replayed.failures] == ["process"], replayed.failures
    assert live["productive_seconds"] == pytest.approx(replayed.productive_seconds, abs=2e-3)
    assert live["lost_seconds"] == pytest.approx(dict(replayed.lost_seconds), abs=2e-3)
    assert live["lost_seconds"]["restart"] > 0
    _same_final_state(tmp_path, reference, tmp_path)


@pytest.mark.slow
def test_a_killed_rank_is_restored_from_memory_in_place(
    tmp_path: Path, unfaulted: tuple[Path, Path]
) -> None:
    """Snapshots every 2 steps, storage only at the end: rank 3 SIGKILLed before step 6 (step 5
    done) comes back from the snapshots (its own pod's, its peer's), the healthy ranks load them
    into their rebuilt engines, and the run ends exactly as the unfaulted one."""
    _, reference = unfaulted
    spec = _spec(tmp_path, STEPS, intervalSteps=0, inMemory={"intervalSteps": 2})
    fault = {faults.ENV: "3:6:kill"}
    shm = tmp_path / "shm"
    codes = _wait(_supervisors(spec, tmp_path, 2, 2, NO_SPARES, shm=shm, **fault), tmp_path)
    text = _logs(tmp_path)
    assert codes == [0, 0], text
    assert sorted(_pids(text)) == [0, 1], text  # one in-place recovery, no gang rebuild
    [record] = recoveries.read(tmp_path / "logs" / recoveries.FILENAME)
    assert record["source"] == "memory", record
    assert record["resumedStep"] in (2, 4) and record["lostSteps"] > 0, record
    assert f"restored step {record['resumedStep']} from memory" in text
    assert [c.step for c in store.scan(tmp_path / "checkpoints")] == [STEPS]  # nothing else stored
    # each pod holds its own ranks' snapshots and its peer pod's (pods on different nodes)
    held = {pod: snapshot_file.listing(shm / f"pod-{pod}")[0] for pod in (0, 1)}
    assert {rank for rank, _ in held[0]} == {rank for rank, _ in held[1]} == {0, 1, 2, 3}, held
    _same_final_state(tmp_path, reference, tmp_path)


STALL_S = 30
"""``stallTimeoutSeconds`` of the hung-collective test: well above a step of the tiny model on a
loaded 2-core machine, far below the process groups' 300 s timeout."""


@pytest.mark.slow
def test_a_rank_hung_in_a_collective_is_recovered_in_place_by_the_stall_watch(
    tmp_path: Path, unfaulted: tuple[Path, Path]
) -> None:
    """Rank 3 blocks before step 4 in a receive no rank sends to, and its peers block in their
    collectives behind it; nothing dies and every heartbeat keeps beating.  Pod 0's supervisor
    sees rank 0's progress stop for ``stallTimeoutSeconds`` and starts a new round: every
    watcher aborts its groups, every rank (the hung one too) meets the next round in the same
    process, long before the groups' own timeout, and the run ends as the unfaulted one."""
    _, reference = unfaulted
    spec = _spec(tmp_path, STEPS, recovery={"stallTimeoutSeconds": STALL_S})
    faulted = _supervisors(spec, tmp_path, 2, 2, NO_SPARES, **{faults.ENV: "3:4:hang"})
    codes = _wait(faulted, tmp_path)
    text = _logs(tmp_path)
    assert codes == [0, 0], text
    assert "rank 3 hangs before step 4" in text, text
    joined = _pids(text)
    assert sorted(joined) == [0, 1], text
    assert joined[0] == joined[1], "a process was replaced: a hang needs only new process groups"
    [record] = recoveries.read(tmp_path / "logs" / recoveries.FILENAME)
    assert (record["tier"], record["cause"], record["ranks"]) == ("process", stall.STALLED, [])
    # detected after the stall timeout of silence (the host looks once a second), not sooner
    assert STALL_S <= record["detectedAt"] - record["failedAt"] < STALL_S + 10, record
    assert record["firstStepAt"] - record["failedAt"] < mesh.DEFAULT_TIMEOUT_S / 2, record
    assert record["resumedStep"] == 3 and record["lostSteps"] == 0, record
    _same_final_state(tmp_path, reference, tmp_path)


@pytest.mark.slow
def test_a_gpu_that_fails_twice_sends_its_pod_away_while_the_other_waits_in_place(
    tmp_path: Path, unfaulted: tuple[Path, Path]
) -> None:
    """Rank 3's GPU fails before step 3 (an uncorrectable ECC error): a new process takes the
    rank in place and replays step 3 on the same GPU, which fails again.  Pod 1's supervisor takes the
    GPU for bad, stops its ranks and exits 79, saying why in its termination log (the operator
    replaces such a pod alone, on another node); pod 0 keeps its processes and waits at the
    round; the replacement joins it, on another node, and the run ends as the unfaulted one.
    The round's record names the node where the GPU failed, not the replacement's."""
    spec, reference = unfaulted
    port = launch.free_port()
    termination = tmp_path / "termination-log"
    pod0, pod1 = _supervisors(
        spec,
        tmp_path,
        2,
        2,
        NO_SPARES,
        port=port,
        nodes=("node-a", "node-b"),
        MESHTRAIN_TERMINATION_LOG=str(termination),
        **{faults.ENV: "3:3:device"},
    )
    assert _wait([pod1], tmp_path) == [exitcodes.DEVICE_SUSPECT], _logs(tmp_path)
    report = exitcodes.read_failure_report(termination.read_text())
    assert report is not None and report[0] == exitcodes.DEVICE_SUSPECT, report
    assert "failed twice" in report[1], report
    assert pod0.poll() is None, _logs(tmp_path)  # not ended with the pod: waiting in place
    [pod1] = _supervisors(  # a healthy GPU, on another node
        spec, tmp_path, 2, 2, NO_SPARES, port=port, only=1, nodes=("node-a", "node-c")
    )
    codes = _wait([pod0, pod1], tmp_path)
    text = _logs(tmp_path)
    assert codes == [0, 0], text
    pod1_log = (tmp_path / "sup-1.log").read_text()  # whole: _logs keeps each file's tail
    assert pod1_log.count("rank 3 meets a GPU error before step 3") == 2, pod1_log
    assert pod1_log.count(f"failed (exit {exitcodes.DEVICE_ERROR})") == 2, pod1_log
    assert "taking it for bad" in pod1_log, pod1_log
    joined = _pids(text)
    last = max(joined)
    assert last >= 2 and all(joined[0][r] == joined[last][r] for r in (0, 1)), text
    records = recoveries.read(tmp_path / "logs" / recoveries.FILENAME)
    assert records[-1]["tier"] in ("container", "pod") and records[-1]["ranks"] == [2, 3], records
    assert records[-1]["nodes"] == [{"node": "node-b", "ranks": [2, 3]}], records
    _same_final_state(tmp_path, reference, tmp_path)


@pytest.mark.slow
def test_a_bad_gpu_under_pod_0_hosting_the_store_halts_the_gang(
    tmp_path: Path, unfaulted: tuple[Path, Path]
) -> None:
    """Rank 1 (pod 0's second GPU) fails twice: pod 0 cannot leave alone, since the store goes
    with it, so it halts the gang and exits 79 without lingering; pod 1 leaves with 75 (the
    operator reads it as following from pod 0's exit and rebuilds without pod 0's node)."""
    spec, _ = unfaulted
    pod0, pod1 = _supervisors(spec, tmp_path, 2, 2, NO_SPARES, **{faults.ENV: "1:3:device"})
    assert _wait([pod0, pod1], tmp_path, timeout=240) == [
        exitcodes.DEVICE_SUSPECT,
        exitcodes.GANG_RESTART,
    ], _logs(tmp_path)
    pod0_log = (tmp_path / "sup-0.log").read_text()
    assert pod0_log.count("rank 1 meets a GPU error before step 3") == 2, pod0_log
    assert "taking it for bad" in pod0_log, pod0_log


@pytest.mark.slow
def test_a_gpu_gone_from_the_bus_sends_its_pod_away_at_the_first_failure(tmp_path: Path) -> None:
    """Rank 1 (pod 1's only GPU) falls off the bus before step 2: no process is started on it
    again; pod 1 leaves with 79 at once, naming the GPU gone, while pod 0 keeps its process and
    waits at the round; the replacement pod joins it and the round's record says why."""
    spec = _spec(tmp_path, 4, ranks=2)
    port = launch.free_port()
    termination = tmp_path / "termination-log"
    pod0, pod1 = _supervisors(
        *(spec, tmp_path, 2, 1, NO_SPARES),
        port=port,
        MESHTRAIN_TERMINATION_LOG=str(termination),
        **{faults.ENV: "1:2:lost"},
    )
    assert _wait([pod1], tmp_path, timeout=240) == [exitcodes.DEVICE_SUSPECT], _logs(tmp_path)
    log = (tmp_path / "sup-1.log").read_text()
    assert log.count("rank 1 meets a GPU error before step 2") == 1, log
    assert f"failed (exit {exitcodes.DEVICE_LOST})" in log, log
    report = exitcodes.read_failure_report(termination.read_text())
    assert report is not None and report[0] == exitcodes.DEVICE_SUSPECT, report
    assert "is gone" in report[1] and "taking it for bad" in report[1], report
    assert "a drill" in report[1], report  # the job set MESHTRAIN_FAULT_INJECT
    assert pod0.poll() is None, _logs(tmp_path)  # waiting in place
    [pod1] = _supervisors(spec, tmp_path, 2, 1, NO_SPARES, port=port, only=1)  # a healthy GPU
    assert _wait([pod0, pod1], tmp_path) == [0, 0], _logs(tmp_path)
    records = recoveries.read(tmp_path / "logs" / recoveries.FILENAME)
    assert any("GPU lost" in r["cause"] and 1 in r["ranks"] for r in records), records


@pytest.mark.slow
def test_a_rank_killed_without_a_word_leaves_with_its_pod_when_nvml_calls_its_gpu_lost(
    tmp_path: Path, fake_nvml: str
) -> None:
    """Rank 1 is SIGKILLed before step 2 (no error text: what a GPU gone mid-kernel often leaves).
    Pod 1's driver library calls its GPU lost: its supervisor asks NVML, and the pod leaves with 79
    naming the GPU as NVML does, while pod 0 waits in place for the replacement; the job ends."""
    spec = _spec(tmp_path, 4, ranks=2)
    port = launch.free_port()
    termination = tmp_path / "termination-log"
    driver = {"MESHTRAIN_DEVICE": "auto", "LD_LIBRARY_PATH": fake_nvml}  # "auto": the CPU here
    common = (spec, tmp_path, 2, 1, NO_SPARES)
    [pod0] = _supervisors(*common, port=port, only=0, **driver, **{faults.ENV: "1:2:kill"})
    [pod1] = _supervisors(
        *common,
        port=port,
        only=1,
        MESHTRAIN_TERMINATION_LOG=str(termination),
        FAKE_NVML_LOST="0",
        **driver,
        **{faults.ENV: "1:2:kill"},
    )
    assert _wait([pod1], tmp_path, timeout=240) == [exitcodes.DEVICE_SUSPECT], _logs(tmp_path)
    assert "failed (SIGKILL)" in (tmp_path / "sup-1.log").read_text()
    report = exitcodes.read_failure_report(termination.read_text())
    assert report is not None and report[0] == exitcodes.DEVICE_SUSPECT, report
    assert "NVML says a GPU of this pod (NVML device 0) is gone" in report[1], report
    assert pod0.poll() is None, _logs(tmp_path)  # waiting in place
    [pod1] = _supervisors(*common, port=port, only=1, **driver)  # a healthy GPU
    assert _wait([pod0, pod1], tmp_path) == [0, 0], _logs(tmp_path)
    records = recoveries.read(tmp_path / "logs" / recoveries.FILENAME)
    assert any("GPU lost" in r["cause"] and 1 in r["ranks"] for r in records), records


@pytest.mark.slow
def test_a_gpu_gone_without_in_place_recovery_still_sends_its_pod_away(tmp_path: Path) -> None:
    """``inPlace: false``: the lost GPU needs no count, so the pod still leaves with 79 (its
    node excluded), halting the gang, rather than 75, a rebuild that may land on the node again."""
    spec = _spec(tmp_path, 4, {"inPlace": False}, ranks=2)
    procs = _supervisors(spec, tmp_path, 1, 2, NO_SPARES, **{faults.ENV: "1:2:lost"})
    assert _wait(procs, tmp_path, timeout=240) == [exitcodes.DEVICE_SUSPECT], _logs(tmp_path)
    assert "is gone: taking it for bad" in _logs(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recovery", "flags"),
    [({"inPlace": False}, ()), (None, ("--in-place-limit=0",))],
    ids=["in-place-off", "budget-spent"],
)
def test_without_in_place_recovery_a_device_error_names_its_rank_in_every_pods_report(
    tmp_path: Path, recovery: dict[str, Any] | None, flags: tuple[str, ...]
) -> None:
    """In-place recovery off, or its budget spent by this very failure: rank 1's GPU (pod 1)
    fails once (78) and the gang leaves for a rebuild (75).  Pod 1's failure report names rank 1,
    so the operator keeps its node's device error past the rebuild (``status.deviceErrors``).
    Pod 0's names it too when it read a halt that names it; a peer that lost rank 1 may halt the
    gang first, bare, and then pod 0's says nothing (the operator waits for pod 1's exit:
    ``failure.GANG_EXITING``), never another rank."""
    spec = _spec(tmp_path, 4, recovery, ranks=2)
    port = launch.free_port()
    logs = [tmp_path / f"termination-{pod}" for pod in (0, 1)]
    procs = [
        proc
        for pod in (0, 1)
        for proc in _supervisors(
            *(spec, tmp_path, 2, 1, NO_SPARES, *flags),
            port=port,
            only=pod,
            MESHTRAIN_TERMINATION_LOG=str(logs[pod]),
            **{faults.ENV: "1:2:device"},
        )
    ]
    codes = _wait(procs, tmp_path, timeout=240)
    assert codes == [exitcodes.GANG_RESTART] * 2, _logs(tmp_path)
    reports = [log.read_text() for log in logs]
    assert all(exitcodes.read_failure_report(text) is not None for text in reports), reports
    assert exitcodes.reported_device_error_ranks(reports[1]) == (1,), reports
    assert exitcodes.reported_device_error_ranks(reports[0]) in ((), (1,)), reports


@pytest.mark.slow
def test_a_device_error_on_a_node_where_the_job_had_one_sends_the_pod_away_at_once(
    tmp_path: Path,
) -> None:
    """The operator told pod 1 that a GPU of the job failed on its node 10 minutes ago (a
    previous gang's; ``exitcodes.DEVICE_ERROR_AT_ENV``).  Its rank's first device error is
    the node's second within the hour: the pod leaves with 79 at once, saying so, and no process
    is started on the GPU again; pod 0, told nothing, waits in place for the replacement."""
    spec = _spec(tmp_path, 4, ranks=2)
    port = launch.free_port()
    termination = tmp_path / "termination-log"
    common = (spec, tmp_path, 2, 1, NO_SPARES)
    fault = {faults.ENV: "1:2:device"}
    [pod0] = _supervisors(*common, port=port, only=0, **fault)
    earlier = str(int(time.time()) - 600)
    [pod1] = _supervisors(
        *common,
        port=port,
        only=1,
        MESHTRAIN_TERMINATION_LOG=str(termination),
        **{exitcodes.DEVICE_ERROR_AT_ENV: earlier, **fault},
    )
    assert _wait([pod1], tmp_path, timeout=240) == [exitcodes.DEVICE_SUSPECT], _logs(tmp_path)
    log = (tmp_path / "sup-1.log").read_text()
    assert log.count(f"failed (exit {exitcodes.DEVICE_ERROR})") == 1, log
    report = exitcodes.read_failure_report(termination.read_text())
    assert report is not None and report[0] == exitcodes.DEVICE_SUSPECT, report
    assert "device error of this job on this node before this pod started" in report[1], report
    assert pod0.poll() is None, _logs(tmp_path)  # waiting in place
    [pod1] = _supervisors(*common, port=port, only=1)  # the replacement, on a healthy node
    assert _wait([pod0, pod1], tmp_path) == [0, 0], _logs(tmp_path)


@pytest.mark.slow
def test_a_restarted_pod_rejoins_while_the_other_keeps_its_processes(
    tmp_path: Path, unfaulted: tuple[Path, Path]
) -> None:
    spec, reference = unfaulted
    port = launch.free_port()
    pod0, pod1 = _supervisors(spec, tmp_path, 2, 2, NO_SPARES, port=port)
    _wait_for_step(pod0, tmp_path, 2)
    os.killpg(pod1.pid, signal.SIGKILL)  # the pod's container: supervisor and workers
    pod1.wait()
    [pod1] = _supervisors(spec, tmp_path, 2, 2, NO_SPARES, port=port, only=1)  # kubelet's restart
    codes = _wait([pod0, pod1], tmp_path)
    text = _logs(tmp_path)
    assert codes == [0, 0], text
    assert "pod 1: restarted: joining the next round" in text
    _only_these_ranks_restarted(tmp_path, text, (2, 3), kept=(0, 1))
    _same_final_state(tmp_path, reference, tmp_path)


@pytest.mark.slow
def test_a_pod_stopped_alone_leaves_and_the_others_wait_in_place_for_its_replacement(
    tmp_path: Path, unfaulted: tuple[Path, Path]
) -> None:
    """``kubectl delete pod`` on pod 1 (SIGTERM to its PID 1): every rank stops after the same
    step with a checkpoint of it, pod 1 exits 143, and pod 0, whose pod got no signal, keeps its
    processes and waits at the next round; the replacement joins it and the run ends exactly as
    the unfaulted one, no step lost."""
    spec, reference = unfaulted
    port = launch.free_port()
    pod0, pod1 = _supervisors(spec, tmp_path, 2, 2, NO_SPARES, port=port)
    log = _wait_for_step(pod0, tmp_path, 2)
    pod1.send_signal(signal.SIGTERM)
    assert _wait([pod1], tmp_path) == [exitcodes.STOPPED], _logs(tmp_path)
    stopped_at = max(r["step"] for r in steplog.read(log))
    assert stopped_at < STEPS and store.scan(tmp_path / "checkpoints")[-1].step == stopped_at
    time.sleep(generations.PEER_STOP_GRACE_S + 2)  # past the wait for its own signal
    assert pod0.poll() is None, _logs(tmp_path)  # not ended with the gang: waiting in place
    seen = rendezvous.connect("127.0.0.1", port, master=False, timeout_s=10)
    # It did not say it left: pod 0 keeps watching the slot's next holder, and the run's end
    # does not count it done.
    assert not seen.check(["rdzv/pod1/left"]) and rendezvous.generation(seen) == 1
    [pod1] = _supervisors(spec, tmp_path, 2, 2, NO_SPARES, port=port, only=1)  # replacement
    codes = _wait([pod0, pod1], tmp_path)
    text = _logs(tmp_path)
    assert codes == [0, 0], text
    joined = _pids(text)
    last = max(joined)
    assert last >= 1 and all(joined[0][r] == joined[last][r] for r in (0, 1)), text
    records = recoveries.read(tmp_path / "logs" / recoveries.FILENAME)
    assert records and records[-1]["resumedStep"] == stopped_at, records
    assert records[-1]["lostSteps"] == 0 and records[-1]["source"] == "storage", records
    # the replacement's report is the widest of the round: its ranks, restarted as a container
    assert records[-1]["tier"] in ("container", "pod") and records[-1]["ranks"] == [2, 3], records
    _same_final_state(tmp_path, reference, tmp_path)


@pytest.mark.slow
def test_a_pod_stopped_alone_with_no_recovery_left_stops_the_gang_with_143(tmp_path: Path) -> None:
    """``inPlaceLimit: 0``: no round to wait in, so every rank leaves with the stop's checkpoint
    and 143, as a whole-gang stop does; never 75 ("gave up recovering in place")."""
    spec = _spec(tmp_path, 500, intervalSteps=1000)
    pod0, pod1 = _supervisors(spec, tmp_path, 2, 2, "--in-place-limit=0", NO_SPARES)
    log = _wait_for_step(pod0, tmp_path)
    pod1.send_signal(signal.SIGTERM)
    assert _wait([pod0, pod1], tmp_path) == [exitcodes.STOPPED] * 2, _logs(tmp_path)
    last = max(r["step"] for r in steplog.read(log))
    assert [c.step for c in store.scan(tmp_path / "checkpoints")] == [last]


@pytest.mark.slow
def test_past_the_in_place_limit_the_supervisor_exits_for_a_gang_rebuild(tmp_path: Path) -> None:
    spec = _spec(tmp_path, 4, ranks=2)
    termination = tmp_path / "termination-log"
    procs = _supervisors(
        spec,
        tmp_path,
        1,
        2,
        "--in-place-limit=0",
        NO_SPARES,
        **{faults.ENV: "1:2", "MESHTRAIN_TERMINATION_LOG": str(termination)},
    )
    assert _wait(procs, tmp_path) == [exitcodes.GANG_RESTART], _logs(tmp_path)
    code, message = exitcodes.read_failure_report(termination.read_text()) or (None, "")
    assert code == exitcodes.GANG_RESTART and "in-place" in message


@pytest.mark.slow
def test_a_permanent_worker_code_passes_through(tmp_path: Path) -> None:
    spec = _spec(tmp_path, 2, ranks=2)
    termination = tmp_path / "termination-log"
    procs = _supervisors(
        spec,
        tmp_path,
        1,
        2,
        NO_SPARES,
        trainer=("--set", "training.steps=-1"),  # refused by every worker: exit 2
        MESHTRAIN_TERMINATION_LOG=str(termination),
    )
    assert _wait(procs, tmp_path) == [exitcodes.SPEC], _logs(tmp_path)
    report = exitcodes.read_failure_report(termination.read_text())
    assert report is not None and report[0] == exitcodes.SPEC


@pytest.mark.slow
def test_sigterm_stops_every_rank_after_a_checkpoint(tmp_path: Path) -> None:
    spec = _spec(tmp_path, 500, ranks=2, intervalSteps=1000)
    [proc] = _supervisors(spec, tmp_path, 1, 2, NO_SPARES)
    log = _wait_for_step(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert _wait([proc], tmp_path) == [exitcodes.STOPPED], _logs(tmp_path)
    last = max(r["step"] for r in steplog.read(log))
    assert [c.step for c in store.scan(tmp_path / "checkpoints")] == [last]
    assert "supervise pod 0: exit 143" in _logs(tmp_path)
    assert last < 500


@pytest.mark.slow
def test_sigterm_with_no_time_to_save_is_a_stop_never_a_gang_rebuild(tmp_path: Path) -> None:
    """A kubelet that refuses a running pod after its restart, or a deletion with a short grace,
    kills the workers before they save: the pod still exits 143, so the operator waits for the
    kubelet's own reason and never reads the trainer "giving up in place" (75)."""
    spec = _spec(tmp_path, 500, ranks=2, intervalSteps=1000)
    [proc] = _supervisors(spec, tmp_path, 1, 2, NO_SPARES, "--shutdown-timeout", "0")
    _wait_for_step(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert _wait([proc], tmp_path) == [exitcodes.STOPPED], _logs(tmp_path)
    assert "workers ended without saving: " + ", ".join(["SIGKILL"] * 2) in _logs(tmp_path)
    assert not store.scan(tmp_path / "checkpoints"), "no worker had time to save"


@pytest.mark.slow
def test_losing_pod_0_and_its_store_sends_every_pod_to_a_gang_rebuild(tmp_path: Path) -> None:
    raw = JobBuilder.cpu_run().layout(data=2).training(steps=500).raw()
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    termination = tmp_path / "termination-log"
    pod0, pod1 = _supervisors(
        spec, tmp_path, 2, 1, NO_SPARES, MESHTRAIN_TERMINATION_LOG=str(termination)
    )
    _wait_for_step(pod1, tmp_path)
    os.killpg(pod0.pid, signal.SIGKILL)  # pod 0: the store, its supervisor and its worker
    assert _wait([pod1], tmp_path, timeout=120) == [exitcodes.GANG_RESTART], _logs(tmp_path)
    report = exitcodes.read_failure_report(termination.read_text())
    assert report is not None and report[0] == exitcodes.GANG_RESTART


def _store_pod(out: Path, port: int, pods: int, local: int) -> subprocess.Popen[bytes]:
    """The store pod (``rendezvousStore: dedicated``) on loopback, in its own session."""
    command = [
        *(sys.executable, "-m", "meshtrain.trainer.recovery.store_host"),
        *(f"--port={port}", f"--nnodes={pods}", f"--nproc-per-node={local}"),
        *("--in-place-limit=10", "--shutdown-timeout=10"),
    ]
    return subprocess.Popen(
        command,
        cwd=REPO,
        stdout=(out / "sup-store.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.mark.slow
def test_with_a_store_pod_a_replaced_pod_0_rejoins_while_pod_1_keeps_its_processes(
    tmp_path: Path, unfaulted: tuple[Path, Path]
) -> None:
    """``rendezvousStore: dedicated``: pod 0 (its supervisor and workers) SIGKILLed and a
    replacement pod (another UID) started in its slot; the store lives on in its own pod, pod 1's
    ranks keep their processes, and the run ends exactly as the unfaulted one.  The store pod
    leaves with 0 once every pod left."""
    spec, reference = unfaulted
    port = launch.free_port()
    store_pod = _store_pod(tmp_path, port, 2, 2)
    pod0, pod1 = _supervisors(spec, tmp_path, 2, 2, NO_SPARES, "--store=dedicated", port=port)
    _wait_for_step(pod1, tmp_path, 2)
    os.killpg(pod0.pid, signal.SIGKILL)
    pod0.wait()
    [pod0] = _supervisors(
        *(spec, tmp_path, 2, 2, NO_SPARES, "--store=dedicated"),
        port=port,
        only=0,
        MESHTRAIN_POD_UID="new-0",
    )
    codes = _wait([pod0, pod1, store_pod], tmp_path)
    text = _logs(tmp_path)
    assert codes == [0, 0, 0], text
    assert "pod 0: restarted: joining the next round" in text
    assert "meshtrain store: exit 0: rank 0 finished; every pod left" in text
    _only_these_ranks_restarted(tmp_path, text, (0, 1), kept=(2, 3))
    _same_final_state(tmp_path, reference, tmp_path)


@pytest.mark.slow
def test_losing_the_store_pod_sends_every_pod_to_a_gang_rebuild(tmp_path: Path) -> None:
    raw = JobBuilder.cpu_run().layout(data=2).training(steps=500).raw()
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    port = launch.free_port()
    store_pod = _store_pod(tmp_path, port, 2, 1)
    pods = _supervisors(spec, tmp_path, 2, 1, NO_SPARES, "--store=dedicated", port=port)
    _wait_for_step(pods[0], tmp_path)
    os.killpg(store_pod.pid, signal.SIGKILL)
    assert _wait(pods, tmp_path, timeout=120) == [exitcodes.GANG_RESTART] * 2, _logs(tmp_path)
