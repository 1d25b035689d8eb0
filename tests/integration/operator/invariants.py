"""What must hold at every observed moment, checked from the API server's own watch events.

:class:`Invariants` follows every pod and node and, after each event, checks:

- GPUs: on every existing node, the GPU requests of its pods that still hold
  them (bound there, or pinned there by required node affinity while gated;
  not Succeeded or Failed) stay within allocatable.  A pod of a TrainingJob
  that is added onto a node without room is a violation.  A pod of another
  owner can make a node overcommitted only by racing the operator (it was
  created bound, after the operator planned there, or just before it could
  see it): that is counted as a race, and must be resolved (the gang placed
  again) within ``grace`` seconds, else it is a violation too.
- Slots: a gang slot (job, node rank) never holds two pods that are not being
  deleted.

The node a pod is committed to is read as the scheduler reads it:
``spec.nodeName``, else the ``metadata.name`` of its required node affinity.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import kubernetes

GPU = "nvidia.com/gpu"
JOB_LABEL = "meshtrain.io/job"
RANK_LABEL = "meshtrain.io/node-rank"
RACE_WINDOW = 2.0
"""An operator pod added this soon after a foreign pod on the same node may not have seen it."""


def committed_node(pod: Any) -> str | None:
    if pod.spec.node_name:
        return pod.spec.node_name
    affinity = pod.spec.affinity and pod.spec.affinity.node_affinity
    required = affinity and affinity.required_during_scheduling_ignored_during_execution
    for term in (required.node_selector_terms if required else None) or []:
        for field in term.match_fields or []:
            if field.key == "metadata.name" and field.operator == "In" and field.values:
                return field.values[0]
    return None


def gpus(pod: Any) -> int:
    total = 0
    for container in pod.spec.containers or []:
        resources = container.resources
        amount = ((resources and resources.requests) or {}).get(GPU) or (
            (resources and resources.limits) or {}
        ).get(GPU)
        total += int(amount or 0)
    return total


class Invariants:
    """Watch threads over pods and nodes; ``violations`` and ``races`` after :meth:`stop`."""

    def __init__(self, core: kubernetes.client.CoreV1Api, grace: float = 20.0) -> None:
        self._core = core
        self._grace = grace
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pods: dict[str, tuple[str | None, int, tuple[str, str, str] | None, bool]] = {}
        """uid -> (node, gpus, slot or None, being deleted)."""
        self._allocatable: dict[str, int] = {}
        self._over_since: dict[str, float] = {}
        self._foreign_at: dict[str, float] = {}
        self.violations: list[str] = []
        self.races = 0
        self.events = 0
        self._threads = [
            threading.Thread(target=self._follow, args=(core.list_node, True), daemon=True),
            threading.Thread(
                target=self._follow, args=(core.list_pod_for_all_namespaces, False), daemon=True
            ),
        ]

    def start(self) -> Invariants:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        with self._lock:
            self._check_durations(time.monotonic())

    def _follow(self, lister: Any, nodes: bool) -> None:
        version = lister().metadata.resource_version  # from now on; the test starts empty
        watch = kubernetes.watch.Watch()
        while not self._stop.is_set():
            for event in watch.stream(lister, resource_version=version, timeout_seconds=1):
                obj = event["object"]
                version = obj.metadata.resource_version
                with self._lock:
                    self.events += 1
                    if nodes:
                        self._on_node(event["type"], obj)
                    else:
                        self._on_pod(event["type"], obj)

    def _on_node(self, type_: str, node: Any) -> None:
        name = node.metadata.name
        if type_ == "DELETED":
            self._allocatable.pop(name, None)
            self._over_since.pop(name, None)
            return
        self._allocatable[name] = int(((node.status and node.status.allocatable) or {}).get(GPU, 0))
        self._check_node(name, operator_added=False, now=time.monotonic())

    def _on_pod(self, type_: str, pod: Any) -> None:
        uid = pod.metadata.uid
        now = time.monotonic()
        old = self._pods.get(uid)
        if type_ == "DELETED" or pod.status.phase in ("Succeeded", "Failed"):
            self._pods.pop(uid, None)
            if old and old[0]:
                self._check_node(old[0], operator_added=False, now=now)
            return
        labels = pod.metadata.labels or {}
        job = labels.get(JOB_LABEL)
        slot = (pod.metadata.namespace, job, labels.get(RANK_LABEL, "")) if job else None
        node = committed_node(pod)
        deleting = pod.metadata.deletion_timestamp is not None
        self._pods[uid] = (node, gpus(pod), slot, deleting)
        if slot and not deleting:
            holders = [u for u, p in self._pods.items() if p[2] == slot and not p[3]]
            if len(holders) > 1:
                self.violations.append(f"slot {slot} held by {len(holders)} pods")
        if node:
            if not job and old is None:
                self._foreign_at[node] = now
            self._check_node(node, operator_added=bool(job) and old is None, now=now)

    def _check_node(self, node: str, *, operator_added: bool, now: float) -> None:
        if node not in self._allocatable:
            return  # deleted (or not yet seen): its pods are failed by the test's kubelet
        committed = sum(p[1] for p in self._pods.values() if p[0] == node)
        if committed <= self._allocatable[node]:
            self._over_since.pop(node, None)
            return
        raced = now - self._foreign_at.get(node, -1e9) < RACE_WINDOW
        if operator_added and not raced:
            self.violations.append(
                f"{node}: {committed} GPUs committed > {self._allocatable[node]} allocatable"
            )
        elif node not in self._over_since:
            self.races += 1
        self._over_since.setdefault(node, now)
        self._check_durations(now)

    def _check_durations(self, now: float) -> None:
        for node, since in list(self._over_since.items()):
            if now - since > self._grace:
                self.violations.append(f"{node}: overcommitted for more than {self._grace:g} s")
                del self._over_since[node]
