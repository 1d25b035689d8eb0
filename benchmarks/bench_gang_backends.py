"""Gangs half-bound under churn, with each gang backend and without (issue #36 item 6).

One private control plane with the native Workload API on (kube-scheduler with ``GangScheduling``)
and scheduler-plugins' scheduler beside it (``sandbox.controlplane.coscheduling``).  For each
backend — ``none``, ``native``, ``coscheduling`` — an operator process (``--gang-backend`` from its
env, as the chart sets it) watches a namespace of its own with a node pool of its own, a stand-in
kubelet runs what binds there, and the same seeded trace is replayed:

* TrainingJobs of 1-4 pods of 8 GPUs arrive; each is deleted ``duration`` seconds after its whole
  gang is bound (or at the end);
* other tenants' pods (8 GPUs each, no meshtrain label, ``default-scheduler``) arrive faster and
  leave after a few seconds.  They race the operator's plans: kube-scheduler does not count gated
  pods, so a foreign pod can take a planned node before the gang's gates are lifted;
* with ``--race P``, for a share P of the gangs a pod bound by ``nodeName`` (a DaemonSet's or a
  static pod's: no scheduler) takes one of its planned nodes the moment its gates are lifted, and
  leaves after 5-20 s: the window a gang scheduler closes and the operator's check cannot.

A sampler lists the namespace's pods every ``--sample`` seconds: a gang (job, attempt) with some
pods bound and some not is partial; one partial for ``--stuck-after`` seconds in a row (binding a
whole gang takes a moment with every backend) is half-bound, and its bound pods' GPUs over that
episode are GPU-seconds held by a partial gang.  It also counts node-seconds over-committed (bound requests above allocatable: two
schedulers binding onto one node from different caches).  Gangs bound are the gangs seen whole.

Run: ``python benchmarks/bench_gang_backends.py [--seconds 150 --nodes 10]``; needs the full
bootstrap (scheduler-plugins).  Results: ``benchmarks/results/gang_backends-<host>.json``
(``gang_backends_race<percent>-<host>.json`` with ``--race``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import pathlib
import random
import sys
import tempfile
import threading
import time
from typing import Any

import kubernetes

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import machine
from meshtrain.sandbox.controlplane import binaries, coscheduling
from tests.builders import POOL_LABEL, JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess
from tests.integration.operator.test_operator_chaos import Kubelet

BACKENDS = ("none", "native", "coscheduling")
GPUS = 8
"""GPUs per node, per gang pod and per foreign pod."""


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One event of the trace."""

    at: float
    """Seconds after the run's start."""
    kind: str
    """``job`` or ``foreign``."""
    pods: int
    """Pods of 8 GPUs (a job's gang size; 1 for a foreign pod)."""
    stays: float
    """A job's seconds once bound whole; a foreign pod's lifetime."""


def trace(seed: int, seconds: float, job_every: float, foreign_every: float) -> list[Arrival]:
    """Poisson arrivals of jobs (1-4 pods, 5-20 s once bound) and foreign pods (2-8 s), by time."""
    rng = random.Random(seed)
    events: list[Arrival] = []
    for kind, every in (("job", job_every), ("foreign", foreign_every)):
        at = rng.expovariate(1 / every)
        while at < seconds:
            if kind == "job":
                events.append(Arrival(at, kind, rng.randint(1, 4), rng.uniform(5, 20)))
            else:
                events.append(Arrival(at, kind, 1, rng.uniform(2, 8)))
            at += rng.expovariate(1 / every)
    return sorted(events, key=lambda e: e.at)


class Sampler(threading.Thread):
    """Samples the namespace's pods: partial gangs, their GPU-seconds, over-committed nodes."""

    def __init__(
        self, cluster: Cluster, namespace: str, sizes: dict[str, int], args: argparse.Namespace
    ) -> None:
        super().__init__(daemon=True)
        self.cluster, self.namespace, self.sizes = cluster, namespace, sizes
        self.every, self.stuck_after = args.sample, args.stuck_after
        self.stop = threading.Event()
        self.transient: set[tuple[str, str]] = set()
        """Gangs (job, attempt) seen partly bound in any sample (binding a gang takes a moment)."""
        self.partial: set[tuple[str, str]] = set()
        """Gangs partly bound for ``stuck_after`` seconds or more in a row: half-bound."""
        self.episodes: dict[tuple[str, str], tuple[float, float]] = {}
        """Open partial episodes: (start, GPU-seconds so far)."""
        self.whole: dict[str, float] = {}
        """Jobs whose gang was seen bound whole, and when (monotonic)."""
        self.partial_gpu_seconds = 0.0
        """GPU-seconds bound pods of half-bound gangs held (episodes of ``stuck_after`` or more)."""
        self.longest = 0.0
        self.overcommitted_node_seconds = 0.0
        self.samples = 0
        self.deleted: set[str] = set()
        """Jobs the run deleted: their gangs are torn down, not half bound."""

    def close(self, key: tuple[str, str], now: float) -> None:
        """End ``key``'s partial episode: counted when it lasted ``stuck_after`` or more."""
        start, held = self.episodes.pop(key)
        if now - start >= self.stuck_after:
            self.partial.add(key)
            self.partial_gpu_seconds += held
            self.longest = max(self.longest, now - start)

    def _settled(self, gangs: dict[tuple[str, str], list[Any]]) -> set[tuple[str, str]]:
        """Gangs now bound whole or not at all."""
        settled = set()
        for key, members in gangs.items():
            bound = sum(1 for p in members if p.spec.node_name)
            if bound == 0 or bound >= self.sizes.get(key[0], len(members)):
                settled.add(key)
        return settled

    def run(self) -> None:
        last = time.monotonic()
        while not self.stop.is_set():
            pods = self.cluster.core.list_namespaced_pod(self.namespace).items
            now = time.monotonic()
            self.sample(pods, now - last, now)
            last = now
            self.stop.wait(self.every)
        for key in list(self.episodes):
            self.close(key, time.monotonic())

    def sample(self, pods: list[Any], dt: float, now: float) -> None:
        self.samples += 1
        gangs: dict[tuple[str, str], list[Any]] = collections.defaultdict(list)
        per_node: dict[str, int] = collections.defaultdict(int)
        for pod in pods:
            labels = pod.metadata.labels or {}
            live = pod.status.phase not in ("Succeeded", "Failed")
            if pod.spec.node_name and live and labels.get("bench") != "race":
                per_node[pod.spec.node_name] += GPUS
            job = labels.get("meshtrain.io/job")
            member = job and job not in self.deleted and "meshtrain.io/spare" not in labels
            if member and live and not pod.metadata.deletion_timestamp:
                gangs[(job, labels.get("meshtrain.io/attempt", ""))].append(pod)
        for key, members in gangs.items():
            bound = sum(1 for p in members if p.spec.node_name)
            size = self.sizes.get(key[0], len(members))
            if 0 < bound < size:
                self.transient.add(key)
                start, held = self.episodes.get(key, (now, 0.0))
                self.episodes[key] = (start, held + bound * GPUS * dt)
            elif bound >= size:
                self.whole.setdefault(key[0], now)
        for key in [k for k in self.episodes if k not in gangs or k in self._settled(gangs)]:
            self.close(key, now)
        self.overcommitted_node_seconds += dt * sum(1 for n in per_node.values() if n > GPUS)


class Racer(threading.Thread):
    """Another tenant's pods bound by ``nodeName`` (a DaemonSet's, a static pod's: no scheduler
    involved) that take one planned node of a gang the moment its gates are lifted, for a share
    ``--race`` of the gangs: the window the operator's own check cannot close, under churn."""

    def __init__(self, cluster: Cluster, namespace: str, args: argparse.Namespace) -> None:
        super().__init__(daemon=True)
        self.cluster, self.namespace = cluster, namespace
        self.rng = random.Random(args.seed + 1)
        self.share = args.race
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.leaving: list[tuple[float, str]] = []
        """(monotonic time to delete, pod) of each pod it created."""
        self.seen: set[tuple[str, str]] = set()
        self.raced = 0

    def run(self) -> None:
        core = self.cluster.core
        version = core.list_namespaced_pod(self.namespace).metadata.resource_version
        watch = kubernetes.watch.Watch()
        while not self.stop.is_set():
            try:
                for event in watch.stream(
                    core.list_namespaced_pod,
                    self.namespace,
                    resource_version=version,
                    timeout_seconds=1,
                ):
                    pod = event["object"]
                    version = pod.metadata.resource_version
                    self._maybe_race(pod)
            except kubernetes.client.ApiException as err:
                if err.status != 410:
                    raise
                version = core.list_namespaced_pod(self.namespace).metadata.resource_version

    def _maybe_race(self, pod: Any) -> None:
        labels = pod.metadata.labels or {}
        node = (pod.metadata.annotations or {}).get("meshtrain.io/planned-node")
        job = labels.get("meshtrain.io/job")
        if not job or not node or "meshtrain.io/spare" in labels or pod.spec.node_name:
            return
        if pod.spec.scheduling_gates or pod.metadata.deletion_timestamp:
            return
        key = (job, labels.get("meshtrain.io/attempt", ""))
        if key in self.seen:
            return
        self.seen.add(key)
        if self.rng.random() >= self.share:
            return
        self.raced += 1
        name = f"race-{self.raced}"
        body = {
            "metadata": {"name": name, "labels": {"bench": "race"}},
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": 0,
                "containers": [
                    {
                        "name": "c",
                        "image": "pause",
                        "resources": {"limits": {"nvidia.com/gpu": str(GPUS)}},
                    }
                ],
            },
        }
        _tolerant(self.cluster.core.create_namespaced_pod, self.namespace, body, ok=409)
        with self.lock:
            self.leaving.append((time.monotonic() + self.rng.uniform(5, 20), name))

    def due(self) -> list[str]:
        """Its pods whose time is up (removed from the list)."""
        now = time.monotonic()
        with self.lock:
            gone = [name for when, name in self.leaving if when <= now]
            self.leaving = [(when, name) for when, name in self.leaving if when > now]
        return gone


def _tolerant(call: Any, *args: Any, ok: int) -> None:
    """``call(*args)``; the status ``ok`` is an answer (a create retried under load that already
    landed: 409; a delete of what is gone: 404)."""
    try:
        call(*args)
    except kubernetes.client.ApiException as err:
        if err.status != ok:
            raise


def _create_foreign(cluster: Cluster, namespace: str, pool: str, name: str) -> None:
    cluster.core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": name, "labels": {"bench": "foreign"}},
            "spec": {
                "nodeSelector": {POOL_LABEL: pool},
                "terminationGracePeriodSeconds": 0,
                "containers": [
                    {
                        "name": "c",
                        "image": "pause",
                        "resources": {"limits": {"nvidia.com/gpu": str(GPUS)}},
                    }
                ],
            },
        },
    )


def replay(
    cluster: Cluster, backend: str, events: list[Arrival], args: argparse.Namespace, logs: Any
) -> dict[str, Any]:
    """One backend's run of the trace in a namespace and node pool of its own."""
    namespace = pool = f"gb-{backend}"
    cluster.core.create_namespace({"metadata": {"name": namespace}})
    for index in range(args.nodes):
        cluster.add_node(pool, gpus=GPUS, name=f"{pool}-{index}")
    env = {"MESHTRAIN_GANG_BACKEND": backend, "MESHTRAIN_GANG_SCHEDULE_TIMEOUT_SECONDS": "10"}
    operator = OperatorProcess(
        cluster.kubeconfig,
        str(logs / f"operator-{backend}.log"),
        ("--namespace", namespace),
        env=env,
    )
    sizes: dict[str, int] = {}
    sampler = Sampler(cluster, namespace, sizes, args)
    racer = Racer(cluster, namespace, args)
    leaving: list[tuple[float, str, str]] = []  # (when, kind, name)
    stays: dict[str, float] = {}
    with Kubelet(cluster, namespace=namespace):
        operator.start()
        sampler.start()
        if args.race > 0:
            racer.start()
        start = time.monotonic()
        pending = list(events)
        try:
            while time.monotonic() - start < args.seconds + 5:
                now = time.monotonic() - start
                while pending and pending[0].at <= now:
                    event = pending.pop(0)
                    name = f"{event.kind}-{int(event.at * 1000)}"
                    if event.kind == "job":
                        sizes[name] = event.pods
                        stays[name] = event.stays
                        job = JobBuilder(name, namespace, pool).layout(data=GPUS * event.pods)
                        _tolerant(cluster.apply, job.gpus(GPUS), ok=409)
                    else:
                        _tolerant(_create_foreign, cluster, namespace, pool, name, ok=409)
                        leaving.append((now + event.stays, "foreign", name))
                for job, seen in list(sampler.whole.items()):
                    if job in stays:
                        leaving.append((seen - start + stays.pop(job), "job", job))
                leaving += [(now, "foreign", name) for name in racer.due()]
                for item in [i for i in leaving if i[0] <= now]:
                    leaving.remove(item)
                    if item[1] == "job":
                        sampler.deleted.add(item[2])
                        _tolerant(cluster.delete_job, namespace, item[2], ok=404)
                    else:
                        delete = functools.partial(
                            cluster.core.delete_namespaced_pod, grace_period_seconds=0
                        )
                        _tolerant(delete, item[2], namespace, ok=404)
                time.sleep(0.1)
        finally:
            racer.stop.set()
            sampler.stop.set()
            sampler.join(timeout=30)
            operator.stop()
    return {
        "backend": backend,
        "load_average_at_end": [round(x, 1) for x in os.getloadavg()],
        "jobs_arrived": len(sizes),
        "gangs_raced": racer.raced,
        "gangs_bound_whole": len(sampler.whole),
        "gangs_ever_half_bound": len(sampler.partial),
        "gangs_seen_partly_bound_in_one_sample": len(sampler.transient),
        "gpu_seconds_held_by_partial_gangs": round(sampler.partial_gpu_seconds, 1),
        "longest_partial_seconds": round(sampler.longest, 1),
        "overcommitted_node_seconds": round(sampler.overcommitted_node_seconds, 1),
        "samples": sampler.samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="trace length per backend")
    parser.add_argument("--nodes", type=int, default=10, help="nodes of 8 GPUs per backend")
    parser.add_argument("--job-every", type=float, default=4.0, help="mean seconds between jobs")
    parser.add_argument(
        "--foreign-every", type=float, default=1.5, help="mean s between foreign pods"
    )
    parser.add_argument("--sample", type=float, default=0.25, help="sampling interval, seconds")
    parser.add_argument(
        "--stuck-after",
        type=float,
        default=1.0,
        help="a gang partly bound this many seconds in a row is half-bound (binding takes a moment)",
    )
    parser.add_argument(
        "--race",
        type=float,
        default=0.0,
        help="share of gangs one of whose planned nodes a node-bound foreign pod takes the moment "
        "its gates are lifted (0: churn alone)",
    )
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args(argv)
    events = trace(args.seed, args.seconds, args.job_every, args.foreign_every)
    found = binaries.locate()
    coscheduling.locate()
    runs = []
    logs = pathlib.Path(tempfile.mkdtemp(prefix="bench-gang-"))
    with (
        Cluster.private(found, gang_api=True) as cluster,
        coscheduling.SecondScheduler(
            pathlib.Path(cluster.kubeconfig), found.kubectl, logs / "second"
        ),
    ):
        for backend in args.backends.split(","):
            result = replay(cluster, backend, events, args, logs)
            print(result, flush=True)
            runs.append(result)
    path = machine.write_results(
        f"gang_backends_race{round(args.race * 100)}" if args.race > 0 else "gang_backends",
        {
            "command": "python benchmarks/bench_gang_backends.py " + " ".join(argv or sys.argv[1:]),
            "settings": vars(args),
            "trace": {
                "jobs": sum(1 for e in events if e.kind == "job"),
                "foreign_pods": sum(1 for e in events if e.kind == "foreign"),
            },
            "runs": runs,
            "logs": str(logs),
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
