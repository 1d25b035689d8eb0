"""Fixtures: one real dp2·pp2·tp1 local run scraped by a real Prometheus.

The run (``run_local``, 4 processes on gloo) trains long enough, even on a quiet machine, for the
dashboards' rate windows (the test substitutes ``$__rate_interval`` = 10s
with a 1 s scrape interval) while a thread polls rank 0's ``/progress``.
Queries are then evaluated at a time inside the run, before the exporters
went away.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshtrain.trainer import launch
from meshtrain.trainer.telemetry import steplog
from tests.builders import JobBuilder
from tests.telemetry import promserver

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "dashboards" / "rules.yaml"
JOB, NAMESPACE = "telemetry-e2e", "tests"
POD = "telemetry-e2e-0"
"""The scrape target's pod: the four ranks' exporter ports of one pod, as on a 4-GPU node."""
SPOOFED_NAMESPACE, SPOOFED_POD = "spoofed", "spoofed-pod"
"""What the exporters are told their namespace and pod are: the scrape target (``NAMESPACE``)
must win, as a tenant's pod must not choose the namespace its series land in."""
STEPS = 400  # ~22 s on a quiet 2-core machine: the rate windows need more than 12 s of training
MICRO_BATCHES = 4


@dataclasses.dataclass
class ScrapedRun:
    """A finished local run and the Prometheus that scraped it."""

    prom: promserver.PrometheusServer
    log_dir: Path
    at: float
    """Unix time inside the run at which to evaluate queries."""
    progress: list[dict[str, Any]]
    """Every /progress document seen during the run."""
    records: list[dict[str, Any]]
    """steps.jsonl of the run."""


def _poll_progress(url: str, out: list[dict[str, Any]], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                out.append(json.load(resp))
        except OSError:
            pass
        stop.wait(0.5)


def fast_rules(path: Path, target: Path) -> Path:
    """A copy of the rules evaluated every second (the test run lasts half a minute)."""
    doc = yaml.safe_load(path.read_text())
    for group in doc["groups"]:
        group["interval"] = "1s"
    target.write_text(yaml.safe_dump(doc))
    return target


@pytest.fixture(scope="session")
def scraped_run(tmp_path_factory: pytest.TempPathFactory) -> ScrapedRun:
    work = tmp_path_factory.mktemp("scraped-run")
    world = 4
    base = promserver.free_port_block(world)
    manifest = (
        JobBuilder(JOB, None)
        .layout(data=2, pipeline=2, gpus_per_node=world)
        .parallelism(schedule="1f1b", microBatches=MICRO_BATCHES)
        .training(
            steps=STEPS,
            microBatch=2,
            warmupSteps=2,
            eval={"interval": 100, "batches": 1, "heldOut": 0.02},
        )
        .checkpoint(path=str(work / "ckpt"), intervalSteps=0)
        .metrics(port=base)
        .manifest()
    )
    spec_path = work / "job.yaml"
    spec_path.write_text(yaml.safe_dump(manifest))
    prom = promserver.PrometheusServer(
        work / "prometheus",
        [f"127.0.0.1:{base + r}" for r in range(world)],
        [fast_rules(RULES, work / "rules.yaml")],
        namespace=NAMESPACE,
        pod=POD,
    )
    names = ("MESHTRAIN_JOB_NAME", "MESHTRAIN_NAMESPACE", "MESHTRAIN_POD_NAME")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(
        MESHTRAIN_JOB_NAME=JOB,
        MESHTRAIN_NAMESPACE=SPOOFED_NAMESPACE,
        MESHTRAIN_POD_NAME=SPOOFED_POD,
    )
    progress: list[dict[str, Any]] = []
    stop = threading.Event()
    poller = threading.Thread(
        target=_poll_progress,
        args=(f"http://127.0.0.1:{base}/progress", progress, stop),
        daemon=True,
    )
    poller.start()
    try:
        code = launch.run_local(spec_path, log_dir=work / "run")
    finally:
        stop.set()
        poller.join()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        assert code == 0, f"run_local exited {code}; logs in {work / 'run'}"
        records = steplog.read(work / "run" / steplog.FILENAME)
        assert len(records) == STEPS
        trained = records[-1]["time"] - records[0]["time"]
        assert trained > 12, f"the run trained only {trained:.1f}s: too short for the rate windows"
        yield ScrapedRun(
            prom=prom,
            log_dir=work / "run",
            at=records[-1]["time"] - 1.5,
            progress=progress,
            records=records,
        )
    finally:
        prom.stop()
