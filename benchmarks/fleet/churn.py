"""The operator under churn: the trace's TrainingJobs on the KWOK fleet, the real kube-scheduler
binding their pods, KWOK ending them on the trace's schedule, the operator as a user runs it.

It measures apply -> all pods running by job size (p50/p95/p99), placements per second, API
requests per second (the API server's own ``apiserver_request_total`` and the operator's
``meshtrain_operator_api_requests_total``), the operator's RSS and CPU, the longest wait of the
largest gangs, events dropped (Events the operator failed to write, watch relists), and, per
waiting job, its plans per capacity change that could admit it: the largest over jobs (the
operator's ``meshtrain_operator_replans_per_admission_max``; the target is 1 at most), and the
same target judged from outside: each re-plan the operator logged against the capacity changes
and reservation ends the benchmark's own watches saw (:mod:`benchmarks.fleet.replans`). It writes
``benchmarks/results/churn-<host>.json`` and prints a table.

    python -m benchmarks.fleet.churn [--nodes 1024] [--minutes 25] [--drain-minutes 3]
        [--compression 60] [--load 1.1] [--seed 36] [--no-time-limits]

Needs the full bootstrap's ``kwok`` (``make bootstrap``). ``make bench-churn`` runs it; never CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import kubernetes

from benchmarks import bench_operator, bench_operator_scale, machine
from benchmarks.fleet import kwok, observe, replans, trace
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane.ports import pick_free_port

CHART_MEMORY_MB = 512
"""The chart's memory limit of the operator (charts/meshtrain/values.yaml: 512Mi)."""
GANG_TARGET_GPUS, GANG_TARGET_SECONDS = 128 * kwok.GPUS_PER_NODE, 5.0
"""The issue's target: p99 apply -> all running of a 128-pod gang under 5 s when capacity exists."""
SAMPLE_SECONDS = 2.0
OPERATOR_FLAGS = (
    *("--standalone", "--log-format=text", "--resync-seconds=300"),
    "--progress-seconds=3600",  # KWOK's pods serve no /progress: do not poll them
    "--gpu-profile=none",  # the fleet's nodes name no GPU product: admit memory unchecked
)
"""``meshtrain operator`` as the benchmark runs it (one replica, no leader election)."""


def _operator_metrics(port: int) -> dict[str, float]:
    """Plans (placement histogram count), placement failures and API requests, from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()

    def total(pattern: str) -> float:
        return sum(float(v) for v in re.findall(pattern, text, re.M))

    return {
        "plans": total(
            r"^meshtrain_operator_placement_duration_seconds_count(?:\{[^}]*\})? (\S+)$"
        ),
        "plan_seconds": total(
            r"^meshtrain_operator_placement_duration_seconds_sum(?:\{[^}]*\})? (\S+)$"
        ),
        "placement_failures": total(
            r"^meshtrain_operator_placement_failures_total\{[^}]*\} (\S+)$"
        ),
        "replans": total(r"^meshtrain_operator_replans_total(?:\{[^}]*\})? (\S+)$"),
        "backfills": total(r"^meshtrain_operator_backfills_total(?:\{[^}]*\})? (\S+)$"),
        "replan_admissions": total(r"^meshtrain_operator_replan_admissions_total (\S+)$"),
        "replans_per_admission_max": total(r"^meshtrain_operator_replans_per_admission_max (\S+)$"),
        "per_job_counts": float("meshtrain_operator_replans_per_admission_max " in text),
        "jobs_settled_after_waiting": total(
            r"^meshtrain_operator_replans_per_admission_count (\S+)$"
        ),
        "api_requests": total(r"^meshtrain_operator_api_requests_total\{[^}]*\} (\S+)$"),
        "reconciles": total(
            r"^meshtrain_operator_reconcile_duration_seconds_count(?:\{[^}]*\})? (\S+)$"
        ),
    }


def _apiserver_requests(plane: controlplane.ControlPlane) -> float:
    """Requests the API server has served (``apiserver_request_total``, every verb and code)."""
    body = plane.admin_client().request("GET", "/metrics", timeout=30).body
    text = body if isinstance(body, str) else str(body)
    return sum(
        float(v) for v in re.findall(r"^apiserver_request_total\{[^}]*\} (\S+)$", text, re.M)
    )


class _Process:
    """RSS and CPU of one process, sampled, and the CPU of its children (the planning worker)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_rss_mb = pid, 0.0
        self.rss: list[float] = []
        self.cpu_start = bench_operator._cpu_seconds(pid)
        self.children: dict[int, float] = {}
        """Child pid -> CPU seconds last seen."""

    def sample(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            rss = bench_operator._rss_mb(self.pid)
            self.rss.append(rss)
            self.peak_rss_mb = max(self.peak_rss_mb, rss)
        children = pathlib.Path(f"/proc/{self.pid}/task/{self.pid}/children")
        with contextlib.suppress(OSError):
            for child in children.read_text().split():
                with contextlib.suppress(OSError, RuntimeError, ValueError):
                    self.children[int(child)] = bench_operator._cpu_seconds(int(child))

    def children_cpu_seconds(self) -> float:
        return sum(self.children.values())

    def cpu_seconds(self) -> float:
        return bench_operator._cpu_seconds(self.pid) - self.cpu_start


def _apply(custom: Any, seen: observe.Observer, job: trace.Job) -> None:
    seen.applied(job.name, job.gpus)
    custom.create_namespaced_custom_object(
        bench_operator.GROUP,
        bench_operator.VERSION,
        trace.NAMESPACE,
        bench_operator.PLURAL,
        job.manifest(),
    )


def _submit(
    custom: Any, jobs: list[trace.Job], seen: observe.Observer, stop: threading.Event
) -> None:
    """Apply each job at its arrival time (late when the API server is slow: the lag is recorded)."""
    started = time.monotonic()
    for job in jobs:
        delay = job.arrival - (time.monotonic() - started)
        if delay > 0 and stop.wait(delay):
            return
        _apply(custom, seen, job)


def _probe(custom: Any, seen: observe.Observer, every: float, stop: threading.Event) -> None:
    """Every ``every`` seconds, when the fleet has room for one beyond the jobs waiting, apply a
    128-pod gang (1,024 GPUs) that runs 30 s: the issue's latency target, when capacity exists."""
    index = 0
    while not stop.wait(every):
        free = seen.fleet_gpus - seen.allocated() - sum(seen.waiting())
        if free < GANG_TARGET_GPUS:
            continue
        job = trace.Job(f"probe-{index:03d}", 0.0, GANG_TARGET_GPUS, 30.0, None)
        index += 1
        _apply(custom, seen, job)


def _probes(seen: observe.Observer) -> dict[str, Any]:
    probes = [r for name, r in seen.jobs.items() if name.startswith("probe-")]
    started = [r.all_running - r.applied for r in probes if r.all_running is not None]
    return {
        "gpus": GANG_TARGET_GPUS,
        "applied": len(probes),
        "apply_to_all_running_seconds": observe.percentiles(started),
        "target_seconds": GANG_TARGET_SECONDS,
    }


def _holders(
    held: observe.Holders, seen: observe.Observer, started_at: float, end: float
) -> dict[str, Any]:
    """Each job that held the reservation: its GPUs, when it was applied, and its periods of
    holding with the time its nodes were said to clear by against its start
    (:func:`observe.holds`), all in seconds from the run's first apply; and their verdicts
    counted."""
    to_epoch = time.time() - time.monotonic()
    ran = {
        name: None if r.all_running is None else r.all_running + to_epoch
        for name, r in seen.jobs.items()
    }
    periods = observe.holds(held.stated(), ran, started_at + to_epoch, end + to_epoch)
    jobs = {
        name: {
            "gpus": seen.jobs[name].gpus if name in seen.jobs else None,
            "applied": round(seen.jobs[name].applied - started_at, 2)
            if name in seen.jobs
            else None,
            "periods": rows,
        }
        for name, rows in periods.items()
    }
    verdicts = [row["verdict"] for rows in periods.values() for row in rows]
    late = [row["late"] for rows in periods.values() for row in rows if "late" in row]
    return {
        "start_allowance_seconds": observe.START_ALLOWANCE_SECONDS,
        "verdicts": {v: verdicts.count(v) for v in sorted(set(verdicts))},
        "most_late_seconds": max(late, default=None),
        "later_times_said": sum(row["later"] for rows in periods.values() for row in rows),
        "jobs": jobs,
    }


def _summary(seen: observe.Observer, shape: kwok.Shape, end: float) -> dict[str, Any]:
    by_size: dict[str, Any] = {}
    for size in trace.SIZES:
        records = [
            r for name, r in seen.jobs.items() if r.gpus == size and not name.startswith("probe-")
        ]
        if not records:
            continue
        started = [r.all_running - r.applied for r in records if r.all_running is not None]
        roomy = [
            r.all_running - r.applied
            for r in records
            if r.all_running is not None and r.room_at_apply
        ]
        waits = [(r.all_running or end) - r.applied for r in records]
        by_size[str(size)] = {
            "jobs": len(records),
            "started": len(started),
            "apply_to_all_running_seconds": observe.percentiles(started),
            "with_room_at_apply_seconds": observe.percentiles(roomy),
            "longest_wait_seconds": max(waits),
        }
    changes = seen.changes
    started_at = min((r.applied for r in seen.jobs.values()), default=end)
    return {
        "probes": _probes(seen),
        "by_size": by_size,
        "jobs": {
            name: {
                "gpus": r.gpus,
                "applied": round(r.applied - started_at, 2),
                "all_running": None
                if r.all_running is None
                else round(r.all_running - started_at, 2),
                "room_at_apply": r.room_at_apply,
            }
            for name, r in seen.jobs.items()
        },
        "capacity_changes": len(changes),
        "admissible_wakeups": sum(c.could_admit() for c in changes),
        "minutes_above_80_percent": observe.allocated_minutes(seen.samples, shape.gpus, 0.8),
        "peak_waiting_jobs": max((w for _, _, w in seen.samples), default=0),
        "mean_allocated_share": (
            sum(a for _, a, _ in seen.samples) / len(seen.samples) / shape.gpus
            if seen.samples
            else 0.0
        ),
        "allocation": {
            "columns": ["seconds", "allocated_gpus", "waiting_jobs"],
            "samples": [
                [round(at - started_at, 1), gpus, waiting] for at, gpus, waiting in seen.samples
            ],
        },
        "watch_restarts": seen.watch_restarts,
    }


def _ended_at_deadline(custom: Any) -> int:
    """TrainingJobs the operator failed at their ``activeDeadlineSeconds`` (their limit ran out)."""
    listed = custom.list_namespaced_custom_object(
        bench_operator.GROUP, bench_operator.VERSION, trace.NAMESPACE, bench_operator.PLURAL
    )
    return sum(
        any(
            c.get("reason") == "DeadlineExceeded"
            for c in (j.get("status") or {}).get("conditions") or []
        )
        for j in listed.get("items") or []
    )


def _replans_seen(
    log: pathlib.Path, seen: observe.Observer, held: dict[str, Any], first_apply: float
) -> dict[str, Any]:
    """The re-plan target judged by the benchmark's own watches (:mod:`benchmarks.fleet.replans`)."""
    to_epoch = time.time() - time.monotonic()
    with log.open(errors="replace") as lines:
        plans = replans.read_log(lines, trace.NAMESPACE)
    return replans.judge(
        plans,
        {name: r.gpus for name, r in seen.jobs.items()},
        [(c.at + to_epoch, c.free_gpus) for c in seen.changes],
        replans.releases_of(
            {name: job["periods"] for name, job in held["jobs"].items()}, first_apply + to_epoch
        ),
        held["jobs"],
    )


def _log_counts(log: pathlib.Path) -> dict[str, int]:
    text = log.read_text(errors="replace") if log.exists() else ""
    return {
        "events_not_written": text.count("could not record event"),
        "watch_relists": max(0, text.count("cache of pods filled") - 1)
        + max(0, text.count("cache of nodes filled") - 1),
        "watch_failures": text.count("watch of "),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = kwok.Shape(nodes=args.nodes)
    spec = trace.Trace(
        shape,
        seed=args.seed,
        wall_seconds=args.minutes * 60,
        compression=args.compression,
        load=args.load,
        time_limits=args.time_limits,
    )
    jobs = trace.held(spec, args.waiting) if args.waiting else list(trace.jobs(spec))
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-churn-"))
    log = workdir / "operator.log"
    results: dict[str, Any] = {
        "trace": {
            "source": "Kokolis et al. 2024 (Meta RSC-1/RSC-2) size mix and series failure model; "
            "Llama 3 16k-GPU run failure rate (419 interruptions / 54 days)",
            "seed": args.seed,
            "minutes": args.minutes,
            "compression": args.compression,
            "load": args.load,
            "time_limits": args.time_limits,
            "jobs": len(jobs),
            "failing_jobs": sum(j.fail_after is not None for j in jobs),
            "gpus_asked": sum(j.gpus for j in jobs),
        },
        "fleet": {
            "nodes": shape.nodes,
            "gpus": shape.gpus,
            **{k: v for k, v in kwok.domains(shape)},
        },
    }
    kwok.binary()  # fails naming `make bootstrap` before anything starts
    with contextlib.ExitStack() as stack:
        plane = stack.enter_context(controlplane.ControlPlane(with_scheduler=True))
        kubeconfig = plane.kubeconfig_path
        api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
        bench_operator._install(api, str(kubeconfig), str(plane.binaries.kubectl))
        core.create_namespace({"metadata": {"name": trace.NAMESPACE}})
        stack.enter_context(kwok.Kwok(kubeconfig, workdir))
        results["fleet"]["register_seconds"] = asyncio.run(kwok.create_nodes(kubeconfig, shape))
        if args.waiting:  # full with pods of no job: every TrainingJob waits
            core.create_namespace({"metadata": {"name": "foreign"}})
            results["fleet"]["fill_seconds"] = asyncio.run(kwok.fill(kubeconfig, shape, "foreign"))
        print(
            f"fleet of {shape.nodes} nodes registered in {results['fleet']['register_seconds']:.0f} s",
            flush=True,
        )
        metrics_port = pick_free_port()
        process, _ = bench_operator._start_operator(
            str(kubeconfig),
            log,
            *OPERATOR_FLAGS,
            metrics_port=metrics_port,
            scope=(f"--namespace={trace.NAMESPACE}",),
        )
        stack.callback(_stop_operator, process)
        bench_operator_scale._wait_log(log, "cache of pods filled", 600)
        operator = _Process(process.pid)
        seen = observe.Observer(api, trace.NAMESPACE, shape.gpus)
        holders = observe.Holders(api, trace.NAMESPACE)
        for watch in (seen, holders):
            watch.start()
            stack.callback(watch.stop)
        before = {**_operator_metrics(metrics_port), "apiserver": _apiserver_requests(plane)}
        stop = threading.Event()
        submitter = threading.Thread(target=_submit, args=(custom, jobs, seen, stop), daemon=True)
        started, load_start = time.monotonic(), os.getloadavg()
        submitter.start()
        if args.probe_every:
            prober = (custom, seen, args.probe_every, stop)
            threading.Thread(target=_probe, args=prober, daemon=True).start()
        end = started + (args.minutes + args.drain_minutes) * 60
        while time.monotonic() < end:
            time.sleep(SAMPLE_SECONDS)
            seen.sample()
            operator.sample()
            if args.progress and len(seen.samples) % 15 == 0:
                held, waiting = seen.samples[-1][1], seen.samples[-1][2]
                print(
                    f"{time.monotonic() - started:6.0f} s: {held / shape.gpus:5.1%} allocated, "
                    f"{waiting} waiting, operator RSS {operator.rss[-1] if operator.rss else 0:.0f} MB",
                    flush=True,
                )
        stop.set()
        wall = time.monotonic() - started
        after = {**_operator_metrics(metrics_port), "apiserver": _apiserver_requests(plane)}
        results["wall_seconds"] = wall
        results["operator"] = {
            "children_cpu_seconds": operator.children_cpu_seconds(),
            "peak_rss_mb": operator.peak_rss_mb,
            "cpu_seconds": operator.cpu_seconds(),
            "cpu_cores_mean": operator.cpu_seconds() / wall,
        }
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        results["operator"]["metrics_delta"] = delta
        finished = time.monotonic()
        results.update(_summary(seen, shape, finished))
        first_apply = min((r.applied for r in seen.jobs.values()), default=finished)
        results["holders"] = _holders(holders, seen, first_apply, finished)
        results["replans_seen"] = _replans_seen(log, seen, results["holders"], first_apply)
        placed = sum(1 for r in seen.jobs.values() if r.all_running is not None)
        results["placements_per_second"] = placed / wall
        results["plans_per_second"] = delta["plans"] / wall
        results["plan_seconds_mean"] = delta["plan_seconds"] / max(1.0, delta["plans"])
        results["load_average_start"] = load_start
        results["apiserver_requests_per_second"] = delta["apiserver"] / wall
        results["operator_requests_per_second"] = delta["api_requests"] / wall
        waiting_plans = delta["placement_failures"]  # a waiting job counts once per plan
        results["plans_of_waiting_jobs"] = waiting_plans
        # the target: re-plans of waiting jobs <= capacity changes that could admit one of them
        results["replans"] = delta.get("replans", 0.0)
        results["replans_per_admissible_wakeup"] = results["replans"] / max(
            1, results["admissible_wakeups"]
        )
        results["plans_per_admissible_wakeup"] = waiting_plans / max(
            1, results["admissible_wakeups"]
        )
        # the target, per job: plans while waiting / max(1, wake-ups that could admit it);
        # None from an operator that does not export it (before issue #36's re-plan counts)
        most = after["replans_per_admission_max"] if after["per_job_counts"] else None
        results["max_replans_per_admissible_wakeup"] = most
        results["replans_target_met"] = None if most is None else most <= 1.0
        results["backfills"] = delta.get("backfills", 0.0)
        results["ended_at_deadline"] = _ended_at_deadline(custom)
        results["dropped"] = _log_counts(log)
        results["load_average_end"] = os.getloadavg()
        results["operator_log"] = str(log)
    return results


def _stop_operator(process: Any) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except Exception:  # noqa: BLE001 - it would not stop: kill it
        process.kill()


def _print(results: dict[str, Any]) -> None:
    probe = results["probes"]
    print(
        f"128-pod probe gangs applied with room: {probe['applied']}, apply -> all running "
        f"{probe['apply_to_all_running_seconds']} (target p99 < {GANG_TARGET_SECONDS:.0f} s)"
    )
    print(
        f"{'job GPUs':>8} {'jobs':>6} {'started':>8} {'p50 s':>8} {'p95 s':>8} {'p99 s':>8} {'longest wait s':>15}"
    )
    for size, row in results["by_size"].items():
        p = row["apply_to_all_running_seconds"]
        print(
            f"{size:>8} {row['jobs']:>6} {row['started']:>8} {p.get('p50', float('nan')):>8.1f} "
            f"{p.get('p95', float('nan')):>8.1f} {p.get('p99', float('nan')):>8.1f} {row['longest_wait_seconds']:>15.0f}"
        )
    op = results["operator"]
    print(
        f"operator peak RSS {op['peak_rss_mb']:.0f} MB (chart limit {CHART_MEMORY_MB}), "
        f"CPU {op['cpu_cores_mean']:.2f} cores mean"
    )
    print(
        f"placements/s {results['placements_per_second']:.2f}, plans/s {results['plans_per_second']:.2f}, "
        f"API server requests/s {results['apiserver_requests_per_second']:.1f}, "
        f"operator requests/s {results['operator_requests_per_second']:.1f}"
    )
    print(
        f"gangs backfilled onto reserved nodes {results['backfills']:.0f}, jobs ended at their "
        f"deadline {results['ended_at_deadline']}"
    )
    print(
        f"minutes above 80% allocated {results['minutes_above_80_percent']:.1f}, "
        f"plans per admissible wake-up {results['plans_per_admissible_wakeup']:.2f}, dropped {results['dropped']}"
    )
    holders = results["holders"]
    print(
        f"holders of the reservation: {holders['verdicts']} (allowing "
        f"{holders['start_allowance_seconds']:.0f} s from clear to running), most late "
        f"{holders['most_late_seconds']} s, later times said {holders['later_times_said']}"
    )
    for name, job in holders["jobs"].items():
        for row in job["periods"]:
            print(
                f"  {name} ({job['gpus']} GPUs, applied {job['applied']}): held {row['from']}-"
                f"{row['until']}, clear by {row['earliest']}, all running {row['all_running']}: "
                f"{row['verdict']}"
            )
    seen = results["replans_seen"]
    print(
        f"re-plans of waiting jobs in the operator's log {seen['replans']}: after a change that "
        f"could admit the job {seen['by_capacity']}, after a reservation ended "
        f"{seen['by_release']}, after neither {seen['unexplained']} (of them the reservation's "
        f"holders' {seen['unexplained_of_holders']}); most per admitting change the benchmark saw "
        f"{seen['most_replans_per_admitting_change']}"
    )
    most, met = results["max_replans_per_admissible_wakeup"], results["replans_target_met"]
    print(
        "most plans of one waiting job per capacity change that could admit it: "
        + ("not exported by this operator" if most is None else f"{most:.2f}")
        + f" (target <= 1: {'-' if met is None else 'met' if met else 'NOT met'})"
    )


def markdown(path: pathlib.Path) -> str:
    """The docs' table of a results file (docs/operator.md, "Under churn")."""
    results = json.loads(path.read_text())["results"]
    rows = [
        "| job GPUs | jobs | started | apply -> all running p50 / p95 / p99 (s) "
        "| same, room at apply: n, p50 / p99 (s) | longest wait (s) |",
        "|---|---|---|---|---|---|",
    ]
    for size, row in results["by_size"].items():
        every, roomy = row["apply_to_all_running_seconds"], row["with_room_at_apply_seconds"]

        def cell(p: dict[str, Any], keys: tuple[str, ...]) -> str:
            return " / ".join(f"{p[k]:.1f}" for k in keys) if p.get("count") else "-"

        rows.append(
            f"| {size} | {row['jobs']} | {row['started']} | {cell(every, ('p50', 'p95', 'p99'))} "
            f"| {roomy.get('count', 0)}: {cell(roomy, ('p50', 'p99'))} "
            f"| {row['longest_wait_seconds']:.0f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--minutes", type=float, default=25.0, help="wall minutes of arrivals")
    parser.add_argument("--drain-minutes", type=float, default=3.0)
    parser.add_argument("--compression", type=float, default=60.0)
    parser.add_argument("--load", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument(
        "--time-limits",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every job declares runPolicy.activeDeadlineSeconds (trace.LIMIT_FACTORS), so the "
        "operator may backfill reserved nodes; --no-time-limits: the trace of the runs before "
        "backfill (the same jobs without limits)",
    )
    parser.add_argument(
        "--waiting",
        type=int,
        default=0,
        help="instead of the trace: fill the fleet with pods of no job and apply this many jobs "
        "at once, all of which wait (the operator's memory at rest)",
    )
    parser.add_argument(
        "--probe-every",
        type=float,
        default=0.0,
        help="seconds between 128-pod probe gangs, each applied only when the fleet has room",
    )
    parser.add_argument("--name", default="churn", help="results file name (churn-<host>.json)")
    parser.add_argument("--progress", action="store_true", help="print allocation every 30 s")
    parser.add_argument(
        "--markdown",
        type=pathlib.Path,
        help="print the docs' table of this results file, run nothing",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    ran = machine.code()  # before the run: commits may land during its 30 minutes
    results = run(args)
    path = machine.write_results(args.name, results, ran)
    _print(results)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
