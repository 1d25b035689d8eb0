"""runPolicy.elastic in the operator: which specs a placement tries, and what a resize writes.

A placement tries the allowed data-parallel degrees largest first, so a gang that lost a node
resumes at the largest degree that fits.  A smaller gang grows back once it has checkpointed
since it resumed, room has lasted ``growStableSeconds`` and the last resize is
``minResizeIntervalSeconds`` old: a rebuild like a spec change, not a failure.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

import pydantic

from meshtrain.api import elastic, rules
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import status as api_status
from meshtrain.operator.policy import conditions, kueue_workload, queue_order

GROW_CHECK_SECONDS = 10.0
"""How often a gang that may grow is checked for room while it runs (the first check's backoff)."""

GROW_CHECK_MAX_SECONDS = 300.0
"""The longest wait between grow checks that keep finding no room (each plans every allowed size)."""


def next_grow_check(previous: float | None) -> float:
    """Seconds until the next grow check after one that found no room: doubling, up to the maximum."""
    return GROW_CHECK_SECONDS if previous is None else min(GROW_CHECK_MAX_SECONDS, 2 * previous)


@dataclasses.dataclass(frozen=True)
class Grow:
    """Look for room for a larger gang; rebuild at the next size that fits."""

    running: int
    """Data-parallel degree the gang runs at now."""
    sizes: tuple[elastic.Size, ...]
    """Larger allowed sizes, largest first."""


def recorded(status: Mapping[str, Any]) -> api_status.ElasticStatus | None:
    """``status.elastic`` as written by :func:`placed_fields` (None when absent or unreadable)."""
    raw = status.get("elastic")
    if not raw:
        return None
    try:
        return api_status.ElasticStatus.model_validate(raw)
    except pydantic.ValidationError:
        return None


def _seconds_since(stamp: str | None, now: datetime.datetime) -> float | None:
    since = conditions.parse_time(stamp)
    return None if since is None else (now - since).total_seconds()


def grow_allowed(
    declared: api_spec.TrainingJobSpec, status: Mapping[str, Any], now: datetime.datetime
) -> bool:
    """Whether room for a larger gang has lasted ``growStableSeconds`` and the last resize is
    ``minResizeIntervalSeconds`` ago (a gang never resized passes the interval)."""
    bounds, record = declared.run_policy.elastic, recorded(status)
    if bounds is None or record is None:
        return True
    stable = _seconds_since(record.room_since, now)
    if stable is None or stable < bounds.grow_stable_seconds:
        return False
    resized = _seconds_since(record.resized_at, now)
    return resized is None or resized >= bounds.min_resize_interval_seconds


def largest_allowed(
    declared: api_spec.TrainingJobSpec, status: Mapping[str, Any], now: datetime.datetime
) -> int | None:
    """The largest degree a placement may pick now: the recorded one while a grow is not allowed
    (a gang restarted after a failure must not grow past the stability rules); None: no cap."""
    record = recorded(status)
    if record is None or grow_allowed(declared, status, now):
        return None
    return record.data


def no_larger_than(
    sized: list[tuple[elastic.Size | None, api_spec.TrainingJobSpec]], cap: int | None
) -> list[tuple[elastic.Size | None, api_spec.TrainingJobSpec]]:
    """The candidates no larger than ``cap`` (all of them when none is, e.g. after a spec change)."""
    if cap is None:
        return sized
    kept = [(size, spec) for size, spec in sized if size is None or size.data <= cap]
    return kept or sized


@dataclasses.dataclass(frozen=True)
class Checked:
    """What a grow check that found room for ``target`` does now."""

    grow: bool
    """Rebuild at ``target`` now (room stable and the resize interval over)."""
    fields: dict[str, Any]
    """Status changes (``status.elastic.roomSince`` set at the first check that found room)."""
    message: str | None
    """Said once, when the room is first seen and the gang does not grow at once."""


def room_found(
    declared: api_spec.TrainingJobSpec,
    status: Mapping[str, Any],
    running: int,
    target: int,
    now: datetime.datetime,
) -> Checked:
    """A grow check found room for ``target``: grow now, or record since when and wait."""
    bounds = declared.run_policy.elastic
    raw = dict(status.get("elastic") or {})
    fields: dict[str, Any] = {}
    first = not raw.get("roomSince")
    if first:
        raw["roomSince"] = conditions.timestamp(now)
        fields = {"elastic": raw}
    merged = {**status, **fields}
    if grow_allowed(declared, merged, now):
        return Checked(True, fields, None)
    assert bounds is not None  # grow_allowed is True without runPolicy.elastic
    message = None
    if first:
        message = (
            f"room for data-parallel degree {target} (running {running}): growing once it has lasted "
            f"growStableSeconds={bounds.grow_stable_seconds} and minResizeIntervalSeconds="
            f"{bounds.min_resize_interval_seconds} have passed since the last resize "
            f"({raw.get('resizedAt') or 'none'})"
        )
    return Checked(False, fields, message)


def no_room(status: Mapping[str, Any]) -> dict[str, Any]:
    """Status changes after a grow check found no room: the stable period starts again."""
    raw = status.get("elastic") or {}
    if not raw.get("roomSince"):
        return {}
    return {"elastic": {**raw, "roomSince": None}}


def within_quota(
    declared: api_spec.TrainingJobSpec, labels: Mapping[str, str] | None
) -> api_spec.TrainingJobSpec:
    """``declared`` with ``maxData`` capped at ``parallelism.data`` for a job Kueue admits (queue label).

    Kueue admits the Workload of the declared size: a larger gang would hold GPUs beyond the quota.
    """
    bounds = declared.run_policy.elastic
    if (
        bounds is None
        or kueue_workload.QUEUE_LABEL not in (labels or {})
        or bounds.max_data <= declared.parallelism.data
    ):
        return declared
    capped = bounds.model_copy(update={"max_data": declared.parallelism.data})
    return declared.model_copy(
        update={"run_policy": declared.run_policy.model_copy(update={"elastic": capped})}
    )


def running_spec(
    declared: api_spec.TrainingJobSpec, status: Mapping[str, Any]
) -> api_spec.TrainingJobSpec:
    """The spec the placed gang runs (the declared one resized to ``status.elastic``)."""
    return elastic.running_spec(declared, recorded(status))


def candidates(
    declared: api_spec.TrainingJobSpec,
) -> list[tuple[elastic.Size | None, api_spec.TrainingJobSpec]]:
    """The specs a placement tries in order (the first that fits wins), or just the declared spec.

    Every allowed size that keeps the global batch, largest first, then the sizes that change it:
    a shrink from dp8 (G=24, 3 micro-batches) takes dp6 (G kept) over dp7 (G=21), since a
    changed batch changes the optimisation, not only the speed; a grow likewise.
    """
    if declared.run_policy.elastic is None:
        return [(None, declared)]
    ordered = sorted(
        elastic.sizes(declared), key=lambda size: (not size.keeps_global_batch, -size.data)
    )
    resized = [(size, elastic.resized(declared, size)) for size in ordered]
    # A size whose spec breaks a rule (a layout rule that holds at the declared degree only) is skipped.
    return [(size, spec) for size, spec in resized if not rules.check(spec)]


def placed_fields(
    declared: api_spec.TrainingJobSpec,
    size: elastic.Size | None,
    status: Mapping[str, Any],
    now: datetime.datetime,
) -> dict[str, Any]:
    """Status fields of a gang placed at ``size``: ``elastic`` and the ``Resized`` condition."""
    if size is None:
        return {}
    # The checkpoint the new gang resumes from is only known from its first report (see baseline).
    record = elastic.status_of(declared, size, None)
    before = recorded(status)
    resized_at = before.resized_at if before is not None else None
    if before is not None and before.data != size.data:
        resized_at = conditions.timestamp(now)
    conds = list(status.get("conditions") or [])
    if record is None:
        message = f"running at parallelism.data={size.data}"
        conds = conditions.set(
            conds, conditions.RESIZED, conditions.FALSE, conditions.DECLARED_SIZE, message, now
        )
        body: dict[str, Any] = {
            "data": size.data,
            "microBatches": size.micro_batches,
            "globalBatch": size.global_batch,
            "learningRate": declared.training.learning_rates(declared.parallelism)[0],
            "checkpointStep": None,
            "message": message,
        }
    else:
        reason = (
            conditions.ELASTIC_SHRUNK
            if size.data < declared.parallelism.data
            else conditions.ELASTIC_GROWN
        )
        conds = conditions.set(
            conds, conditions.RESIZED, conditions.TRUE, reason, record.message, now
        )
        body = record.model_dump(by_alias=True, mode="json")
    # A new gang judges room afresh; the time of the last resize carries over.
    body |= {"resizedAt": resized_at, "roomSince": None}
    return {"elastic": body, "conditions": conds}


def change(previous: int | None, size: elastic.Size | None) -> str | None:
    """``shrink`` or ``grow`` when a gang placed at ``size`` runs another degree than ``previous``."""
    if size is None or previous is None or previous == size.data:
        return None
    return "shrink" if size.data < previous else "grow"


def grow_due(declared: api_spec.TrainingJobSpec, status: Mapping[str, Any]) -> Grow | None:
    """A grow check when the gang runs below its largest size and has checkpointed since it was placed."""
    record = recorded(status)
    if declared.run_policy.elastic is None or record is None:
        return None
    newest = status.get("lastCheckpointStep")
    if record.checkpoint_step is None or newest is None or newest <= record.checkpoint_step:
        return None  # checked first: the sizes cost a rule check per degree of the range
    larger = [
        size for size, _ in candidates(declared) if size is not None and size.data > record.data
    ]
    if not larger:
        return None
    return Grow(record.data, tuple(larger))


def baseline(status: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``status.elastic`` with the checkpoint the placed gang resumed from, at its first report stating one.

    Empty when already known or when the report states none (a gang that restored nothing takes its
    first saved checkpoint as the baseline).  Not taken from the status at placement, which may
    predate the old gang's last checkpoint.
    """
    raw = status.get("elastic")
    step = changes.get("lastCheckpointStep")
    if not raw or step is None or raw.get("checkpointStep") is not None:
        return {}
    return {"elastic": {**raw, "checkpointStep": step}}


def growing(
    status: Mapping[str, Any], running: int, size: elastic.Size, now: datetime.datetime
) -> tuple[dict[str, Any], str]:
    """Status fields (and the message) that rebuild a running gang at the larger ``size``."""
    message = (
        f"room for data-parallel degree {size.data} (running {running}): rebuilding the gang at it; "
        f"the pods checkpoint the step they stop at (last checkpoint so far: step "
        f"{status.get('lastCheckpointStep')}) and training resumes there"
    )
    conds = list(status.get("conditions") or [])
    for type_ in (conditions.PLACED, conditions.RUNNING):
        conds = conditions.set(
            conds, type_, conditions.FALSE, conditions.ELASTIC_GROWING, message, now
        )
    fields = {
        "phase": api_status.Phase.RESTARTING.value,
        "placement": [],
        "straggler": None,
        "specHash": None,
        "conditions": conds,
        **queue_order.CLEARED,  # a grow that loses the race waits from then
    }
    return fields, message
