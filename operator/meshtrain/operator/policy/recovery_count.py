"""In-place restarts of a gang counted in ``status.recovery``, each once, with its cause.

Two sources.  The kubelet's restarts of a pod's trainer container (its restart rules,
``kubelet_tier``): ``restartCount`` and ``lastState.terminated`` of each pod of the gang, tier
``container``.  The trainer's own records in rank 0's progress report (``recovery``): tiers
``process`` and ``pod`` (its ``container`` records are the restarts the pods show, counted from
them; they only give ``last`` its timings).  Each restart counts once, whichever pass sees it:
the status keeps what was counted (each pod's restartCount by UID, the newest generation of the
records), and starts again with each gang attempt.  The budget of the attempt
(``attemptRestarts``, checked against ``runPolicy.recovery.inPlaceLimit``) starts again too once the
gang has run ``conditions.STEADY_SECONDS`` with no restart (the rule of ``disruption_budget``); the
restarts in it that disruptions caused (lost pods and nodes: ``attemptDisruptions``) make the
rebuild past the limit a disruption.  A trainer record of a lower round than the newest counted
means pod 0's store started again (its rounds count from 0): its records are counted anew.  The
rows of the state machine that write it, and rebuild the gang past the limit, are ``in_place``'s.
Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import conditions, kubelet_tier, pod_failure, pod_state

TIERS = ("process", "container", "pod", "torchrun")
"""The in-place tiers ``status.recovery.byTier`` counts."""
REPORTED_TIERS = ("process",)
"""Tiers counted from the trainer's records (``container`` is counted from the pods, ``pod`` by the
operator as it creates the replacement: ``replacement.status_changes``, ``torchrun`` from the
report's cumulative count alone: :func:`_torchrun_restarts`)."""
TORCHRUN = "torchrun"
"""Tier of a custom trainer's worker group restarted by torchrun's elastic agent (``torchrun_tier``)."""
RECORD_KEYS = (
    "generation",
    "tier",
    "cause",
    "pod",
    "ranks",
    "failedAt",
    "detectedAt",
    "rejoinedAt",
    "restoredAt",
    "resumedStep",
    "source",
    "lostSteps",
    "firstStepAt",
    "nodes",
)
"""Keys of ``status.recovery.last``: every one is written (null when unknown), so a merge patch
leaves nothing of the record before."""
RESTARTED = "InPlaceRestart"
"""Event reason of each in-place restart counted."""
EXHAUSTED = "InPlaceRestartsExhausted"
"""Reason of the gang rebuild once in-place restarts exceed their budget."""
MAX_EVENTS = 4
"""Events one pass records; further restarts of the same pass are summed in the last."""
MAX_RANKS = 16
"""Global ranks a record lists."""


@dataclasses.dataclass(frozen=True)
class Restart:
    """One in-place restart, as it is counted."""

    tier: str
    """process, container or pod."""
    record: dict[str, Any]
    """Its ``status.recovery.last`` form (:data:`RECORD_KEYS`)."""
    told: str
    """What its Event says (without the budget)."""


@dataclasses.dataclass(frozen=True)
class Counted:
    """What this pass adds to ``status.recovery``: the new value and one Event per restart."""

    recovery: dict[str, Any] | None
    """The new ``status.recovery`` (None: nothing new)."""
    events: tuple[str, ...] = ()
    """The message of each Event (reason :data:`RESTARTED`)."""
    attempt_restarts: int = 0
    """In-place restarts of the current gang attempt, the new ones included."""
    named: tuple[dict[str, Any], ...] = ()
    """The trainer's records counted this pass (:data:`RECORD_KEYS`), for ``device_errors``."""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _budget_reset(
    stored: Mapping[str, Any], status: Mapping[str, Any], now: datetime.datetime
) -> bool:
    """Whether the gang ran :data:`conditions.STEADY_SECONDS` since the attempt's last restart."""
    at = stored.get("countedAt")
    try:
        since = conditions.parse_time(at if isinstance(at, str) else None)
    except ValueError:  # not written by this operator: no reset
        return False
    return since is not None and conditions.steady(status, now, since)


def book(
    status: Mapping[str, Any], attempt: int, now: datetime.datetime | None = None
) -> dict[str, Any]:
    """``status.recovery`` as stored (defaults where missing), its per-attempt part reset when it is
    of another gang attempt than ``attempt``, and its budget (``attemptRestarts``,
    ``attemptDisruptions``) when the gang ran steadily since the last restart (at ``now``)."""
    raw = status.get("recovery")
    stored: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    found = stored.get("byTier")
    tiers: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    same = _int(stored.get("attempt")) == attempt
    listed = stored.get("countedPods")
    pods: list[Any] = listed if same and isinstance(listed, list) else []
    fresh = not same or (now is not None and _budget_reset(stored, status, now))
    return {
        "inPlaceRestarts": _int(stored.get("inPlaceRestarts")) or 0,
        "byTier": {
            tier: _int(tiers.get(tier)) or 0
            for tier in TIERS
            if tier != TORCHRUN or _int(tiers.get(tier)) is not None
        },
        "last": stored.get("last") if isinstance(stored.get("last"), Mapping) else None,
        "attempt": attempt,
        "attemptRestarts": 0 if fresh else (_int(stored.get("attemptRestarts")) or 0),
        "attemptDisruptions": 0 if fresh else (_int(stored.get("attemptDisruptions")) or 0),
        "countedAt": stored.get("countedAt") if same else None,
        "countedGeneration": _int(stored.get("countedGeneration")) if same else None,
        "countedProcess": _int(stored.get("countedProcess")) if same else None,
        "countedTorchrun": _int(stored.get("countedTorchrun")) if same else None,
        "countedPods": [p for p in pods if isinstance(p, Mapping)],
    }


def _record(**known: Any) -> dict[str, Any]:
    return {key: known.get(key) for key in RECORD_KEYS}


POD_RESTART_CAUSE = "pod restarted in place (RestartAllContainers)"
"""The cause of a KEP-5532 pod restart: the kubelet's report says only that (and 137)."""


def cause(last: pod_state.LastExit) -> str:
    """Why a container ended, in the words of a recovery record: OOMKilled, SIGKILL, exit 1, or
    :data:`POD_RESTART_CAUSE` when the kubelet restarted the whole pod (its report then hides the
    exit code of the container that fired the rule)."""
    if last.reason == "OOMKilled":
        return "OOMKilled"
    if last.reason == kubelet_tier.RESTARTING_ALL:
        return POD_RESTART_CAUSE
    number = last.signal or (last.exit_code - 128 if last.exit_code > 128 else None)
    if number is not None:
        try:
            return signal.Signals(number).name
        except ValueError:
            return f"signal {number}"
    return f"exit {last.exit_code}"


def _unix(when: datetime.datetime | None) -> float | None:
    return round(when.timestamp(), 3) if when is not None else None


def _container_restarts(
    pods: Sequence[pod_state.PodState], counted: Sequence[Mapping[str, Any]], gpus: int
) -> tuple[list[Restart], list[dict[str, Any]]]:
    """The container restarts of ``pods`` not yet ``counted``, and what is counted after them."""
    before = {p.get("uid"): _int(p.get("restarts")) or 0 for p in counted}
    restarts: list[Restart] = []
    now_counted: list[dict[str, Any]] = []
    for pod in pods:
        if not pod.uid or pod.restarts <= 0:
            continue
        now_counted.append({"uid": pod.uid, "restarts": pod.restarts})
        new = pod.restarts - before.get(pod.uid, 0)
        if new <= 0 or pod_failure.oom_killed(pod.problem):
            continue  # an OOM kill rebuilds the gang (pod_failure): no in-place restart
        why = cause(pod.last_exit) if pod.last_exit is not None else "unknown"
        ranks = list(range(pod.index * gpus, pod.index * gpus + min(gpus, MAX_RANKS)))
        failed_at = _unix(pod.last_exit.finished_at) if pod.last_exit is not None else None
        record = _record(tier="container", cause=why, pod=pod.name, ranks=ranks, failedAt=failed_at)
        times = f"{new} restarts" if new > 1 else "restart"
        told = (
            f"pod {pod.name}: the kubelet restarted its trainer container in place after {why} "
            f"({times}; {pod.restarts} in all)"
        )
        restarts.extend(Restart("container", record, told) for _ in range(new))
    return restarts, now_counted


def _valid_record(value: Any) -> bool:
    return isinstance(value, Mapping) and _int(value.get("generation")) is not None


def _reported_restarts(
    records: Sequence[Mapping[str, Any]], counted_generation: int | None
) -> tuple[list[Restart], dict[str, Any] | None, int | None]:
    """The trainer's records newer than ``counted_generation``: the restarts of the tiers it
    counts, the newest record (for ``last``) and the newest generation."""
    fresh = sorted(
        (r for r in records if _valid_record(r)),
        key=lambda r: int(r["generation"]),
    )
    if fresh and counted_generation is not None and fresh[-1]["generation"] < counted_generation:
        counted_generation = None  # pod 0's store started again: its rounds count from 0
    fresh = [r for r in fresh if counted_generation is None or r["generation"] > counted_generation]
    restarts = [
        Restart(
            str(r["tier"]),
            _record(**{k: r.get(k) for k in RECORD_KEYS}),
            f"the trainer recovered in place ({r['tier']} tier, round {r['generation']}) after "
            f"{r.get('cause') or 'a failure'}",
        )
        for r in fresh
        if r.get("tier") in REPORTED_TIERS
    ]
    if not fresh:
        return [], None, counted_generation
    newest = fresh[-1]
    return restarts, _record(**{k: newest.get(k) for k in RECORD_KEYS}), int(newest["generation"])


def _tally(
    recovery: dict[str, Any],
    restarts: Sequence[Restart],
    limit: int,
    now: datetime.datetime | None,
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``recovery`` with ``restarts`` added, and an Event naming each (at most :data:`MAX_EVENTS`,
    the last summing the rest)."""
    tiers = dict(recovery["byTier"])
    for restart in restarts:
        tiers[restart.tier] = tiers.get(restart.tier, 0) + 1
    done = recovery["attemptRestarts"]
    shown = restarts if len(restarts) <= MAX_EVENTS else restarts[: MAX_EVENTS - 1]
    events = [
        f"{r.told}; in-place restart {done + i} of runPolicy.recovery.inPlaceLimit={limit}"
        for i, r in enumerate(shown, start=1)
    ]
    if len(restarts) > len(shown):
        events.append(
            f"{len(restarts) - len(shown)} more in-place restart(s), the last: "
            f"{restarts[-1].told}; {done + len(restarts)} of "
            f"runPolicy.recovery.inPlaceLimit={limit}"
        )
    updated = {
        **recovery,
        "inPlaceRestarts": recovery["inPlaceRestarts"] + len(restarts),
        "byTier": tiers,
        "attemptRestarts": done + len(restarts),
        "countedAt": conditions.timestamp(now)
        if restarts and now is not None
        else recovery["countedAt"],
    }
    return updated, tuple(events)


def from_pods(
    status: Mapping[str, Any],
    attempt: int,
    gang: Sequence[pod_state.PodState],
    spec: api_spec.TrainingJobSpec,
    now: datetime.datetime | None = None,
) -> Counted:
    """The container restarts the gang's pods show that ``status`` has not counted yet (at ``now``)."""
    recovery = book(status, attempt, now)
    limit = spec.run_policy.recovery.in_place_limit
    restarts, counted = _container_restarts(
        gang, recovery["countedPods"], spec.resources.gpus_per_node
    )
    counted = counted[: limit + 1]  # past that many pods the gang is rebuilt this pass
    if not restarts and counted == recovery["countedPods"]:
        return Counted(None, attempt_restarts=recovery["attemptRestarts"])
    updated, events = _tally(recovery, restarts, limit, now)
    updated["countedPods"] = counted
    if restarts:
        updated["last"] = restarts[-1].record
    return Counted(updated, events, updated["attemptRestarts"])


def from_report(
    status: Mapping[str, Any],
    attempt: int,
    records: Any,
    spec: api_spec.TrainingJobSpec,
    now: datetime.datetime | None = None,
    counts: Any = None,
) -> Counted:
    """The trainer's in-place records (``recovery`` of a progress report that passed
    ``progress_report``'s schema) that ``status`` has not counted yet (at ``now``); with the
    store's cumulative ``counts`` (``recovery_counts``), as many process restarts as it grew by
    since ``countedProcess``, so none is missed."""
    counted = counts if isinstance(counts, Mapping) else {}
    if not isinstance(records, list) and _int(counted.get(TORCHRUN)) is None:
        return Counted(None)
    recovery = book(status, attempt, now)
    listed = records if isinstance(records, list) else []
    restarts, newest, generation = _reported_restarts(listed, recovery["countedGeneration"])
    named = tuple(r.record for r in restarts)
    total = _int(counted.get("process"))
    if total is not None:
        restarts = _by_count(restarts, total, recovery["countedProcess"], newest)
    torchrun = _int(counted.get(TORCHRUN))
    by_torchrun = _torchrun_restarts(torchrun, recovery["countedTorchrun"])
    if newest is None and not restarts and torchrun == recovery["countedTorchrun"]:
        return Counted(None, attempt_restarts=recovery["attemptRestarts"])
    limit = spec.run_policy.recovery.in_place_limit
    updated, events = _tally(recovery, [*restarts, *by_torchrun], limit, now)
    updated["countedGeneration"] = generation
    if total is not None:
        updated["countedProcess"] = total
    if torchrun is not None:
        updated["countedTorchrun"] = torchrun
    updated["last"] = newest or (by_torchrun[-1].record if by_torchrun else recovery["last"])
    return Counted(updated, events, updated["attemptRestarts"], named)


def _torchrun_restarts(total: int | None, before: int | None) -> list[Restart]:
    """The worker-group restarts pod 0's torchrun agent counted (``TORCHELASTIC_RESTART_COUNT``,
    cumulative for the agent's life: the gang attempt) since ``before``; a lower count is a new
    agent (its pod restarted in place), all of it new."""
    if total is None:
        return []
    new = total - before if before is not None and total >= before else total
    record = _record(tier=TORCHRUN, cause="a worker failed")
    told = (
        "torchrun restarted the custom trainer's worker group in place after a worker failed "
        f"(pod 0's agent: {total} restart(s) of --max-restarts)"
    )
    return [Restart(TORCHRUN, record, told) for _ in range(max(new, 0))]


def _by_count(
    restarts: list[Restart], total: int, before: int | None, newest: Mapping[str, Any] | None
) -> list[Restart]:
    """The process restarts the store's cumulative count ``total`` adds to ``before`` (a lower
    count: the store started again, all of it new): the records' own where they name them, the
    others told by the count alone."""
    new = total - before if before is not None and total >= before else total
    if new <= 0:
        return []
    shown = restarts[-new:]
    unnamed = Restart(
        "process",
        dict(newest) if newest is not None else _record(tier="process"),
        "the trainer recovered in place (process tier; counted by the store, its record not seen)",
    )
    return [*([unnamed] * (new - len(shown))), *shown]
