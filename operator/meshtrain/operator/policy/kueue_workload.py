"""A job's Kueue Workload as values: built from the job, read as Kueue's answer, patched.

A job labelled ``kueue.x-k8s.io/queue-name`` is one Workload (one pod set: the gang) that
meshtrain creates and owns, as Kueue expects of an external framework; Kueue decides when the
gang may hold its GPUs, meshtrain where.  What to do with the answer (:class:`Gate`) is
``kueue``'s; the reads and writes are ``cluster.workloads``'.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import (
    builders,
    conditions,
    identity,
    kueue_topology,
    naming,
    node_affinity,
    replacement,
)

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
GROUP, VERSION, PLURAL = "kueue.x-k8s.io", "v1beta2", "workloads"
API_VERSION = f"{GROUP}/{VERSION}"
POD_SET = "trainers"
EXTERNAL_FRAMEWORK = f"{api_spec.KIND}.{api_spec.API_VERSION}.{api_spec.API_GROUP}"
"""How Kueue's integrations.externalFrameworks names TrainingJob."""
# Kueue's condition types and the reasons meshtrain reports (pkg apis/kueue/v1beta2).
QUOTA_RESERVED, ADMITTED, EVICTED, FINISHED, REQUEUED, PODS_READY = (
    "QuotaReserved",
    "Admitted",
    "Evicted",
    "Finished",
    "Requeued",
    "PodsReady",
)
# PodsReady reasons, as Kueue's own job reconciler writes them (waitForPodsReady reads them).
STARTED, RECOVERED, WAIT_FOR_START, WAIT_FOR_RECOVERY = (
    "Started",
    "Recovered",
    "WaitForStart",
    "WaitForRecovery",
)
NOT_STARTED = "Not all pods of the gang are running"
PRIORITY_CLASS_NOT_FOUND = "WorkloadPriorityClassNotFound"
POD_PRIORITY_CLASS_NOT_FOUND = "PriorityClassNotFound"
NAME_TAKEN = "WorkloadNameTaken"
INVALID_QUEUE_NAME = "InvalidQueueName"
WORKLOAD_REJECTED = "WorkloadRejected"
WARNING_REASONS = (
    INVALID_QUEUE_NAME,
    WORKLOAD_REJECTED,
    "Inadmissible",
    PRIORITY_CLASS_NOT_FOUND,
    POD_PRIORITY_CLASS_NOT_FOUND,
    NAME_TAKEN,
)
"""Kueue cannot admit the workload as it stands (e.g. its LocalQueue does not exist): the user must act."""
REQUEUED_REASONS = ("Preempted", "NodeFailures")
"""Eviction reasons after which Kueue queues the workload again (the rest wait for the user)."""


@dataclasses.dataclass(frozen=True)
class Queue:
    """Where a job is queued."""

    name: str
    """The LocalQueue in the job's namespace."""
    priority_class: str | None
    """A WorkloadPriorityClass (label kueue.x-k8s.io/priority-class), or None."""


def queue_of(labels: Mapping[str, str] | None) -> Queue | None:
    """The queue a job's labels name, or None when Kueue is not asked to admit it."""
    labels = labels or {}
    name = labels.get(QUEUE_LABEL)
    return Queue(name, labels.get(PRIORITY_CLASS_LABEL)) if name else None


DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""A LocalQueue name (an object name): lower-case alphanumerics, '-' and '.', at most 253."""


def invalid_queue_name(queue: Queue) -> Waiting | None:
    """Why the label cannot name a LocalQueue (Kueue would refuse the Workload), or None."""
    if len(queue.name) <= 253 and DNS_1123_SUBDOMAIN.fullmatch(queue.name):
        return None
    return Waiting(
        INVALID_QUEUE_NAME,
        f'metadata.labels["{QUEUE_LABEL}"]={queue.name!r} cannot name a LocalQueue: a LocalQueue '
        "name is an RFC 1123 subdomain (lower-case letters, digits, '-' and '.', starting and "
        "ending alphanumeric); set the label to the LocalQueue's name",
    )


def workload_rejected(status: int, answer: str) -> str:
    """The Queued message when the API server refuses the Workload (Kueue's webhook, no Kueue...)."""
    return (
        f"the API server refused the job's Kueue Workload ({status}): {answer}; check that Kueue "
        "v0.15.0 or later (serving kueue.x-k8s.io/v1beta2) is installed and the LocalQueue named "
        f'by metadata.labels["{QUEUE_LABEL}"] exists; trying again with backoff'
    )


def workload_name(job: str) -> str:
    return f"trainingjob-{job}"


POD_PRIORITY_GROUP, POD_PRIORITY_KIND = "scheduling.k8s.io", "PriorityClass"
WORKLOAD_PRIORITY_KIND = "WorkloadPriorityClass"


@dataclasses.dataclass(frozen=True)
class Priority:
    """A Workload's priority, and the class it comes from (Kueue's ``priorityClassRef``)."""

    value: int
    ref: tuple[str, str, str] | None = None
    """(group, kind, name) of the class; None: no class names it (Kueue's default priority, 0)."""


def workload_priority(name: str, value: int) -> Priority:
    return Priority(value, (GROUP, WORKLOAD_PRIORITY_KIND, name))


def pod_priority(name: str, value: int) -> Priority:
    return Priority(value, (POD_PRIORITY_GROUP, POD_PRIORITY_KIND, name))


def default_priority(priority_classes: Sequence[Mapping[str, Any]]) -> Priority:
    """The priority of pods that name no PriorityClass, as Kueue derives it for its integrations.

    The globalDefault PriorityClass (the lowest, should several claim it), else 0 without a class.
    """
    defaults = [c for c in priority_classes if c.get("globalDefault")]
    if not defaults:
        return Priority(0)
    lowest = min(defaults, key=lambda c: int(c.get("value") or 0))
    return pod_priority(lowest["metadata"]["name"], int(lowest.get("value") or 0))


def _requests_only(container: Mapping[str, Any]) -> dict[str, Any]:
    """A container as Kueue counts it: its requests (a limit alone requests the limit) and whether
    it is a sidecar."""
    resources = container.get("resources") or {}
    requests = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    counted: dict[str, Any] = {"name": container["name"], "resources": {"requests": requests}}
    if container.get("restartPolicy"):
        counted["restartPolicy"] = container["restartPolicy"]
    return counted


def spare_pods(spec: api_spec.TrainingJobSpec) -> int:
    """Spare pods the job holds while it runs (none for a gang that cannot rejoin)."""
    return spec.run_policy.recovery.spare_nodes if replacement.rejoins(spec) else 0


def build_workload(
    job: identity.JobRef,
    spec: api_spec.TrainingJobSpec,
    queue: Queue,
    pod: Mapping[str, Any],
    priority: Priority,
    tas_levels: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The Workload of ``job``: one pod set of ``spec.pods`` copies of ``pod``'s requests.

    ``tas_levels``: the levels of the TAS Topology the queue's flavors name (none: no TAS); the
    pod set then asks Kueue for topology (``kueue_topology.topology_request``).

    ``pod`` is a pod of the gang as the builders make it; Kueue sees its containers'
    requests, pod-level resources and overhead, node selector, tolerations and required node
    affinity (less the pin to a node), which is what its quota and flavors judge.
    ``priority`` orders it in its queue and decides what it may preempt.
    """
    template_spec = pod["spec"]
    containers = [_requests_only(c) for c in template_spec["containers"]]
    template: dict[str, Any] = {"spec": {"containers": containers, "restartPolicy": "Never"}}
    if template_spec.get("initContainers"):  # podTemplateOverride's: sidecars count in the quota
        template["spec"]["initContainers"] = [
            _requests_only(c) for c in template_spec["initContainers"]
        ]
    for key in ("nodeSelector", "tolerations", "priorityClassName", "resources", "overhead"):
        if template_spec.get(key):
            template["spec"][key] = template_spec[key]
    terms = node_affinity.unpinned(node_affinity.required_terms(pod))
    if terms:  # podTemplateOverride's: Kueue picks only flavors whose nodes they allow
        required = {"nodeSelectorTerms": [dict(t) for t in terms]}
        template["spec"]["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
        }
    # The spare pods request what a gang pod does: the quota counts them (runPolicy.recovery.spareNodes);
    # spareNodes raised after admission gets no more spares than admitted (sparing.wanted).
    pod_set: dict[str, Any] = {"name": POD_SET, "count": spec.pods + spare_pods(spec), "template": template}  # fmt: skip
    if tas_levels:
        pod_set["topologyRequest"] = kueue_topology.topology_request(spec, tas_levels, pod_set["count"])  # fmt: skip
    workload_spec: dict[str, Any] = {"queueName": queue.name, "podSets": [pod_set]}
    workload_spec["priority"] = priority.value
    if priority.ref is not None:
        group, kind, name = priority.ref
        workload_spec["priorityClassRef"] = {"group": group, "kind": kind, "name": name}
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job.name),
            "namespace": job.namespace,
            "labels": {naming.LABEL_JOB: job.name},
            "annotations": {SPEC_HASH_ANNOTATION: identity.spec_hash(spec)},
            "ownerReferences": [builders.owner_reference(job)],
        },
        "spec": workload_spec,
    }


@dataclasses.dataclass(frozen=True)
class Waiting:
    """Kueue has not admitted the workload (yet): the gang must not hold GPUs."""

    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Admitted:
    """Kueue admitted the workload: the gang may be placed and run."""

    cluster_queue: str
    pods_ready: tuple[str, str] | None = None
    """(status, reason) of the workload's PodsReady condition; None while it has none."""
    flavors: tuple[str, ...] = ()
    """The ResourceFlavors Kueue assigned the gang's pod set: its pods go where they say."""
    count: int | None = None
    """The pods Kueue admitted in the gang's pod set (``podSetAssignments[].count``; None: not
    said): the gang's and its spares'; spares past it would run outside the quota."""
    topology: kueue_topology.Assignment | None = None
    """Kueue TAS's ``topologyAssignment`` of the pod set: the gang goes only there (None: none)."""


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Where the admitted flavors let the gang run: what Kueue injects into its own jobs' pods."""

    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The flavors' spec.nodeLabels."""
    tolerations: tuple[Mapping[str, Any], ...] = ()
    """The flavors' spec.tolerations."""


class AssignmentConflict(ValueError):
    """A flavor's node label contradicts the job's own node selector."""


FLAVOR_NOT_FOUND, FLAVOR_CONFLICT = "ResourceFlavorNotFound", "ResourceFlavorConflict"


@dataclasses.dataclass(frozen=True)
class Unassignable:
    """The admitted flavors give the gang nowhere to go (Placed=False with this reason)."""

    reason: str
    message: str


def assignment(flavors: Sequence[Mapping[str, Any]]) -> Assignment:
    """The node labels and tolerations of the admitted ResourceFlavors, merged."""
    selector: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    for flavor in flavors:
        spec = flavor.get("spec") or {}
        selector.update(spec.get("nodeLabels") or {})
        tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
    return Assignment(selector, tuple(tolerations))


def gang_pod(
    pod: Mapping[str, Any],
    where: Assignment,
    *,
    job: str,
    topology: kueue_topology.Assignment | None,
) -> dict[str, Any]:
    """A pod the operator creates for job ``job`` (gang pod, recovered pod, spare or lone
    replacement): :func:`assign`, and marked as a TAS pod of the job's Workload
    (``kueue_topology.mark``) when Kueue TAS assigned the pod set (``topology``), so Kueue
    counts it once and finds it on its node.  Every pod-creating path goes through here."""
    assigned = assign(pod, where)
    return assigned if topology is None else kueue_topology.mark(assigned, workload_name(job))


def assign(pod: Mapping[str, Any], where: Assignment) -> dict[str, Any]:
    """``pod`` with the flavors' node selector and tolerations added (Kueue's pod set info merge)."""
    spec = dict(pod["spec"])
    selector = dict(spec.get("nodeSelector") or {})
    clash = {k: (selector[k], v) for k, v in where.node_selector.items() if selector.get(k, v) != v}
    if clash:
        described = ", ".join(
            f"{k}={ours} (flavor: {theirs})" for k, (ours, theirs) in clash.items()
        )
        raise AssignmentConflict(
            f"spec.resources.nodeSelector contradicts the ResourceFlavor Kueue admitted the job "
            f"with: {described}; select nodes the flavor covers, or queue the job elsewhere"
        )
    if where.node_selector:
        spec["nodeSelector"] = {**selector, **where.node_selector}
    own = list(spec.get("tolerations") or [])
    added = [dict(t) for t in where.tolerations if t not in own]
    if added:
        spec["tolerations"] = own + added
    return {**pod, "spec": spec}


@dataclasses.dataclass(frozen=True)
class Evicted:
    """Kueue took the admission back (preemption, deactivation...): stop the gang, keep no quota."""

    reason: str
    message: str
    holds_quota: bool
    """Kueue still counts the workload's quota: release it once the gang is gone."""


@dataclasses.dataclass(frozen=True)
class Finished:
    """The workload is finished (meshtrain marked it when the job ended)."""


@dataclasses.dataclass(frozen=True)
class Outdated:
    """The Workload describes another spec or queue than the job's: stop the gang, replace it."""

    reason: str
    message: str


State = Waiting | Admitted | Evicted | Finished | Outdated

SPEC_HASH_ANNOTATION = f"{naming.GROUP}/spec-hash"
"""The job spec a Workload was built from (its pod set, requests and priority follow from it)."""


def outdated(workload: Mapping[str, Any], spec_hash: str) -> Outdated | None:
    """Why ``workload`` no longer describes the job (Kueue's EquivalentToWorkload), or None.

    Kueue charged the quota of the Workload's pod set: a changed spec (a larger gang) must
    be queued again rather than run against the old admission.
    """
    annotations = (workload.get("metadata") or {}).get("annotations") or {}
    if annotations.get(SPEC_HASH_ANNOTATION) != spec_hash:
        return Outdated(
            "WorkloadOutdated",
            "the job's spec changed since Kueue admitted it: its Workload is replaced and queued again",
        )
    return None


QUEUE_REMOVED = "QueueLabelRemoved"


def reserved(workload: Mapping[str, Any]) -> bool:
    """Whether Kueue holds quota for ``workload`` (its queue can then no longer change)."""
    return _condition(workload, QUOTA_RESERVED) is not None


def queue_of_workload(workload: Mapping[str, Any]) -> Queue:
    """The queue the Workload is in (a job's label removed while admitted still answers to it)."""
    return Queue(str((workload.get("spec") or {}).get("queueName") or ""), None)


def queue_removed() -> Outdated:
    """The queue label went before Kueue admitted the job: its Workload goes, it runs without Kueue."""
    return Outdated(
        QUEUE_REMOVED,
        f'metadata.labels["{QUEUE_LABEL}"] was removed before Kueue admitted the job: its Workload '
        "is deleted and the job is placed without Kueue",
    )


def was_queued(status: Mapping[str, Any]) -> bool:
    """Whether the job has been queued by Kueue (its status carries a Queued condition)."""
    return conditions.find(status.get("conditions") or [], conditions.QUEUED) is not None


@dataclasses.dataclass(frozen=True)
class Gate:
    """Kueue's answer for a queued job: its Workload's state, None before the Workload exists."""

    state: State | None
    priority: Priority = Priority(0)
    """The priority a Workload created now gets (read while none exists)."""
    move_to: str | None = None
    """The job's label names this other LocalQueue and Kueue holds no quota yet: move the Workload."""
    rejected: str | None = None
    """Why the API server refused the last create of the Workload, shown while it is tried again."""


def gate_for(
    workload: Mapping[str, Any] | None, uid: str, queue: Queue | None, spec_hash: str | None
) -> Gate | None:
    """Kueue's answer for job ``uid`` labelled with ``queue``, given the Workload of its name.

    None: the job is not queued (any more).  A Gate without a state: the job has no
    Workload yet (the caller reads the priority it gets).  The queue label follows Kueue's
    rules for its own jobs: a new queue moves a Workload that holds no quota yet and waits
    while one does; a label removed before admission deletes the Workload, after it the
    job answers to its Workload's queue until Kueue is done with it.
    """
    if workload is not None and not controlled_by(workload, uid):
        return Gate(name_taken(workload)) if queue is not None else None
    bad_name = invalid_queue_name(queue) if queue is not None else None
    if bad_name is not None and (workload is None or not reserved(workload)):
        return Gate(bad_name)
    if workload is None:
        return Gate(None) if queue is not None else None  # no label: the job left Kueue
    found = state(workload)
    held = reserved(workload) or isinstance(found, Finished)
    if queue is None and not held:
        return Gate(queue_removed())
    if spec_hash is not None and not isinstance(found, Finished):
        found = outdated(workload, spec_hash) or found
    current = queue_of_workload(workload).name
    wanted = current if queue is None else queue.name
    return Gate(found, move_to=wanted if wanted != current and not held else None)


@dataclasses.dataclass(frozen=True)
class MoveWorkload:
    """Point the waiting Workload at the job's new LocalQueue (Kueue's queue-name change)."""

    queue: str


@dataclasses.dataclass(frozen=True)
class CreateWorkload:
    """Create the job's Workload so Kueue can queue it."""

    priority: Priority


@dataclasses.dataclass(frozen=True)
class ReleaseQuota:
    """The evicted gang is gone: give its quota back (:func:`release_patch`)."""


@dataclasses.dataclass(frozen=True)
class DeleteWorkload:
    """Delete the job's Workload (outdated, or the job suspended): Kueue frees its quota."""


@dataclasses.dataclass(frozen=True)
class ReportPodsReady:
    """Tell Kueue whether the admitted gang is up (:func:`pods_ready_patch`)."""

    ready: bool


@dataclasses.dataclass(frozen=True)
class FinishWorkload:
    """The job ended: mark its Workload finished (:func:`finish_patch`) so Kueue frees the quota."""

    succeeded: bool
    message: str


def missing_priority_class(queue: Queue) -> Waiting:
    """The job names a WorkloadPriorityClass that does not exist: no Workload can be created."""
    return Waiting(
        PRIORITY_CLASS_NOT_FOUND,
        f'metadata.labels["{PRIORITY_CLASS_LABEL}"]: WorkloadPriorityClass '
        f'"{queue.priority_class}" does not exist; create it or name an existing one',
    )


def missing_pod_priority_class(name: str) -> Waiting:
    """The job's pods name a PriorityClass that does not exist: no priority, no Workload."""
    return Waiting(
        POD_PRIORITY_CLASS_NOT_FOUND,
        f'spec.pod.priorityClassName: PriorityClass "{name}" does not exist; create it or name an '
        "existing one (Kueue takes a queued job's priority from it)",
    )


def controlled_by(workload: Mapping[str, Any], uid: str) -> bool:
    """Whether ``workload`` is the job's own (its controller owner reference is the job ``uid``)."""
    refs = (workload.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("controller") and r.get("uid") == uid for r in refs)


def name_taken(workload: Mapping[str, Any]) -> Waiting:
    """A Workload of the job's name that is not the job's: read as nothing, never changed."""
    metadata = workload.get("metadata") or {}
    owners = ", ".join(
        f"{r.get('kind')}/{r.get('name')} (uid {r.get('uid')})"
        for r in metadata.get("ownerReferences") or []
    )
    return Waiting(
        NAME_TAKEN,
        f"Workload {metadata.get('name')} exists but is not this job's (owners: {owners or 'none'}); "
        "the job is queued once it is gone (a previous job of this name is still being deleted, "
        "or delete that Workload)",
    )


def _condition(workload: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    found = conditions.find((workload.get("status") or {}).get("conditions") or [], type_)
    return found if found and found.get("status") == conditions.TRUE else None


def _topology_request(workload: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``topologyRequest`` of the Workload's gang pod set (None: none asked)."""
    for pod_set in (workload.get("spec") or {}).get("podSets") or []:
        if pod_set.get("name") == POD_SET:
            return pod_set.get("topologyRequest") or None
    return None


def state(workload: Mapping[str, Any]) -> State:
    """What Kueue says of ``workload`` (as read from the API server)."""
    status = workload.get("status") or {}
    if _condition(workload, FINISHED):
        return Finished()
    evicted = _condition(workload, EVICTED)
    if evicted:
        return Evicted(
            evicted.get("reason") or EVICTED,
            evicted.get("message") or "",
            holds_quota=status.get("admission") is not None,
        )
    if _condition(workload, ADMITTED) and status.get("admission"):
        ready = conditions.find(status.get("conditions") or [], PODS_READY)
        assigned = [
            name
            for pod_set in status["admission"].get("podSetAssignments") or []
            if pod_set.get("name") == POD_SET
            for name in (pod_set.get("flavors") or {}).values()
        ]
        ours = [
            pod_set
            for pod_set in status["admission"].get("podSetAssignments") or []
            if pod_set.get("name") == POD_SET
        ]
        counts = [p["count"] for p in ours if type(p.get("count")) is int]
        return Admitted(
            status["admission"].get("clusterQueue", ""),
            (ready.get("status", ""), ready.get("reason", "")) if ready else None,
            tuple(sorted(set(assigned))),
            counts[0] if counts else None,
            kueue_topology.read(ours[0].get("topologyAssignment"), _topology_request(workload))
            if ours
            else None,
        )
    reserved = conditions.find(status.get("conditions") or [], QUOTA_RESERVED) or {}
    return Waiting(
        reserved.get("reason") or "Pending",
        reserved.get("message") or "waiting for Kueue to admit the workload",
    )


def _set(
    current: Sequence[dict[str, Any]],
    type_: str,
    status: str,
    reason: str,
    message: str,
    now: datetime.datetime,
    generation: int,
) -> list[dict[str, Any]]:
    updated = conditions.set(current, type_, status, reason, message, now)
    return [{**c, "observedGeneration": generation} if c["type"] == type_ else c for c in updated]


def release_patch(workload: Mapping[str, Any], now: datetime.datetime) -> dict[str, Any]:
    """Status patch that gives an evicted workload's quota back once its gang is gone.

    Kueue leaves this step to the workload's owner: clear ``admission``, mark the quota
    released and, after a preemption, requeued; Kueue then admits it again when it can.
    """
    evicted = _condition(workload, EVICTED) or {}
    reason, message = evicted.get("reason") or EVICTED, evicted.get("message") or ""
    generation = int((workload.get("metadata") or {}).get("generation") or 0)
    current = list((workload.get("status") or {}).get("conditions") or [])
    current = _set(current, REQUEUED, conditions.TRUE if reason in REQUEUED_REASONS else conditions.FALSE,
                   reason, message, now, generation)  # fmt: skip
    current = _set(current, QUOTA_RESERVED, conditions.FALSE, "Pending", message, now, generation)
    current = _set(current, ADMITTED, conditions.FALSE, "NoReservation", "The workload has no reservation", now, generation)  # fmt: skip
    if conditions.find(current, PODS_READY):  # the next admission waits for a fresh start
        current = _set(current, PODS_READY, conditions.FALSE, WAIT_FOR_START, NOT_STARTED, now, generation)  # fmt: skip
    return {"status": {"admission": None, "conditions": current}}


def finish_patch(
    workload: Mapping[str, Any], *, succeeded: bool, message: str, now: datetime.datetime
) -> dict[str, Any]:
    """Status patch that marks the workload finished, so Kueue frees its quota."""
    generation = int((workload.get("metadata") or {}).get("generation") or 0)
    current = list((workload.get("status") or {}).get("conditions") or [])
    reason = "Succeeded" if succeeded else "Failed"
    return {
        "status": {
            "conditions": _set(current, FINISHED, conditions.TRUE, reason, message, now, generation)
        }
    }


def pods_ready_condition(
    current: tuple[str, str] | None, ready: bool
) -> tuple[str, str, str] | None:
    """The PodsReady condition (status, reason, message) Kueue expects, None when ``current`` says it.

    The job's owner reports it (Kueue's own job reconciler does for its kinds); with
    waitForPodsReady configured, Kueue evicts an admitted workload whose PodsReady stays
    False past the timeout, and measures a recovery from the False after a True.
    """
    if ready:
        recovering = current is not None and current[1] in (WAIT_FOR_RECOVERY, RECOVERED)
        wanted = (conditions.TRUE, RECOVERED if recovering else STARTED, "All pods of the gang are running")  # fmt: skip
    elif current is None:
        wanted = (conditions.FALSE, WAIT_FOR_START, NOT_STARTED)
    elif current[0] == conditions.TRUE or current[1] == WAIT_FOR_RECOVERY:
        wanted = (conditions.FALSE, WAIT_FOR_RECOVERY, "A pod of the gang stopped, waiting for recovery")  # fmt: skip
    else:
        return None
    return None if current == wanted[:2] else wanted


def pods_ready_patch(
    workload: Mapping[str, Any], *, ready: bool, now: datetime.datetime
) -> dict[str, Any] | None:
    """Status patch that reports PodsReady for ``ready`` (None when the workload says it already)."""
    found = state(workload)
    if not isinstance(found, Admitted):
        return None
    wanted = pods_ready_condition(found.pods_ready, ready)
    if wanted is None:
        return None
    generation = int((workload.get("metadata") or {}).get("generation") or 0)
    current = list((workload.get("status") or {}).get("conditions") or [])
    return {"status": {"conditions": _set(current, PODS_READY, *wanted, now, generation)}}
