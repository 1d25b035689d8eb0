"""The status subresource of a TrainingJob: phase, conditions, placement, progress, and what the
operator decided about elastic sizes and stragglers.  Written only by the operator."""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import Field

from meshtrain.api import limits
from meshtrain.api.spec import base


class Phase(str, enum.Enum):
    """Lifecycle phase of a TrainingJob (see docs/architecture.md)."""

    PENDING = "Pending"
    PLACING = "Placing"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Condition(base.StatusModel):
    """A Kubernetes-style condition."""

    type: str = Field(
        description="Condition type, e.g. Placed, Running, Succeeded, Failed, WontFit."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(
        description="CamelCase reason, a constant of meshtrain.operator.policy.conditions."
    )
    message: str = Field("", description="Human explanation with the numbers.")
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")


class PodPlacement(base.StatusModel):
    """The node chosen for one pod of the gang."""

    pod_index: int = Field(
        ge=0, description="Node rank: the pod holds ranks [i*gpusPerNode, (i+1)*gpusPerNode)."
    )
    node: str = Field(description="Node name.")
    pod: str | None = Field(
        None,
        max_length=limits.MAX_POD_NAME_LENGTH,
        description="The pod that holds this index once a lost pod was replaced alone "
        "(runPolicy.recovery); absent: the gang's own <job>-r<attempt>-<index>.",
    )
    replaced: int | None = Field(
        None,
        ge=0,
        le=limits.MAX_COUNT,
        description="Times this index was replaced in this gang attempt (absent: never).",
    )
    previous_node: str | None = Field(
        None,
        max_length=limits.MAX_NODE_NAME_LENGTH,
        description="The node of the pod this index's replacement took over from (absent: never "
        "replaced): a recovery record read after the replacement may name it for its failed ranks.",
    )
    pending: bool | None = Field(
        None,
        description="The replacement named by pod is recorded but not created yet (a pass after "
        "an operator crash creates it); absent once created.",
    )


class SpareNode(base.StatusModel):
    """A node held in reserve for the job (runPolicy.recovery.spareNodes) by a spare pod."""

    pod: str = Field(max_length=limits.MAX_POD_NAME_LENGTH, description="The spare pod.")
    node: str = Field(description="The node whose GPUs it holds for a replacement.")


class Progress(base.StatusModel):
    """Last training progress reported by rank 0."""

    step: int = Field(0, ge=0, description="Last completed optimizer step.")
    loss: float | None = Field(None, description="Loss at that step.")
    tokens_per_second: float | None = Field(None, description="Throughput of the whole job.")
    eval_loss: float | None = Field(None, description="Validation loss of the last evaluation.")
    skipped_updates: int | None = Field(
        None, ge=0, description="Updates the loss guard skipped so far (in this run of the gang)."
    )
    gradient_noise_scale: float | None = Field(
        None,
        description="Measured gradient noise scale (McCandlish et al. 2018): the batch beyond which more "
        "data parallelism stops paying (needs data >= 2).",
    )
    updated_at: str | None = Field(None, description="RFC 3339 time of the report.")
    resumed_from_uid: str | None = Field(
        None,
        max_length=limits.MAX_UID_LENGTH,
        description="UID of the job that wrote the checkpoint this gang resumed from; another than "
        "metadata.uid when the job was deleted and applied again (docs/checkpoints.md).",
    )


class LostSeconds(base.StatusModel):
    """Seconds lost to failures, by phase."""

    detection: float = Field(0.0, ge=0, description="Failure to its detection.")
    restart: float = Field(0.0, ge=0, description="Detection to the process groups rebuilt.")
    reload: float = Field(0.0, ge=0, description="Process groups rebuilt to the state loaded.")
    recompute: float = Field(
        0.0, ge=0, description="Steps done and done again after a restore, and steps cut short."
    )


class Goodput(base.StatusModel):
    """Productive step time over wall time since the job's creation, across restarts (rank 0's
    steps.jsonl and recoveries.jsonl, docs/telemetry.md, "Goodput")."""

    ratio: float | None = Field(None, ge=0, le=1, description="productiveSeconds / wallSeconds.")
    productive_seconds: float = Field(0.0, ge=0, description="Step time of each step's last run.")
    wall_seconds: float = Field(0.0, ge=0, description="Wall time since the first step started.")
    lost_seconds: LostSeconds | None = Field(None, description="Time lost to failures, by phase.")


class ElasticStatus(base.StatusModel):
    """The size a gang of a job with ``runPolicy.elastic`` was placed at."""

    data: int = Field(ge=1, description="Data-parallel degree of the placed gang.")
    micro_batches: int = Field(ge=1, description="Micro-batches per replica at that degree.")
    global_batch: int = Field(ge=1, description="Global batch at that degree.")
    learning_rate: float = Field(
        description="Peak learning rate at that global batch (training.lrScaling applied; under none the "
        "declared rate times the batch ratio)."
    )
    checkpoint_step: int | None = Field(
        None,
        description=(
            "Checkpoint step the gang placed at this size resumed from, as its first progress report "
            "states it (unset until then); it grows only after a newer one."
        ),
    )
    message: str = Field("", description="What changed and why.")
    resized_at: str | None = Field(
        None,
        description="RFC 3339 time the gang was last placed at another degree than before (a shrink or a "
        "grow); the next grow waits runPolicy.elastic.minResizeIntervalSeconds from it.",
    )
    room_since: str | None = Field(
        None,
        description="RFC 3339 time since which every grow check found room for a larger degree (empty when "
        "the last one found none); the gang grows once that lasted runPolicy.elastic.growStableSeconds.",
    )


class OtherStraggler(base.StatusModel):
    """Another rank flagged at the same time, and where it runs."""

    rank: int = Field(ge=0, description="Global rank.")
    pod_index: int | None = Field(None, ge=0, description="Node rank of its pod.")
    node: str | None = Field(None, description="Node the pod was placed on.")
    slowdown: float = Field(description="Its compute time over its peers' median.")


class Straggler(base.StatusModel):
    """The rank the trainer flagged as persistently slower than its peers, and where it runs."""

    rank: int = Field(ge=0, description="Global rank of the slowest flagged rank.")
    pod_index: int | None = Field(None, ge=0, description="Node rank of its pod.")
    node: str | None = Field(None, description="Node the pod was placed on.")
    slowdown: float = Field(
        description="Its compute time over its peers' median (median over the window)."
    )
    since_step: int | None = Field(
        None, ge=0, description="Step at which it was first flagged in this run of the gang."
    )
    since: str | None = Field(None, description="RFC 3339 time the operator first saw it.")
    others: list[OtherStraggler] = Field(
        default_factory=list,
        description="The other ranks flagged now, slowest first; replace excludes their nodes too.",
    )


class Backfill(base.StatusModel):
    """The job was placed on nodes reserved for another job because its deadline ends it first."""

    holder: str = Field(description="namespace/name of the job the nodes were reserved for.")
    deadline_at: str = Field(
        description="RFC 3339 time the job is failed at the latest: status.startTime plus "
        "runPolicy.activeDeadlineSeconds when it was placed there. Raising or removing the "
        "deadline later does not move it; a resume from suspend clears it."
    )


class ExcludedNode(base.StatusModel):
    """A node this job is not placed on again."""

    node: str = Field(description="Node name.")
    reason: str = Field(
        description="Why: Straggler, Disrupted (it disrupted the job twice), or BadGPU (a GPU of"
        " the job's pod there failed twice within an hour, or is gone)."
    )
    message: str = Field(
        "",
        description="With the numbers: rank, slowdown, step; the disruptions; or the"
        " supervisor's words for the bad GPU.",
    )
    time: str | None = Field(None, description="RFC 3339 time it was excluded.")
    rank: int | None = Field(
        None, ge=0, description="The straggler rank that was on it (reason Straggler)."
    )


class DeviceError(base.StatusModel):
    """A device error of one of the job's GPUs (an uncorrectable ECC or NVLink error), by node."""

    node: str = Field(description="Node of the GPU that failed.")
    time: str = Field(description="RFC 3339 time it failed.")
    ranks: list[Annotated[int, Field(ge=0, description="A global rank.")]] = Field(
        default_factory=list,
        max_length=8,
        description="The ranks whose GPU failed there (at most 8).",
    )
    message: str = Field("", description="How the operator learned of it.")


class DisruptedNode(base.StatusModel):
    """A node that disrupted this job's gang (runPolicy.disruptionRestartLimit)."""

    node: str = Field(description="Node name.")
    count: int = Field(ge=1, description="Gang restarts it caused.")
    reason: str = Field(
        "", description="The last disruption's reason, e.g. UnexpectedAdmissionError."
    )
    time: str | None = Field(None, description="RFC 3339 time of the last disruption.")


class Disruptions(base.StatusModel):
    """Gang restarts caused by disruptions: the run of them, when the next placement may go, and where."""

    streak: int = Field(
        0,
        ge=0,
        description="Disruption restarts in a row (since a gang last ran for 10 minutes); the job fails "
        "once it passes runPolicy.disruptionRestartLimit.",
    )
    preemptions: int = Field(
        0,
        ge=0,
        description="Preemption restarts in a row (kube-scheduler preemption, the Eviction API): "
        "spaced like the others, not counted against runPolicy.disruptionRestartLimit.",
    )
    not_before: str | None = Field(
        None,
        description="RFC 3339 time before which the gang is not placed again (exponential backoff "
        "with jitter after a repeated disruption).",
    )
    nodes: list[DisruptedNode] = Field(
        default_factory=list,
        description="The nodes that disrupted the job, most recent last (at most 32).",
    )


class FailedRanksNode(base.StatusModel):
    """A node failed ranks of an in-place recovery ran on."""

    node: str = Field(max_length=limits.MAX_NODE_NAME_LENGTH, description="Node name.")
    ranks: list[Annotated[int, Field(ge=0, description="A global rank.")]] = Field(
        default_factory=list, max_length=16, description="The failed ranks that ran there."
    )


class RecoveryRecord(base.StatusModel):
    """One in-place recovery: the trainer's record (``recoveries.jsonl``), or a container restart the kubelet made."""

    generation: int | None = Field(None, description="Rendezvous round training continued in.")
    tier: Literal["process", "container", "pod", "torchrun", "gang"] = Field(
        description="What was restarted: a process (a spare took its rank), a container (the kubelet's "
        "restart rules), a pod (re-placed), a custom trainer's worker group (torchrun's agent), the gang."
    )
    cause: str = Field(description="Why: exit 1, SIGKILL, OOMKilled, pod deleted, node lost, ...")
    pod: str | None = Field(
        None, description="The pod whose trainer container restarted (tier container)."
    )
    ranks: list[Annotated[int, Field(ge=0, description="A global rank.")]] = Field(
        default_factory=list, description="Global ranks that failed (at most 16)."
    )
    failed_at: float | None = Field(None, description="Unix time the failure was first observed.")
    detected_at: float | None = Field(
        None, description="Unix time the new rendezvous round started."
    )
    rejoined_at: float | None = Field(
        None, description="Unix time the process groups were rebuilt."
    )
    restored_at: float | None = Field(None, description="Unix time the state was loaded.")
    resumed_step: int | None = Field(None, description="Step training continued after.")
    source: Literal["memory", "storage", "none"] | None = Field(
        None, description="Where the restored state came from."
    )
    lost_steps: int | None = Field(None, description="Steps computed again.")
    first_step_at: float | None = Field(None, description="Unix time the next step completed.")
    nodes: list[FailedRanksNode] | None = Field(
        None,
        max_length=limits.MAX_RECOVERY_NODES,
        description="Where the failed ranks ran, as their pods' supervisors said (at most 2 nodes).",
    )


class RecoveryTiers(base.StatusModel):
    """In-place restarts by tier."""

    process: int = Field(0, ge=0, description="Worker processes the supervisor replaced.")
    container: int = Field(
        0, ge=0, description="Trainer containers the kubelet restarted in place."
    )
    pod: int = Field(0, ge=0, description="Pods re-placed while the others waited.")
    torchrun: int | None = Field(
        None,
        ge=0,
        description="A custom trainer's worker groups torchrun restarted after a failure (counted by "
        "pod 0's agent, as its progress report's recovery_counts.torchrun says); absent until the "
        "first is counted.",
    )


class CountedPod(base.StatusModel):
    """A pod whose trainer container restarts are counted."""

    uid: str = Field(max_length=128, description="The pod's UID.")
    restarts: int = Field(ge=0, description="Its trainer container's restartCount counted so far.")


class RecoveryStatus(base.StatusModel):
    """In-place restarts (runPolicy.recovery): counted once each, with the last one's cause."""

    in_place_restarts: int = Field(0, ge=0, description="In-place restarts of any tier so far.")
    by_tier: RecoveryTiers = Field(default_factory=RecoveryTiers, description="The same, by tier.")
    last: RecoveryRecord | None = Field(None, description="The newest in-place recovery.")
    attempt: int = Field(
        0, ge=0, description="Gang attempt (status.restarts) the counts below are of."
    )
    attempt_restarts: int = Field(
        0,
        ge=0,
        description="In-place restarts of that gang attempt: past runPolicy.recovery.inPlaceLimit the "
        "gang is rebuilt.",
    )
    attempt_disruptions: int = Field(
        0,
        ge=0,
        description="Of attemptRestarts, those disruptions caused (pods and nodes lost): the rebuild past "
        "the limit is a disruption when the others stay within it.",
    )
    counted_at: str | None = Field(
        None,
        description="When the last in-place restart of that attempt was counted: once the gang has run "
        "10 minutes since (and since it last started running), attemptRestarts starts again.",
    )
    counted_generation: int | None = Field(
        None,
        description="Newest rendezvous round of the trainer's records counted in that attempt.",
    )
    counted_process: int | None = Field(
        None,
        ge=0,
        description="The trainer store's cumulative process-tier count (its progress report's "
        "recovery_counts) counted in that attempt.",
    )
    counted_torchrun: int | None = Field(
        None,
        ge=0,
        description="Pod 0's torchrun restart count (TORCHELASTIC_RESTART_COUNT, its progress "
        "report's recovery_counts.torchrun) counted in that attempt.",
    )
    counted_pods: list[CountedPod] = Field(
        default_factory=list,
        max_length=limits.MAX_COUNTED_PODS,
        description="Pods of that attempt whose container restarts are counted (each restart once).",
    )


class TrainingJobStatus(base.StatusModel):
    """The status subresource of a TrainingJob."""

    phase: Phase = Field(Phase.PENDING, description="Lifecycle phase.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Conditions with reasons and messages."
    )
    layout: str | None = Field(None, description="Layout such as dp2·pp4·tp8.")
    world_size: int | None = Field(None, description="Processes in the job, one GPU each.")
    placement: list[PodPlacement] = Field(
        default_factory=list, description="Node per pod (rank block)."
    )
    spares: list[SpareNode] = Field(
        default_factory=list,
        max_length=limits.MAX_SPARE_NODES,
        description="Nodes held in reserve while the gang runs (runPolicy.recovery.spareNodes): a lost "
        "pod's replacement takes one first.",
    )
    cross_level_bytes: dict[str, float] = Field(
        default_factory=dict, description="Predicted bytes per step crossing each fabric level."
    )
    restarts: int = Field(0, ge=0, description="Gang restarts so far.")
    disruption_restarts: int = Field(
        0,
        ge=0,
        description="Of restarts, those caused by a node lost or a pod disrupted (eviction, preemption, "
        "drain, node shutdown): not counted against runPolicy.backoffLimit.",
    )
    disruptions: Disruptions | None = Field(
        None,
        description="Set after a disruption restart: the streak, the backoff and the nodes that caused them.",
    )
    last_checkpoint_step: int | None = Field(
        None, description="Step of the newest complete checkpoint."
    )
    progress: Progress | None = Field(None, description="Last reported training progress.")
    goodput: Goodput | None = Field(
        None, description="Goodput and the time lost to failures, as rank 0 last reported them."
    )
    plan: dict[str, Any] = Field(
        default_factory=dict,
        description="Key numbers of the planner: memory per GPU, step time, bubble.",
    )
    start_time: str | None = Field(None, description="When the pods first ran.")
    backfill: Backfill | None = Field(
        None,
        description="Set when the job was placed on nodes reserved for a job that waited longer, "
        "its deadline ending it before those nodes clear (backfill): the deadline then in force.",
    )
    queued_since: str | None = Field(
        None,
        description="When the job began to wait for its placement (RFC 3339): the order of the "
        "waiting jobs, oldest first, after priority. Kept when the gang is rebuilt for a cause "
        "that is not its own (a node or pod lost, a GPU taken for bad, a preemption, a "
        "straggler's rebuild), so it waits in its old place while its spec is unchanged; "
        "cleared by its own failure, a spec change, a resume, an elastic grow or a Kueue hold.",
    )
    queued_generation: int | None = Field(
        None,
        description="The spec generation queuedSince was kept for: a spec edited since waits "
        "from its own start.",
    )
    completion_time: str | None = Field(None, description="When the job succeeded or failed.")
    observed_generation: int | None = Field(
        None, description="Spec generation the status describes."
    )
    spec_hash: str | None = Field(
        None,
        description="Hash of the spec (runPolicy left out) the placed gang was built from; "
        "a spec with another hash makes the operator rebuild the gang.",
    )
    elastic: ElasticStatus | None = Field(
        None,
        description="Set once a job with runPolicy.elastic is placed: the data-parallel degree, batch and "
        "learning rate its gang runs with (the Resized condition says whether that is parallelism.data).",
    )
    straggler: Straggler | None = Field(
        None,
        description="The rank the trainer flags as a straggler now (runPolicy.stragglerPolicy); empty when none.",
    )
    excluded_nodes: list[ExcludedNode] = Field(
        default_factory=list,
        description="Nodes a straggler was replaced on, that disrupted the job twice, or where a GPU"
        " of its pod was taken for bad; each is left out of this job's placements for 24 h after its"
        " time.",
    )
    device_errors: list[DeviceError] = Field(
        default_factory=list,
        max_length=32,
        description="The job's newest 32 device errors, by node, kept across its gangs: a pod placed"
        " on a node within an hour of one there is told its time (MESHTRAIN_DEVICE_ERROR_AT), so that"
        " one more device error takes the GPU for bad at once (exit 79, the node excluded).",
    )
    straggler_replacements: int = Field(
        0, ge=0, description="Gangs rebuilt without a straggler's node so far."
    )
    recovery: RecoveryStatus | None = Field(
        None,
        description="In-place restarts (process, container, pod) counted with their cause; set after the first.",
    )
