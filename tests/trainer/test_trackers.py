"""Experiment trackers, read back with each tracker's own reader: a real ``meshtrain run`` (resumed
once) with TensorBoard, MLflow (a real ``mlflow server`` on loopback) and W&B (offline) all on;
every series must equal steps.jsonl step by step.  A dead MLflow server costs one warning, not the run.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mt_harness
import pytest

from meshtrain.api import job_dir, loading
from meshtrain.trainer import launch
from meshtrain.trainer.telemetry import steplog
from tests.builders import JobBuilder

pytest.importorskip("tensorboard", reason="the tracking extra (pip install meshtrain[tracking])")
pytest.importorskip("wandb", reason="the tracking extra (pip install meshtrain[tracking])")
pytest.importorskip("mlflow.server", reason="the MLflow server (the test extra)")

from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing import event_accumulator
from wandb.proto import wandb_internal_pb2  # W&B's own record schema

pytestmark = pytest.mark.slow

EXPERIMENT = "trackers-test"
RUN_NAME = "tracked run"
FIRST_STEPS, ALL_STEPS = 3, 5
"""The first run trains 3 steps; the second resumes from its checkpoint to step 5."""
SERVER_START_S = 90.0
ALWAYS = ("loss", "lr", "tokens_per_second", "step_seconds", "grad_norm", "mfu")
"""Fields every record has, so every tracker must plot them."""


def _wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow server exited {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"mlflow server not healthy in {SERVER_START_S:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on loopback: sqlite store, artifacts served from a local folder."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = launch.free_port()
    log = root / "server.log"
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow_cli), "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{root / 'store.db'}"]
    command += ["--artifacts-destination", str(root / "artifacts"), "--workers", "1"]
    # no job runner: it starts seven task-queue processes that this test never uses
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=root, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server, log)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _job(tmp_path: Path, tracking: dict) -> Path:
    return mt_harness.write_job(
        tmp_path, JobBuilder.cpu_run().training(steps=ALL_STEPS).tracking(**tracking).raw()
    )


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, mlflow_server):
    """Train 3 steps, then resume to 5 in the same log directory, every tracker on; the step
    records of both runs (``meshtrain run`` starts each run's steps.jsonl afresh)."""
    tmp = tmp_path_factory.mktemp("tracked")
    tracking = {
        "tensorboard": {},
        "mlflow": {"trackingUri": mlflow_server, "experimentName": EXPERIMENT, "runName": RUN_NAME},
        "wandb": {"project": "meshtrain-test", "mode": "offline"},
    }
    spec_path = _job(tmp, tracking)
    logs = tmp / "logs"
    records = []
    for steps in (FIRST_STEPS, ALL_STEPS):
        assert launch.run_local(spec_path, steps=steps, log_dir=logs) == 0, (
            logs / "rank-0.log"
        ).read_text()[-3000:]
        records += steplog.read(logs / steplog.FILENAME)
        shutil.copy(logs / "rank-0.log", tmp / f"rank-0-to-{steps}.log")
    assert [r["step"] for r in records] == list(range(1, ALL_STEPS + 1))
    return {"logs": logs, "records": records, "spec": spec_path, "tmp": tmp, "url": mlflow_server}


def _metric_fields(records) -> set[str]:
    return {
        k
        for r in records
        for k, v in r.items()
        if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _series(records, field: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[field])) for r in records if field in r]


def test_no_tracker_warned(tracked_run):
    for log in sorted(tracked_run["tmp"].glob("rank-0-to-*.log")):
        assert "experiment tracker" not in log.read_text(), log.read_text()[-3000:]


def test_tensorboard_scalars_equal_the_step_log(tracked_run):
    folder = tracked_run["logs"] / "checkpoints" / job_dir.TENSORBOARD_SUBDIR
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2  # one per run, in one folder
    events = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    records = tracked_run["records"]
    tags = set(events.Tags()["scalars"])
    assert set(ALWAYS) <= tags
    assert tags == _metric_fields(records)
    for tag in tags:
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        expected = _series(records, tag)
        assert [s for s, _ in logged] == [s for s, _ in expected], tag
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6), tag


def _param_of(document: dict, key: str) -> str:
    """The spec's value at a dotted param key, written as the param is (strings as they are)."""
    value = document
    for part in key.split("."):
        value = value[part]
    return value if isinstance(value, str) else json.dumps(value)


def test_mlflow_run_holds_params_metrics_plan_and_report(tracked_run, tmp_path):
    client = MlflowClient(tracking_uri=tracked_run["url"])
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "the resumed job must continue the same run"
    run = runs[0]
    assert run.info.run_name == RUN_NAME and run.info.status == "FINISHED"
    assert run.data.tags["namespace"] == "local" and run.data.tags["trainingjob"] == "logs"
    job = loading.load_spec_file(str(tracked_run["spec"]))
    job = loading.apply_overrides(job, [f"training.steps={FIRST_STEPS}"])  # the run that made it
    document = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    params = run.data.params
    assert params["layout"] == job.parallelism.layout_string
    assert {k.split(".")[0] for k in params} == {"layout", "parallelism", "model", "training"}
    for key, value in params.items():
        if key != "layout":
            assert value == _param_of(document, key), key
    assert params["training.learningRate"] == "0.003" and params["model.hidden"] == "32"
    records = tracked_run["records"]
    assert set(run.data.metrics) == _metric_fields(records)
    for field in run.data.metrics:
        history = client.get_metric_history(run.info.run_id, field)
        logged, expected = sorted((m.step, m.value) for m in history), _series(records, field)
        assert [step for step, _ in logged] == [step for step, _ in expected], field
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected]), field
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"plan.txt", "report.html"} <= names
    report = Path(client.download_artifacts(run.info.run_id, "report.html", str(tmp_path)))
    assert "meshtrain report" in report.read_text()
    plan = Path(client.download_artifacts(run.info.run_id, "plan.txt", str(tmp_path)))
    assert "dp1" in plan.read_text() or "data" in plan.read_text()
    stored = tracked_run["logs"] / "checkpoints" / job_dir.TRACKING_SUBDIR / "mlflow.json"
    assert json.loads(stored.read_text())["run_id"] == run.info.run_id


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic,
    version), then LevelDB log blocks of 32 KiB, each record with a crc32, length and type."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    out, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        left = block - offset % block
        if left < 7:  # a block's tail too short for a header is padding
            offset += left
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 2, 3, 4):
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):
                out.append(pending)
                pending = b""
        elif kind == 0 and length == 0:
            break
    return out


def test_wandb_offline_history_equals_the_step_log(tracked_run):
    folder = tracked_run["logs"] / "checkpoints" / job_dir.TRACKING_SUBDIR
    run_id = json.loads((folder / "wandb.json").read_text())["run_id"]
    files = sorted(folder.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert files, sorted(str(p) for p in folder.rglob("*"))[:40]
    history: dict[int, dict[str, float]] = {}
    config: dict[str, object] = {}
    for path in files:
        for raw in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history[record.history.step.num] = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            elif kind == "run":  # the run's config (the spec) is sent with the run
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    records = tracked_run["records"]
    assert sorted(history) == [r["step"] for r in records]
    for record in records:
        logged = history[record["step"]]
        for field in ALWAYS:
            assert logged[field] == pytest.approx(record[field], rel=1e-9), (record["step"], field)
        assert set(_metric_fields([record])) <= set(logged)
    assert config["parallelism"]["data"] == 1 and config["model"]["hidden"] == 32


def test_dead_mlflow_server_warns_once_and_training_succeeds(tmp_path):
    dead = f"http://127.0.0.1:{launch.free_port()}"  # nothing listens there
    spec_path = _job(tmp_path, {"mlflow": {"trackingUri": dead}})
    assert launch.run_local(spec_path, steps=3, log_dir=tmp_path / "logs") == 0
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert log.count("WARNING: experiment tracker mlflow") == 1, log[-3000:]
    assert "training goes on without it" in log
    assert [r["step"] for r in steplog.read(tmp_path / "logs" / steplog.FILENAME)] == [1, 2, 3]
