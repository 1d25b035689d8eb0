"""The operator dashboard's namespace filter on a real scrape of the operator's real registry.

A real Prometheus scrapes the operator's ``/metrics`` (its process-wide registry, the one
``meshtrain operator`` serves) as the chart's ServiceMonitor does: no ``honor_labels``, the
target in the operator's namespace, the per-job series' ``exported_namespace`` moved back to
``namespace``.  Every panel query answers with the namespace variable at All; with one tenant's
namespace selected no series of another namespace comes back.  The sandbox test
(test_dashboards_live.py) does the same with the real operator reconciling real jobs.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from wsgiref import simple_server

import prometheus_client
import pytest

from meshtrain.operator.cluster import metrics
from meshtrain.sandbox import prometheus as sandbox_prometheus
from tests.telemetry import conftest, promserver

pytestmark = pytest.mark.slow

OPERATOR_NAMESPACE, TENANT = "meshtrain-system", "tenant-a"
RATE_INTERVAL = "5s"
"""Five 1 s scrapes."""


class _Quiet(simple_server.WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass


def _job(name: str, phase: str, **status: object) -> dict:
    return {
        "metadata": {
            "name": name,
            "namespace": TENANT,
            "uid": uuid.uuid4().hex,
            "generation": 1,
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {metrics.QUEUE_LABEL: "team-a"},
        },
        "spec": {
            "parallelism": {"data": 2},
            "runPolicy": {"backoffLimit": 3, "elastic": {"minData": 1, "maxData": 2}},
        },
        "status": {"phase": phase, "restarts": 0, **status},
    }


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[promserver.PrometheusServer]:
    running, waiting = f"run-{uuid.uuid4().hex[:5]}", f"wait-{uuid.uuid4().hex[:5]}"
    placed = {"placement": [{"node": "n0"}], "elastic": {"data": 1}}
    # The registry is process-wide: operator tests that ran earlier in this pytest process
    # left their namespaces' series in it.  Start as a fresh operator process does, empty.
    metrics.forget_all()
    for per_namespace in (
        metrics.RECONCILE_SECONDS,
        metrics.PLACEMENT_SECONDS,
        metrics.APPLY_TO_RUNNING_SECONDS,
        metrics.PLACEMENT_FAILURES,
    ):
        per_namespace.clear()
    metrics.observe_job(_job(running, "Pending"), unschedulable=False, placed_condition=None)
    metrics.observe_job(
        _job(running, "Running", **placed), unschedulable=False, placed_condition=None
    )
    metrics.observe_job(
        _job(waiting, "Pending"),
        unschedulable=True,
        placed_condition={"lastTransitionTime": "2026-01-01T00:00:00Z"},
    )
    metrics.RECONCILE_SECONDS.labels(namespace=TENANT).observe(0.01)
    metrics.PLACEMENT_SECONDS.labels(namespace=TENANT).observe(0.002)
    metrics.API_REQUESTS.labels(verb="list", resource="pods").inc()
    port = promserver.free_port_block(1, start=49100, stop=49900)
    server = simple_server.make_server(
        "127.0.0.1", port, prometheus_client.make_wsgi_app(), handler_class=_Quiet
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    prom = promserver.PrometheusServer(
        tmp_path_factory.mktemp("operator-scrape"),
        [f"127.0.0.1:{port}"],
        namespace=OPERATOR_NAMESPACE,
        job="meshtrain-operator",
        relabel=sandbox_prometheus.OPERATOR_METRIC_RELABEL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _enough_scrapes(prom):
            time.sleep(1)
        yield prom
    finally:
        prom.stop()
        server.shutdown()
        for name in (running, waiting):
            metrics.forget(TENANT, name)


def _enough_scrapes(prom: promserver.PrometheusServer) -> bool:
    count = prom.query('count_over_time(up{job="meshtrain-operator"}[10s])', time.time())
    return bool(count) and float(count[0]["value"][1]) >= 6


def _board() -> dict:
    return json.loads((conftest.REPO / "dashboards" / "meshtrain-operator.json").read_text())


OPERATOR_ROW = {
    "Operator replicas up",
    "API errors/s",
    "Kubernetes API requests and errors by verb",
    "Re-plans per admitting capacity change",
}
"""The panels of the operator process's own series, under the "Operator" row."""


def _panels() -> list[tuple[str, list[str]]]:
    return [
        (p["title"], [t["expr"] for t in p["targets"]])
        for p in _board()["panels"]
        if p["type"] != "row"
    ]


def _query(
    prom: promserver.PrometheusServer, expr: str, namespace: str, operator_namespace: str
) -> list[dict]:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    expr = expr.replace("$operator_namespace", operator_namespace).replace("$namespace", namespace)
    return prom.query(expr, time.time())


def _answers(
    prom: promserver.PrometheusServer, title: str, exprs: list[str], **chosen: str
) -> bool:
    """Whether the panel shows something other than 0 or nothing (a stat of `or vector(0)` reads 0)."""
    return any(r["value"][1] != "0" for e in exprs for r in _query(prom, e, **chosen)) or any(
        _query(prom, e, **chosen) for e in exprs if "vector(0)" not in e
    )


def test_the_namespace_variables_list_the_jobs_and_the_operators(scraped):
    variables = {v["name"]: v for v in _board()["templating"]["list"]}

    def values(name: str) -> set[str]:
        selector = variables[name]["definition"].removeprefix("label_values(").rsplit(",", 1)[0]
        return set(scraped.api("label/namespace/values", **{"match[]": selector}))

    assert values("namespace") == {TENANT}
    assert values("operator_namespace") == {OPERATOR_NAMESPACE}


def test_per_job_series_carry_the_jobs_namespace_and_no_exported_label(scraped):
    series = scraped.api("series", **{"match[]": '{__name__=~"meshtrain_operator_.+"}'})
    assert not [s for s in series if any(k.startswith("exported_") for k in s)]
    per_job = [s for s in series if "trainingjob" in s]
    assert per_job and {s["namespace"] for s in per_job} == {TENANT}
    of = lambda *names: {s["namespace"] for s in series if s["__name__"] in names}  # noqa: E731
    assert of(
        "meshtrain_operator_jobs",
        "meshtrain_operator_unschedulable_jobs",
        "meshtrain_operator_reconcile_duration_seconds_count",
        "meshtrain_operator_placement_duration_seconds_count",
        "meshtrain_operator_placement_failures_total",
        "meshtrain_operator_job_apply_to_running_seconds_count",
    ) == {TENANT}
    assert of("meshtrain_operator_api_requests_total", "meshtrain_operator_api_errors_total") == {
        OPERATOR_NAMESPACE
    }


def test_the_operator_row_is_the_one_the_test_expects(scraped):
    titles = [p["title"] for p in _board()["panels"]]
    row = titles.index("Operator")
    assert set(titles[row + 1 :]) == OPERATOR_ROW


def test_each_panel_answers_for_its_own_namespace_only(scraped):
    """A tenant selected: every per-job panel shows the tenant's jobs, and the Operator row the
    operator (selected by operator_namespace, never emptied by the tenant's namespace)."""
    tenant = {"namespace": TENANT, "operator_namespace": OPERATOR_NAMESPACE}
    elsewhere = {"namespace": "no-such-namespace", "operator_namespace": "no-such-namespace"}
    silent, leaking = [], []
    for title, exprs in _panels():
        if not _answers(scraped, title, exprs, **tenant):
            silent.append(title)
        if _answers(scraped, title, exprs, **elsewhere):
            leaking.append(title)
        own = title in OPERATOR_ROW
        other_tenant = {**tenant, "namespace": "no-such-namespace"}
        if own and not _answers(scraped, title, exprs, **other_tenant):
            silent.append(f"{title} (with another tenant selected)")
        if not own and _answers(scraped, title, exprs, **other_tenant):
            leaking.append(f"{title} (with another tenant selected)")
    assert not silent, "panels without data for the tenant:\n" + "\n".join(silent)
    assert not leaking, "panels with data of another namespace:\n" + "\n".join(leaking)
    (running,) = _panels()[0][1]  # the "Running jobs" stat
    assert float(_query(scraped, running, **tenant)[0]["value"][1]) >= 1
