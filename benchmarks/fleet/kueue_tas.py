"""A TrainingJob as a Kueue user would run it with Topology-Aware Scheduling: an Indexed batch Job.

Pure: :func:`batch_job` turns a TrainingJob spec into a Kueue-managed batch Job of one pod per
node slot (completion index i = meshtrain's pod i, ranks ``[i*gpusPerNode, (i+1)*gpusPerNode)``),
and :func:`queue_objects` the Topology, ResourceFlavor, ClusterQueue and LocalQueue it queues in.
The TAS annotations (:func:`annotations`) ask Kueue for what meshtrain's placement is after:
tensor groups never leave a pod, so each pipeline stage's pods are a PodSet slice required inside
one domain of the lowest level (NVLink domain where domains span nodes, rack, block, ...) whose
smallest domain holds a stage; the job as a whole prefers that level (Kueue climbs from there),
or the lowest where no domain holds a stage.  A one-stage job is a single slice: the whole PodSet is required there instead;
a stage of one pod needs no slice.  :func:`constraints` makes that choice once; :func:`meshtrain_levels`
gives meshtrain's TrainingJob the same (``spec.topology.levels[].scope: stage`` for the slice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.api import spec as api_spec

KUEUE = "kueue.x-k8s.io"
QUEUE_NAME_LABEL = f"{KUEUE}/queue-name"
REQUIRED = f"{KUEUE}/podset-required-topology"
PREFERRED = f"{KUEUE}/podset-preferred-topology"
SLICE_REQUIRED = f"{KUEUE}/podset-slice-required-topology"
SLICE_SIZE = f"{KUEUE}/podset-slice-size"
HOSTNAME = "kubernetes.io/hostname"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
"""Pod label (and annotation) the Job controller sets: Kueue's rank order, meshtrain's pod index."""


@dataclasses.dataclass(frozen=True)
class Fabric:
    """The cluster's Kueue Topology and how many GPUs the smallest domain of each level holds."""

    levels: tuple[str, ...]
    """Node labels of the Topology's levels, top first, ``kubernetes.io/hostname`` last."""
    domain_gpus: Mapping[str, int]
    """GPUs in the smallest domain of each level (the label's key): what a slice may count on."""
    stage_levels: tuple[str, ...]
    """Levels a stage may be required in, top first: every fabric level, then the NVLink domain
    where domains span nodes."""


def fabric_for(job: api_spec.TrainingJobSpec, domain_gpus: Mapping[str, int]) -> Fabric:
    """The Topology a job's ``spec.topology`` describes: its fabric levels, NVLink domain, host."""
    labels = [level.label for level in job.topology.levels]
    stage_levels = list(labels)
    if job.topology.nvlink_domain_label:
        labels.append(job.topology.nvlink_domain_label)
        stage_levels.append(job.topology.nvlink_domain_label)
    labels.append(HOSTNAME)
    missing = [label for label in labels if label not in domain_gpus]
    if missing:
        raise ValueError(f"domain_gpus names no size for the levels {missing}")
    return Fabric(
        levels=tuple(labels), domain_gpus=dict(domain_gpus), stage_levels=tuple(stage_levels)
    )


@dataclasses.dataclass(frozen=True)
class Constraints:
    """What a job asks of the fabric, the one choice both sides of the head to head are given."""

    preferred: str | None
    """The level the whole job prefers (Kueue's pod set level when nothing is required)."""
    required: str | None
    """The level the whole job is required in (a one-stage job's), else None."""
    stage: str | None
    """The level each pipeline stage is required in (Kueue's PodSet slice level), else None."""
    stage_pods: int
    """Pods of one stage (Kueue's slice size); 0 when stages share pods."""


def constraints(job: api_spec.TrainingJobSpec, fabric: Fabric) -> Constraints:
    """The constraints of ``job`` on ``fabric`` (see the module docstring): the source of truth of
    both :func:`annotations` (Kueue's side) and :func:`meshtrain_levels` (meshtrain's)."""
    grid, per_pod = job.parallelism.layout, job.resources.gpus_per_node
    stage_gpus = grid.world_size // grid.pipeline
    stage_pods = stage_gpus // per_pod if stage_gpus % per_pod == 0 else 0
    candidates = fabric.stage_levels
    fits = [label for label in candidates if fabric.domain_gpus[label] >= stage_gpus]
    lowest = candidates[-1] if candidates else HOSTNAME
    if not stage_pods or not fits:  # stages share pods, or none fits a domain: prefer
        return Constraints(lowest, None, None, stage_pods)
    stage_level = fits[-1]
    if grid.pipeline == 1:
        return Constraints(None, stage_level, None, stage_pods)
    if stage_pods == 1:  # a stage on one pod is never split: a slice of one asks nothing
        return Constraints(stage_level, None, None, stage_pods)
    # Kueue refuses a slice level above the PodSet's, so the job prefers the stage's level
    return Constraints(stage_level, None, stage_level, stage_pods)


def annotations(job: api_spec.TrainingJobSpec, fabric: Fabric) -> dict[str, str]:
    """The pod template's TAS annotations for ``job`` on ``fabric``: its :func:`constraints`."""
    found = constraints(job, fabric)
    if found.required is not None:
        return {REQUIRED: found.required}
    asked = {PREFERRED: found.preferred or HOSTNAME}
    if found.stage is not None:
        asked |= {SLICE_REQUIRED: found.stage, SLICE_SIZE: str(found.stage_pods)}
    return asked


def meshtrain_levels(job: api_spec.TrainingJobSpec, fabric: Fabric) -> list[dict[str, str]]:
    """``spec.topology.levels`` giving meshtrain the same :func:`constraints` as Kueue: the job's
    fabric levels (all preferred, as meshtrain weighs every level), the one the job or each stage
    is required in made ``mode: required`` (``scope: stage`` for a stage), the NVLink-domain label
    appended last when that is the level."""
    found = constraints(job, fabric)
    kept = {found.required: "job", found.stage: "stage"}
    kept.pop(None, None)
    levels: list[dict[str, str]] = []
    for level in job.topology.levels:
        levels.append({"label": level.label})
    domain = job.topology.nvlink_domain_label
    if domain is not None and domain in kept:
        levels.append({"label": domain})
    for level in levels:
        if level["label"] in kept:
            level |= {"mode": "required", "scope": kept[level["label"]]}
    return levels


def batch_job(
    name: str,
    namespace: str,
    queue: str,
    job: api_spec.TrainingJobSpec,
    fabric: Fabric,
    pod_metadata: Mapping[str, Mapping[str, str]] | None = None,
    image: str = "registry.k8s.io/pause:3.10",
) -> dict[str, Any]:
    """An Indexed, suspended batch Job in ``queue`` with one pod per node slot of ``job``.

    ``pod_metadata`` (``labels``/``annotations``) is merged into the pod template (e.g. the
    simulated fleet's run time of a pod).
    """
    pods = job.parallelism.layout.pods(job.resources.gpus_per_node)
    gpus = {job.resources.gpu_resource_name: str(job.resources.gpus_per_node)}
    extra = dict(pod_metadata or {})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {"name": "trainer", "image": image, "resources": {"requests": gpus, "limits": gpus}}
        ],
    }
    if job.resources.node_selector:
        pod_spec["nodeSelector"] = dict(job.resources.node_selector)
    if job.resources.tolerations:
        pod_spec["tolerations"] = [
            toleration.model_dump(by_alias=True, exclude_none=True)
            for toleration in job.resources.tolerations
        ]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": {QUEUE_NAME_LABEL: queue}},
        "spec": {
            "suspend": True,
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimit": job.run_policy.backoff_limit,
            "template": {
                "metadata": {
                    "labels": dict(extra.get("labels") or {}),
                    "annotations": {
                        **(extra.get("annotations") or {}),
                        **annotations(job, fabric),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def queue_objects(
    fabric: Fabric,
    queue: str,
    namespace: str,
    gpus: int,
    gpu_resource: str = "nvidia.com/gpu",
    node_labels: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Topology, ResourceFlavor (nodes with ``node_labels``), ClusterQueue of ``gpus``, LocalQueue.

    The flavor's ``tolerations`` are what the fleet's taints need (Kueue adds them to the pods).
    """
    api = f"{KUEUE}/v1beta2"
    flavor: dict[str, Any] = {"nodeLabels": dict(node_labels or {}), "topologyName": queue}
    if tolerations:
        flavor["tolerations"] = [dict(toleration) for toleration in tolerations]
    quota = [{"name": gpu_resource, "nominalQuota": gpus}]
    group = {"coveredResources": [gpu_resource], "flavors": [{"name": queue, "resources": quota}]}
    return [
        {
            "apiVersion": api,
            "kind": "Topology",
            "metadata": {"name": queue},
            "spec": {"levels": [{"nodeLabel": label} for label in fabric.levels]},
        },
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": queue}, "spec": flavor},
        {
            "apiVersion": api,
            "kind": "ClusterQueue",
            "metadata": {"name": queue},
            "spec": {"namespaceSelector": {}, "resourceGroups": [group]},
        },
        {
            "apiVersion": api,
            "kind": "LocalQueue",
            "metadata": {"name": queue, "namespace": namespace},
            "spec": {"clusterQueue": queue},
        },
    ]


def pod_nodes(pods: Sequence[Mapping[str, Any]], count: int) -> list[str] | None:
    """Node of each completion index among ``pods`` (running or ungated with a hostname), or None.

    A pod's node is ``spec.nodeName`` once bound, else the ``kubernetes.io/hostname`` Kueue's
    ungater put in its node selector; None until every index 0..count-1 has one.
    """
    nodes: dict[int, str] = {}
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        spec = pod.get("spec") or {}
        node = spec.get("nodeName") or (spec.get("nodeSelector") or {}).get(HOSTNAME)
        index = labels.get(COMPLETION_INDEX)
        if node and index is not None and index.isdigit() and int(index) < count:
            nodes[int(index)] = str(node)
    if len(nodes) < count:
        return None
    return [nodes[index] for index in range(count)]
