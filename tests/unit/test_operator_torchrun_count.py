"""torchrun's restarts of a custom trainer's worker group, counted from the progress report.

Pod 0's torchrun agent counts its worker-group restarts (``TORCHELASTIC_RESTART_COUNT``) for its
life, the gang attempt; the report carries it as ``recovery_counts.torchrun``.  Table: each growth
is counted once (a poll that sees the same count adds nothing), several restarts between two polls
are all counted, a lower count (a new agent) is counted whole, a new gang attempt starts the count
again, and a report without the count leaves ``byTier`` as it was (no ``torchrun`` key).  The
report passes the operator's schema first, as a polled one does.  The real torchrun path is
tests/trainer/test_torchrun_restarts_counted.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshtrain.api import loading
from meshtrain.operator.policy import progress_report, progress_status
from tests.builders import JobBuilder

SPEC = loading.parse_spec(
    JobBuilder("ddp")
    .layout(data=2, gpus_per_node=1)
    .trainer(type="custom", command=["torchrun", "train.py"], progressPort=8000)
    .run_policy(recovery={"inPlaceLimit": 5, "torchrunElastic": True})
    .raw()
)


def _report(torchrun: int | None) -> dict[str, Any]:
    document: dict[str, Any] = {"step": 10}
    if torchrun is not None:
        document["recovery_counts"] = {"torchrun": torchrun}
    reading = progress_report.parse(json.dumps(document).encode())
    assert reading.document is not None and not reading.notes
    return reading.document


def _count(status: dict[str, Any], torchrun: int | None) -> tuple[dict[str, Any], int]:
    changes, told = progress_status.recovery_changes(status, _report(torchrun), SPEC)
    return {**status, **changes}, len(told)


@pytest.mark.parametrize(
    ("polls", "counted", "events"),
    [
        ([0, 0], 0, 0),
        ([0, 1, 1], 1, 1),
        ([0, 3], 3, 3),  # three restarts between two polls
        ([2, 2, 3], 3, 3),  # first seen at 2: both counted, then one more
        ([2, 1], 3, 3),  # a lower count: a new agent, its one restart counted
    ],
)
def test_each_torchrun_restart_is_counted_once(polls: list[int], counted: int, events: int) -> None:
    status: dict[str, Any] = {"restarts": 0}
    told = 0
    for torchrun in polls:
        status, new = _count(status, torchrun)
        told += new
    by_tier = status.get("recovery", {}).get("byTier", {})
    assert by_tier.get("torchrun", 0) == counted and told == events
    if counted:
        assert status["recovery"]["attemptRestarts"] == counted
        assert status["recovery"]["last"]["tier"] == "torchrun"


def test_a_new_gang_attempt_counts_its_agent_from_zero() -> None:
    status, _ = _count({"restarts": 0}, 2)
    status, told = _count({**status, "restarts": 1}, 1)  # the rebuilt gang's agent restarted once
    assert told == 1 and status["recovery"]["byTier"]["torchrun"] == 3
    assert status["recovery"]["attemptRestarts"] == 1


def test_a_report_without_the_count_adds_no_torchrun_tier() -> None:
    status, told = _count({"restarts": 0}, None)
    assert told == 0 and "recovery" not in status
