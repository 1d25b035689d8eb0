"""What one pass of the state machine sees of a job, the rows of its table, and their sections.

:class:`Situation` holds what ``lifecycle.decide`` is given and the facts several rules read,
each worked out once, when a rule first asks.  A :class:`Rule` decides the pass when its guard
holds; a :class:`Note` owes actions that every decision below it carries first.  A
:class:`Section` names what the rows above it leave for the rows in it (the gang exists, it
runs, ...): its condition is part of each of their guards.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import (
    conditions,
    container_reasons,
    device_errors,
    gang_status,
    identity,
    job_actions,
    job_state,
    kueue_topology,
    kueue_workload,
    pod_failure,
    pod_state,
    replacement,
    rescheduling,
)

Fact = TypeVar("Fact")

LEAVING_RECHECK_SECONDS = 30.0
"""Safety recheck while a dropped placement's pods are still there (their deletion wakes the job)."""


@dataclasses.dataclass(frozen=True)
class Situation:
    """One job at one pass: what the state machine is given, and what follows from it."""

    job: job_state.JobState
    pods: tuple[pod_state.PodState, ...]
    """Every pod labelled with the job, of any attempt."""
    now: datetime.datetime
    kueue: kueue_workload.Gate | None = None
    """Kueue's answer for a job it queues (None: the job is not queued)."""
    nodes_gone: frozenset[str] = frozenset()
    """Nodes of ``status.placement`` that no longer exist."""
    spares_holding: int = 0
    """The job's spare pods (``runPolicy.recovery.spareNodes``) that still hold resources: they
    are no pods of the gang, but hold GPUs (and Kueue quota) until they are gone."""
    node_labels: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    """Labels of the nodes the job's pods are on or planned on (a node not here is not judged
    against Kueue TAS's assignment)."""
    store_loss: pod_failure.Failure | None = None
    """The placed gang's rendezvous store pod lost (``store_pod.loss``; None: it serves, or the
    job has none)."""
    _facts: dict[Callable[[Situation], Any], Any] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def holding(self) -> bool:
        """Whether a pod of the job, a spare included, still holds its node's resources."""
        return self.spares_holding > 0 or pod_state.holding(self.pods)

    def once(self, fact: Callable[[Situation], Fact]) -> Fact:
        """``fact(self)``, worked out at the first ask: a rule's guard and decision share it."""
        if fact not in self._facts:
            self._facts[fact] = fact(self)
        return cast("Fact", self._facts[fact])

    @functools.cached_property
    def phase(self) -> str:
        return str(self.job.status.get("phase") or job_state.Phase.PENDING.value)

    @functools.cached_property
    def finished(self) -> bool:
        """Succeeded or Failed."""
        return self.phase in job_state.FINAL

    @property
    def spec(self) -> api_spec.TrainingJobSpec:
        """The valid spec: read only in :data:`VALID` and the sections within it."""
        assert self.job.spec is not None
        return self.job.spec

    @functools.cached_property
    def kueue_admits(self) -> bool:
        """Whether Kueue lets the gang exist: the job is not queued, or its Workload is admitted."""
        return self.kueue is None or isinstance(self.kueue.state, kueue_workload.Admitted)

    @functools.cached_property
    def left_kueue(self) -> bool:
        """Whether the job was queued and no longer is (its queue label and Workload are gone)."""
        return self.kueue is None and kueue_workload.was_queued(self.job.status)

    @functools.cached_property
    def workload_open(self) -> bool:
        """Whether the job has a Workload Kueue is not done with."""
        return (
            self.kueue is not None
            and self.kueue.state is not None
            and not isinstance(self.kueue.state, kueue_workload.Finished)
        )

    @functools.cached_property
    def placed(self) -> bool:
        """Whether a placement is recorded (``status.placement``)."""
        return bool(self.job.status.get("placement"))

    @functools.cached_property
    def spec_changed(self) -> bool:
        """Whether the spec no longer hashes as the one the placement was made for (``status.specHash``)."""
        built_from = self.job.status.get("specHash")
        if not built_from:
            return False
        return not identity.same_spec(built_from, self.spec)

    @functools.cached_property
    def attempt(self) -> int:
        """The gang attempt (``status.restarts``): its pods carry it as a label."""
        return int(self.job.status.get("restarts") or 0)

    @functools.cached_property
    def current(self) -> tuple[pod_state.PodState, ...]:
        """The pods of the current attempt (the gang), but those a replacement superseded; any other is stale."""
        placed = replacement.entries(self.job.status)
        name, attempt = self.job.ref.name, self.attempt
        gang = tuple(
            p
            for p in self.pods
            if p.attempt == attempt and not replacement.superseded(name, attempt, placed, p)
        )
        if self.job.spec is not None and self.job.spec.trainer.type == "builtin":
            return gang
        # a custom program's failure report is its own say: no device error of its is the node's
        return tuple(
            dataclasses.replace(p, device_error_ranks=()) if p.device_error_ranks else p
            for p in gang
        )

    @functools.cached_property
    def stale(self) -> tuple[pod_state.PodState, ...]:
        """Pods of an earlier attempt, and pods of this one a replacement superseded."""
        kept = {(p.name, p.uid) for p in self.current}
        return tuple(p for p in self.pods if (p.name, p.uid) not in kept)

    @functools.cached_property
    def missing(self) -> tuple[int, ...]:
        """Pod indices of the gang without a pod."""
        present = {p.index for p in self.current}
        return tuple(i for i in range(self.spec.pods) if i not in present)

    @functools.cached_property
    def failures(self) -> tuple[pod_failure.Failure, ...]:
        """The failed pods of the gang; without any, a pod missing from the released gang; the
        store pod's loss first."""
        placement = self.job.status.get("placement") or []
        found = pod_failure.of_gang(
            self.current, self.missing, placement, self.nodes_gone, self.now
        )
        if any(p.left_bad_gpu for p in self.current):
            # the ranks that gave up (75) followed the pod that left a bad GPU (with the store,
            # when pod 0 hosted it): that pod's loss is the cause
            found = tuple(f for f in found if not f.gave_up)
        elif named := [p for p in self.current if p.device_error_ranks]:
            # a device error halted the gang and every pod's report names its ranks: the pods that
            # ran them say the cause (while none of those has exited, the first that names them)
            failed, gpus = device_errors.reported_ranks(named), self.spec.resources.gpus_per_node
            ran = {self.spec.parallelism.layout.pod_of(r, gpus) for r in failed}
            sayers = {p.name for p in named if p.index in ran} or {named[0].name}
            found = tuple(f for f in found if not f.gave_up or f.pod in sayers)
        if self.store_loss is None or any(p.phase == "Succeeded" for p in self.current):
            return found  # a rank finished: the store may go with its finished gang
        # the ranks that gave up (75) lost the store with it: the store's loss is the cause
        return (self.store_loss, *(f for f in found if not f.gave_up))

    @functools.cached_property
    def gang_running(self) -> bool:
        """Whether every pod of the gang is released and Running (or already Succeeded)."""
        return pod_state.all_running(self.current)

    @functools.cached_property
    def flavors(self) -> tuple[str, ...]:
        """The ResourceFlavors Kueue admitted the job with (none when not queued)."""
        if self.kueue is not None and isinstance(self.kueue.state, kueue_workload.Admitted):
            return self.kueue.state.flavors
        return ()

    @functools.cached_property
    def topology(self) -> kueue_topology.Assignment | None:
        """Kueue TAS's topologyAssignment of the admitted gang (None: none, or not queued)."""
        if self.kueue is not None and isinstance(self.kueue.state, kueue_workload.Admitted):
            return self.kueue.state.topology
        return None

    @functools.cached_property
    def observed(self) -> gang_status.Observed:
        """What the gang's pods say about Placed and PodsScheduled."""
        return gang_status.observe(
            job_state.conditions_of(self.job), self.current, self.spec.pods, self.now
        )

    @functools.cached_property
    def gated(self) -> tuple[str, ...]:
        """Pods of the gang still behind the gang gate."""
        return tuple(p.name for p in self.current if p.gated)

    @functools.cached_property
    def observation(self) -> tuple[job_actions.SetStatus, ...]:
        """The write of :attr:`observed`'s conditions, when they changed."""
        if self.observed.conditions == job_state.conditions_of(self.job):
            return ()
        return (job_actions.set_status(self.job, conditions=self.observed.conditions),)

    @property
    def observation_unwritten(self) -> tuple[job_actions.SetStatus, ...]:
        """:attr:`observation`, unless the gates are lifted this pass (which writes it first)."""
        return () if self.gated else self.observation

    @functools.cached_property
    def refusals(self) -> rescheduling.Refusals:
        """Released pods kube-scheduler refused on their planned nodes."""
        return rescheduling.refused(self.current, self.now)

    @functools.cached_property
    def startup_left(self) -> float | None:
        """Seconds of ``startupTimeoutSeconds`` left since the gang's first pod was created (None: no pod);
        in a gang that ran (phase Running), since its newest pod (a replacement) was created, and
        for a gang that rejoins, of ``rejoinTimeoutSeconds`` (what its survivors wait).

        While the kubelet pulls a pod's image (``PodState.pulling``: past its volumes and sandbox)
        the timeout waits, for up to ``container_reasons.PULL_ALLOWANCE_SECONDS`` more.
        """
        created = [p.created_at for p in self.current if p.created_at is not None]
        if not created:
            return None
        ran = self.phase == job_state.Phase.RUNNING.value
        if ran and replacement.rejoins(self.spec):
            # The survivors wait for a replacement only rejoinTimeoutSeconds, then give up (75):
            # waiting longer for it is time the gang cannot use.
            timeout = self.spec.run_policy.recovery.rejoin_timeout_seconds
        else:
            timeout = self.spec.run_policy.startup_timeout_seconds
            if any(p.pulling and not p.terminal for p in self.current):
                timeout += container_reasons.PULL_ALLOWANCE_SECONDS
        # A gang that ran waits only for a replaced pod: its clock starts with that pod.
        first = max(created) if ran else min(created)
        return (first + datetime.timedelta(seconds=timeout) - self.now).total_seconds()


@dataclasses.dataclass(frozen=True)
class Rule:
    """A row that decides: the first rule whose guard holds decides the pass."""

    name: str
    """What it checks and decides, as the table reads."""
    when: Callable[[Situation], bool]
    """The guard: its section's condition, and then its own."""
    then: Callable[[Situation], job_actions.Decision]
    """What it decides; the actions the notes above it owe go first."""
    owed: bool = True
    """False: its decision stands alone, without what the notes above it owe."""
    section: Section | None = None
    """The section it lies in (None: the whole table); the table's last rule lies in one its guard
    need not say, since the rows above it leave only that section."""


@dataclasses.dataclass(frozen=True)
class Note:
    """A row that decides nothing: actions every decision below it carries first (none: nothing owed)."""

    name: str
    """What it adds, as the table reads."""
    adds: Callable[[Situation], tuple[job_actions.Action, ...]]
    """The actions, none outside its section."""
    section: Section | None = None
    """The section it lies in (None: the whole table)."""


@dataclasses.dataclass(frozen=True)
class Section:
    """A named part of the table: what the rows above it leave for the rows in it.

    Its rows' guards hold only inside it, so no row rests on the ones above it unsaid.
    """

    name: str
    """What holds in it."""
    holds: Callable[[Situation], bool]
    """Its condition, read once the sections around it cover the situation."""
    within: Section | None = None
    """The section it lies in (None: the whole table)."""

    def covers(self, seen: Situation) -> bool:
        """Whether ``seen`` lies in this section (and in the sections around it)."""
        return (self.within is None or self.within.covers(seen)) and self.holds(seen)

    def rule(
        self,
        name: str,
        when: Callable[[Situation], bool],
        then: Callable[[Situation], job_actions.Decision],
        owed: bool = True,
    ) -> Rule:
        """A rule of this section: it decides when the section covers the situation and ``when`` holds."""
        return Rule(name, lambda seen: self.covers(seen) and when(seen), then, owed, self)

    def note(self, name: str, adds: Callable[[Situation], tuple[job_actions.Action, ...]]) -> Note:
        """A note of this section: it adds nothing outside it."""
        return Note(name, lambda seen: adds(seen) if self.covers(seen) else (), self)


FINISHED = Section("finished: Succeeded or Failed", lambda seen: seen.finished)
VALID = Section(
    "not finished, the spec keeps every rule",
    lambda seen: not seen.finished and seen.job.spec is not None,
)
MAY_RUN = Section(
    "the gang may exist: not suspended, not held by Kueue",
    lambda seen: (
        not seen.spec.run_policy.suspend
        and seen.phase != job_state.Phase.SUSPENDED.value
        and not seen.left_kueue
        and seen.kueue_admits
    ),
    VALID,
)
UNPLACED = Section("no placement recorded", lambda seen: not seen.placed, MAY_RUN)
SPEC_CHANGED = Section(
    "placed for an earlier spec", lambda seen: seen.placed and seen.spec_changed, MAY_RUN
)
PLACED = Section(
    "placed for the spec as it is", lambda seen: seen.placed and not seen.spec_changed, MAY_RUN
)
GANG_EXISTS = Section(
    "every pod of the gang exists, none failed",
    lambda seen: not seen.missing and not seen.failures,
    PLACED,
)
GANG_RUNNING = Section("every pod of the gang runs", lambda seen: seen.gang_running, GANG_EXISTS)
GANG_STARTING = Section(
    "the gang is starting: not every pod runs yet", lambda seen: not seen.gang_running, GANG_EXISTS
)


def set_conditions(
    situation: Situation, reason: str, message: str, *changes: tuple[str, str]
) -> list[dict[str, Any]]:
    """The job's conditions with each ``(type, status)`` of ``changes`` set now, for one reason and message."""
    conds = job_state.conditions_of(situation.job)
    for type_, status in changes:
        conds = conditions.set(conds, type_, status, reason, message, situation.now)
    return conds


def gang_stopped(
    seen: Situation,
    status: job_actions.SetStatus,
    event: job_actions.Emit,
    grace_seconds: int | None = None,
) -> job_actions.Decision:
    """``status`` and ``event``, then the gang's pods deleted (``grace_seconds``); look again at once."""
    doomed = pod_state.undeleted(seen.current)
    deleted = (job_actions.DeletePods(doomed, grace_seconds),) if doomed else ()
    return job_actions.Decision((status, event, *deleted), requeue_after=0)
