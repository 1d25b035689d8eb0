"""Chaos on a real control plane: 20 jobs at once, the operator SIGKILLed again and again, nodes tainted,
cordoned and deleted, foreign GPU pods and a restricted namespace, all while the jobs run.

A private kube-apiserver + etcd + kube-scheduler (no controller-manager, no
kubelet): the scheduler binds the pods, and this test plays the kubelet (a
bound pod becomes Running) and the pod garbage collector (the pods of a
deleted node fail).  :class:`invariants.Invariants` checks every pod and node
event; at the end every job must be Running or wait with a condition that
says why, and each job's ``status.restarts`` must equal the number of its
gang attempts this test broke (a Running pod failed or lost with its node), but
for the current attempt when its lost pods were replaced alone (the pod tier of
``runPolicy.recovery``: its ``status.placement`` records the replacement).
The seed is printed; a failure names it.  With ``MESHTRAIN_CHAOS_FIGURES`` set
to a path, the run's figures (faults, violations, restarts, convergence times)
are written there as JSON before the assertions; ``benchmarks/bench_operator_chaos.py``
collects them.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any, Self

import kubernetes
import pytest

from tests.builders import JobBuilder
from tests.integration.operator import invariants
from tests.integration.operator.cluster import (
    SETTLE_CALM_SECONDS,
    Cluster,
    OperatorProcess,
    settle,
)

pytestmark = pytest.mark.integration

NODES = 32
GPUS_PER_NODE = 8
JOBS = 20
KILLS = 5
SEED = int(os.environ.get("MESHTRAIN_CHAOS_SEED", time.time_ns() % 100_000))
POOL = "chaos"
SETTLE_SECONDS = 120
"""How long the jobs get to settle after the last fault."""
WAITING_REASONS = ("InsufficientGPUs", "TopologyUnsatisfiable")
FIGURES = os.environ.get("MESHTRAIN_CHAOS_FIGURES")
"""Where to write the run's figures (JSON); unset: nowhere."""


@pytest.fixture(scope="module")
def plane(control_plane_binaries) -> Iterator[Cluster]:
    with Cluster.private(control_plane_binaries) as found:
        yield found


class _Background:
    """Runs ``_run`` on a daemon thread inside a ``with`` block; ``_stop`` is set on leaving it."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        raise NotImplementedError


class Kubelet(_Background):
    """Bound pods of existing nodes become Running, deleted ones go; the pods of a deleted node fail."""

    def __init__(
        self, cluster: Cluster, namespace: str | None = None, ip: str | None = None
    ) -> None:
        self._cluster = cluster
        self._namespace = namespace
        """Only this namespace's pods (None: every namespace)."""
        self._ip = ip
        """Pod IP a Running pod reports (a test's progress server), None: none."""
        self.gone: set[str] = set()
        super().__init__()

    def _run(self) -> None:
        core = self._cluster.core
        scope: tuple[Any, ...] = (
            (core.list_namespaced_pod, self._namespace)
            if self._namespace
            else (core.list_pod_for_all_namespaces,)
        )
        version = scope[0](*scope[1:]).metadata.resource_version
        watch = kubernetes.watch.Watch()
        while not self._stop.is_set():
            for event in watch.stream(*scope, resource_version=version, timeout_seconds=1):
                pod = event["object"]
                version = pod.metadata.resource_version
                node = pod.spec.node_name
                if event["type"] != "DELETED" and node and pod.metadata.deletion_timestamp:
                    self._finish(pod)  # the containers stopped: the kubelet confirms the deletion
                    continue
                if (
                    event["type"] != "DELETED"
                    and node
                    and node not in self.gone
                    and pod.status.phase == "Pending"
                    and not pod.metadata.deletion_timestamp
                ):
                    try:
                        self._cluster.set_pod_phase(
                            pod.metadata.namespace, pod.metadata.name, "Running", ip=self._ip
                        )
                    except kubernetes.client.ApiException:
                        pass  # deleted meanwhile

    def _finish(self, pod: Any) -> None:
        try:
            # That very pod (UID): a gang rebuilt without a restart reuses its pods' names.
            self._cluster.core.delete_namespaced_pod(
                pod.metadata.name,
                pod.metadata.namespace,
                body=kubernetes.client.V1DeleteOptions(
                    grace_period_seconds=0,
                    preconditions=kubernetes.client.V1Preconditions(uid=pod.metadata.uid),
                ),
            )
        except kubernetes.client.ApiException:
            pass  # already gone

    def lose(self, node: str) -> list[Any]:
        """The node is gone: its pods fail (what the pod GC's deletion means to the operator)."""
        self.gone.add(node)
        core = self._cluster.core
        lost = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items
        for pod in lost:
            try:
                core.patch_namespaced_pod_status(
                    pod.metadata.name,
                    pod.metadata.namespace,
                    {"status": {"phase": "Failed", "reason": "NodeLost", "message": "node gone"}},
                )
            except kubernetes.client.ApiException:
                pass
        return lost


def _jobs(rng: random.Random, namespace: str) -> list[JobBuilder]:
    """Mixed sizes: 1-8 GPUs per pod, 1-8 pods; about 1.2x the cluster's GPUs in all."""
    made = []
    for index in range(JOBS):
        per_node = rng.choice((1, 2, 4, 8))
        pods = rng.choice((1, 2, 2, 4, 4, 8))
        made.append(
            JobBuilder(f"j{index:02d}", namespace, POOL)
            .layout(data=pods * per_node)
            .gpus(per_node)
            .run_policy(backoffLimit=20, startupTimeoutSeconds=600)
        )
    return made


class Chaos:
    """The faults, each a method that returns False when it cannot act yet (tried again later)."""

    def __init__(
        self,
        cluster: Cluster,
        rng: random.Random,
        operator: OperatorProcess,
        kubelet: Kubelet,
        namespace: str,
        nodes: list[str],
    ) -> None:
        self.cluster, self.rng, self.operator, self.kubelet = cluster, rng, operator, kubelet
        self.namespace = namespace
        self.restricted = f"{namespace}-restricted"
        self.nodes = nodes
        self.faults: list[str] = []
        self.broken: set[tuple[str, str, str]] = set()
        """(namespace, job, attempt) of every gang attempt broken while it ran."""

    def kill(self) -> bool:
        self.operator.kill()
        time.sleep(self.rng.uniform(0.0, 1.0))
        self.operator.start()
        self.faults.append("SIGKILL operator")
        return True

    def taint(self) -> bool:
        node = self.rng.choice(self.nodes)
        taint = {"key": "chaos", "effect": "NoSchedule"}
        self.cluster.core.patch_node(node, {"spec": {"taints": [taint]}})
        self.faults.append(f"taint {node}")
        return True

    def cordon(self) -> bool:
        node = self.rng.choice(self.nodes)
        self.cluster.core.patch_node(node, {"spec": {"unschedulable": True}})
        self.faults.append(f"cordon {node}")
        return True

    def _break(self, pod: Any, *, bound: bool = False) -> None:
        """Count the pod's gang attempt as broken: it was Running (or, with ``bound``, bound at all:
        a released gang's pod the node took with it fails its attempt even before it ran)."""
        labels = pod.metadata.labels or {}
        live = pod.status.phase == "Running" or (
            bound
            and pod.spec.node_name
            and not pod.metadata.deletion_timestamp
            and pod.status.phase not in ("Succeeded", "Failed")
        )
        if "meshtrain.io/job" in labels and live:
            job = labels["meshtrain.io/job"]
            self.broken.add((pod.metadata.namespace, job, labels["meshtrain.io/attempt"]))

    def delete_node(self) -> bool:
        node = self.rng.choice(self.nodes)
        self.nodes.remove(node)
        self.cluster.core.delete_node(node)
        for pod in self.kubelet.lose(node):
            self._break(pod, bound=True)
        self.faults.append(f"delete node {node}")
        return True

    def foreign(self) -> bool:
        """A pod of another owner takes every free GPU of the node with the most free.

        On a full cluster, a node joins the pool and another tenant's pod takes part of it the
        moment it is schedulable (the node is held by a taint until the pod is bound), so the
        fault is always possible and still takes GPUs the operator could otherwise have used.
        """
        core = self.cluster.core
        committed: dict[str, int] = {}
        for pod in core.list_pod_for_all_namespaces().items:
            node = invariants.committed_node(pod)
            if node and pod.status.phase not in ("Succeeded", "Failed"):
                committed[node] = committed.get(node, 0) + invariants.gpus(pod)
        free = {n: GPUS_PER_NODE - committed.get(n, 0) for n in self.nodes}
        node = max(free, key=lambda n: (free[n], self.rng.random()))
        joining = free[node] <= 0
        if joining:
            hold = {"key": "chaos-joining", "effect": "NoSchedule"}
            node = self.cluster.add_node(POOL, gpus=GPUS_PER_NODE, taints=[hold])
            self.nodes.append(node)
            free[node] = self.rng.randint(1, GPUS_PER_NODE)
        self._bind_foreign(node, free[node])
        if joining:
            core.patch_node(node, {"spec": {"taints": []}})
        self.faults.append(
            f"foreign pod with {free[node]} GPU(s) on {'new node ' if joining else ''}{node}"
        )
        return True

    def _bind_foreign(self, node: str, gpus: int) -> None:
        container = {
            "name": "c",
            "image": "pause",
            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
        }
        self.cluster.core.create_namespaced_pod(
            "default",
            {
                "metadata": {"generateName": "foreign-"},
                "spec": {"nodeName": node, "containers": [container]},
            },
        )

    def restricted_namespace(self) -> bool:
        labels = {"pod-security.kubernetes.io/enforce": "restricted"}
        self.cluster.core.create_namespace(
            {"metadata": {"name": self.restricted, "labels": labels}}
        )
        self.cluster.apply(JobBuilder("strict", self.restricted, POOL).layout(data=2).gpus(1))
        self.faults.append(f"restricted namespace {self.restricted} with a job")
        return True

    def fail_pod(self) -> bool:
        running = [
            p
            for p in self.cluster.pods(self.namespace)
            if p.status.phase == "Running" and not p.metadata.deletion_timestamp
        ]
        if not running:
            return False
        pod = self.rng.choice(running)
        self._break(pod)
        self.cluster.set_pod_phase(self.namespace, pod.metadata.name, "Failed", exit_code=1)
        self.faults.append(f"pod {pod.metadata.name} failed")
        return True

    def run(self, plan: list[str]) -> None:
        """Each fault of ``plan`` at a random moment; one that cannot act yet goes to the back."""
        tries = 0
        while plan and tries < 4 * len(plan) + 20:
            tries += 1
            time.sleep(self.rng.uniform(0.5, 3.0))
            action = plan.pop(0)
            if not getattr(self, action)():
                plan.append(action)
        assert not plan, f"faults never possible: {plan}"


def _settled(cluster: Cluster, jobs: list[tuple[str, str]]) -> list[str]:
    """Jobs neither Running nor waiting with a reason (empty when all have settled)."""
    unsettled = []
    for namespace, name in jobs:
        status = cluster.status(namespace, name)
        placed = cluster.condition(namespace, name, "Placed")
        waiting = (
            status.get("phase") in ("Pending", "Restarting")
            and placed.get("status") == "False"
            and placed.get("reason") in WAITING_REASONS
            and placed.get("message")
        )
        if status.get("phase") != "Running" and not waiting:
            unsettled.append(f"{namespace}/{name}: {status.get('phase')} {placed.get('reason')}")
    return unsettled


class Phases(_Background):
    """Polls the jobs' phases every second: when each first ran, and when each last changed."""

    def __init__(self, cluster: Cluster, namespaces: tuple[str, ...]) -> None:
        self._cluster, self._namespaces = cluster, namespaces
        self.started = time.monotonic()
        self.first_running: dict[str, float] = {}
        """Job -> seconds after the start when it was first seen Running."""
        self._seen: dict[str, str] = {}
        super().__init__()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for namespace in self._namespaces:
                try:
                    found = self._cluster.custom.list_namespaced_custom_object(
                        "meshtrain.io", "v1alpha1", namespace, "trainingjobs"
                    )["items"]
                except kubernetes.client.ApiException:
                    continue  # the restricted namespace is not there yet
                for job in found:
                    key = f"{namespace}/{job['metadata']['name']}"
                    phase = (job.get("status") or {}).get("phase", "")
                    if phase == "Running":
                        self.first_running.setdefault(key, time.monotonic() - self.started)


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {
        "median": round(ordered[len(ordered) // 2], 1),
        "max": round(ordered[-1], 1),
        "count": len(ordered),
    }


def test_jobs_converge_through_operator_kills_and_node_faults(plane, tmp_path):
    rng = random.Random(SEED)
    namespace = f"chaos-{SEED}"
    plane.core.create_namespace({"metadata": {"name": namespace}})
    nodes = [plane.add_node(POOL, gpus=GPUS_PER_NODE, name=f"c{i:02d}") for i in range(NODES)]
    operator = OperatorProcess(plane.kubeconfig, str(tmp_path / "operator.log"))
    watched = invariants.Invariants(plane.core).start()
    try:
        with (
            Kubelet(plane) as kubelet,
            Phases(plane, (namespace, f"{namespace}-restricted")) as phases,
        ):
            operator.start()
            phases.started = time.monotonic()
            for job in _jobs(rng, namespace):
                plane.apply(job)
            chaos = Chaos(plane, rng, operator, kubelet, namespace, nodes)
            plan = ["kill"] * KILLS + ["taint", "cordon", "delete_node", "restricted_namespace"]
            plan += ["foreign"] * 3 + ["fail_pod"] * 2
            rng.shuffle(plan)
            chaos.run(plan)
            faults_over = time.monotonic()
            jobs = [(namespace, f"j{i:02d}") for i in range(JOBS)] + [(chaos.restricted, "strict")]
            unsettled = settle(lambda: _settled(plane, jobs), SETTLE_SECONDS)
            # calm that long, a late second count of a restart would have shown
            settled_after = time.monotonic() - faults_over - SETTLE_CALM_SECONDS
            faults_seconds = faults_over - phases.started
    finally:
        operator.stop()
        watched.stop()

    faults, broken = chaos.faults, chaos.broken
    restarts = {(ns, name): plane.status(ns, name).get("restarts", 0) for ns, name in jobs}
    # Each broken attempt ends in a gang restart, so attempts 0 .. restarts-1 are the broken ones,
    # but the current attempt may be broken and run on: its lost pods were replaced alone (the pod
    # tier of runPolicy.recovery), which its placement records.
    expected = {
        key: sum(1 for b in broken if b[:2] == key and int(b[2]) < restarts[key])
        for key in restarts
    }
    unhealed = [
        b for b in sorted(broken) if int(b[2]) == restarts[b[:2]] and not _replaced(plane, *b[:2])
    ]
    kills = sum(1 for f in faults if f.startswith("SIGKILL"))
    print(
        f"chaos seed {SEED}: {len(jobs)} jobs, {kills} operator kills, "
        f"{len(faults) - kills} other faults ({'; '.join(f for f in faults if not f.startswith('SIGKILL'))}), "
        f"{sum(restarts.values())} restarts for {len(broken)} broken attempts, "
        f"{watched.events} events checked, {watched.races} foreign-pod races, "
        f"{len(watched.violations)} violations"
    )
    if FIGURES:
        figures = {
            "seed": SEED,
            "nodes": NODES,
            "jobs": len(jobs),
            "operator_kills": kills,
            "other_faults": [f for f in faults if not f.startswith("SIGKILL")],
            "faults_phase_seconds": round(faults_seconds, 1),
            "events_checked": watched.events,
            "foreign_pod_races": watched.races,
            "violations": len(watched.violations),
            "violation_examples": [str(v) for v in watched.violations[:5]],
            "broken_attempts": len(broken),
            "restarts_counted": sum(restarts.values()),
            "restarts_equal_broken_attempts_per_job": restarts == expected and not unhealed,
            "unsettled": unsettled,
            "settled_seconds_after_last_fault": None if unsettled else round(settled_after, 1),
            "first_running_seconds_after_apply": _spread(list(phases.first_running.values())),
            "jobs_never_running": sorted(
                f"{ns}/{name}" for ns, name in jobs if f"{ns}/{name}" not in phases.first_running
            ),
        }
        with open(FIGURES, "w") as out:
            json.dump(figures, out, indent=2)
    assert kills >= KILLS
    assert watched.violations == [], f"seed {SEED}: {watched.violations}"
    assert unsettled == [], f"seed {SEED}: {unsettled}"
    assert restarts == expected, f"seed {SEED}: restarts {restarts} != broken attempts {expected}"
    assert unhealed == [], f"seed {SEED}: broken, neither restarted nor replaced: {unhealed}"


def _replaced(cluster: Cluster, namespace: str, name: str) -> bool:
    """Whether a pod of the job's current gang attempt was replaced alone."""
    placement = cluster.status(namespace, name).get("placement") or []
    return any(entry.get("replaced") for entry in placement)
