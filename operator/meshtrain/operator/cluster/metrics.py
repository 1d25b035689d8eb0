"""The operator's own Prometheus metrics (``meshtrain_operator_*``, base units).

Counters and histograms are incremented where the thing happens; the per-job gauges
(``namespace``, ``trainingjob``) come from a collector over what the reconciler last saw of each
job, so a scrape always reports the current phase.  docs/telemetry.md lists every series.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections import Counter as _Tally
from collections.abc import Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshtrain import placement
from meshtrain.api.spec import run_policy as api_run_policy
from meshtrain.api.spec import status as api_status
from meshtrain.operator.policy import conditions

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Metadata label naming a job's queue (Kueue's convention); jobs without it have an empty ``queue``."""
JOB_LABELS = ("namespace", "trainingjob")
FINAL_PHASES = frozenset({api_status.Phase.SUCCEEDED.value, api_status.Phase.FAILED.value})

prometheus_client.disable_created_metrics()  # *_created series only add noise to every counter

RECONCILE_SECONDS = prometheus_client.Histogram(
    "meshtrain_operator_reconcile_duration_seconds",
    "Duration of one reconcile pass of a TrainingJob, by the job's namespace.",
    labelnames=("namespace",),
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
PLACEMENT_SECONDS = prometheus_client.Histogram(
    "meshtrain_operator_placement_duration_seconds",
    "Duration of planning one gang (list nodes and pods, plan), by the job's namespace.",
    labelnames=("namespace",),
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
API_REQUESTS = prometheus_client.Counter(
    "meshtrain_operator_api_requests",
    "Requests the operator sent to the Kubernetes API server, by verb and resource.",
    ["verb", "resource"],
)
RESTARTS = prometheus_client.Counter(
    "meshtrain_operator_gang_restarts",
    "Gang restarts performed after a pod failure.",
    labelnames=JOB_LABELS,
)
RESTART_TIERS = ("gang", "process", "container", "pod", "torchrun")
"""``tier`` of :data:`RESTARTS_BY_TIER`: the operator's gang rebuild, or an in-place restart."""
RESTARTS_BY_TIER = prometheus_client.Counter(
    "meshtrain_operator_restarts",
    "Restarts of a job's training by tier: gang (the operator rebuilt the gang, as "
    "meshtrain_operator_gang_restarts_total counts), container (the kubelet restarted a trainer "
    "container in place), process or pod (the trainer's supervisor recovered in place).",
    labelnames=(*JOB_LABELS, "tier"),
)
ELASTIC_RESIZES = prometheus_client.Counter(
    "meshtrain_operator_elastic_resizes",
    "Gangs placed at another data-parallel degree than they ran at (runPolicy.elastic), by direction.",
    labelnames=(*JOB_LABELS, "direction"),
)
APPLY_TO_RUNNING_SECONDS = prometheus_client.Histogram(
    "meshtrain_operator_job_apply_to_running_seconds",
    "Time from a TrainingJob's creation to its first Running phase, by the job's namespace.",
    labelnames=("namespace",),
    buckets=(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 4 * 3600.0),
)
PLACEMENT_FAILURES = prometheus_client.Counter(
    "meshtrain_operator_placement_failures",
    "Placement attempts that placed nothing, by the job's namespace and reason (a waiting job"
    " counts once per attempt).",
    labelnames=("namespace", "reason"),
)
REPLANS = prometheus_client.Counter(
    "meshtrain_operator_replans",
    "Plans of a job that already waited for capacity in this replica (for a change of capacity or"
    " of time alone that could admit it, or after a spec change), by the job's namespace.",
    labelnames=("namespace",),
)
REPLAN_ADMISSIONS = prometheus_client.Counter(
    "meshtrain_operator_replan_admissions",
    "Wake-ups of a waiting job by a capacity change that could admit it (the wake-up rule's"
    " admissions), and passes owed when the nodes it may use changed with time (a hold for one"
    " domain ended, an avoided node came back): what each re-plan should answer to.",
)
REPLANS_PER_ADMISSION = prometheus_client.Histogram(
    "meshtrain_operator_replans_per_admission",
    "Per job that stopped waiting: its plans while waiting per capacity change that could admit"
    " it (plans / max(1, admissions)); above 1, it was planned again without such a change.",
    buckets=(0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0),
)
REPLANS_PER_ADMISSION_MAX = prometheus_client.Gauge(
    "meshtrain_operator_replans_per_admission_max",
    "The most plans per admitting capacity change any waiting job reached in this replica"
    " (counted at each plan; the target is 1 at most).",
)
ASSUMPTIONS_EXPIRED = prometheus_client.Counter(
    "meshtrain_operator_assumed_pods_expired",
    "Pods assumed on their planned node whose assumption ran out before the pod appeared.",
)
BACKFILLS = prometheus_client.Counter(
    "meshtrain_operator_backfills",
    "Gangs placed on nodes reserved for another job because their runPolicy.activeDeadlineSeconds "
    "ends them before that job could start there (policy.reservation); by namespace.",
    labelnames=("namespace",),
)
RESERVATION_PLANS = prometheus_client.Counter(
    "meshtrain_operator_reservation_plans",
    "Plans of the node set reserved for the job that waited longest (reserving.refresh): one per "
    "new holder, at most one per 30 s of capacity or node changes after that; by the holder's "
    "namespace.",
    labelnames=("namespace",),
)
PLACEMENT_FAILURE_REASONS = (
    placement.INSUFFICIENT_GPUS,
    placement.TOPOLOGY_UNSATISFIABLE,
    conditions.WONT_FIT,
)
"""Reasons whose series start at 0 in every namespace with a job, so a rate reads 0, not "no data"."""
API_VERBS = ("get", "list", "watch", "create", "update", "patch", "delete")
API_ERRORS = prometheus_client.Counter(
    "meshtrain_operator_api_errors",
    "Kubernetes API requests that failed (an error status other than an expected NotFound or"
    " AlreadyExists, or no answer), by verb.",
    labelnames=("verb",),
)
for _verb in API_VERBS:  # known label values start at 0, so a rate reads 0, not "no data"
    API_ERRORS.labels(verb=_verb)


@dataclasses.dataclass(frozen=True)
class JobView:
    """What the last reconcile of a job left, as far as metrics are concerned."""

    phase: str
    """status.phase."""
    queue: str
    """Value of the job's queue label, empty without one."""
    restarts: int
    """status.restarts."""
    backoff_limit: int
    """spec.runPolicy.backoffLimit."""
    unschedulable_since: float | None
    """Unix time the job became unschedulable (its Placed condition's transition), None when it is not."""
    uid: str
    """metadata.uid."""
    generation: int
    """metadata.generation: grows with every spec change."""
    data_degree: tuple[int, int] | None = None
    """(running, declared) data-parallel degree of a job with runPolicy.elastic that is placed."""
    straggler_replacements: int = 0
    """status.stragglerReplacements."""


_jobs: dict[tuple[str, str], JobView] = {}
"""(namespace, name) -> view, as of the job's last reconcile."""
_reached_running: set[str] = set()
"""uids of jobs whose first Running phase was seen (or that were Running when first seen)."""


def _unix(stamp: str | None) -> float | None:
    if not stamp:
        return None
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def observe_job(
    body: Mapping[str, Any],
    *,
    unschedulable: bool,
    placed_condition: Mapping[str, Any] | None,
    now: float | None = None,
) -> None:
    """Record the state the reconciler left a job in; the first Running of a job is timed from its creation."""
    metadata = body.get("metadata") or {}
    status = body.get("status") or {}
    spec = body.get("spec") or {}
    key = (metadata.get("namespace", ""), metadata.get("name", ""))
    phase = status.get("phase") or api_status.Phase.PENDING.value
    since = None
    if unschedulable:
        since = _unix((placed_condition or {}).get("lastTransitionTime")) or time.time()
    previous = _jobs.get(key)
    _jobs[key] = JobView(
        phase=phase,
        queue=(metadata.get("labels") or {}).get(QUEUE_LABEL, ""),
        restarts=int(status.get("restarts") or 0),
        backoff_limit=int(
            (spec.get("runPolicy") or {}).get(
                "backoffLimit", api_run_policy.RunPolicy.model_fields["backoff_limit"].default
            )
        ),
        unschedulable_since=since,
        uid=metadata.get("uid", ""),
        generation=int(metadata.get("generation") or 0),
        data_degree=_data_degree(spec, status),
        straggler_replacements=int(status.get("stragglerReplacements") or 0),
    )
    for reason in PLACEMENT_FAILURE_REASONS:  # bounded: one series per namespace and reason
        PLACEMENT_FAILURES.labels(namespace=key[0], reason=reason)
    for tier in RESTART_TIERS:  # each tier's series from 0, not from its first restart
        RESTARTS_BY_TIER.labels(namespace=key[0], trainingjob=key[1], tier=tier)
    if (spec.get("runPolicy") or {}).get(
        "elastic"
    ):  # each direction's series from 0, not from its first resize
        for direction in RESIZE_DIRECTIONS:
            ELASTIC_RESIZES.labels(namespace=key[0], trainingjob=key[1], direction=direction)
    uid = _jobs[key].uid
    if phase != api_status.Phase.RUNNING.value or uid in _reached_running:
        return
    _reached_running.add(uid)
    created = _unix(metadata.get("creationTimestamp"))
    if previous is not None and previous.phase != phase and created is not None:
        APPLY_TO_RUNNING_SECONDS.labels(namespace=key[0]).observe(
            max(0.0, (now or time.time()) - created)
        )


def _data_degree(spec: Mapping[str, Any], status: Mapping[str, Any]) -> tuple[int, int] | None:
    running = (status.get("elastic") or {}).get("data")
    declared = (spec.get("parallelism") or {}).get("data", 1)
    if not isinstance(running, int) or not status.get("placement"):
        return None
    return running, int(declared)


RESIZE_DIRECTIONS = ("shrink", "grow")


def resized(namespace: str, name: str, direction: str) -> None:
    """Count one elastic size change of a job's gang (``shrink`` or ``grow``)."""
    ELASTIC_RESIZES.labels(namespace=namespace, trainingjob=name, direction=direction).inc()


def forget(namespace: str, name: str) -> None:
    """Drop a deleted job, its restart counter included (a series per job ever seen would only grow)."""
    RESTARTS.remove(namespace, name)  # a no-op for a job never restarted
    for tier in RESTART_TIERS:
        RESTARTS_BY_TIER.remove(namespace, name, tier)
    for direction in RESIZE_DIRECTIONS:
        ELASTIC_RESIZES.remove(namespace, name, direction)
    view = _jobs.pop((namespace, name), None)
    if view is not None:
        _reached_running.discard(view.uid)


def forget_all() -> None:
    """Drop every job: a replica that lost the Lease no longer sees them change or go."""
    _jobs.clear()
    _reached_running.clear()
    RESTARTS.clear()
    RESTARTS_BY_TIER.clear()
    ELASTIC_RESIZES.clear()


def restarted(
    namespace: str, name: str, before: Mapping[str, Any], after: Mapping[str, Any]
) -> None:
    """Count the restarts a status write records: a gang rebuild (``restarts`` grew) and the
    in-place restarts of each tier (``recovery.byTier`` grew)."""
    labels = {"namespace": namespace, "trainingjob": name}
    if int(after.get("restarts") or 0) > int(before.get("restarts") or 0):
        RESTARTS.labels(**labels).inc()
        RESTARTS_BY_TIER.labels(**labels, tier="gang").inc()
    old, new = _tiers(before), _tiers(after)
    for tier in RESTART_TIERS[1:]:
        if new.get(tier, 0) > old.get(tier, 0):
            RESTARTS_BY_TIER.labels(**labels, tier=tier).inc(new[tier] - old.get(tier, 0))


def _tiers(status: Mapping[str, Any]) -> dict[str, int]:
    recovery = status.get("recovery")
    tiers = recovery.get("byTier") if isinstance(recovery, Mapping) else None
    if not isinstance(tiers, Mapping):
        return {}
    return {k: v for k, v in tiers.items() if isinstance(v, int) and not isinstance(v, bool)}


def api_error(verb: str) -> None:
    """Count one failed API request (``kube.Client`` calls this with the request's verb)."""
    API_ERRORS.labels(verb=verb).inc()


class _JobCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        now = time.time()
        views = dict(_jobs)
        yield from _by_namespace(views)
        labels = [*JOB_LABELS]
        phase_of = GaugeMetricFamily(
            "meshtrain_operator_job_status_phase",
            "1 for the phase a TrainingJob is in, 0 for the others.",
            labels=[*labels, "phase"],
        )
        restarts = GaugeMetricFamily(
            "meshtrain_operator_job_restarts",
            "Gang restarts of a TrainingJob (status.restarts).",
            labels=labels,
        )
        generation = GaugeMetricFamily(
            "meshtrain_operator_job_spec_generation",
            "metadata.generation of a TrainingJob (a change is a spec change).",
            labels=labels,
        )
        remaining = GaugeMetricFamily(
            "meshtrain_operator_job_restarts_remaining",
            "Gang restarts a job not yet finished may still use (backoffLimit - restarts; only"
            " for backoffLimit > 0).",
            labels=labels,
        )
        waited = GaugeMetricFamily(
            "meshtrain_operator_job_unschedulable_seconds",
            "How long a job not yet finished has been unschedulable (0 when it is placed or placeable).",
            labels=labels,
        )
        degree = GaugeMetricFamily(
            "meshtrain_operator_job_data_parallel_degree",
            "Data-parallel degree a placed gang with runPolicy.elastic runs at.",
            labels=labels,
        )
        declared = GaugeMetricFamily(
            "meshtrain_operator_job_declared_data_parallel_degree",
            "parallelism.data of a placed gang with runPolicy.elastic (the degree its global batch is stated at).",
            labels=labels,
        )
        replaced = CounterMetricFamily(
            "meshtrain_operator_straggler_replacements",
            "Gangs rebuilt without a straggler's node (runPolicy.stragglerPolicy replace; "
            "status.stragglerReplacements, so it survives an operator restart).",
            labels=labels,
        )
        for (namespace, name), view in sorted(views.items()):
            key = [namespace, name]
            replaced.add_metric(key, view.straggler_replacements)
            if view.data_degree is not None:
                degree.add_metric(key, view.data_degree[0])
                declared.add_metric(key, view.data_degree[1])
            for phase in api_status.Phase:
                phase_of.add_metric([*key, phase.value], 1.0 if view.phase == phase.value else 0.0)
            restarts.add_metric(key, view.restarts)
            generation.add_metric(key, view.generation)
            if view.phase in FINAL_PHASES:
                continue
            if view.backoff_limit > 0:  # with no restarts allowed there are none to use up
                remaining.add_metric(key, max(0, view.backoff_limit - view.restarts))
            since = view.unschedulable_since
            waited.add_metric(key, 0.0 if since is None else max(0.0, now - since))
        yield from (phase_of, restarts, generation, remaining, waited, degree, declared, replaced)


def _by_namespace(views: Mapping[tuple[str, str], JobView]) -> Iterator[Metric]:
    """The jobs of each namespace with a job by phase and queue (every phase from 0 for the
    namespace's queues and the empty one), and those waiting for capacity."""
    by_phase = _Tally((ns, v.phase, v.queue) for (ns, _), v in views.items())
    waiting = _Tally(ns for (ns, _), v in views.items() if v.unschedulable_since is not None)
    jobs = GaugeMetricFamily(
        "meshtrain_operator_jobs",
        "TrainingJobs by namespace, phase and queue.",
        labels=["namespace", "phase", "queue"],
    )
    unschedulable = GaugeMetricFamily(
        "meshtrain_operator_unschedulable_jobs",
        "TrainingJobs waiting for capacity (InsufficientGPUs or TopologyUnsatisfiable), by namespace.",
        labels=["namespace"],
    )
    for namespace in sorted({ns for ns, _ in views}):
        queues = {""} | {v.queue for (ns, _), v in views.items() if ns == namespace}
        for queue in sorted(queues):
            for phase in api_status.Phase:
                count = by_phase.get((namespace, phase.value, queue), 0)
                jobs.add_metric([namespace, phase.value, queue], count)
        unschedulable.add_metric([namespace], waiting.get(namespace, 0))
    yield jobs
    yield unschedulable


prometheus_client.REGISTRY.register(_JobCollector())


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Expose /metrics on ``address:port`` (a daemon thread)."""
    prometheus_client.start_http_server(port, addr=address)
