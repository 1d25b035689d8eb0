"""Kueue Topology-Aware Scheduling (TAS) and meshtrain's placement: one source of placement truth.

When a job's ClusterQueue hands out a ResourceFlavor with a ``topologyName``, its Workload asks
Kueue for topology (:func:`topology_request`, from ``spec.topology``), and Kueue's answer, the
pod set's ``topologyAssignment`` (domains and pod counts), bounds the plan: the gang's nodes
come only from the assigned domains, each domain holding at most its count
(:func:`restrict`), and a plan that does not put exactly the assigned counts there is refused
(:func:`conflict`, ``placement_outcome.within_assignment``).  Inside that, meshtrain's cost model still decides which rank block goes
where.  Pure: the reads are ``cluster.workloads``'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from meshtrain import placement
from meshtrain.api import limits
from meshtrain.api import spec as api_spec

CONFLICT = "TopologyAssignmentConflict"
"""Placed=False reason: meshtrain's rules cannot be met inside Kueue's topologyAssignment."""
TAS_POD_ANNOTATION = "kueue.x-k8s.io/podset-unconstrained-topology"
"""Marks a gang pod as TAS-managed, so Kueue's TAS cache counts it in the Workload's TAS usage,
not again as non-TAS usage of its node."""
WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"
"""The pod's Workload, as Kueue sets it on its own TAS pods: Kueue finds a Workload's pods on a
node by it (its ``WorkloadSliceNameKey`` index), so a cordon, an untolerated taint or a brief
NotReady of a node the gang runs on does not make Kueue move the assignment away from the
running pods.  Kueue's topology ungater lists these pods too, but only ungates pods carrying its
own scheduling gate, which meshtrain's never do."""
HOSTNAME = "kubernetes.io/hostname"
UNREAD = "TopologyNotRead"
"""Warning Event reason: the operator may not read the queue's TAS Topology (RBAC: 403)."""


@dataclasses.dataclass(frozen=True)
class Domain:
    """One domain of Kueue's assignment."""

    values: tuple[str, ...]
    """The domain's node-label value at each of the assignment's levels."""
    count: int
    """Pods Kueue assigned to it."""


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A pod set's ``topologyAssignment``, expanded from Kueue's compressed slices."""

    levels: tuple[str, ...]
    """Node labels of the assigned levels, highest first (the lowest is often the hostname)."""
    domains: tuple[Domain, ...]
    """Every assigned domain, in Kueue's order."""
    stage_slice: tuple[str, int] | None = None
    """The pod set's ``podSetSliceRequiredTopology`` and ``podSetSliceSize`` (None: no slices):
    Kueue admitted each run of that many pods inside one domain of that level, so the plan must
    keep each pipeline stage (what :func:`topology_request` asks a slice to be) in one."""

    @property
    def total(self) -> int:
        return sum(domain.count for domain in self.domains)

    def counts(self) -> dict[tuple[str, ...], int]:
        """Pods per domain, a domain Kueue lists twice (its slices may) counted with both."""
        found: dict[tuple[str, ...], int] = {}
        for domain in self.domains:
            found[domain.values] = found.get(domain.values, 0) + domain.count
        return found

    def describe(self) -> str:
        shown = ", ".join(f"{'/'.join(d.values)}={d.count}" for d in self.domains[:8])
        more = f" and {len(self.domains) - 8} more" if len(self.domains) > 8 else ""
        return f"{'/'.join(self.levels)}: {shown}{more}"


def _value(level: Mapping[str, Any], index: int) -> str:
    """The value at domain ``index`` of one slice level (universal, or prefix+root+suffix)."""
    if level.get("universal") is not None:
        return str(level["universal"])
    individual = level.get("individual") or {}
    roots = individual.get("roots") or []
    return f"{individual.get('prefix') or ''}{roots[index]}{individual.get('suffix') or ''}"


MAX_DOMAINS = limits.MAX_WORLD_SIZE + limits.MAX_SPARE_NODES
"""Domains decoded from one assignment at most: each holds a pod, and a gang and its spares have no
more; a longer status is not a gang's, and its counts then fail the plan's check (a conflict)."""


def read(
    assignment: Mapping[str, Any] | None, request: Mapping[str, Any] | None = None
) -> Assignment | None:
    """The domains and counts of a ``topologyAssignment`` (Kueue v1beta2's slices), or None.

    Decoded as Kueue's ``tas.InternalSeqFrom`` does: each slice covers ``domainCount``
    domains; each level's value is universal or prefix + root + suffix; counts universal or
    individual.  ``request``, the pod set's ``topologyRequest``, gives the stage slice Kueue
    kept (:attr:`Assignment.stage_slice`).
    """
    if not assignment:
        return None
    levels = tuple(str(level) for level in assignment.get("levels") or [])
    domains: list[Domain] = []
    for piece in assignment.get("slices") or []:
        counts = piece.get("podCounts") or {}
        per_level = piece.get("valuesPerLevel") or []
        room = MAX_DOMAINS - len(domains)
        for index in range(max(0, min(int(piece.get("domainCount") or 0), room))):
            count = counts.get("universal")
            domains.append(
                Domain(
                    tuple(_value(level, index) for level in per_level),
                    int(count if count is not None else counts["individual"][index]),
                )
            )
    if not levels:
        return None
    level, size = (request or {}).get("podSetSliceRequiredTopology"), (request or {}).get("podSetSliceSize")  # fmt: skip
    stage_slice = (str(level), size) if level and type(size) is int and size > 1 else None
    return Assignment(levels, tuple(domains), stage_slice)


def tas_levels(topology: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The node labels of a Kueue Topology's levels, highest first (() for no Topology)."""
    levels = ((topology or {}).get("spec") or {}).get("levels") or []
    return tuple(str(level.get("nodeLabel")) for level in levels if level.get("nodeLabel"))


def topology_request(
    spec: api_spec.TrainingJobSpec, levels: Sequence[str], count: int
) -> dict[str, Any]:
    """The ``topologyRequest`` of the pod set (``count`` pods) in a queue whose TAS Topology has
    ``levels``.

    Only levels the Topology has are named; "lowest" is in the Topology's order of ``levels``,
    whatever the order of ``spec.topology``.  ``required``: the lowest ``spec.topology`` level
    with mode required and scope job (the whole gang in one domain of it, the same rule the
    planner keeps).  A level required with scope stage is a PodSet slice of one stage's pods
    there (:func:`_stage_slice`), in place of the NVLink-domain slice below.
    Else ``preferred``: the lowest fabric level of ``spec.topology`` the Topology has, else the
    NVLink-domain label, else the Topology's own second-lowest level (its lowest is usually the
    hostname), so Kueue packs the gang as tightly as it can.  With the NVLink-domain label among
    the levels, at or below that level, and more than one pipeline stage, each stage's pods (its
    data-parallel all-reduce, the heaviest traffic; tensor groups never leave a pod) are a
    PodSet slice required in one NVLink domain (``podSetSliceRequiredTopology`` /
    ``podSetSliceSize``), when stages fill whole pods and the slices divide ``count`` (spares
    included).
    """
    topology, order = spec.topology, list(levels)
    fabric = [level for level in topology.levels if level.label in order]
    grid = spec.parallelism
    required = [lv.label for lv in fabric if lv.mode == "required" and lv.scope == "job"]
    staged = [lv.label for lv in fabric if lv.mode == "required" and lv.scope == "stage"]
    if staged and grid.pipeline == 1:  # one stage: the stage is the job
        required, staged = [*required, *staged], []
    nvlink = topology.nvlink_domain_label if topology.nvlink_domain_label in order else None
    request: dict[str, Any] = {}
    if required:
        request["required"] = max(required, key=order.index)  # lowest in the Topology
    elif fabric:
        request["preferred"] = max((level.label for level in fabric), key=order.index)
    elif nvlink:
        request["preferred"] = nvlink
    elif levels:
        request["preferred"] = (
            levels[-2] if len(levels) > 1 and levels[-1] == HOSTNAME else levels[-1]
        )
    stage_pods = _stage_pods(spec)
    slices = grid.pipeline > 1 and stage_pods > 1 and count % stage_pods == 0
    if staged:
        _stage_slice(request, max(staged, key=order.index), stage_pods, order, slices)
        return request
    level = request.get("required") or request.get("preferred")
    # Kueue refuses a slice level above the pod set's level (tas_flavor_snapshot.go: "podset
    # slice topology X is above the podset topology Y"): the job would never be admitted.
    below = nvlink is not None and level is not None and order.index(nvlink) >= order.index(level)
    if below and slices:
        request["podSetSliceRequiredTopology"] = nvlink
        request["podSetSliceSize"] = stage_pods
    return request


def _stage_pods(spec: api_spec.TrainingJobSpec) -> int:
    """Pods of one pipeline stage (every rank of it), or 0 when a stage does not fill whole pods."""
    grid, per_pod = spec.parallelism, spec.resources.gpus_per_node
    per_stage = grid.world_size // grid.pipeline
    return per_stage // per_pod if per_stage % per_pod == 0 else 0


def _stage_slice(
    request: dict[str, Any], level: str, stage_pods: int, order: list[str], slices: bool
) -> None:
    """Ask Kueue for each pipeline stage in one domain of the stage-scoped ``level``: a PodSet
    slice of ``stage_pods`` there (when ``slices``), the pod set's own level raised to it where it
    was a lower preference (Kueue refuses a slice above the pod set's level); a required level at
    or below it already keeps every stage in one domain."""
    job_level = request.get("required")
    if job_level is not None and order.index(job_level) >= order.index(level):
        return
    if job_level is None and order.index(request["preferred"]) > order.index(level):
        request["preferred"] = level
    if slices:
        request["podSetSliceRequiredTopology"] = level
        request["podSetSliceSize"] = stage_pods


def unknown_required(
    spec: api_spec.TrainingJobSpec, levels: Sequence[str], spares: int = 0
) -> str | None:
    """Why no Workload may be created for ``spec`` in a queue whose TAS Topology has ``levels``
    (() : no TAS), or None.

    A ``required`` level the Topology lacks cannot be asked of Kueue (:func:`topology_request`
    leaves it out), so Kueue would admit the gang anywhere its own request allows and hold the
    quota while the gang could never be placed inside the assignment.  Likewise a level required
    per stage whose slices do not divide the pod set (``spares`` spare pods in it): Kueue takes
    no slice request then and may split a stage across domains.
    """
    if not levels:
        return None
    stage_pods = _stage_pods(spec)
    count = spec.pods + spares
    for index, level in enumerate(spec.topology.levels):
        sliced = level.mode == "required" and level.scope == "stage" and level.label in levels
        if sliced and spec.parallelism.pipeline > 1 and stage_pods and count % stage_pods:
            return (
                f"spec.topology.levels[{index}] requires each pipeline stage ({stage_pods} pods) "
                f"in one {level.label!r} domain, but the Kueue Workload's pod set has {count} pods "
                f"({spares} of them spares, runPolicy.recovery.spareNodes), which Kueue cannot "
                f"cut into slices of {stage_pods}: so no Workload is created; make spareNodes a "
                f"multiple of {stage_pods}, drop the spares, or use scope: job "
                "(checked again with backoff)"
            )
    for index, level in enumerate(spec.topology.levels):
        if level.mode == "required" and level.label not in levels:
            whom = "each pipeline stage" if level.scope == "stage" else "the gang"
            return (
                f"spec.topology.levels[{index}].label {level.label!r} is required, but the Kueue "
                f"TAS Topology of the job's queue has the levels {', '.join(levels)}: Kueue could "
                f"not keep {whom} in one such domain, so no Workload is created; make the level "
                f"preferred{' (and drop its scope)' if level.scope == 'stage' else ''}, require a level the Topology has, or add the label to the Topology "
                "(checked again with backoff)"
            )
    return None


def _in(node: placement.Node, assignment: Assignment) -> tuple[str, ...] | None:
    """The assigned domain ``node`` lies in (its values at the assignment's levels), or None."""
    values = tuple(node.labels.get(level, "") for level in assignment.levels)
    return values if all(values) else None


def restrict(
    offered: Iterable[placement.Node], assignment: Assignment, gpus_per_pod: int
) -> list[placement.Node]:
    """The offered nodes inside the assigned domains, each domain offering at most its count.

    A domain of one node (the hostname level) offers ``min(room, count)`` pods there; a wider
    domain's nodes are taken in name order until they offer its count (the last one cut to what
    remains), so no plan can put more pods in a domain than Kueue assigned it.
    """
    left = assignment.counts()
    kept = []
    for node in sorted(offered, key=lambda n: n.name):
        where = _in(node, assignment)
        if where is None or left.get(where, 0) <= 0:
            continue
        slots = min(node.allocatable_gpus // gpus_per_pod, left[where])
        left[where] -= slots
        kept.append(dataclasses.replace(node, allocatable_gpus=slots * gpus_per_pod))
    return kept


def placed_per_domain(
    nodes: Sequence[str], labels: Mapping[str, Mapping[str, str]], assignment: Assignment
) -> dict[tuple[str, ...], int]:
    """Pods per assigned domain of a plan's ``nodes`` (a pod outside any counts under ())."""
    assigned = {domain.values for domain in assignment.domains}
    counts: dict[tuple[str, ...], int] = {}
    for name in nodes:
        node_labels = labels.get(name) or {}
        values = tuple(node_labels.get(level, "") for level in assignment.levels)
        key = values if values in assigned else ()
        counts[key] = counts.get(key, 0) + 1
    return counts


def misplaced(
    nodes: Mapping[int, str], labels: Mapping[str, Mapping[str, str]], assignment: Assignment
) -> tuple[int, ...]:
    """The pod indices of ``nodes`` (index -> node) outside ``assignment``: on a node of no
    assigned domain, or beyond its domain's count (lower indices keep their slots first).  A
    node without ``labels`` (unknown here: a node gone is another rule's) is not judged."""
    left = assignment.counts()
    out = []
    for index in sorted(nodes):
        node_labels = labels.get(nodes[index])
        if node_labels is None:
            continue
        values = tuple(node_labels.get(level, "") for level in assignment.levels)
        if left.get(values, 0) > 0:
            left[values] -= 1
        else:
            out.append(index)
    return tuple(out)


def spare_room(
    free: Mapping[str, int],
    used: Sequence[str],
    labels: Mapping[str, Mapping[str, str]],
    assignment: Assignment,
) -> dict[str, int]:
    """The pod slots ``free`` (node -> slots) leaves inside what the pods already held (``used``:
    their nodes) have not taken of Kueue's assignment.

    Kueue counts spares in the pod set, so they too go only to the assigned domains, up to each
    domain's count, and so does a lost pod's lone replacement (the survivors and the spares it
    may take in ``used`` / ``free`` as the caller counts them); nodes in name order, as
    :func:`restrict`.
    """
    taken = placed_per_domain(used, labels, assignment)
    left = {values: count - taken.get(values, 0) for values, count in assignment.counts().items()}
    room = {}
    for name in sorted(free):
        values = tuple((labels.get(name) or {}).get(level, "") for level in assignment.levels)
        slots = min(free[name], left.get(values, 0))
        if slots > 0:
            room[name] = slots
            left[values] -= slots
    return room


def replacement_room(
    free: Mapping[str, int],
    survivors: Sequence[str],
    spares: Iterable[str],
    labels: Mapping[str, Mapping[str, str]],
    assignment: Assignment,
) -> dict[str, int]:
    """The pod slots ``free`` leaves a lost pod's replacement inside Kueue's ``assignment``: what
    the surviving gang pods (``survivors``: their nodes) and the spares (``spares``: theirs)
    left of each domain, plus one slot on each spare's own node (a swap: the spare leaves, the
    replacement takes its place in the same domain).  ``free`` counts the spares' GPUs as free
    (they are the replacement's), so the spares must be counted here, or a domain holding one
    would be overfilled."""
    held = list(spares)
    room = spare_room(free, [*survivors, *held], labels, assignment)
    for node in held:
        if free.get(node, 0) > 0:
            room[node] = max(room.get(node, 0), 1)
    return room


def conflict(
    nodes: Sequence[str],
    labels: Mapping[str, Mapping[str, str]],
    assignment: Assignment,
    spares: int,
) -> str | None:
    """Why a plan's ``nodes`` break Kueue's assignment, or None when they keep it.

    The gang must lie in the assigned domains, each receiving exactly its count; ``spares``
    (the pods Kueue admitted beyond the gang: runPolicy.recovery.spareNodes) may be left
    over, at most one domain's worth each.
    """
    placed = placed_per_domain(nodes, labels, assignment)
    outside = placed.pop((), 0)
    if outside:
        return (
            f"{outside} pod(s) planned outside Kueue's assigned domains ({assignment.describe()})"
        )
    short = {values: count - placed.get(values, 0) for values, count in assignment.counts().items()}
    over = {k: v for k, v in short.items() if v < 0}
    if over:
        return f"more pods than Kueue assigned in {', '.join('/'.join(k) for k in over)}"
    missing = sum(short.values())
    if missing > spares:
        return (
            f"{len(nodes)} pod(s) planned where Kueue assigned {assignment.total} "
            f"({assignment.describe()}); the gang must fill the assignment exactly"
        )
    return split_stage(nodes, labels, assignment)


def split_stage(
    nodes: Sequence[str], labels: Mapping[str, Mapping[str, str]], assignment: Assignment
) -> str | None:
    """Why a plan's ``nodes`` break the stage slices Kueue admitted, or None.

    Each run of ``podSetSliceSize`` pods (a pipeline stage: ``topology_request`` asks for no
    other slice) must share one domain of ``podSetSliceRequiredTopology``, as Kueue promised
    when it admitted the slices; a node without that label is no domain.
    """
    if assignment.stage_slice is None:
        return None
    level, size = assignment.stage_slice
    for start in range(0, len(nodes) - size + 1, size):
        domains = {(labels.get(name) or {}).get(level, "") for name in nodes[start : start + size]}
        if len(domains) > 1 or "" in domains:
            shown = ", ".join(sorted(d or "<none>" for d in domains)[:4])
            return (
                f"pods {start}-{start + size - 1} (one pipeline stage) span {level} domains "
                f"{shown}; Kueue admitted each stage as a slice inside one {level} domain"
            )
    return None


def unread_message(error: str) -> str:
    """The Warning Event of a Workload created without a topology request after a 403."""
    return (
        f"Kueue TAS topology not read ({error}): the operator's RBAC lacks get on LocalQueues, "
        "ClusterQueues or Topologies (an install older than its chart); the Workload is queued "
        "without a topologyRequest, so Kueue's own choice (implied TAS in a TAS-only queue) "
        "bounds the gang: apply the chart's RBAC (manifests/rbac)"
    )


def conflict_message(why: str, assignment: Assignment) -> str:
    """The Placed=False message of a plan that cannot keep Kueue's topologyAssignment."""
    return (
        f"meshtrain's placement cannot be met inside Kueue's topologyAssignment "
        f"({assignment.describe()}): {why}; the gang stays unplaced (Kueue's assignment is never "
        "ignored): relax spec.topology's required levels or the queue's TAS request, or free the "
        "assigned nodes"
    )


def mark(pod: dict[str, Any], workload: str) -> dict[str, Any]:
    """``pod`` annotated as TAS-managed (:data:`TAS_POD_ANNOTATION`) and as a pod of Kueue
    Workload ``workload`` (:data:`WORKLOAD_ANNOTATION`)."""
    metadata = dict(pod.get("metadata") or {})
    metadata["annotations"] = {
        **(metadata.get("annotations") or {}),
        TAS_POD_ANNOTATION: "true",
        WORKLOAD_ANNOTATION: workload,
    }
    return {**pod, "metadata": metadata}
