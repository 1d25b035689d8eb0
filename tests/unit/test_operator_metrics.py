"""The operator's per-job gauges, apply-to-Running histogram and API verbs, read back from its registry."""

from __future__ import annotations

import uuid

import prometheus_client
import pytest

from meshtrain.operator.cluster import metrics

REGISTRY = prometheus_client.REGISTRY


def body(name: str, phase: str, **extra: object) -> dict:
    status = {"phase": phase, "restarts": extra.get("restarts", 0)}
    return {
        "metadata": {
            "name": name,
            "namespace": extra.get("namespace", "ns"),
            "uid": extra.get("uid", name),
            "generation": extra.get("generation", 1),
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": extra.get("labels", {}),
        },
        "spec": {"runPolicy": {"backoffLimit": extra.get("backoff", 3)}},
        "status": status,
    }


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@pytest.fixture
def job_name():
    name = f"j{uuid.uuid4().hex[:6]}"
    yield name
    metrics.forget("ns", name)


def test_phase_restarts_left_and_generation_of_a_running_job(job_name):
    metrics.observe_job(
        body(job_name, "Running", restarts=1, backoff=3, generation=4),
        unschedulable=False,
        placed_condition=None,
    )
    key = {"namespace": "ns", "trainingjob": job_name}
    assert sample("meshtrain_operator_job_status_phase", **key, phase="Running") == 1
    assert sample("meshtrain_operator_job_status_phase", **key, phase="Failed") == 0
    assert sample("meshtrain_operator_job_restarts", **key) == 1
    assert sample("meshtrain_operator_job_restarts_remaining", **key) == 2
    assert sample("meshtrain_operator_job_spec_generation", **key) == 4
    assert sample("meshtrain_operator_job_unschedulable_seconds", **key) == 0


def test_a_finished_job_has_no_restarts_left_or_waiting_time(job_name):
    metrics.observe_job(
        body(job_name, "Failed", restarts=3), unschedulable=False, placed_condition=None
    )
    key = {"namespace": "ns", "trainingjob": job_name}
    assert sample("meshtrain_operator_job_status_phase", **key, phase="Failed") == 1
    assert sample("meshtrain_operator_job_restarts_remaining", **key) is None
    assert sample("meshtrain_operator_job_unschedulable_seconds", **key) is None


def test_a_job_allowed_no_restarts_has_none_left_to_use_up(job_name):
    metrics.observe_job(
        body(job_name, "Running", backoff=0), unschedulable=False, placed_condition=None
    )
    key = {"namespace": "ns", "trainingjob": job_name}
    assert sample("meshtrain_operator_job_restarts_remaining", **key) is None
    assert sample("meshtrain_operator_job_restarts", **key) == 0


def test_unschedulable_time_counts_from_the_placed_condition(job_name):
    before = sample("meshtrain_operator_unschedulable_jobs", namespace="ns") or 0
    placed = {"type": "Placed", "status": "False", "lastTransitionTime": "2020-01-01T00:00:00Z"}
    metrics.observe_job(body(job_name, "Pending"), unschedulable=True, placed_condition=placed)
    waited = sample(
        "meshtrain_operator_job_unschedulable_seconds", namespace="ns", trainingjob=job_name
    )
    assert waited > 5 * 365 * 86400  # since 2020
    assert sample("meshtrain_operator_unschedulable_jobs", namespace="ns") == before + 1


def test_jobs_by_phase_and_queue(job_name):
    labels = {metrics.QUEUE_LABEL: "team-a"}
    metrics.observe_job(
        body(job_name, "Placing", labels=labels), unschedulable=False, placed_condition=None
    )
    key = {"namespace": "ns", "queue": "team-a"}
    assert sample("meshtrain_operator_jobs", **key, phase="Placing") == 1
    assert sample("meshtrain_operator_jobs", **key, phase="Running") == 0


def test_per_job_operator_series_carry_the_jobs_namespace(job_name):
    """Jobs by phase, unschedulable jobs, apply-to-Running and placement failures are counted in
    the job's namespace: another namespace's jobs do not show in this one's series."""
    other = f"other-{job_name}"
    placed = {"type": "Placed", "status": "False", "lastTransitionTime": "2020-01-01T00:00:00Z"}
    in_ns = sample("meshtrain_operator_job_apply_to_running_seconds_count", namespace="ns")
    try:
        metrics.observe_job(
            body(job_name, "Pending", namespace=other), unschedulable=True, placed_condition=placed
        )
        metrics.observe_job(
            body(job_name, "Running", namespace=other, uid=f"{job_name}-b"),
            unschedulable=False,
            placed_condition=None,
            now=1767225600.0 + 7,
        )
        assert sample("meshtrain_operator_jobs", namespace=other, phase="Running", queue="") == 1
        assert sample("meshtrain_operator_unschedulable_jobs", namespace=other) == 0
        count = "meshtrain_operator_job_apply_to_running_seconds_count"
        assert sample(count, namespace=other) == 1
        for reason in metrics.PLACEMENT_FAILURE_REASONS:
            key = {"namespace": other, "reason": reason}
            assert sample("meshtrain_operator_placement_failures_total", **key) == 0
        assert sample(count, namespace="ns") == in_ns  # nothing counted in another namespace
    finally:
        metrics.forget(other, job_name)
    assert sample("meshtrain_operator_jobs", namespace=other, phase="Running", queue="") is None


def test_operator_wide_series_have_no_job_namespace():
    """The process's own series (API requests and errors) stay without a namespace label: the
    scrape gives them the operator's."""
    for family in (metrics.API_REQUESTS, metrics.API_ERRORS):
        assert "namespace" not in family._labelnames
    for family in (
        metrics.RECONCILE_SECONDS,
        metrics.PLACEMENT_SECONDS,
        metrics.APPLY_TO_RUNNING_SECONDS,
        metrics.PLACEMENT_FAILURES,
    ):
        assert "namespace" in family._labelnames
        assert "trainingjob" not in family._labelnames


def test_first_running_is_timed_from_creation_once(job_name):
    count = "meshtrain_operator_job_apply_to_running_seconds_count"
    total = "meshtrain_operator_job_apply_to_running_seconds_sum"
    n0, s0 = sample(count, namespace="ns") or 0, sample(total, namespace="ns") or 0
    created = 1767225600.0  # 2026-01-01T00:00:00Z
    metrics.observe_job(body(job_name, "Placing"), unschedulable=False, placed_condition=None)
    metrics.observe_job(
        body(job_name, "Running"), unschedulable=False, placed_condition=None, now=created + 42
    )
    assert sample(count, namespace="ns") == n0 + 1
    assert sample(total, namespace="ns") == pytest.approx(s0 + 42)
    for phase in ("Restarting", "Running"):  # a gang restart is not a second start
        metrics.observe_job(body(job_name, phase), unschedulable=False, placed_condition=None)
    assert sample(count, namespace="ns") == n0 + 1


def test_a_job_already_running_when_first_seen_is_not_timed(job_name):
    count = "meshtrain_operator_job_apply_to_running_seconds_count"
    n0 = sample(count, namespace="ns")
    metrics.observe_job(body(job_name, "Running"), unschedulable=False, placed_condition=None)
    assert sample(count, namespace="ns") == n0


def test_api_errors_start_at_zero_for_every_verb_and_count_by_verb():
    for verb in metrics.API_VERBS:
        assert sample("meshtrain_operator_api_errors_total", verb=verb) is not None
    before = sample("meshtrain_operator_api_errors_total", verb="patch")
    metrics.api_error("patch")
    assert sample("meshtrain_operator_api_errors_total", verb="patch") == before + 1


def test_a_deleted_job_leaves_no_restart_counter_behind(job_name):
    metrics.RESTARTS.labels(namespace="ns", trainingjob=job_name).inc()
    key = {"namespace": "ns", "trainingjob": job_name}
    assert sample("meshtrain_operator_gang_restarts_total", **key) == 1
    metrics.forget("ns", job_name)
    assert sample("meshtrain_operator_gang_restarts_total", **key) is None
    metrics.forget("ns", "never-restarted")


def test_an_elastic_job_has_both_resize_series_from_zero(job_name):
    elastic = body(job_name, "Running")
    elastic["spec"]["runPolicy"]["elastic"] = {"minData": 2, "maxData": 4}
    metrics.observe_job(elastic, unschedulable=False, placed_condition=None)
    metrics.observe_job(
        body(f"{job_name}-fixed", "Running"), unschedulable=False, placed_condition=None
    )
    for direction in ("shrink", "grow"):
        key = {"namespace": "ns", "trainingjob": job_name, "direction": direction}
        assert sample("meshtrain_operator_elastic_resizes_total", **key) == 0
        fixed = {**key, "trainingjob": f"{job_name}-fixed"}
        assert sample("meshtrain_operator_elastic_resizes_total", **fixed) is None
    metrics.forget("ns", f"{job_name}-fixed")
    metrics.forget("ns", job_name)
    assert sample("meshtrain_operator_elastic_resizes_total", **key) is None


def test_a_replica_that_stands_by_reports_no_job(job_name):
    metrics.observe_job(body(job_name, "Failed"), unschedulable=False, placed_condition=None)
    metrics.RESTARTS.labels(namespace="ns", trainingjob=job_name).inc()
    key = {"namespace": "ns", "trainingjob": job_name}
    assert sample("meshtrain_operator_job_status_phase", **key, phase="Failed") == 1
    metrics.forget_all()  # what leadership.run does when the Lease is lost
    assert sample("meshtrain_operator_job_status_phase", **key, phase="Failed") is None
    assert sample("meshtrain_operator_gang_restarts_total", **key) is None
