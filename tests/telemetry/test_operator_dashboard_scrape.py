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
    metrics.observe_job(_job(running, "Pending"), unschedulable=False, placed_condition=None)
    metrics.observe_job(
        _job(running, "Running", **placed), unschedulable=False, placed_condition=None
    )
    metrics.observe_job(
        _job(waiting, "Pending"),
        unschedulable=True,
        placed_condition={"lastTransitionTime": "2026-01-01T00:00:00Z"},
    )
    metrics.RECONCILE_SECONDS.observe(0.01)
    metrics.PLACEMENT_SECONDS.observe(0.002)
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


def _targets() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _board()["panels"] for t in p["targets"]]


def _query(prom: promserver.PrometheusServer, expr: str, namespace: str) -> list[dict]:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", namespace)
    return prom.query(expr, time.time())


def test_the_namespace_variable_lists_the_jobs_and_the_operators(scraped):
    (variable,) = [v for v in _board()["templating"]["list"] if v["name"] == "namespace"]
    selector = variable["definition"].removeprefix("label_values(").rsplit(",", 1)[0]
    found = scraped.api("label/namespace/values", **{"match[]": selector})
    assert {TENANT, OPERATOR_NAMESPACE} <= set(found), found


def test_per_job_series_carry_the_jobs_namespace_and_no_exported_label(scraped):
    series = scraped.api("series", **{"match[]": '{__name__=~"meshtrain_operator_.+"}'})
    assert not [s for s in series if any(k.startswith("exported_") for k in s)]
    per_job = [s for s in series if "trainingjob" in s]
    assert per_job and {s["namespace"] for s in per_job} >= {TENANT}
    assert OPERATOR_NAMESPACE not in {s["namespace"] for s in per_job}
    own = {s["namespace"] for s in series if s["__name__"] == "meshtrain_operator_jobs"}
    assert own == {OPERATOR_NAMESPACE}  # the operator's own: its target's namespace


def test_every_panel_answers_with_all_namespaces(scraped):
    empty = [f"{title}: {expr}" for title, expr in _targets() if not _query(scraped, expr, ".*")]
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_one_tenants_namespace_keeps_the_others_out(scraped):
    answered = 0
    for title, expr in _targets():
        for result in _query(scraped, expr, TENANT):
            assert result["metric"].get("namespace", TENANT) == TENANT, (title, result)
            answered += 1
    assert answered
    running = _query(scraped, _targets()[0][1], TENANT)  # the "Running jobs" stat
    assert float(running[0]["value"][1]) >= 1


def test_an_empty_namespace_shows_nothing(scraped):
    """Selecting a namespace without jobs or operator empties every panel (a stat may read 0)."""
    shown = [
        f"{title}: {r['metric']} {r['value'][1]}"
        for title, expr in _targets()
        for r in _query(scraped, expr, "no-such-namespace")
        if r["value"][1] != "0"
    ]
    assert not shown, "unfiltered panels:\n" + "\n".join(shown)
