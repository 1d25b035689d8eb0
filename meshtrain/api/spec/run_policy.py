"""``spec.runPolicy``: failure, time and lifetime policy, elastic data parallelism and straggler
handling, and the rule on the section alone (the ones that read the layout or the checkpoint
are in :mod:`meshtrain.api.spec.cross_section` and :mod:`meshtrain.api.elastic`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshtrain.api import limits
from meshtrain.api.spec import base


class Elastic(base.SpecModel):
    """The data-parallel degrees a job may run at when nodes are lost or come back.

    ``parallelism.data`` states the global batch (microBatch x microBatches x data); at another
    degree the operator raises or lowers microBatches to keep it, or states the change in status.
    """

    min_data: int = Field(
        ge=1,
        le=limits.MAX_DATA,
        description="Smallest data-parallel degree the job may shrink to when a node is lost and no equal "
        "replacement fits.",
    )
    max_data: int = Field(
        ge=1,
        le=limits.MAX_DATA,
        description="Largest data-parallel degree the job may grow to when capacity is free (at the next "
        "checkpoint).",
    )
    grow_stable_seconds: int = Field(
        120,
        ge=0,
        le=86400,
        description="Grow only after room for a larger degree was found at every check (about every 10 s) "
        "for this long, so capacity that comes and goes (a flapping node) does not rebuild the gang.",
    )
    min_resize_interval_seconds: int = Field(
        600,
        ge=0,
        le=86400,
        description="Least time between two resizes of the gang: a grow waits until this long after the last "
        "shrink or grow. A shrink is never delayed (the gang lost a node and cannot run at its size), but it "
        "starts the interval.",
    )


class StragglerPolicy(base.SpecModel):
    """What to do about a rank that computes persistently slower than its data-parallel peers."""

    action: Literal["ignore", "report", "replace"] = Field(
        "report",
        description="ignore: no detection; report: status.straggler, a Straggler condition, an Event and the "
        "slowdown metric; replace: also stop the gang at a step boundary with a checkpoint and place it again "
        "without the slow rank's node (status.excludedNodes), resuming from that step.",
    )
    threshold: float = Field(
        1.25,
        gt=1,
        description="A rank is a straggler when its compute time is more than this factor of its peers' median "
        "(the median over the window of per-step ratios).",
    )
    window: int = Field(
        20,
        ge=4,
        le=10000,
        description="Steps the slowdown is judged over; a rank is flagged once more than half of the last "
        "window steps were slow, so detection takes about window/2 steps.",
    )
    max_replacements: int = Field(
        3,
        ge=0,
        le=limits.MAX_COUNT,
        description="replace: nodes excluded for this job at most; after that a straggler is only reported.",
    )


STEADY_RUNNING_SECONDS = 600
"""A gang that has run this long with no restart has recovered: its in-place restart count
(``inPlaceLimit``, the operator's and the supervisor's) and its disruption restarts in a row
(``disruptionRestartLimit``) start again."""


class Recovery(base.SpecModel):
    """How a failed rank is recovered before the whole gang is rebuilt (docs/operator.md).

    In place: the pods stay where they are; the built-in trainer's supervisor replaces a failed
    worker process (a warm spare takes its rank) and the kubelet restarts a dead trainer container
    (container restart rules); every rank rejoins a new rendezvous round and training resumes.
    """

    in_place: bool = Field(
        True,
        description="Restart failed trainer processes and containers in place (no pod deleted, no placement "
        "redone). A custom trainer (trainer.type custom) only with torchrunElastic.",
    )
    in_place_limit: int = Field(
        10,
        ge=0,
        le=limits.MAX_COUNT,
        description="In-place restarts (any tier: process, container, pod) one gang attempt may make; the count "
        "starts again once the gang has run 10 minutes with no restart. Past it the operator rebuilds the whole "
        "gang, which counts against backoffLimit (against disruptionRestartLimit when lost pods or nodes used the "
        "budget up). 0: every failure rebuilds the gang.",
    )
    warm_spares: int = Field(
        1,
        ge=0,
        le=limits.MAX_GPUS_PER_NODE,
        description="Pre-started spare trainer processes per pod (torch imported, waiting for a rank), so a failed "
        "rank's replacement does not pay a cold Python and torch start; 0: a replacement starts cold.",
    )
    rejoin_timeout_seconds: int = Field(
        120,
        ge=1,
        le=limits.MAX_REJOIN_SECONDS,
        description="How long the ranks wait at a new rendezvous round for every rank (a replaced pod's included) "
        "before giving up; then the pods exit with the gang-restart code and the operator rebuilds the gang.",
    )
    stall_timeout_seconds: int = Field(
        600,
        ge=0,
        le=limits.MAX_REJOIN_SECONDS,
        description="A gang whose rank 0 made no progress (a restore, a completed step) for this long while every "
        "rank is in the round is taken as hung: a collective that never returns (a stuck GPU or link; NCCL's "
        "watchdog leaves the communicators to the supervisor's abort). It is recovered like a failed process: "
        "every rank's process groups are aborted and the gang meets in a new round in the same processes, an "
        "in-place restart with cause stalled (past inPlaceLimit, or without inPlace, the gang is rebuilt). Set it "
        "above the longest step plus an evaluation and a synchronous checkpoint save, and above the engine's build "
        "and the restore at a round's start (the final saves are not watched). 0: never. Built-in trainer only.",
    )
    spare_nodes: int = Field(
        0,
        ge=0,
        le=limits.MAX_SPARE_NODES,
        description="Nodes kept reserved for this job beside its gang, so a pod lost with its node is re-placed "
        "there without waiting for the scheduler; 0: none.",
    )
    rendezvous_store: Literal["pod0", "dedicated"] = Field(
        "pod0",
        description="Where the built-in trainer's rendezvous store runs (with inPlace; ignored otherwise). pod0: in "
        "pod 0's supervisor, so losing pod 0 or its node rebuilds the gang. dedicated: in a small pod of its own "
        "(no GPU, the job's tolerations, kept off the gang's nodes where the scheduler can), so a lost pod 0 is "
        "replaced alone like any other pod and only the store pod's own loss rebuilds the gang (docs/recovery.md).",
    )
    torchrun_elastic: bool = Field(
        False,
        description="A custom trainer whose command is torchrun (or python -m torch.distributed.run), with inPlace: "
        "its torchrun restarts all its workers in a new c10d rendezvous round (--max-restarts inPlaceLimit per "
        "agent), and where the operator serves it a pod but pod 0 whose torchrun is killed by a signal restarts whole "
        "in place (KEP-5532). torchrun's restarts are counted in status.recovery.byTier.torchrun when the program reports "
        "them (recovery_counts.torchrun on trainer.progressPort); gangs of more than 10 pods keep the gang "
        "rebuild (docs/recovery.md).",
    )

    @property
    def dedicated_store(self) -> bool:
        """Whether the built-in trainer's rendezvous store runs in a pod of its own (``dedicated``
        with ``inPlace``; without in-place recovery every failure rebuilds the gang anyway)."""
        return self.in_place and self.rendezvous_store == "dedicated"


class RunPolicy(base.SpecModel):
    """Failure, time and lifetime policy."""

    backoff_limit: int = Field(
        3, ge=0, le=limits.MAX_COUNT, description="Gang restarts allowed before the job fails."
    )
    disruption_restart_limit: int = Field(
        10,
        ge=0,
        le=1000,
        description="Gang restarts in a row caused by disruptions (node lost, eviction, preemption, a pod the "
        "kubelet refused such as UnexpectedAdmissionError) allowed before the job fails; not counted against "
        "backoffLimit. The count starts again once a gang has run for 10 minutes. Repeated disruptions wait "
        "with exponential backoff and jitter, and a node that disrupts the job twice is excluded "
        "(status.excludedNodes).",
    )
    active_deadline_seconds: int | None = Field(
        None,
        ge=1,
        le=limits.MAX_SECONDS,
        description="Fail the job when it has been active this long (seconds since status.startTime). A job that "
        "declares it may also run on nodes reserved for a gang that waited longer, when it ends before they "
        "would be clear for that gang (backfill).",
    )
    ttl_seconds_after_finished: int | None = Field(
        None,
        ge=0,
        le=limits.MAX_SECONDS,
        description="Delete the job this long after it succeeded or failed.",
    )
    startup_timeout_seconds: int = Field(
        600,
        ge=1,
        le=limits.MAX_SECONDS,
        description="Pods not all Running this long after creation count as a failed start.",
    )
    suspend: bool = Field(
        False,
        description="Remove the pods but keep the job and its status; setting it back to false re-places the job.",
    )
    termination_grace_period_seconds: int = Field(
        60,
        ge=10,
        le=86400,
        description="How long a deleted pod (suspend, spec change, drain) gets to stop: its ranks finish the current step "
        "and checkpoint it. The pods' terminationGracePeriodSeconds; torchrun waits 5 s less before killing the ranks.",
    )
    elastic: Elastic | None = Field(
        None,
        description="Run at any data-parallel degree from minData to maxData: the largest that fits, shrinking "
        "when a node is lost and growing back when capacity returns; empty: only at parallelism.data.",
    )
    straggler_policy: StragglerPolicy = Field(
        default_factory=StragglerPolicy,
        description="Detection of a slow rank (compared with its data-parallel peers) and what to do about it.",
    )
    recovery: Recovery = Field(
        default_factory=Recovery,
        description="In-place recovery of a failed rank (process, container) before the gang is rebuilt, its "
        "budget, warm spare processes, the rejoin timeout and spare nodes.",
    )


def _elastic_bounds(policy: RunPolicy) -> str | None:
    bounds = policy.elastic
    if bounds is not None and bounds.min_data > bounds.max_data:
        return (
            f"elastic.minData={bounds.min_data} is above elastic.maxData={bounds.max_data}: "
            "minData is the smallest data-parallel degree, maxData the largest"
        )
    return None


RULES: tuple[base.Rule[RunPolicy], ...] = (
    base.Rule(
        "elastic-bounds",
        "spec.runPolicy.elastic.minData",
        "!has(self.runPolicy.elastic) || self.runPolicy.elastic.minData <= self.runPolicy.elastic.maxData",
        "runPolicy.elastic.minData must not exceed runPolicy.elastic.maxData",
        _elastic_bounds,
    ),
)
"""Rules on the run policy alone."""
