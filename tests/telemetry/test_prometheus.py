"""A real dp2·pp2·tp1 ``run_local`` scraped by a real Prometheus (conftest): what the exporters serve.

Every rank's exporter is scraped with its coordinates, memory by component,
``/progress`` follows the run and the step log has its fields.  Every panel
and rule of the dashboards is evaluated against the sandbox, with the real
operator too, in test_dashboards_live.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from meshtrain.trainer.telemetry import goodput, progress
from tests.telemetry.conftest import (
    JOB,
    NAMESPACE,
    POD,
    REPO,
    RULES,
    SPOOFED_NAMESPACE,
    SPOOFED_POD,
    STEPS,
)

pytestmark = pytest.mark.slow


def test_run_reached_every_exporter(scraped_run):
    up = scraped_run.prom.query('up{job="meshtrain-trainer"}', scraped_run.at)
    assert len(up) == 4 and all(r["value"][1] == "1" for r in up), up
    ranks = scraped_run.prom.query(
        f'meshtrain_step{{trainingjob="{JOB}", namespace="{NAMESPACE}"}}', scraped_run.at
    )
    assert sorted(int(r["metric"]["rank"]) for r in ranks) == [0, 1, 2, 3]
    coords = {
        r["metric"]["rank"]: (r["metric"]["pp"], r["metric"]["dp"], r["metric"]["tp"])
        for r in ranks
    }
    assert coords == {
        "0": ("0", "0", "0"),
        "1": ("0", "1", "0"),
        "2": ("1", "0", "0"),
        "3": ("1", "1", "0"),
    }


def test_job_is_the_scrape_jobs_and_the_trainingjob_is_named_by_trainingjob(scraped_run):
    """No series of the exporters sets ``job``: every one keeps Prometheus' scrape job."""
    series = scraped_run.prom.api(
        "series", **{"match[]": '{__name__=~"meshtrain_.+"}', "start": scraped_run.at - 60}
    )
    assert len({s["__name__"] for s in series}) > 20, series
    labels = {(s["job"], s["trainingjob"], s["namespace"]) for s in series}
    assert labels == {("meshtrain-trainer", JOB, NAMESPACE)}, labels
    assert not [s for s in series if any(k.startswith("exported_") for k in s)]


def test_an_exporter_cannot_choose_its_namespace_or_pod(scraped_run):
    """The exporters ran with MESHTRAIN_NAMESPACE and MESHTRAIN_POD_NAME spoofed: every scraped
    series carries the target's namespace, none the spoofed values, none an exported_* label
    (the relabelling the chart's PodMonitor does; test_chart_rendered.py holds them equal)."""
    series = scraped_run.prom.api(
        "series",
        **{"match[]": '{__name__=~".+", job="meshtrain-trainer"}', "start": scraped_run.at - 60},
    )
    assert len(series) > 20, series
    assert {s.get("namespace") for s in series} == {NAMESPACE}
    assert {s.get("pod") for s in series if s["__name__"].startswith("meshtrain_")} == {POD}
    spoofed = [s for s in series if {SPOOFED_NAMESPACE, SPOOFED_POD} & set(s.values())]
    assert not spoofed, spoofed[:3]
    assert not [s for s in series if any(k.startswith("exported_") for k in s)]


def test_memory_of_every_rank_by_component_and_peak(scraped_run):
    sel = f'trainingjob="{JOB}", namespace="{NAMESPACE}"'
    state = scraped_run.prom.query(f"meshtrain_memory_bytes{{{sel}}}", scraped_run.at)
    components = {(r["metric"]["rank"], r["metric"]["component"]) for r in state}
    assert components == {
        (str(rank), c) for rank in range(4) for c in ("parameters", "gradients", "optimizer")
    }
    assert all(float(r["value"][1]) > 0 for r in state)
    peak = scraped_run.prom.query(f"meshtrain_memory_peak_bytes{{{sel}}}", scraped_run.at)
    assert sorted(r["metric"]["rank"] for r in peak) == ["0", "1", "2", "3"]
    largest = max(float(r["value"][1]) for r in state)
    assert all(
        float(r["value"][1]) > largest for r in peak
    )  # a process' peak RSS holds its tensors and more


def test_promtool_accepts_the_rules():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (apt-get install prometheus)"
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_progress_endpoint_followed_the_run(scraped_run):
    docs = scraped_run.progress
    assert docs, "rank 0 never answered /progress"
    last = docs[-1]
    assert set(last) == set(progress.FIELDS)
    assert 0 < last["step"] <= STEPS and last["loss"] > 0 and last["tokens_per_second"] > 0
    assert (
        last["eval_loss"] > 0 and last["skipped_updates"] == 0
    )  # the run evaluates every 100 steps
    assert [d["step"] for d in docs] == sorted(d["step"] for d in docs)


def test_step_log_has_the_documented_fields(scraped_run):
    fields = {
        "step",
        "loss",
        "tokens",
        "step_seconds",
        "tokens_per_second",
        "allreduce_seconds",
        "exposed_comm_seconds",
        "bubble_ratio",
        "bubble_ratio_theoretical",
        "mfu",
    }
    for record in scraped_run.records:
        assert fields <= set(record), fields - set(record)
    assert [r["step"] for r in scraped_run.records] == list(range(1, STEPS + 1))
    assert all(
        r["allreduce_seconds"] > 0 for r in scraped_run.records
    )  # dp=2: gradient buckets every step


def _panel_queries(title: str) -> list[str]:
    board = json.loads((REPO / "dashboards" / "meshtrain-training.json").read_text())
    (panel,) = [p for p in board["panels"] if p["title"] == title]
    resolved = {"$namespace": NAMESPACE, "$trainingjob": JOB, "$pod": ".*", "$rank": ".*"}
    queries = []
    for target in panel["targets"]:
        expr = target["expr"]
        for name, value in resolved.items():
            expr = expr.replace(name, value)
        queries.append(expr)
    return queries


def test_goodput_panels_answer_from_the_scrape(scraped_run):
    """The dashboard's goodput queries return rank 0's series; the ratio is its account of the log."""
    (ratio_query,) = _panel_queries("Goodput")
    (ratio,) = scraped_run.prom.query(ratio_query, scraped_run.at)
    replayed = goodput.account_of(scraped_run.log_dir).ratio
    assert replayed is not None and 0.5 < float(ratio["value"][1]) <= 1
    assert float(ratio["value"][1]) == pytest.approx(replayed, abs=0.1)
    (lost_query,) = _panel_queries("Time lost to failures by phase")
    lost = scraped_run.prom.query(lost_query, scraped_run.at)
    assert {r["metric"]["phase"]: float(r["value"][1]) for r in lost} == dict.fromkeys(
        goodput.PHASES, 0.0
    )  # a run without failures: every phase at 0
    series = scraped_run.prom.query(
        f'meshtrain_goodput_ratio{{trainingjob="{JOB}"}}', scraped_run.at
    )
    assert [r["metric"]["rank"] for r in series] == ["0"]  # global rank 0 alone
    assert scraped_run.progress[-1]["goodput"]["lost_seconds"] == dict.fromkeys(goodput.PHASES, 0.0)


def test_every_training_panel_of_the_trainer_answers_from_the_scrape(scraped_run):
    """The training dashboard's trainer queries, as Grafana sends them (job, namespace selected)."""
    board = json.loads((REPO / "dashboards" / "meshtrain-training.json").read_text())
    empty = []
    for panel in board["panels"]:
        if panel.get("meshtrainOptional") == "dcgm":
            continue
        for query in _panel_queries(panel["title"]):
            if "meshtrain_operator_" in query:
                continue  # the operator's series: test_dashboards_live.py
            if not scraped_run.prom.query(query.replace("$__rate_interval", "10s"), scraped_run.at):
                empty.append(f"{panel['title']}: {query}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
