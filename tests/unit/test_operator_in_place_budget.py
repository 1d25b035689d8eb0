"""The in-place budget of a gang attempt: it starts again once the gang has run ten minutes with no
restart (the stable-running rule of the disruption budget), the rebuild past it is a disruption
when lost pods and nodes used it up, and a trainer store that started again (its rounds from 0)
has its records counted anew, and the store's cumulative counts miss no restart the few records
left out; a trainer container in CrashLoopBackOff rebuilds the gang at once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshtrain.operator.policy import (
    conditions,
    disruption_budget,
    job_state,
    lifecycle,
    progress_report,
    progress_status,
    recovery_count,
    replacement,
)
from tests.builders import JobBuilder
from tests.unit.test_operator_in_place import (
    KILLED,
    RECORD,
    gang,
    manifest,
    parsed,
    reported,
    running,
)
from tests.unit.test_operator_lifecycle import T0, at, job, status_of

STEADY = conditions.STEADY_SECONDS
LAST_COUNTED = 60.0
"""Seconds after T0 the attempt's last in-place restart was counted."""


def steady_running(recovery: dict[str, Any]) -> dict[str, Any]:
    """A gang Running (condition True) since T0 whose last in-place restart was counted at
    :data:`LAST_COUNTED`, pod 1's first one among them."""
    conds = conditions.set([], conditions.RUNNING, conditions.TRUE, "AllPodsRunning", "", T0)
    book = {
        "inPlaceRestarts": recovery["attemptRestarts"],
        "byTier": {"process": 0, "container": recovery["attemptRestarts"], "pod": 0},
        "attempt": 0,
        "countedAt": conditions.timestamp(at(LAST_COUNTED)),
        "countedPods": [{"uid": "uid-1", "restarts": 1}],
        **recovery,
    }
    return running(conditions=conds, recovery=book)


def spec(backoff: int = 3, **recovery: Any) -> dict[str, Any]:
    builder = JobBuilder().layout(data=2, gpus_per_node=1)
    return builder.run_policy(backoffLimit=backoff, recovery=recovery).raw()


def test_the_stable_running_rule_is_the_disruption_budgets():
    assert disruption_budget.STEADY_SECONDS == conditions.STEADY_SECONDS == 600.0


def test_the_budget_starts_again_after_the_gang_ran_ten_minutes_with_no_restart():
    status = steady_running({"attemptRestarts": 1})
    again = gang(manifest(0), manifest(1, restarts=2, last=KILLED))  # one more restart
    soon = lifecycle.decide(
        job(spec(inPlaceLimit=1), **status), again, at(LAST_COUNTED + STEADY - 1)
    )
    assert status_of(soon)["restarts"] == 1, "2 restarts within ten minutes pass inPlaceLimit=1"
    later = lifecycle.decide(job(spec(inPlaceLimit=1), **status), again, at(LAST_COUNTED + STEADY))
    recovery = status_of(later)["recovery"]
    assert "restarts" not in status_of(later), "ten quiet minutes: the count started again"
    assert recovery["attemptRestarts"] == 1 and recovery["inPlaceRestarts"] == 2
    assert recovery["countedAt"] == conditions.timestamp(at(LAST_COUNTED + STEADY))


def test_the_gang_must_be_running_for_the_budget_to_start_again():
    status = steady_running({"attemptRestarts": 1})
    status["conditions"] = conditions.set(
        status["conditions"], conditions.RUNNING, conditions.FALSE, "ContainersStarting", "", T0
    )
    again = gang(manifest(0), manifest(1, restarts=2, last=KILLED))
    decision = lifecycle.decide(job(spec(inPlaceLimit=1), **status), again, at(10 * STEADY))
    assert status_of(decision)["restarts"] == 1


def test_past_the_budget_lost_pods_make_the_rebuild_a_disruption_not_a_backoff():
    again = gang(manifest(0), manifest(1, restarts=2, last=KILLED))
    own = steady_running({"attemptRestarts": 1, "attemptDisruptions": 0})
    failed = lifecycle.decide(job(spec(0, inPlaceLimit=1), **own), again, at(120))
    assert status_of(failed)["phase"] == "Failed", "the job's own restarts: backoffLimit=0 used"
    cond = conditions.find(status_of(failed)["conditions"], conditions.FAILED)
    assert cond is not None and cond["reason"] == conditions.BACKOFF_LIMIT_EXCEEDED

    lost = steady_running({"attemptRestarts": 1, "attemptDisruptions": 1})
    rebuilt = lifecycle.decide(job(spec(0, inPlaceLimit=1), **lost), again, at(120))
    status = status_of(rebuilt)
    assert status["phase"] == "Restarting" and status["restarts"] == 1
    assert status["disruptionRestarts"] == 1, "counted under disruptionRestartLimit"
    cond = conditions.find(status["conditions"], conditions.RUNNING)
    assert cond is not None and cond["reason"] == recovery_count.EXHAUSTED
    assert "1 of them lost pods or nodes" in cond["message"]


def test_a_replaced_pod_is_a_disruption_of_the_budget_and_dates_it():
    state = job(spec(), **steady_running({"attemptRestarts": 1}))
    lost = replacement.Replaced(1, "j-r0-1", "node lost", "j-r0-1-x1", "n7", False)
    changes = replacement.status_changes(state, [lost], 1, at(300))
    recovery = changes["recovery"]
    assert recovery["attemptRestarts"] == 2 and recovery["attemptDisruptions"] == 1
    assert recovery["countedAt"] == conditions.timestamp(at(300))
    replaced = {**state.status, **changes}
    assert replacement.attempt_restarts(replaced, 0, at(300 + STEADY - 1)) == 2
    assert replacement.attempt_restarts(replaced, 0, at(300 + STEADY)) == 0


def test_records_of_a_store_that_started_again_are_counted_anew():
    status = running(recovery={"attempt": 0, "attemptRestarts": 5, "countedGeneration": 5})
    first = {**RECORD, "generation": 1}
    changes, told = progress_status.recovery_changes(status, reported(first), parsed(spec()), at(9))
    recovery = changes["recovery"]
    assert recovery["byTier"]["process"] == 1 and recovery["countedGeneration"] == 1
    assert len(told) == 1
    counted = {**status, **changes}
    assert progress_status.recovery_changes(counted, reported(first), parsed(spec())) == ({}, ())


def test_a_status_without_the_new_fields_reads_as_before():
    status = job_state.read(
        {
            "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1},
            "spec": spec(),
            "status": running(recovery={"attempt": 0, "attemptRestarts": 3}),
        }
    ).status
    booked = recovery_count.book(status, 0, at(10 * STEADY))
    assert booked["attemptRestarts"] == 3 and booked["attemptDisruptions"] == 0
    assert booked["countedAt"] is None


BACKED_OFF = {
    "waiting": {
        "reason": "CrashLoopBackOff",
        "message": "back-off 10s restarting failed container=trainer pod=j-r0-1_ns(uid-1)",
    }
}


def test_a_trainer_container_in_crash_loop_back_off_rebuilds_the_gang_at_once():
    crashed = {**KILLED, "exitCode": 1}
    held = gang(manifest(0), manifest(1, restarts=2, last=crashed, state=BACKED_OFF))
    decision = lifecycle.decide(job(spec(), **running()), held, at(10))
    status = status_of(decision)
    assert status["restarts"] == 1 and status["phase"] == "Restarting"
    cond = conditions.find(status["conditions"], conditions.RUNNING)
    assert cond is not None and cond["reason"] == "CrashLoopBackOff"
    assert "j-r0-1" in cond["message"] and "back-off 10s" in cond["message"]
    restarted = gang(manifest(0), manifest(1, restarts=2, last=crashed))  # running again
    decision = lifecycle.decide(job(spec(), **running()), restarted, at(10))
    assert "restarts" not in status_of(decision)


def test_a_sidecar_in_crash_loop_back_off_is_not_the_trainers():
    pod = manifest(1)
    sidecar = {"name": "ship-logs", "restartCount": 4, "state": BACKED_OFF}
    pod["status"]["containerStatuses"].append(sidecar)
    decision = lifecycle.decide(job(spec(), **running()), gang(manifest(0), pod), at(10))
    assert "restarts" not in status_of(decision)


def counted_report(counts: Any, *records: dict[str, Any]) -> dict[str, Any]:
    body = {"step": 42, "recovery": list(records), "recovery_counts": counts}
    reading = progress_report.parse(json.dumps(body).encode())
    assert reading.document is not None
    return reading.document


def test_the_stores_counts_count_every_process_restart_the_records_left_out():
    newest = [{**RECORD, "generation": g} for g in (4, 5)]  # 5 rounds, the report names 2
    changes, told = progress_status.recovery_changes(
        running(), counted_report({"process": 5}, *newest), parsed(spec()), at(9)
    )
    recovery = changes["recovery"]
    assert recovery["byTier"]["process"] == 5 and recovery["attemptRestarts"] == 5
    assert recovery["countedProcess"] == 5 and recovery["last"]["generation"] == 5
    assert len(told) == 4, "at most 4 Events a pass, the last summing the rest"
    status = running(recovery=recovery)
    same = counted_report({"process": 5}, *newest)
    assert progress_status.recovery_changes(status, same, parsed(spec()), at(19)) == ({}, ())
    more = counted_report({"process": 7}, *newest)  # two more whose records were not seen
    changes, _ = progress_status.recovery_changes(status, more, parsed(spec()), at(29))
    assert changes["recovery"]["byTier"]["process"] == 7
    restarted = counted_report({"process": 1}, {**RECORD, "generation": 1})  # a new store
    changes, _ = progress_status.recovery_changes(
        running(recovery=changes["recovery"]), restarted, parsed(spec()), at(39)
    )
    assert changes["recovery"]["byTier"]["process"] == 8


@pytest.mark.parametrize(
    "counts", [{"process": -1}, {"process": 1.5}, {"everything": 1}, [1], {"process": True}]
)
def test_counts_out_of_the_schema_are_dropped(counts):
    body = {"step": 1, "recovery": [RECORD], "recovery_counts": counts}
    reading = progress_report.parse(json.dumps(body).encode())
    assert reading.document is not None and "recovery_counts" not in reading.document
