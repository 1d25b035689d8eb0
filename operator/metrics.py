"""The operator's own Prometheus metrics.

What it is: the metric objects (reconcile and placement duration histograms,
gang restarts counter) and a collector that reports jobs by phase and
unschedulable jobs from what the reconciler last saw; :func:`serve` exposes
them over HTTP.  What it is not: the trainer's metrics (see
``meshtrain.trainer.telemetry``), and it decides nothing.

Names follow Prometheus conventions: ``meshtrain_operator_*``, base units.
"""

from __future__ import annotations

from collections import Counter as _Tally
from collections.abc import Iterator

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from meshtrain.api import spec as api_spec

RECONCILE_SECONDS = prometheus_client.Histogram(
    "meshtrain_operator_reconcile_duration_seconds",
    "Duration of one reconcile pass of a TrainingJob.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
PLACEMENT_SECONDS = prometheus_client.Histogram(
    "meshtrain_operator_placement_duration_seconds",
    "Duration of planning one gang (list nodes and pods, plan).",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
RESTARTS = prometheus_client.Counter(
    "meshtrain_operator_gang_restarts", "Gang restarts performed after a pod failure."
)

_jobs: dict[tuple[str, str], tuple[str, bool]] = {}
"""(namespace, name) -> (phase, unschedulable), as of the job's last reconcile."""


def observe_job(namespace: str, name: str, phase: str, *, unschedulable: bool) -> None:
    """Record the phase the reconciler left a job in."""
    _jobs[(namespace, name)] = (phase, unschedulable)


def forget(namespace: str, name: str) -> None:
    """Drop a deleted job."""
    _jobs.pop((namespace, name), None)


class _JobCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_phase = _Tally(phase for phase, _ in _jobs.values())
        jobs = GaugeMetricFamily(
            "meshtrain_operator_jobs", "TrainingJobs by phase.", labels=["phase"]
        )
        for phase in api_spec.Phase:
            jobs.add_metric([phase.value], by_phase.get(phase.value, 0))
        yield jobs
        waiting = GaugeMetricFamily(
            "meshtrain_operator_unschedulable_jobs",
            "TrainingJobs waiting for capacity (InsufficientGPUs or TopologyUnsatisfiable).",
        )
        waiting.add_metric([], sum(1 for _, stuck in _jobs.values() if stuck))
        yield waiting


prometheus_client.REGISTRY.register(_JobCollector())


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Expose /metrics on ``address:port`` (a daemon thread)."""
    prometheus_client.start_http_server(port, addr=address)
