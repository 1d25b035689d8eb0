"""Head to head with Kueue TAS (issue #36 item 4): the same trace on the same KWOK fleet, placed by
meshtrain as TrainingJobs, then by Kueue v0.17.0 as Indexed batch Jobs with TAS annotations.

One control plane (kube-apiserver, kube-scheduler, kube-controller-manager running only the Job,
garbage-collector and ServiceAccount controllers: no node lifecycle controller may evict KWOK's
lease-less nodes), one KWOK fleet, one trace (benchmarks/fleet/trace.py, its seed and compression).
Phase 1 runs the meshtrain operator and applies each TrainingJob at its arrival time; every job,
pod and the operator are then removed; phase 2 runs Kueue with its batch/job integration and a
Topology of the fleet's labels (block, rack, NVLink domain, host) and creates each job as the
batch Job :mod:`.kueue_tas` makes of it, at the same arrival times.  Both sides get the same
constraints (:func:`.kueue_tas.constraints`): a stage required in a domain is Kueue's PodSet slice
and meshtrain's ``scope: stage`` level there (``--all-preferred``: meshtrain's levels all
preferred, as in the runs before that field; ``--wait-seconds``: meshtrain's preferred levels hold
each job that long for one domain, ``spec.topology.levels[].waitSeconds``).  Each phase runs for the
trace's minutes plus a drain.  Per job: bytes per step by fabric level on the nodes its pods were
bound to (:mod:`.compare`, the placement's cost model), time to start; per phase: utilisation.

A Kueue batch Job retries pods one by one, not as a gang, so a job the trace fails once runs on
Kueue's side as one attempt of ``fail_after + run_seconds`` (the GPU-time it holds on meshtrain's
side, without the restart): the Kueue side never pays a re-placement.

    python -m benchmarks.fleet.headtohead [--nodes 256] [--nodes-per-rack 8]
        [--racks-per-block 4] [--nodes-per-clique 4] [--minutes 8] [--drain-minutes 2]
        [--compression 60] [--load 1.1] [--seed 36] [--all-preferred] [--wait-seconds 0]

Needs the full bootstrap's ``kwok`` and Kueue (``make bootstrap``); ``make bench-headtohead`` runs
it, never CI.  Writes ``benchmarks/results/headtohead-<host>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import pathlib
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import kubernetes

from benchmarks import bench_operator, bench_operator_scale, machine
from benchmarks.fleet import compare, kueue_tas, kwok, observe, trace
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.placement import values
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import kueue

CONTROLLERS = "--controllers=job-controller,garbage-collector-controller,serviceaccount-controller,serviceaccount-token-controller"
"""The only kube-controller-manager loops the run needs (batch Jobs, owner cleanup, ServiceAccounts)."""
INDEX_LABELS = ("meshtrain.io/node-rank", kueue_tas.COMPLETION_INDEX)
"""Pod labels naming a pod's index in its gang: meshtrain's node rank, the Job's completion index."""
QUEUE = "fleet"
FLEET_NODES = {"type": "kwok"}
"""The label every fleet node carries (kwok.node): the ResourceFlavor's node labels."""
SAMPLE_SECONDS = 2.0


class Bindings(observe.WatchThread):
    """A pod watch of the trace's namespace: the node each pod index of each job was first bound to."""

    def __init__(self, api: kubernetes.client.ApiClient, pods: Mapping[str, int]) -> None:
        super().__init__(api)
        self._pods = dict(pods)
        self._nodes: dict[str, dict[int, str]] = collections.defaultdict(dict)

    def binding(self, job: str) -> list[str] | None:
        """Node of each pod index of ``job``, once every index was bound."""
        found, count = self._nodes.get(job, {}), self._pods[job]
        return [found[i] for i in range(count)] if len(found) == count else None

    def _run(self) -> None:
        self._watch(self._core.list_namespaced_pod, trace.NAMESPACE)

    def _event(self, type_: str, pod: Any) -> None:
        labels = pod.metadata.labels or {}
        job, node = labels.get(observe.JOB_LABEL), pod.spec.node_name
        if job not in self._pods or not node or labels.get(kwok.ATTEMPT_LABEL, "0") != "0":
            return
        index = next((labels[key] for key in INDEX_LABELS if key in labels), "")
        if index.isdigit() and int(index) < self._pods[job]:
            self._nodes[job].setdefault(int(index), node)


def _drive(
    api: kubernetes.client.ApiClient,
    jobs: list[trace.Job],
    submit: Callable[[trace.Job], None],
    shape: kwok.Shape,
    seconds: float,
) -> dict[str, Any]:
    """Submit each job at its arrival time for ``seconds``; what the watches saw."""
    seen = observe.Observer(api, trace.NAMESPACE, shape.gpus)
    bindings = Bindings(api, {job.name: job.pods for job in jobs})
    seen.start()
    bindings.start()
    stop = threading.Event()

    def submitter() -> None:
        began = time.monotonic()
        for job in jobs:
            if stop.wait(max(0.0, job.arrival - (time.monotonic() - began))):
                return
            seen.applied(job.name, job.gpus)
            submit(job)

    load_before = os.getloadavg()
    started = time.monotonic()
    thread = threading.Thread(target=submitter, daemon=True)
    thread.start()
    while time.monotonic() - started < seconds:
        time.sleep(SAMPLE_SECONDS)
        seen.sample()
        if len(seen.samples) % 30 == 0:
            held, waiting = seen.samples[-1][1], seen.samples[-1][2]
            print(f"  {time.monotonic() - started:5.0f} s: {held / shape.gpus:5.1%} allocated, {waiting} waiting", flush=True)  # fmt: skip
    stop.set()
    end = time.monotonic()
    seen.stop()
    bindings.stop()
    nodes = [values.Node(kwok.node_name(i), kwok.GPUS_PER_NODE, shape.labels(i)) for i in range(shape.nodes)]  # fmt: skip
    outcomes: dict[str, compare.Outcome] = {}
    for job in jobs:
        record = seen.jobs.get(job.name)
        ran = record.all_running if record is not None else None
        binding = bindings.binding(job.name)
        outcomes[job.name] = compare.Outcome(
            gpus=job.gpus,
            start_seconds=ran - record.applied if record is not None and ran is not None else None,
            bytes=compare.bound(_spec(job), nodes, binding) if binding is not None else None,
        )
    return {
        "outcomes": outcomes,
        "utilisation": compare.utilisation(seen.samples, shape.gpus, started, end),
        "minutes_above_80_percent": observe.allocated_minutes(seen.samples, shape.gpus, 0.8),
        "submitted": sum(1 for job in jobs if job.name in seen.jobs),
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }


def _spec(job: trace.Job) -> api_spec.TrainingJobSpec:
    return loading.parse_spec(job.spec(), job.name)


def same_levels(jobs: list[trace.Job], shape: kwok.Shape) -> dict[str, list[dict[str, str]]]:
    """Each job's ``spec.topology.levels`` with the constraints Kueue's side gets
    (:func:`.kueue_tas.constraints`, on the fleet's smallest domains)."""
    sizes = domain_gpus(shape)
    found = {}
    for job in jobs:
        spec = _spec(job)
        found[job.name] = kueue_tas.meshtrain_levels(spec, kueue_tas.fabric_for(spec, sizes))
    return found


def waiting_levels(levels: list[dict[str, Any]], seconds: int) -> list[dict[str, Any]]:
    """``levels`` with every preferred one holding the job ``seconds`` for one of its domains
    (``spec.topology.levels[].waitSeconds``); required levels are left as they are."""
    return [
        level if level.get("mode") == "required" else {**level, "waitSeconds": seconds}
        for level in levels
    ]


def _meshtrain(api: kubernetes.client.ApiClient, plane: Any, jobs: list[trace.Job], shape: kwok.Shape, seconds: float, workdir: pathlib.Path, levels: Mapping[str, list[dict[str, str]]]) -> dict[str, Any]:  # fmt: skip
    """Phase 1: the operator places the trace's TrainingJobs (``levels``: a job's
    ``spec.topology.levels`` where not all preferred); then every job and pod is removed."""
    custom = kubernetes.client.CustomObjectsApi(api)
    log = workdir / "operator.log"
    process, _ = bench_operator._start_operator(
        str(plane.kubeconfig_path), log, "--standalone", "--log-format", "text",
        "--resync-seconds", "300", "--progress-seconds", "3600", "--gpu-profile", "none",
        scope=(f"--namespace={trace.NAMESPACE}",),
    )  # fmt: skip
    try:

        def submit(job: trace.Job) -> None:
            custom.create_namespaced_custom_object(
                bench_operator.GROUP, bench_operator.VERSION, trace.NAMESPACE, bench_operator.PLURAL, job.manifest(levels.get(job.name))
            )  # fmt: skip

        # Ready as Kueue is when its phase starts: caches filled, the planning worker (started
        # by the first plan, seconds of imports) running; the warm-up job is gone before the trace.
        bench_operator_scale._wait_log(log, "cache of pods filled", 600)
        submit(trace.Job("warmup", 0.0, kwok.GPUS_PER_NODE, 1.0, None))
        bench_operator_scale._wait_log(log, "planning worker started", 600)
        custom.delete_namespaced_custom_object(
            bench_operator.GROUP, bench_operator.VERSION, trace.NAMESPACE, bench_operator.PLURAL, "warmup"
        )  # fmt: skip
        core = kubernetes.client.CoreV1Api(api)
        _wait_empty("the warm-up's pods", lambda: core.list_namespaced_pod(trace.NAMESPACE, limit=1).items)  # fmt: skip
        found = _drive(api, jobs, submit, shape, seconds)
        custom.delete_collection_namespaced_custom_object(
            bench_operator.GROUP, bench_operator.VERSION, trace.NAMESPACE, bench_operator.PLURAL
        )
        _wait_empty("TrainingJobs", lambda: custom.list_namespaced_custom_object(
            bench_operator.GROUP, bench_operator.VERSION, trace.NAMESPACE, bench_operator.PLURAL, limit=1
        )["items"])  # fmt: skip
    finally:
        process.terminate()
        process.wait(timeout=60)
    found["operator_log"] = str(log)
    return found


def domain_gpus(shape: kwok.Shape) -> dict[str, int]:
    """GPUs of the smallest domain of each level of ``shape`` (what a Kueue slice may count on)."""
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for index in range(shape.nodes):
        for label, value in shape.labels(index).items():
            counts[label][value] += kwok.GPUS_PER_NODE
    return {label: min(counter.values()) for label, counter in counts.items()}


def _kueue(api: kubernetes.client.ApiClient, plane: Any, jobs: list[trace.Job], shape: kwok.Shape, seconds: float, workdir: pathlib.Path) -> dict[str, Any]:  # fmt: skip
    """Phase 2: Kueue admits the trace's batch Jobs with TAS; the scheduler binds their pods."""
    sizes = domain_gpus(shape)
    specs = {job.name: _spec(job) for job in jobs}
    fabric = kueue_tas.fabric_for(specs[jobs[0].name], sizes)
    custom = kubernetes.client.CustomObjectsApi(api)
    batch = kubernetes.client.BatchV1Api(api)
    with kueue.Kueue(plane, workdir / "kueue", [], frameworks=["batch/job"]):
        for body in kueue_tas.queue_objects(
            fabric, QUEUE, trace.NAMESPACE, shape.gpus, node_labels=FLEET_NODES
        ):
            group, version = body["apiVersion"].split("/")
            if body["kind"] == "LocalQueue":
                custom.create_namespaced_custom_object(group, version, trace.NAMESPACE, "localqueues", body)  # fmt: skip
            else:
                plural = {"Topology": "topologies", "ResourceFlavor": "resourceflavors", "ClusterQueue": "clusterqueues"}[body["kind"]]  # fmt: skip
                custom.create_cluster_custom_object(group, version, plural, body)

        def submit(job: trace.Job) -> None:
            run = job.run_seconds + (job.fail_after or 0.0)  # one attempt: see the module docstring
            metadata = {
                "labels": {observe.JOB_LABEL: job.name},
                "annotations": kwok.lifecycle_annotations(run, None),
            }
            spec = specs[job.name]
            body = kueue_tas.batch_job(job.name, trace.NAMESPACE, QUEUE, spec, kueue_tas.fabric_for(spec, sizes), metadata)  # fmt: skip
            batch.create_namespaced_job(trace.NAMESPACE, body)

        found = _drive(api, jobs, submit, shape, seconds)
        found["annotations"] = {
            str(job.gpus): kueue_tas.annotations(specs[job.name], fabric) for job in jobs
        }
    return found


def _wait_empty(what: str, listed: Callable[[], list[Any]], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while listed():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} still present after {timeout:.0f} s")
        time.sleep(2)


def _clear(api: kubernetes.client.ApiClient) -> None:
    """Every pod of the trace's namespace gone (force-deleted: KWOK runs no kubelet to drain them)."""
    core = kubernetes.client.CoreV1Api(api)
    core.delete_collection_namespaced_pod(trace.NAMESPACE, grace_period_seconds=0)
    _wait_empty("pods", lambda: core.list_namespaced_pod(trace.NAMESPACE, limit=1).items)


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = kwok.Shape(
        nodes=args.nodes,
        nodes_per_rack=args.nodes_per_rack,
        racks_per_block=args.racks_per_block,
        nodes_per_clique=args.nodes_per_clique,
    )
    generated = trace.Trace(shape, seed=args.seed, wall_seconds=args.minutes * 60, compression=args.compression, load=args.load)  # fmt: skip
    jobs = list(trace.jobs(generated))
    seconds = (args.minutes + args.drain_minutes) * 60
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-headtohead-"))
    results: dict[str, Any] = {
        "trace": {
            "seed": args.seed,
            "minutes": args.minutes,
            "drain_minutes": args.drain_minutes,
            "compression": args.compression,
            "load": args.load,
            "jobs": len(jobs),
            "failing_jobs": sum(j.fail_after is not None for j in jobs),
            "meshtrain_constraints": "all preferred"
            if args.all_preferred
            else "the same as Kueue's",
            "meshtrain_wait_seconds": args.wait_seconds,
        },  # fmt: skip
        "fleet": {
            "nodes": shape.nodes,
            "gpus": shape.gpus,
            "nodes_per_rack": shape.nodes_per_rack,
            "racks_per_block": shape.racks_per_block,
            "nodes_per_clique": shape.nodes_per_clique,
        },  # fmt: skip
    }
    kwok.binary()  # fails naming `make bootstrap` before anything starts
    kueue.locate()
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        plane = stack.enter_context(
            controlplane.ControlPlane(
                with_scheduler=True,
                with_controller_manager=True,
                extra_controller_manager_args=[CONTROLLERS],
            )  # fmt: skip
        )
        api = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig_path))
        stack.callback(api.close)
        bench_operator._install(api, str(plane.kubeconfig_path), str(plane.binaries.kubectl))
        kubernetes.client.CoreV1Api(api).create_namespace({"metadata": {"name": trace.NAMESPACE}})
        stack.enter_context(kwok.Kwok(plane.kubeconfig_path, workdir))
        asyncio.run(kwok.create_nodes(plane.kubeconfig_path, shape))
        print(f"meshtrain: {len(jobs)} jobs over {args.minutes} min + {args.drain_minutes} min drain", flush=True)  # fmt: skip
        levels = {} if args.all_preferred else same_levels(jobs, shape)
        if args.wait_seconds:
            levels = {
                job.name: waiting_levels(levels.get(job.name) or job.spec()["topology"]["levels"], args.wait_seconds)
                for job in jobs
            }  # fmt: skip
        phases = {"meshtrain": _meshtrain(api, plane, jobs, shape, seconds, workdir, levels)}
        _clear(api)
        print("kueue TAS: the same jobs", flush=True)
        phases["kueue"] = _kueue(api, plane, jobs, shape, seconds, workdir)
    results["wall_seconds"] = time.monotonic() - began
    for name, phase in phases.items():
        results[name] = {key: value for key, value in phase.items() if key != "outcomes"}
    ours, theirs = phases["meshtrain"]["outcomes"], phases["kueue"]["outcomes"]
    results["by_size"] = compare.by_size(ours, theirs)
    results["jobs"] = {
        job.name: {
            "gpus": job.gpus,
            "arrival": job.arrival,
            "meshtrain": _row(ours[job.name]),
            "kueue": _row(theirs[job.name]),
        }  # fmt: skip
        for job in jobs
    }
    return results


def _row(outcome: compare.Outcome) -> dict[str, Any]:
    found: dict[str, Any] = {"start_seconds": outcome.start_seconds}
    if outcome.bytes is not None:
        found |= {f"{level}_bytes": getattr(outcome.bytes, level) for level in ("nvlink", *compare.SWITCHES)}  # fmt: skip
    return found


def _print(results: dict[str, Any]) -> None:
    print(f"{'GPUs':>5} {'jobs':>5} | {'started m/k':>11} | {'p50 start s m/k':>17} | {'cross-leaf GB m/k':>19} | {'cross-block GB m/k':>19}")  # fmt: skip
    for size, row in results["by_size"].items():
        m, k = row["meshtrain"], row["kueue"]

        def gb(entry: dict[str, Any], field: str) -> str:
            value = entry[f"{field}_bytes_per_step"]
            return "-" if value is None else f"{value / 1e9:.2f}"

        p50 = [e["start_seconds"].get("p50") for e in (m, k)]
        starts = "/".join("-" if p is None else f"{p:.1f}" for p in p50)
        print(f"{size:>5} {row['jobs']:>5} | {m['started']:>5}/{k['started']:<5} | {starts:>17} | {gb(m, 'cross_leaf'):>9}/{gb(k, 'cross_leaf'):<9} | {gb(m, 'cross_block'):>9}/{gb(k, 'cross_block'):<9}")  # fmt: skip
    for name in ("meshtrain", "kueue"):
        print(f"{name}: utilisation {results[name]['utilisation']:.1%}, {results[name]['minutes_above_80_percent']:.1f} min above 80%")  # fmt: skip


def markdown(results: dict[str, Any]) -> str:
    """docs/operator.md's comparison table of a results file (meshtrain / Kueue TAS per cell)."""
    lines = [
        "| job GPUs | jobs | bound by both | started (m / k) | time to start p50 s (m / k) | p95 s (m / k) | cross-leaf GB/step (m / k) | cross-block GB/step (m / k) | inside a leaf GB/step (m / k) |",  # fmt: skip
        "|---:|---:|---:|---|---|---|---|---|---|",
    ]

    def pair(row: dict[str, Any], read: Callable[[dict[str, Any]], Any], unit: float = 1.0) -> str:
        found = [read(row[name]) for name in ("meshtrain", "kueue")]
        return " / ".join("-" if v is None else f"{v / unit:.2f}" if unit != 1.0 else f"{v:.1f}" for v in found)  # fmt: skip

    for size, row in results["by_size"].items():
        starts = f"{row['meshtrain']['started']} / {row['kueue']['started']}"
        p50 = pair(row, lambda e: e["start_seconds"].get("p50"))
        p95 = pair(row, lambda e: e["start_seconds"].get("p95"))
        leaf_out = pair(row, lambda e: e["cross_leaf_bytes_per_step"], 1e9)
        block_out = pair(row, lambda e: e["cross_block_bytes_per_step"], 1e9)
        leaf = pair(row, lambda e: e["leaf_bytes_per_step"], 1e9)
        lines.append(f"| {size} | {row['jobs']} | {row['bound_by_both']} | {starts} | {p50} | {p95} | {leaf_out} | {block_out} | {leaf} |")  # fmt: skip
    use = " / ".join(f"{results[name]['utilisation']:.1%}" for name in ("meshtrain", "kueue"))
    lines.append(f"\nUtilisation over each phase (meshtrain / Kueue TAS): {use}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--nodes-per-rack", type=int, default=8)
    parser.add_argument("--racks-per-block", type=int, default=4)
    parser.add_argument("--nodes-per-clique", type=int, default=4)
    parser.add_argument(
        "--minutes", type=float, default=8.0, help="wall minutes of arrivals per phase"
    )
    parser.add_argument("--drain-minutes", type=float, default=2.0)
    parser.add_argument("--compression", type=float, default=60.0)
    parser.add_argument("--load", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument(
        "--all-preferred",
        action="store_true",
        help="meshtrain's jobs declare every level preferred (the runs before spec.topology's scope), "
        "not the constraints Kueue's side gets",
    )
    parser.add_argument(
        "--wait-seconds",
        type=int,
        default=0,
        help="meshtrain's preferred levels hold each job this long for one of their domains "
        "(spec.topology.levels[].waitSeconds; wall seconds, the trace's --compression times that "
        "in cluster time); Kueue's side has no such setting",
    )
    parser.add_argument(
        "--name", default="headtohead", help="results file name (<name>-<host>.json)"
    )
    parser.add_argument("--table", type=pathlib.Path, help="print docs/operator.md's table of a results file and exit")  # fmt: skip
    args = parser.parse_args(argv)
    if args.table is not None:
        print(markdown(json.loads(args.table.read_text())["results"]))
        return 0
    ran = machine.code()  # before the run: commits may land during it
    results = run(args)
    path = machine.write_results(args.name, results, ran)
    _print(results)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
