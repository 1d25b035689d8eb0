"""Time from a killed rank to the next completed step: in-place recovery vs. fresh processes, side by side.

Two supervisors (``python -m meshtrain.trainer.supervise``) play two pods of two local ranks on
loopback (dp2·pp2, the tiny CPU model, gloo, a checkpoint every step).  Once step ``--kill-at``
is logged the benchmark SIGKILLs global rank 3's worker and measures until the next step
completes:

* ``in_place``: the supervisors recover in place (a warm spare takes rank 3, the healthy ranks
  rebuild their process groups); the time is the recovery record's ``firstStepAt`` minus the
  kill, with its phases;
* ``torchrun``: the torchrun tier (``operator.policy.torchrun_tier``): two torchrun agents
  started with the command and environment the operator builds for a custom trainer's pods
  (``tests/torchrun_agents.py``), running the same ranks (``torchrun -m meshtrain.trainer``);
  the agents restart every worker in a new c10d rendezvous round (four new Python processes,
  no pod replaced); the time is the first step logged after the kill;
* ``fresh``: ``--no-in-place``: the supervisors stop every worker and exit 75, and the benchmark
  starts two new supervisors at once (every rank a new Python process importing torch, as after
  a gang rebuild, minus Kubernetes' share); the time is the first step the new processes log,
  minus the kill.

Modes alternate per repeat in one run.  Run: ``python benchmarks/bench_recovery.py [--repeats 3]``
(``python -m benchmarks recovery``); results in ``benchmarks/results/recovery-<host>.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import machine
from meshtrain.trainer import launch, supervise
from meshtrain.trainer.telemetry import recoveries, steplog
from tests import torchrun_agents
from tests.builders import JobBuilder

JOINED = re.compile(r"meshtrain worker rank 3 pid (\d+): joined generation 0")
TIMEOUT_S = 600.0


def _start(spec: Path, out: Path, *flags: str) -> list[subprocess.Popen[bytes]]:
    port = launch.free_port()
    env = supervise.loopback_env(spec, out)
    procs = []
    for pod in range(2):
        with (out / f"sup-{pod}-{port}.log").open("ab") as log:
            procs.append(
                subprocess.Popen(
                    supervise.loopback_command(2, 2, pod, port, *flags),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the benchmark ends a run with its children
                )
            )
    return procs


def _until(condition: Any, what: str) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _logs(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(out.glob("sup-*.log")))


def _supervised_rank3(out: Path) -> int:
    """Rank 3's pid, from the supervisors' logs."""
    return int(_until(lambda: JOINED.search(_logs(out)), "rank 3's pid").group(1))


def _kill_rank3(
    out: Path, kill_at: int, pid_of: Callable[[Path], int] = _supervised_rank3
) -> float:
    """Wait for step ``kill_at``, SIGKILL rank 3's worker (``pid_of``); the time of the kill."""
    log = out / "logs" / steplog.FILENAME
    _until(
        lambda: log.exists() and max((r["step"] for r in steplog.read(log)), default=0) >= kill_at,
        f"step {kill_at}",
    )
    pid = pid_of(out)
    at = time.time()
    os.kill(pid, signal.SIGKILL)
    return at


def in_place(spec: Path, out: Path, kill_at: int) -> dict[str, Any]:
    procs = _start(spec, out)
    try:
        killed = _kill_rank3(out, kill_at)
        path = out / "logs" / recoveries.FILENAME
        [record] = _until(lambda: recoveries.read(path), "the recovery record")
    finally:
        torchrun_agents.end(procs)
    return {
        "kill_to_step_s": record["firstStepAt"] - killed,
        "detect_s": record["detectedAt"] - killed,
        "rejoin_s": record["rejoinedAt"] - record["detectedAt"],
        "restore_s": record["restoredAt"] - record["rejoinedAt"],
        "first_step_s": record["firstStepAt"] - record["restoredAt"],
        "record": record,
    }


def fresh(spec: Path, out: Path, kill_at: int) -> dict[str, Any]:
    procs = _start(spec, out, "--no-in-place")
    restarted: list[subprocess.Popen[bytes]] = []
    try:
        killed = _kill_rank3(out, kill_at)
        codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
        stopped = time.time()
        restarted = _start(spec, out)
        log = out / "logs" / steplog.FILENAME
        first = _until(
            lambda: [r for r in steplog.read(log) if r["time"] > stopped],
            "a step after the restart",
        )[0]
    finally:
        torchrun_agents.end(procs + restarted)
    return {
        "kill_to_step_s": first["time"] - killed,
        "stop_s": stopped - killed,
        "start_to_step_s": first["time"] - stopped,
        "supervisor_codes": codes,
        "resumed_step": first["step"] - 1,
    }


def torchrun(spec: Path, out: Path, kill_at: int) -> dict[str, Any]:
    bin_dir = out / "bin"
    bin_dir.mkdir()
    torchrun_agents.shim(bin_dir)
    port = launch.free_port()
    custom = (
        JobBuilder()
        .layout(data=2, pipeline=2, gpus_per_node=2)
        .trainer(type="custom", command=["torchrun", "-m", "meshtrain.trainer"])
        .run_policy(recovery={"torchrunElastic": True})
    )
    local = supervise.loopback_env(spec, out)
    loopback = {k: v for k, v in local.items() if k not in os.environ or k == "OMP_NUM_THREADS"}
    loopback["MESHTRAIN_TERMINATION_LOG"] = str(out / "termination-log")
    agents = []
    for index, pod in enumerate(torchrun_agents.pods(custom)):
        env = torchrun_agents.loopback_env(pod, port, bin_dir, **loopback)
        agents.append(torchrun_agents.start(pod, env, out / f"sup-{index}-{port}.log"))
    log = out / "logs" / steplog.FILENAME

    def rank3(_: Path) -> int:  # the rendezvous deals the ranks: either agent may hold it
        return int(
            _until(lambda: torchrun_agents.workers(*(a.pid for a in agents)).get(3), "rank 3")
        )

    try:
        killed = _kill_rank3(out, kill_at, rank3)
        first = _until(
            lambda: [r for r in steplog.read(log) if r["time"] > killed], "a step after the kill"
        )[0]
    finally:
        torchrun_agents.end(agents)
    return {"kill_to_step_s": first["time"] - killed, "resumed_step": first["step"] - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description="in-place recovery vs. fresh processes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=3, help="kill once this step is logged")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"in_place": [], "torchrun": [], "fresh": []}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        raw = (
            JobBuilder.cpu_run()
            .layout(data=2, pipeline=2)
            .training(steps=args.steps)
            .checkpoint(intervalSteps=1, keep=2, asyncSave=False)
            .raw()
        )
        spec = Path(tmp) / "job.yaml"
        spec.write_text(yaml.safe_dump(raw))
        for repeat in range(args.repeats):
            for mode, run in (("in_place", in_place), ("torchrun", torchrun), ("fresh", fresh)):
                out = Path(tmp) / f"{mode}-{repeat}"
                out.mkdir()
                result = run(spec, out, args.kill_at)
                runs[mode].append(result)
                print(
                    f"{mode:9s} repeat {repeat}: kill -> next step {result['kill_to_step_s']:.2f} s"
                )
    median = {
        mode: statistics.median(r["kill_to_step_s"] for r in results)
        for mode, results in runs.items()
    }
    results = {
        "setup": "2 pods x 2 ranks on loopback (supervisors; torchrun: 2 elastic torchrun agents as the "
        "operator starts a custom trainer), dp2·pp2 tiny CPU model, gloo, checkpoint every step",
        "kill_at_step": args.kill_at,
        "runs": runs,
        "median_kill_to_step_s": median,
        "caveat": "medians of the repeats on a shared 2-core machine; ratios of medians, not a target "
        "check; a GPU cluster's cold torch/CUDA/NCCL start makes the fresh and torchrun rows slower",
        "fresh_over_in_place": median["fresh"] / median["in_place"],
        "fresh_over_torchrun": median["fresh"] / median["torchrun"],
        "torchrun_over_in_place": median["torchrun"] / median["in_place"],
    }
    print(f"fresh / in-place: {results['fresh_over_in_place']:.1f}x")
    print(f"wrote {machine.write_results('recovery', results)}")


if __name__ == "__main__":
    main()
