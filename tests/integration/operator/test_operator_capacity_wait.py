"""A job waiting for GPUs is planned again only for a capacity change that could admit it
(``policy.capacity_queue``): nodes that still leave it short wake nothing; the one that makes
room places it.  Against a real API server and kube-scheduler, with its own operator whose
resync is long, so that every plan it makes is one a change woke."""

from __future__ import annotations

import re
import time
import uuid

from benchmarks.fleet import replans as replans_seen
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess, operated, wait_for


def _unplaced_plans(operator: OperatorProcess, namespace: str) -> float:
    """The operator's count of plans that placed nothing in ``namespace`` (every reason)."""
    pattern = rf'^meshtrain_operator_placement_failures_total\{{[^}}]*namespace="{namespace}"[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, operator.metrics(), re.M))


def test_a_waiting_job_is_planned_only_for_a_change_that_could_admit_it(
    control_plane_binaries, tmp_path
):
    log = str(tmp_path / "operator.log")
    text = "text"  # the format the churn benchmark reads its plans from
    with operated(control_plane_binaries, log, 300, log_format=text) as (cluster, operator):
        namespace, pool = f"wait-{uuid.uuid4().hex[:6]}", f"p{uuid.uuid4().hex[:6]}"
        cluster.core.create_namespace({"metadata": {"name": namespace}})
        cluster.add_node(pool, gpus=8)
        changes = [(time.time(), 8)]  # (when, free GPUs after): what the benchmark's watch sees
        cluster.apply(JobBuilder("big", namespace, pool).layout(data=32).gpus(8))  # 4 x 8 GPUs
        wait_for(
            "Placed=False for want of GPUs",
            lambda: (
                cluster.condition(namespace, "big", "Placed").get("reason") == "InsufficientGPUs"
            ),
        )
        wait_for("the first plan counted", lambda: _unplaced_plans(operator, namespace) >= 1)
        time.sleep(1.0)  # a pass its own status write woke has come and gone
        before = _unplaced_plans(operator, namespace)
        replans = _replans(operator, namespace)
        for _ in range(2):  # 24 GPUs: three nodes cannot hold four pods of 8
            cluster.add_node(pool, gpus=8)
            changes.append((time.time(), 8 * len(changes) + 8))
        time.sleep(3.0)
        assert _unplaced_plans(operator, namespace) == before
        assert _replans(operator, namespace) == replans  # not planned again either
        cluster.add_node(pool, gpus=8)  # 32: room for the gang
        changes.append((time.time(), 32))
        cluster.wait_gang(namespace, "big", 4)
        assert _unplaced_plans(operator, namespace) == before  # woken once, and placed
        assert _replans(operator, namespace) == replans + 1  # by that one plan
        # The operator's own per-job count: one plan for the one change that could admit it.
        wait_for("the job's count closed", lambda: _sample(operator, "_count") == 1.0)
        assert _sample(operator, "_sum") == 1.0
        assert _sample(operator, "_max") == 1.0
        # The churn benchmark's check from outside: its log has every re-plan the operator
        # counted, and each came after a change whose free GPUs covered the job's 32.
        with open(log, errors="replace") as lines:
            plans = replans_seen.read_log(lines, namespace)
        assert [p.again for p in plans] == [False] + [True] * int(replans + 1), plans
        judged = replans_seen.judge(plans, {"big": 32}, changes, releases=[], holders=[])
        assert (judged["replans"], judged["unexplained"]) == (replans + 1, 0), judged
        assert judged["most_replans_per_admitting_change"] == 1.0


def test_the_reservation_s_holder_gets_its_node_set_without_a_plan_of_its_gang(
    control_plane_binaries, tmp_path
):
    """A job that waited past ``--reserve-after-seconds`` holds the reservation: its node set is
    planned (no capacity change could place its gang, so the gang is not planned again); the
    change that makes room places it with one plan."""
    log = str(tmp_path / "operator.log")
    env = {"MESHTRAIN_RESERVE_AFTER_SECONDS": "4"}
    with operated(control_plane_binaries, log, resync_seconds=1, env=env) as (cluster, operator):
        namespace, pool = f"hold-{uuid.uuid4().hex[:6]}", f"p{uuid.uuid4().hex[:6]}"
        cluster.core.create_namespace({"metadata": {"name": namespace}})
        for _ in range(2):
            cluster.add_node(pool, gpus=8)
        cluster.apply(JobBuilder("filler", namespace, pool).layout(data=8).gpus(8))  # one node
        cluster.wait_gang(namespace, "filler", 1)
        cluster.apply(JobBuilder("big", namespace, pool).layout(data=16).gpus(8))  # 2 x 8 GPUs
        wait_for(  # it would fit with meshtrain's own pods gone: it may hold the reservation
            "Placed=False for want of GPUs",
            lambda: (
                cluster.condition(namespace, "big", "Placed").get("reason") == "InsufficientGPUs"
            ),
        )
        replans = _replans(operator, namespace)
        assert _reservation_plans(operator, namespace) == 0  # it may not hold yet: the count
        # below is of the passes after it does
        wait_for("its node set planned", lambda: _reservation_plans(operator, namespace) >= 1, 30)
        time.sleep(2.0)  # two resyncs more, the holder's among them
        assert _replans(operator, namespace) == replans  # its node set, not its gang
        cluster.add_node(pool, gpus=8)  # room for the gang
        cluster.wait_gang(namespace, "big", 2)
        assert _replans(operator, namespace) == replans + 1  # by that one plan
        wait_for("the job's count closed", lambda: _sample(operator, "_count") == 1.0)
        assert _sample(operator, "_max") == 1.0


def _reservation_plans(operator: OperatorProcess, namespace: str) -> float:
    """The operator's count of node-set plans of holders in ``namespace``."""
    pattern = rf'^meshtrain_operator_reservation_plans_total\{{[^}}]*namespace="{namespace}"[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, operator.metrics(), re.M))


def _waits_for_gpus(cluster: Cluster, namespace: str, pool: str, data: int) -> None:
    """A namespace, one 8-GPU node of ``pool`` and a job "big" of ``data`` x 8 GPUs that waits."""
    cluster.core.create_namespace({"metadata": {"name": namespace}})
    cluster.add_node(pool, gpus=8)
    cluster.apply(JobBuilder("big", namespace, pool).layout(data=data).gpus(8))
    wait_for(
        "Placed=False for want of GPUs",
        lambda: cluster.condition(namespace, "big", "Placed").get("reason") == "InsufficientGPUs",
    )


def _sample(operator: OperatorProcess, suffix: str) -> float:
    """``meshtrain_operator_replans_per_admission`` + ``suffix`` (``_count``, ``_sum``, ``_max``)."""
    pattern = rf"^meshtrain_operator_replans_per_admission{suffix} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, operator.metrics(), re.M))


def _replans(operator: OperatorProcess, namespace: str) -> float:
    """The operator's count of plans of jobs that already waited, in ``namespace``."""
    pattern = rf'^meshtrain_operator_replans_total\{{[^}}]*namespace="{namespace}"[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, operator.metrics(), re.M))


def test_a_resync_plans_a_waiting_job_only_after_a_capacity_change(
    control_plane_binaries, tmp_path
):
    """With a 1 s resync, a job that cannot fit is not planned again at every resync; the node
    that makes room places it."""
    log = str(tmp_path / "operator.log")
    with operated(control_plane_binaries, log, resync_seconds=1) as (cluster, operator):
        namespace, pool = f"sync-{uuid.uuid4().hex[:6]}", f"p{uuid.uuid4().hex[:6]}"
        _waits_for_gpus(cluster, namespace, pool, data=16)  # 2 x 8 GPUs, one node
        time.sleep(1.5)  # a pass its own status write woke has come and gone
        before = _replans(operator, namespace) + _unplaced_plans(operator, namespace)
        time.sleep(5.0)  # five resyncs, no capacity change
        assert _replans(operator, namespace) + _unplaced_plans(operator, namespace) == before
        cluster.add_node(pool, gpus=8)  # room for the gang
        cluster.wait_gang(namespace, "big", 2)
