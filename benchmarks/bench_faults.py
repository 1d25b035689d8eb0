"""Faults injected on a schedule into a job on the sandbox's two kubelet nodes: recovery side by side.

The sandbox (``meshtrain.sandbox``: real control plane, two kubelet nodes with containerd, the
operator from the chart, the trainer image built from this tree) runs the example job (dp2·pp2,
one pod of two ranks per node, storage checkpoints every ``--interval`` steps) once per recovery
mode, in one run.  When rank 0 has logged step 18, 38, 58, 78 (three steps past a checkpoint) the
next fault of the schedule hits the pod of node rank ``--target-rank``: 1 by default, so never
pod 0, which hosts the job's rendezvous store unless the job has a store pod of its own:

- ``process``: SIGKILL one worker process from the host (the busiest process of the trainer
  container other than its PID 1, found through the container's cgroup);
- ``container``: SIGKILL the container's PID 1 (the task ``ctr tasks ls`` names);
- ``pod``: ``kubectl delete pod`` (default grace period);
- ``node``: SIGKILL the node's kubelet and containerd, its shims and containers (a node that lost
  power), and start kubelet and containerd again ``--outage`` seconds later.

Per fault, from rank 0's ``steps.jsonl`` on the checkpoint claim (:mod:`benchmarks.fault_analysis`):
seconds from the fault to the next completed step, steps lost (recomputed); over the run, goodput
(productive step time / wall time); the operator's status (restarts, ``status.recovery`` where the
operator has it) and ``recoveries.jsonl`` when the trainer writes one.  The modes:

- ``rebuild``: today's full gang rebuild (``runPolicy.recovery.inPlace: false`` where that field
  exists; on a tree without it, the only path);
- ``inplace``: ``runPolicy.recovery.inPlace: true`` and, where the spec has them, in-memory
  checkpoints every ``--in-memory-interval`` steps (only offered when the spec has the field);
- ``store``: ``inplace`` with ``runPolicy.recovery.rendezvousStore: dedicated``, the store in a
  pod of its own (only offered when the spec has the field). ``--target-rank 0 --modes
  inplace,store`` compares a lost pod 0 with and without it: a gang rebuild against pod 0
  replaced alone.

Then an unfaulted job resumed from a copy of the first mode's last checkpoint before its first
fault trains to the end, and each mode's final checkpoint is compared with its final checkpoint
tensor by tensor (``torch.equal``).

Needs root and ``make bootstrap``; brings the sandbox up (building the trainer image from this
tree and importing it into both nodes when it changed: those times are recorded too) and down.
One sandbox per machine: on a shared machine run it under the sandbox lock, e.g.
``flock /work/sandbox.lock make bench-faults``.  Not part of ``python -m benchmarks`` unless named
(``python -m benchmarks faults``).

Run: ``python benchmarks/bench_faults.py [--modes rebuild,inplace] [--faults process,container,pod,node]``;
results in ``benchmarks/results/sandbox_faults-<host>.json`` (``--tag T``:
``sandbox_faults-T-<host>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import fault_analysis, fault_injection, machine
from meshtrain.api.spec import checkpoint as checkpoint_spec
from meshtrain.api.spec import run_policy as run_policy_spec
from meshtrain.sandbox import example, supervisor
from tests.e2e.test_sandbox import _example, _pods, _saved_steps, _written
from tests.e2e.test_sandbox_resilience import _live_pods, _status, _wait

FAULTS = ("process", "container", "pod", "node")
NAMESPACE = "default"
POLL = 0.5
LOG_POLL = 0.02
"""Seconds between reads of the step log while waiting for a step (a step takes ~0.2 s here)."""
STATUS_EVERY = 3.0


def has_in_place() -> bool:
    """Whether this tree's spec has ``runPolicy.recovery`` (the in-place restart paths)."""
    return hasattr(run_policy_spec, "Recovery")


def has_store_pod() -> bool:
    """Whether this tree's spec has ``runPolicy.recovery.rendezvousStore``."""
    return hasattr(run_policy_spec.Recovery, "dedicated_store")


def has_in_memory() -> bool:
    """Whether this tree's spec has ``checkpoint.inMemory``."""
    return hasattr(checkpoint_spec, "InMemoryCheckpoint")


def _target_pod(paths: supervisor.Paths, name: str, rank: str) -> dict[str, Any]:
    """The running pod of node rank ``rank`` whose container runs."""

    def running() -> dict[str, Any] | None:
        for pod in _live_pods(paths, name):
            labels = pod["metadata"].get("labels") or {}
            statuses = (pod.get("status") or {}).get("containerStatuses") or []
            if labels.get("meshtrain.io/node-rank") == rank and any(
                "running" in (c.get("state") or {}) for c in statuses
            ):
                return pod
        return None

    found: dict[str, Any] = _wait("the target pod running", running, 300, every=POLL)
    return found


# --- one job under the schedule ------------------------------------------------------------


def job_for(mode: str, name: str, args: argparse.Namespace) -> Any:
    """The example job for ``mode``, checkpoints every ``args.interval`` steps, all kept."""
    claim = f"{name}-checkpoints"
    job = (
        _example(name, claim)
        .training(steps=args.steps)
        .checkpoint(intervalSteps=args.interval, keep=args.steps // args.interval + 1)
        .run_policy(backoffLimit=20, disruptionRestartLimit=10)
    )
    in_place = mode in ("inplace", "store")
    if has_in_place():
        recovery: dict[str, Any] = {"inPlace": in_place}
        if mode == "store":
            recovery["rendezvousStore"] = "dedicated"
        job.run_policy(recovery=recovery)
    if in_place and has_in_memory() and args.in_memory_interval:
        job.checkpoint(inMemory={"intervalSteps": args.in_memory_interval})
    return job


def _job_dir(paths: supervisor.Paths, name: str) -> pathlib.Path:
    return paths.root / "volumes" / NAMESPACE / f"{name}-checkpoints" / NAMESPACE / name


def _records(job_dir: pathlib.Path) -> list[fault_analysis.StepRecord]:
    return fault_analysis.step_records(fault_analysis.read_jsonl(job_dir / "logs" / "steps.jsonl"))


def _last_step(tail: fault_analysis.Tail) -> int:
    records = tail.read()
    return records[-1].step if records else 0


def _not_failed(paths: supervisor.Paths, name: str) -> None:
    status = _status(paths, NAMESPACE, name)
    if status.get("phase") in example.TERMINAL and status.get("phase") != "Succeeded":
        raise RuntimeError(f"{name} ended {status.get('phase')}: {json.dumps(status)[:2000]}")


def _watch(
    paths: supervisor.Paths, name: str, what: str, probe: Callable[[], Any], timeout: float
) -> None:
    """Until ``probe`` (of the step log: read often) holds, the job's phase read every few
    seconds (a kubectl call costs CPU this 2-core machine's recovery is measured on)."""
    deadline, checked = time.monotonic() + timeout, time.monotonic()
    while time.monotonic() < deadline:
        if probe():
            return
        if time.monotonic() - checked > STATUS_EVERY:
            _not_failed(paths, name)
            checked = time.monotonic()
        time.sleep(LOG_POLL)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def _inject(
    kind: str,
    paths: supervisor.Paths,
    name: str,
    outage: fault_injection.NodeOutage | None,
    rank: str,
) -> dict[str, Any]:
    if kind == "node":
        assert outage is not None
        return outage.stop()
    pod = _target_pod(paths, name, rank)
    act = {
        "process": fault_injection.kill_process,
        "container": fault_injection.kill_container,
        "pod": fault_injection.delete_pod,
    }[kind]
    return act(paths, pod) | {"pod": pod["metadata"]["name"]}


def run_mode(
    paths: supervisor.Paths,
    mode: str,
    args: argparse.Namespace,
    outage: fault_injection.NodeOutage | None,
    partial: dict[str, Any],
) -> dict[str, Any]:
    """One job through the fault schedule; what each fault cost and the run's goodput.

    ``partial`` holds what is known so far (the faults injected, the job's directory), for
    :func:`partial_summary` when the run is stopped before the job ends.
    """
    name = f"faults-{mode}"
    job_dir = _job_dir(paths, name)
    shutil.rmtree(job_dir.parent.parent, ignore_errors=True)  # a previous run's claim
    created = time.time()
    faults: list[dict[str, Any]] = []
    partial.update(mode=mode, job_dir=job_dir, faults=faults, created=created)
    example.apply(paths, _written(paths, job_for(mode, name, args)))
    tail = fault_analysis.Tail(job_dir / "logs" / "steps.jsonl")
    _watch(paths, name, "the first step", lambda: _last_step(tail) >= 1, 900)
    checkpoint_before_first = None
    for index, kind in enumerate(args.faults):
        trigger = args.first + index * args.spacing
        _watch(paths, name, f"step {trigger}", lambda t=trigger: _last_step(tail) >= t, 900)  # type: ignore[misc]
        saved = _saved_steps(job_dir)
        if checkpoint_before_first is None:
            checkpoint_before_first = saved[-1] if saved else None
        restarts = _status(paths, NAMESPACE, name).get("restarts") or 0
        target = _inject(kind, paths, name, outage, str(args.target_rank))
        injected_at = float(target.pop("at"))
        print(f"[{mode}] {kind} fault after step {_last_step(tail)}: {target}", flush=True)
        if kind == "node":
            assert outage is not None
            time.sleep(args.outage)
            outage.start()
        gap = fault_analysis.usual_gap(tail.read())

        def recovered(at: float = injected_at, g: float = gap) -> Any:
            return fault_analysis.fault_cost(tail.read(), at, g).next_step_at

        _watch(paths, name, f"the step after the {kind} fault", recovered, args.fault_timeout)
        status = _status(paths, NAMESPACE, name)
        faults.append(
            {
                "fault": kind,
                "target": target,
                "injected_at": injected_at,
                "newest_checkpoint_at_fault": saved[-1] if saved else None,
                "operator_restarts": (status.get("restarts") or 0) - restarts,
                "status_recovery": status.get("recovery"),
            }
        )
    final = example.follow(paths, NAMESPACE, name, timeout=1800, on_change=lambda _: None)
    return _summarise(mode, job_dir, final, faults, created) | {
        "checkpoint_before_first_fault": checkpoint_before_first,
        "job_dir": str(job_dir),
    }


def partial_summary(partial: dict[str, Any]) -> dict[str, Any] | None:
    """What a mode stopped before its job ended had measured (its faults so far, its goodput)."""
    if not partial.get("faults"):
        return None
    summary = _summarise(
        partial["mode"], partial["job_dir"], {}, partial["faults"], partial["created"]
    )
    return summary | {"stopped_before_the_end": True, "job_dir": str(partial["job_dir"])}


def _summarise(
    mode: str,
    job_dir: pathlib.Path,
    final: dict[str, Any],
    faults: list[dict[str, Any]],
    created: float,
) -> dict[str, Any]:
    records = _records(job_dir)
    recoveries = fault_analysis.read_jsonl(job_dir / "logs" / "recoveries.jsonl")
    gap = fault_analysis.usual_gap(records)
    for fault in faults:
        cost = fault_analysis.fault_cost(records, fault["injected_at"], gap)
        seconds = cost.seconds_to_next_step
        fault.update(
            last_step_before=cost.last_step_before,
            resumed_after=cost.resumed_after,
            seconds_to_next_step=None if seconds is None else round(seconds, 2),
            steps_lost=cost.steps_lost,
            trainer_recovery=fault_analysis.recovery_for(recoveries, cost),
        )
    good = fault_analysis.goodput(records)
    status = final.get("status") or {}
    ended = max((r.end for r in records), default=created)
    return {
        "mode": mode,
        "phase": status.get("phase"),
        "faults": faults,
        "goodput": {
            "ratio": round(good.ratio, 4),
            "productive_seconds": round(good.productive_seconds, 2),
            "wall_seconds": round(good.wall_seconds, 2),
            "recomputed_steps": good.recomputed_steps,
            "job_wall_seconds": round(ended - created, 2),
        },
        "median_seconds_between_steps": round(gap, 3),
        "status": {
            k: status.get(k)
            for k in ("restarts", "disruptionRestarts", "recovery", "goodput", "progress")
        },
        "recoveries": recoveries,
        "final_checkpoint": max(_saved_steps(job_dir), default=None),
    }


# --- the weights check -----------------------------------------------------------------------


def reference_run(
    paths: supervisor.Paths, source: pathlib.Path, step: int, args: argparse.Namespace
) -> pathlib.Path:
    """An unfaulted job resumed from a copy of ``source``'s checkpoint ``step``; its directory."""
    name = "faults-reference"
    job_dir = _job_dir(paths, name)
    shutil.rmtree(job_dir.parent.parent, ignore_errors=True)
    job = job_for("rebuild", name, args)
    job_dir.mkdir(parents=True)
    shutil.copytree(source / f"step-{step:08d}", job_dir / f"step-{step:08d}")
    for path in [job_dir.parent.parent, job_dir.parent, job_dir, *job_dir.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    example.apply(paths, _written(paths, job))
    final = example.follow(paths, NAMESPACE, name, timeout=1800, on_change=lambda _: None)
    example.kubectl(paths, "delete", "tj", name, "-n", NAMESPACE, "--wait=false")
    if (final.get("status") or {}).get("phase") != "Succeeded":
        raise RuntimeError(f"the reference run ended {final.get('status')}")
    _wait("the reference job's pods gone", lambda: not _pods(paths, name), 300)
    return job_dir


def _tensors(checkpoint: pathlib.Path) -> dict[str, Any]:
    """A DCP checkpoint's whole state, on this host's CPU (no process group)."""
    import torch  # noqa: PLC0415 - only the weights check needs torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "state.pt"
        dcp_to_torch_save(str(checkpoint), str(out))
        loaded: dict[str, Any] = torch.load(out, weights_only=False)
    return loaded


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for key, value in state.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): state}


def compare(a: pathlib.Path, b: pathlib.Path) -> dict[str, Any]:
    """Tensor by tensor: equal, and the keys and largest difference where not."""
    import torch  # noqa: PLC0415

    left, right = _flat(_tensors(a)), _flat(_tensors(b))
    tensors = [k for k, v in left.items() if isinstance(v, torch.Tensor)]
    differ = [
        k
        for k in tensors
        if not (isinstance(right.get(k), torch.Tensor) and torch.equal(left[k], right[k]))
    ]
    worst = max(
        (
            float((left[k].double() - right[k].double()).abs().max())
            for k in differ
            if isinstance(right.get(k), torch.Tensor) and left[k].shape == right[k].shape
        ),
        default=0.0,
    )
    return {
        "tensors": len(tensors),
        "equal": not differ and set(left) == set(right),
        "differing": differ[:20],
        "max_abs_difference": worst,
        "keys_only_in_one": sorted(set(left) ^ set(right))[:20],
    }


def weights_check(
    paths: supervisor.Paths, runs: dict[str, dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    first = next(iter(runs.values()))
    start = first.get("checkpoint_before_first_fault")
    if start is None:
        return {"compared": False, "why": "no checkpoint was written before the first fault"}
    reference = reference_run(paths, pathlib.Path(first["job_dir"]), start, args)
    last = f"step-{args.steps:08d}"
    unfaulted = fault_analysis.goodput(_records(reference))
    out: dict[str, Any] = {
        "compared": True,
        "resumed_from_step": start,
        "final_step": args.steps,
        "reference_goodput": round(unfaulted.ratio, 4),
        "reference_median_seconds_between_steps": round(
            fault_analysis.usual_gap(_records(reference)), 3
        ),
    }
    for mode, run in runs.items():
        job_dir = pathlib.Path(run["job_dir"])
        out[mode] = compare(job_dir / last, reference / last)
        if run.get("checkpoint_before_first_fault") != start:
            out[mode]["own_start"] = compare(
                job_dir / f"step-{start:08d}", reference / f"step-{start:08d}"
            )
    return out


# --- the run --------------------------------------------------------------------------------


def image_times(log: pathlib.Path) -> list[str]:
    """What scripts/images.sh said it built or pushed in this sandbox's start, with times."""
    if not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    return [
        line
        for line in lines
        if re.search(r"\] (built|pushed|imported|.* up to date|.* already)", line)
    ]


def _cell(fault: dict[str, Any]) -> str:
    """``seconds s, N lost``, and the trainer's tier and restore source when it recorded them."""
    text = f"{fault.get('seconds_to_next_step')} s, {fault.get('steps_lost')} lost"
    record = fault.get("trainer_recovery") or {}
    if record:
        text += f" ({record.get('tier')}/{record.get('source')})"
    return text


def table(runs: dict[str, dict[str, Any]], faults: list[str]) -> str:
    modes = list(runs)
    widths = [22] + [34] * len(modes)
    out = [fault_analysis.row("fault", modes, widths)]
    for index, kind in enumerate(faults):
        cells = [
            _cell(runs[m]["faults"][index]) if index < len(runs[m]["faults"]) else None
            for m in modes
        ]
        out.append(fault_analysis.row(f"{kind} -> next step", cells, widths))
    out.append(fault_analysis.row("goodput", [runs[m]["goodput"]["ratio"] for m in modes], widths))
    return "\n".join(out)


SPEEDUPS = (("rebuild", "inplace"), ("inplace", "store"))
"""Pairs of modes compared fault by fault: the first's time to the next step over the second's."""


def speedups(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per pair of modes in the run, per fault: the slower path's time to the next step over the
    faster one's (``rebuild/inplace``; ``inplace/store``, which with ``--target-rank 0`` is pod
    0's gang rebuild over its replacement alone)."""
    out: dict[str, dict[str, float | None]] = {}
    for slow_mode, fast_mode in SPEEDUPS:
        if slow_mode not in runs or fast_mode not in runs:
            continue
        ratios: dict[str, float | None] = {}
        for old, new in zip(runs[slow_mode]["faults"], runs[fast_mode]["faults"], strict=False):
            slow, fast = old.get("seconds_to_next_step"), new.get("seconds_to_next_step")
            ratios[old["fault"]] = round(slow / fast, 2) if slow and fast else None
        out[f"{slow_mode}/{fast_mode}"] = ratios
    return out


def _interrupted(signum: int, _frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    offered = ["rebuild", "inplace"] if has_in_place() else ["rebuild"]
    if has_store_pod():
        offered.append("store")
    parser.add_argument("--modes", default=",".join(offered), help=f"of {offered}")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"in order, of {FAULTS}")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--interval", type=int, default=5, help="storage checkpoint interval")
    parser.add_argument("--in-memory-interval", type=int, default=1)
    parser.add_argument("--first", type=int, default=18, help="step of the first fault")
    parser.add_argument("--spacing", type=int, default=20, help="steps between faults")
    parser.add_argument("--outage", type=float, default=20.0, help="seconds a stopped node is down")
    parser.add_argument("--fault-timeout", type=float, default=900.0)
    parser.add_argument(
        "--target-rank",
        type=int,
        default=1,
        choices=range(len(supervisor.NODES)),
        help="the node rank whose pod the faults hit",
    )
    parser.add_argument("--tag", default="", help="results/sandbox_faults-TAG-<host>.json")
    parser.add_argument("--no-weights", action="store_true", help="skip the reference run")
    parser.add_argument("--state-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = [m for m in args.modes if m not in offered] + [
        f for f in args.faults if f not in FAULTS
    ]
    if unknown:
        parser.error(
            f"unknown or unavailable in this tree: {unknown} (modes {offered}, faults {FAULTS})"
        )
    if args.first + args.spacing * (len(args.faults) - 1) + args.spacing > args.steps:
        parser.error("--steps leaves no room after the last fault: raise it or lower --spacing")

    paths = supervisor.Paths(
        (args.state_dir or pathlib.Path(tempfile.mkdtemp(prefix="faults-"))).resolve()
    )
    paths.root.mkdir(parents=True, exist_ok=True)
    was_up = supervisor.status(paths).get("status") == "ready"
    started = time.monotonic()
    state = supervisor.up(paths)
    results: dict[str, Any] = {
        "command": " ".join(["python benchmarks/bench_faults.py", *(argv or sys.argv[1:])]),
        "job": "the sandbox example (dp2·pp2·tp1, tiny, two pods of two ranks on two nodes), "
        f"{args.steps} steps, storage checkpoints every {args.interval} steps",
        "target_node_rank": args.target_rank,
        "schedule": [
            {"fault": f, "after_step": args.first + i * args.spacing}
            for i, f in enumerate(args.faults)
        ],
        "node_outage_seconds": args.outage,
        "in_place_available": has_in_place(),
        "in_memory_available": has_in_memory(),
        "sandbox_up_seconds": round(time.monotonic() - started, 1),
        "sandbox_timings_seconds": state.get("timings"),
        "images": image_times(paths.logs / "images.log"),
        "load_average_before": os.getloadavg(),
    }
    runs: dict[str, dict[str, Any]] = {}
    target_node = supervisor.NODES[args.target_rank].name  # one pod per node, in rank order
    outage = fault_injection.NodeOutage(paths, target_node) if "node" in args.faults else None
    signal.signal(signal.SIGTERM, _interrupted)  # the results so far are still written
    partial: dict[str, Any] = {}
    try:
        for mode in args.modes:
            partial.clear()
            runs[mode] = run_mode(paths, mode, args, outage, partial)
            partial.clear()
            example.kubectl(
                paths, "delete", "tj", f"faults-{mode}", "-n", NAMESPACE, "--wait=false"
            )
            _wait("the job's pods gone", lambda m=mode: not _pods(paths, f"faults-{m}"), 300)  # type: ignore[misc]
        results["runs"] = runs
        results["weights"] = (
            {"compared": False, "why": "--no-weights"}
            if args.no_weights
            else weights_check(paths, runs, args)
        )
    finally:
        stopped = partial_summary(partial)
        if stopped is not None:
            runs[stopped["mode"]] = stopped
        results["runs"] = runs
        results["speedup"] = speedups(runs)
        results["load_average_after"] = os.getloadavg()
        if outage is not None:
            outage.close()
            if was_up and outage.started:
                print(f"{target_node}'s kubelet and containerd were restarted and are now stopped")
        if not was_up:  # a sandbox someone else started is theirs to bring down
            results["down_leftovers"] = supervisor.down(paths)
        if args.state_dir is None:  # this run's own state directory, volumes included
            shutil.rmtree(paths.root, ignore_errors=True)
        path = machine.write_results(
            "-".join(["sandbox_faults", *([args.tag] if args.tag else [])]), results
        )
        print(f"results: {path}")
    print(table(runs, args.faults))
    if results.get("speedup"):
        print(f"time to the next step, one mode over another: {results['speedup']}")
    print(f"weights: {json.dumps(results['weights'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
